"""The linear op's torch layer on a machine without a GPU: the C argument struct, the guard's
reasons, the fp64 oracle, the hand-back to torch (bit for bit), and the custom op with its fake
implementation under torch.compile."""

import ctypes
import types

import pytest

torch = pytest.importorskip("torch")

from opgraft import _lib, dispatch  # noqa: E402
from opgraft.ops import linear as ops  # noqa: E402


def rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def supports_at(a: _lib.LinearArgs, arch: int = 90) -> tuple[int, str]:
    """The C guard for a struct, as if on sm_<arch> (it never reads the data)."""
    a.arch = arch
    reason = ctypes.create_string_buffer(256)
    st = _lib.lib().opgraft_linear_supports(ctypes.byref(a), reason, len(reason))
    return st, reason.value.decode()


@pytest.fixture
def stats():
    dispatch.reset_stats()
    yield dispatch.stats_of("linear")
    dispatch.reset_stats()


def test_args_mirror_the_tensors():
    xfull = rand(3, 80)
    x = xfull[:, :72]
    w = rand(129, 72, seed=1)
    b = rand(129, seed=2)
    a = ops.linear_args(x, w, b)
    assert (a.dtype, a.weight_dtype, a.bias_dtype, a.out_dtype) == (_lib.DTYPE_BF16,) * 4
    assert (a.rows, a.out_features, a.in_features) == (3, 129, 72)
    assert list(a.x_stride) == [80, 1] and list(a.weight_stride) == [72, 1] and list(a.out_stride) == [129, 1]
    assert a.x == x.data_ptr() and a.weight == w.data_ptr() and a.bias == b.data_ptr()
    assert a.struct_size == ctypes.sizeof(_lib.LinearArgs)
    out = torch.empty(3, 200, dtype=torch.float16)[:, :129]
    a = ops.linear_args(x, w, None, out)
    assert a.bias is None and a.out == out.data_ptr() and list(a.out_stride) == [200, 1]
    assert a.out_dtype == _lib.DTYPE_FP16
    assert supports_at(a)[1].startswith("dtype mismatch: x bf16, weight bf16, bias none, out fp16")


@pytest.mark.parametrize("x, w, b", [
    (rand(3, 64), rand(16, 48), None),            # K differs
    (rand(3, 64), rand(16, 64), rand(15)),        # bias length
    (rand(2, 3, 64), rand(16, 64), None),         # 3-D x
    (rand(3, 64), rand(16, 64), rand(32)[::2]),   # strided bias
])
def test_inconsistent_tensors_are_refused(x, w, b):
    assert ops.linear_args(x, w, b).dtype == -1


def test_guard_reasons_for_real_tensors():
    w = rand(5120, 2048)
    assert supports_at(ops.linear_args(rand(1, 2048), w, None)) == (_lib.OK, "")
    assert supports_at(ops.linear_args(rand(8, 2048), w, rand(5120))) == (_lib.OK, "")
    st, why = supports_at(ops.linear_args(rand(9, 2048), w, None))
    assert st == _lib.EUNSUPPORTED and why == "rows 9 > 8 (kernel limit)"
    st, why = supports_at(ops.linear_args(rand(2, 2048), w, None), arch=80)
    assert why == "rows 2 > linear.max_rows 1"
    st, why = supports_at(ops.linear_args(rand(1, 2048), w, None), arch=75)
    assert why == "sm_75 is older than sm_80"
    st, why = supports_at(ops.linear_args(rand(2, 2048, dtype=torch.float32), w.float(), None))
    assert why == "dtype fp32 (the kernel takes bf16 and fp16)"
    st, why = supports_at(ops.linear_args(rand(2, 2048), w.half(), None))
    assert why.startswith("dtype mismatch: x bf16, weight fp16")
    st, why = supports_at(ops.linear_args(rand(2, 12), rand(7, 12), None))
    assert why == "in_features 12 is not a positive multiple of 8"
    x = rand(2, 2052)[:, :2048]  # rows 2052 elements apart: not 16-byte multiples
    assert supports_at(ops.linear_args(x, w, None))[1] == "x row stride 2052 is not a multiple of 8 elements (16 bytes)"
    wt = rand(2048, 5120).t()  # a transposed weight: its columns are not contiguous
    assert supports_at(ops.linear_args(rand(1, 2048), wt, None))[1] == "a tensor's last dimension is not contiguous"
    x = rand(1, 2052)[:, 4:]  # 8 bytes past the base
    if x.data_ptr() % 16:
        assert supports_at(ops.linear_args(x, w, None))[1] == "x or weight not 16-byte aligned"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_oracle_matches_torch_fp64(dtype):
    xfull = rand(5, 160, dtype=dtype)
    x = xfull[:, :136]
    w = rand(33, 136, dtype=dtype, seed=1)
    b = rand(33, dtype=dtype, seed=2)
    got = ops.linear_reference_cpu(x, w, b)
    want = x.double() @ w.double().T + b.double()
    assert got.dtype == torch.float64 and got.shape == (5, 33)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(ops.linear_reference_cpu(x, w), x.double() @ w.double().T, rtol=1e-12, atol=1e-12)


def test_cpu_tensors_go_to_torch_bit_for_bit(stats):
    x, w, b = rand(3, 64), rand(48, 64, seed=1), rand(48, seed=2)
    y = ops.linear_or_torch(x, w, b)
    assert torch.equal(y, torch.nn.functional.linear(x, w, b))
    ok, why = ops.linear_supports(x, w, b)
    assert not ok and why == "tensors are not on a CUDA device"
    big = rand(20, 64)
    assert torch.equal(ops.linear_or_torch(big, w), torch.nn.functional.linear(big, w))
    s = stats.snapshot()
    assert s["taken"] == 0
    assert s["delegated_by_reason"] == {"tensors are not on a CUDA device": 1, "rows N > N (kernel limit)": 1}
    with pytest.raises(_lib.OpgraftError, match="not on a CUDA device"):
        ops.linear_into(torch.empty(3, 48, dtype=torch.bfloat16), x, w, b)


def test_custom_op_eager_and_fake(stats):
    x, w, b = rand(4, 64), rand(24, 64, seed=1), rand(24, seed=2)
    y = torch.ops.opgraft.linear(x, w, b)
    assert torch.equal(y, torch.nn.functional.linear(x, w, b))
    assert torch.equal(torch.ops.opgraft.linear(x, w), torch.nn.functional.linear(x, w))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(rand(7, 64)), mode.from_tensor(w)
        fy = torch.ops.opgraft.linear(fx, fw, None)
        assert fy.shape == (7, 24) and fy.dtype == torch.bfloat16 and fy.is_contiguous()
    with pytest.raises(ValueError, match="2-D"):
        torch.ops.opgraft.linear(rand(2, 3, 64), w, b)
    torch.library.opcheck(torch.ops.opgraft.linear.default, (x, w, b),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_custom_op_under_torch_compile(stats):
    """Dynamo traces the op once with a symbolic row count; each call then decides at run time
    (here: torch's path, CPU tensors), with the bits of an eager torch.nn.functional.linear."""
    w, b = rand(40, 64, seed=1), rand(40, seed=2)

    def f(x):
        return torch.ops.opgraft.linear(x, w, b) * 2

    seen = []

    def backend(gm, example_inputs):
        seen.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    cf = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
    for m in (1, 3, 8, 17):
        x = rand(m, 64, seed=m)
        assert torch.equal(cf(x), torch.nn.functional.linear(x, w, b) * 2), m
    # (one graph for every row count, and one more for a single row, which Dynamo specializes)
    assert len(seen) <= 2 and all("opgraft.linear" in g for g in seen)
    # The real lowering too (AOT autograd + Inductor on CPU), where the fake gives the shapes.
    torch._dynamo.reset()
    ci = torch.compile(f, fullgraph=True, dynamic=True)
    x = rand(5, 64, seed=9)
    assert torch.equal(ci(x), torch.nn.functional.linear(x, w, b) * 2)
    assert stats.snapshot()["delegated_by_reason"] == {"tensors are not on a CUDA device": 4,
                                                       "rows N > N (kernel limit)": 1}


def test_plan_cache_and_forget():
    x, w = rand(2, 64), rand(16, 64)
    p = ops.plan_for(x, w)
    assert ops.plan_for(x, w) is p and p.handle is None
    ops.forget_plans()
    assert ops.plan_for(x, w) is not p


def _norm_inputs(M=3, K=64, N=24, dtype=torch.bfloat16):
    return (rand(M, K, dtype=dtype, seed=1), (4 * rand(M, K, dtype=dtype, seed=2)).to(dtype),
            (rand(K, dtype=dtype, seed=3).abs() + 0.5).to(dtype), rand(N, K, dtype=dtype, seed=4))


def test_norm_args_and_guard():
    x, r, nw, w = _norm_inputs(2, 2048, 5120)
    assert supports_at(ops.linear_args(x, w, None, norm=(r, nw, 1e-6))) == (_lib.OK, "")
    a = ops.linear_args(x, w, None, norm=(r, nw, 1e-6))
    assert a.residual == r.data_ptr() and a.norm_weight == nw.data_ptr() and a.residual_out == 16
    assert tuple(a.residual_out_stride) == (2048, 1) and abs(a.norm_eps - 1e-6) < 1e-12
    st, why = supports_at(ops.linear_args(x, w, None, norm=(r, nw.half(), 1e-6)))
    assert st == _lib.EUNSUPPORTED and why.startswith("dtype mismatch: x bf16, norm")
    st, why = supports_at(ops.linear_args(x, w, None, norm=(r.half(), nw.half(), 1e-6)))
    assert why == "dtype mismatch: x bf16, norm fp16"
    wide = rand(2, 2052)
    assert supports_at(ops.linear_args(x, w, None, norm=(wide[:, :2048], nw, 1e-6)))[1] == \
        "residual row strides 2052 / 2048 (at least in_features, multiples of 8 elements)"
    assert supports_at(ops.linear_args(x, w, None, norm=(r, nw, float("nan"))))[1] == "norm_eps nan outside 0..1"
    assert ops.linear_args(x, w, None, norm=(r[:1], nw, 1e-6)).dtype == -1  # residual unlike x
    assert ops.linear_args(x, w, None, norm=(r, nw[:100], 1e-6)).dtype == -1
    fp8 = torch.zeros(5120, 2048, dtype=torch.float8_e4m3fn)
    st, why = supports_at(ops.linear_args(x, fp8, None, weight_scale=torch.ones(40, 16), block=(128, 128),
                                          norm=(r, nw, 1e-6)))
    assert why == "add + RMSNorm with FP8 weights (the norm form takes 16-bit weights)"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_oracle_matches_torch(dtype):
    """The C oracle rounds the normalized input where vLLM's function does: its products then match
    torch's fp64 product of that input, and residual_out matches bit for bit."""
    x, r, nw, w = _norm_inputs(3, 200, 40, dtype)
    b = rand(40, dtype=dtype, seed=5)
    y, ro = ops.add_rms_norm_linear_reference_cpu(x, r, nw, 1e-5, w, b)
    n, want_r = ops.add_rms_norm_reference(x, r, nw, 1e-5)
    want = n.double() @ w.double().T + b.double()
    assert torch.equal(ro, want_r)
    assert float((y - want).abs().max()) < 1e-12 * float(want.abs().max())


def test_norm_op_on_cpu_is_the_composition(stats):
    """On CPU tensors the op is vLLM's add + RMSNorm (its IR op where vLLM is loaded, else the same
    function in torch) and then the linear op: the same bits as the two calls."""
    x, r, nw, w = _norm_inputs()
    b = rand(24, seed=6)
    y, ro = torch.ops.opgraft.add_rms_norm_linear(x, r, nw, 1e-6, w, b)
    n, want_r = ops.add_rms_norm_reference(x, r, nw, 1e-6)
    assert torch.equal(ro, want_r) and torch.equal(y, torch.nn.functional.linear(n, w, b))
    assert stats.snapshot()["taken"] == 0
    from torch._subclasses.fake_tensor import FakeTensorMode

    x5, r5 = rand(5, 64), rand(5, 64, seed=7)
    with FakeTensorMode() as mode:
        fx, fr5, fnw, fw = (mode.from_tensor(t) for t in (x5, r5, nw, w))
        fy, fr = torch.ops.opgraft.add_rms_norm_linear(fx, fr5, fnw, 1e-6, fw, None)
        assert fy.shape == (5, 24) and fr.shape == (5, 64) and fy.dtype == fr.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="2-D"):
        torch.ops.opgraft.add_rms_norm_linear(x[None], r[None], nw, 1e-6, w)
    torch.library.opcheck(torch.ops.opgraft.add_rms_norm_linear.default, (x, r, nw, 1e-6, w, b),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_every_variant_is_registered():
    assert dispatch.variants("linear") == ["opgraft", "passthrough"]
    assert dispatch.VARIANT_ENV["linear"] == "OPGRAFT_LINEAR_VARIANT"


def test_gpu_check_cases_set_only_known_tunables():
    from tools.checks import linear as linear_checks

    keys = set(_lib.tune_keys())
    cases = linear_checks.cases()
    assert len({c["name"] for c in cases}) == len(cases)
    for c in cases:
        assert set(c["tunables"]) <= keys, c["name"]
    assert any(c["tunables"] for c in cases)


def test_bench_helpers_and_presets():
    from opgraft.bench import linear as linear_bench
    from opgraft.presets import LINEAR_PRESETS

    q = {s.proj: (s.out_features, s.in_features) for s in LINEAR_PRESETS["Qwen3-30B-A3B"]}
    assert q == {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048), "lm_head": (151936, 2048)}
    l70 = {s.proj: (s.out_features, s.in_features) for s in LINEAR_PRESETS["Llama-3-70B/tp8"]}
    assert l70 == {"qkv": (1280, 8192), "o": (8192, 1024), "gate_up": (7168, 8192), "down": (8192, 3584),
                   "lm_head": (16032, 8192)}
    l8 = {s.proj: (s.out_features, s.in_features) for s in LINEAR_PRESETS["Llama-3-8B"]}
    assert l8["gate_up"] == (28672, 4096) and l8["down"] == (4096, 14336) and l8["qkv"] == (6144, 4096)
    qkv = LINEAR_PRESETS["Qwen3-30B-A3B"][0]
    assert qkv.tune_key() == "linear:bf16:N5120:K2048"
    assert linear_bench.copies_for(qkv) == 7  # 7 x 21 MB >= 128 MiB
    assert linear_bench.copies_for(LINEAR_PRESETS["Qwen3-30B-A3B"][2]) == linear_bench.MAX_COPIES
    assert linear_bench.copies_for(LINEAR_PRESETS["Qwen3-30B-A3B"][3]) == 1
    assert linear_bench.call_bytes(qkv, 2) == 2 * (5120 * 2048 + 2 * 2048 + 2 * 5120)
    w = linear_bench.make_weight(qkv, "bf16", "cpu")
    assert w.shape == (5120, 2048) and w.dtype == torch.bfloat16
    assert 0.5 < float(w.float().std() * 2048 ** 0.5) < 1.5


class _FakeKernel:
    """Stands in for the GPU kernel on CPU tensors (fp32 sums, rounded once), so that the GPU
    check's and the bench's own code runs here: a typo in them must not cost a GPU run."""

    def __init__(self, monkeypatch):
        monkeypatch.setattr(ops, "linear_supports", self.supports)
        monkeypatch.setattr(ops, "linear_into", self.into)
        monkeypatch.setattr(ops, "linear_or_torch", self.or_torch)
        monkeypatch.setattr(ops, "add_rms_norm_linear_into", self.norm_into)
        monkeypatch.setattr(ops, "norm_linear_or_none", self.norm_or_none)
        real_plan_for = ops.plan_for
        monkeypatch.setattr(ops, "plan_for", lambda x, w, b=None, out=None, norm=None, **kw: (
            types.SimpleNamespace(handle=1, reason="") if norm is not None and self._ok(x, w, b) else real_plan_for(x, w, b, out, norm=norm, **kw)))

    def norm_into(self, out, r_out, x, r, nw, eps, w, b=None, normed_out=None):
        n, ro = ops.add_rms_norm_reference(x, r, nw, eps)
        r_out.copy_(ro)
        if normed_out is not None:
            normed_out.copy_(n)
        return self.into(out, n, w, b), r_out

    def norm_or_none(self, x, r, nw, eps, w, b=None, normed=False):
        if not self._ok(x, w, b):
            dispatch.stats_of("linear").delegate("fake: refused")
            return None
        dispatch.stats_of("linear").take()
        out, ro = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype), torch.empty_like(x)
        hn = torch.empty_like(x) if normed else None
        res = self.norm_into(out, ro, x, r, nw, eps, w, b, hn)
        return (*res, hn) if normed else res

    @staticmethod
    def _ok(x, w, b):
        return x.dim() == 2 and 1 <= x.shape[0] <= ops.MAX_ROWS and x.data_ptr() % 16 == 0

    def supports(self, x, w, b=None):
        return (True, "") if self._ok(x, w, b) else (False, "fake: refused")

    def into(self, out, x, w, b=None):
        y = x.float() @ w.float().T
        out.copy_((y + b.float() if b is not None else y).to(out.dtype))
        return out

    def or_torch(self, x, w, b=None):
        if not self._ok(x, w, b):
            dispatch.stats_of("linear").delegate("fake: refused")
            return torch.nn.functional.linear(x, w, b)
        dispatch.stats_of("linear").take()
        return self.into(torch.empty(x.shape[0], w.shape[0], dtype=x.dtype), x, w, b)


def test_gpu_check_harness_runs_on_a_fake_kernel(monkeypatch, stats):
    from tools.checks import linear as linear_checks

    _FakeKernel(monkeypatch)
    monkeypatch.setattr(linear_checks.linear_bench, "make_weight",
                        lambda s, dt, dev, seed=0: torch.randn(s.out_features, s.in_features,
                                                               generator=torch.Generator().manual_seed(seed))
                        .mul_(s.in_features ** -0.5).to(linear_checks.linear_bench.TORCH_DTYPES[dt]))
    small = [c for c in linear_checks.cases() if not c.get("fp8") and not c.get("qk")  # the fake has no epilogue
             and c["path"] not in ("graph", "inductor") and c["N"] * c["K"] <= (1 << 22)]
    assert len(small) > 20
    for c in small:
        r = linear_checks.run_case(c, device="cpu")
        assert r["passed"], r


def test_bench_rows_on_a_fake_kernel(monkeypatch):
    from opgraft.bench import linear as linear_bench
    from opgraft.presets import LinearShape

    _FakeKernel(monkeypatch)
    monkeypatch.setattr(linear_bench, "run_facts", lambda: {"gpu": "fake", "date": "today"})
    monkeypatch.setattr(linear_bench, "device_of", lambda device: (90, "NVIDIA H200"))
    monkeypatch.setattr(linear_bench, "between_traffic", lambda mib, device: None)
    times = {"opgraft": 2.0, "torch-linear": 3.0}

    def timed(call, schedule, between, reps, timing):
        call(0, None)
        return times["opgraft" if call.__name__ == "call" else "torch-linear"], {"timing": timing}

    monkeypatch.setattr(linear_bench, "timed_calls", timed)
    rows = linear_bench.bench_shape(LinearShape("toy", "qkv", 40, 64), rows=(1, 3), device="cpu", ceiling_tbps=4.5)
    assert [(r["impl"], r["M"]) for r in rows] == [("opgraft", 1), ("torch-linear", 1), ("opgraft", 3),
                                                    ("torch-linear", 3)]
    r = rows[0]
    assert r["op"] == "linear" and r["N"] == 40 and r["K"] == 64 and r["gpu"] == "fake" and r["date"] == "today"
    assert r["speedup"] == 1.5 and r["median_us"] == 2.0 and r["bytes"] == 2 * (40 * 64 + 64 + 40)
    assert r["fraction_of_ceiling"] == round(r["bytes"] / 2e-6 / 1e12 / 4.5, 3)
    assert r["rel_err"] < 1e-2 and r["deterministic"] and r["guard"] == "take" and r["max_rows"] == 8
    assert "opgraft" in linear_bench.format_table(rows)


def test_fp8_bench_rows_against_a_fake_vllm_kernel(monkeypatch):
    """bench_fp8_shape's rows: ours and vLLM's on the weights vLLM post-processes, both checked
    against the C oracle, ours with the speedup over vLLM's; vLLM's row says why when it cannot run."""
    from opgraft.bench import linear as linear_bench
    from opgraft.presets import LinearShape

    def dequant(w, s):
        return w.float() * s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)

    prepared = []

    def prepare(w, s):
        prepared.append(w.shape)
        return w, s

    monkeypatch.setattr(linear_bench, "vllm_fp8_linear",
                        lambda: (prepare, lambda x, w, s: (x.float() @ dequant(w, s).T).to(x.dtype), ""))
    monkeypatch.setattr(ops, "linear_fp8_supports", lambda x, w, s, block, bias=None: (True, ""))
    monkeypatch.setattr(ops, "linear_fp8_into", lambda out, x, w, s, block, bias=None:
                        out.copy_((x.float() @ dequant(w, s).T).to(out.dtype)))
    monkeypatch.setattr(linear_bench, "run_facts", lambda: {"gpu": "fake", "date": "today"})
    monkeypatch.setattr(linear_bench, "between_traffic", lambda mib, device: None)
    monkeypatch.setattr(linear_bench, "timed_calls",
                        lambda call, schedule, between, reps, timing: (call(0, None), (3.0 if call.__name__ == "vcall"
                                                                                      else 2.0, {}))[1])
    shape = LinearShape("toy", "o", 256, 256)
    rows = linear_bench.bench_fp8_shape(shape, rows=(1, 2), device="cpu", ceiling_tbps=4.5)
    assert len(prepared) == linear_bench.copies_for(shape, 1)
    assert [(r["impl"], r["M"]) for r in rows] == [("opgraft-fp8", 1), ("vllm-fp8", 1), ("opgraft-fp8", 2),
                                                    ("vllm-fp8", 2)]
    ours, theirs = rows[0], rows[1]
    assert ours["speedup"] == 1.5 and ours["median_us"] == 2.0 and theirs["median_us"] == 3.0
    assert 0 < ours["rel_err"] < 0.1 and 0 < theirs["rel_err"] < 0.1  # unquantized x: e4m3 error and ours["guard"] == "take"
    assert "vllm-fp8" in linear_bench.format_table(rows)

    monkeypatch.setattr(linear_bench, "vllm_fp8_linear", lambda: (None, None, "no FlashInfer"))
    rows = linear_bench.bench_fp8_shape(shape, rows=(1,), device="cpu", ceiling_tbps=4.5)
    assert rows[1]["impl"] == "vllm-fp8" and rows[1]["median_us"] is None and rows[1]["guard"] == "not run: no FlashInfer"
    assert "speedup" not in rows[0]


def test_vllm_fp8_linear_says_why_not_without_an_sm90_gpu():
    from opgraft.bench import linear as linear_bench

    prepare, fn, why = linear_bench.vllm_fp8_linear()
    assert prepare is None and fn is None and why


def test_norm_bench_rows_on_a_fake_kernel(monkeypatch):
    from opgraft.bench import linear as linear_bench
    from opgraft.presets import LinearShape

    _FakeKernel(monkeypatch)
    monkeypatch.setattr(linear_bench, "run_facts", lambda: {"gpu": "fake", "date": "today"})
    monkeypatch.setattr(linear_bench, "between_traffic", lambda mib, device: None)
    monkeypatch.setattr(linear_bench, "_compiled_norm", lambda: ops.add_rms_norm_reference)
    times = {"fused": 2.0, "two": 3.0, "stock": 4.0}

    def timed(call, schedule, between, reps, timing):
        call(0, None)
        return times[call.__name__], {"timing": timing}

    monkeypatch.setattr(linear_bench, "timed_calls", timed)
    rows = linear_bench.bench_norm_shape(LinearShape("toy", "qkv", 40, 64), rows=(1, 3), device="cpu",
                                         ceiling_tbps=4.5)
    assert [(r["impl"], r["M"]) for r in rows] == [(i, m) for m in (1, 3)
                                                    for i in ("opgraft-norm", "norm+opgraft", "norm+torch")]
    r = rows[0]
    assert r["norm"] == "add_rms_norm" and r["speedup"] == 2.0 and r["bytes"] == 2 * (40 * 64 + 64 + 40) + 3 * 64 * 2
    assert r["deterministic"] and r["residual_out_exact"] and r["rel_err"] < 1e-2 and r["guard"] == "take"
    assert all(x["rel_err"] < 1e-2 for x in rows) and "normed_out" not in r
    # A router gate's form also writes the normalized rows (the MoE layer's experts read them).
    rows = linear_bench.bench_norm_shape(LinearShape("toy", "router", 8, 64), rows=(2,), device="cpu",
                                         ceiling_tbps=4.5)
    r = rows[0]
    assert r["impl"] == "opgraft-norm" and r["normed_out"] and r["normed_out_exact"]
    assert r["bytes"] == 2 * (8 * 64 + 2 * 64 + 2 * 8) + 4 * 2 * 64 * 2


@pytest.mark.parametrize("name", ["linear", "linear_fp8", "add_rms_norm_linear"])
def test_ops_inside_vllms_graph_pieces_take_no_string(name):
    """A string argument is a constant of the traced graph: every layer's piece would become a graph
    of its own, and Inductor would compile each (bench/NOTES.md v50)."""
    schema = getattr(torch.ops.opgraft, name).default._schema
    assert [a.name for a in schema.arguments if str(a.type) == "str"] == [], str(schema)
