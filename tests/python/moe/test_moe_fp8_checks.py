"""The FP8 GPU check and bench modules' plumbing, run on CPU with our kernel's call replaced by the
oracle (the modules must not fail on the GPU for a reason a CPU run can find): every FP8 case
builds its tensors, scales and oracle, and the bench builds its rows."""

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

from opgraft.bench import moe as moe_bench  # noqa: E402
from opgraft.ops import moe as ops  # noqa: E402
from opgraft.presets import MoeShape  # noqa: E402
from tools.checks import moe as checks  # noqa: E402


@pytest.fixture
def oracle_kernel(monkeypatch):
    """moe_experts_into writes the torch oracle of the quantized model; the guard says yes."""

    def fake_into(out, hidden, w13, w2, tw, ids, apply_router_weight_on_input=False, workspace=None, stages=3,
                  expert_map=None, fp8=None):
        local = ids if expert_map is None else expert_map[ids.long()].to(ids.dtype)
        if fp8.hidden_scale is None:  # 16-bit hidden states: quantized as gate_up does
            hidden, xs = moe_bench.quantize_as_the_kernel(hidden, moe_bench.kernel_group(fp8.block_shape))
            fp8 = ops.Fp8Scales(xs, fp8.w13_scale, fp8.w2_scale, fp8.block_shape)
        out.copy_(moe_bench.reference_fp8(hidden, fp8, w13, w2, tw, local).to(out.dtype))
        return out

    monkeypatch.setattr(ops, "moe_supports", lambda *a, **k: (True, ""))
    monkeypatch.setattr(ops, "moe_experts_into", fake_into)


def _small(c):
    s = c["shape"]
    return s.num_experts * s.hidden * s.inter <= 16 * 256 * 256


def test_every_fp8_case_runs_its_checks(oracle_kernel):
    cases = [c for c in checks.fp8_cases() if _small(c)]
    assert len(cases) >= 15
    for c in cases:
        r = checks._run_fp8_case(c, "cpu")
        assert r["supported"] and r["deterministic"], c["name"]
        assert r["rel_err"] < 1e-2, (c["name"], r["rel_err"])  # bf16 rounding of the oracle itself
        assert r["passed"], (c["name"], r)
        assert "c_oracle_vs_torch_fp64" not in r or r["c_oracle_vs_torch_fp64"] < 1e-9


def test_case_names_and_kinds():
    names = [c["name"] for c in checks.cases()]
    assert len(names) == len(set(names))
    fp8 = [c for c in checks.cases() if "kind" in c]
    assert all(c["name"].startswith("fp8 ") for c in fp8)
    assert {c["kind"] for c in fp8} == {"fp8-block", "fp8-tensor"}
    assert any(c["ep"] and c["shape"].top_k > c["shape"].num_experts for c in fp8)
    assert any(c["block"] == (64, 64) for c in fp8) and any(c["block"] == (32, 32) for c in fp8)


def test_fp8_bench_rows(oracle_kernel, monkeypatch):
    monkeypatch.setattr(moe_bench, "timed_calls", lambda *a, **k: (10.0, {"timing": "test"}))
    monkeypatch.setattr(moe_bench, "run_facts", lambda: {"gpu": "none"})
    shape = MoeShape("small", 16, 256, 128, 4)
    for kind, G in (("fp8-block", 0), ("fp8-tensor", 64)):
        rows = moe_bench.bench_shape_fp8(shape, [1, 3], kind, device="cpu", n_routings=2, ceiling_tbps=4.0,
                                         global_experts=G, between_mib=0)
        impls = {r["impl"] for r in rows}
        assert {"opgraft", "opgraft+quant"} <= impls
        assert "opgraft-x16" in impls  # timed, or a delegate row with the rule's reason
        for r in rows:
            assert r["dtype"] == kind and r["bytes"] > 0 and r["global_experts"] == (G or 16)
            assert r["fraction_of_ceiling"] is not None and r["rel_err"] < 1e-2
        # vLLM's FP8 path does not run on this CPU: the rows say why
        assert rows[0]["builtin_missing"] and "vllm-triton" in rows[0]["builtin_missing"]
        text = moe_bench.format_table(rows)
        assert kind in text and "FP8 backends missing" in text


def test_fp8_bench_x16_row_says_why_when_the_rule_declines(oracle_kernel, monkeypatch):
    """With the guard refusing 16-bit hidden states, the block bench keeps a delegate row with the reason."""
    monkeypatch.setattr(moe_bench, "timed_calls", lambda *a, **k: (10.0, {"timing": "test"}))
    monkeypatch.setattr(moe_bench, "run_facts", lambda: {"gpu": "none"})
    monkeypatch.setattr(ops, "moe_supports", lambda *a, fp8=None, **k: (False, "moe.fp8_quantize 0")
                        if fp8 is not None and fp8.hidden_scale is None else (True, ""))
    rows = moe_bench.bench_shape_fp8(MoeShape("small", 16, 256, 128, 4), [1], "fp8-block", device="cpu",
                                     n_routings=2, ceiling_tbps=4.0, between_mib=0)
    x16 = [r for r in rows if r["impl"] == "opgraft-x16"]
    assert len(x16) == 1 and x16[0]["median_us"] is None and x16[0]["guard"] == "delegate: moe.fp8_quantize 0"


def test_expert_parallel_cases_route_tokens_to_the_ranks_experts():
    """A rank with 4 of 256 experts and random top-8 routing would see no token routed to it; the
    cases route token 0 to all of its experts and every other token to one, rows still distinct."""
    for c in [c for c in checks.cases() + checks.fp8_cases() if c.get("ep")]:
        gen = torch.Generator().manual_seed(200 + c["seed"])
        tw, ids, emap = checks._routing(c, c["ep"], "cpu", gen)
        local = emap[ids.long()]
        k, n_local = c["shape"].top_k, c["shape"].num_experts
        assert (local[0] >= 0).sum() == min(k, n_local), c["name"]
        assert bool(((local >= 0).sum(1) >= 1).all()), c["name"]
        if not c["dup"]:
            assert all(len(set(r)) == k for r in ids.tolist()), c["name"]


def test_routed_x16_cases_run_their_checks(monkeypatch):
    """The routed FP8 cases whose kernels quantize bf16/fp16 hidden states: on CPU with the kernel
    calls replaced by the oracle of that quantization, every check of a small case runs and passes."""

    def quantized(hidden, fp8):
        if fp8.hidden_scale is not None:
            return hidden, fp8
        x, xs = moe_bench.quantize_as_the_kernel(hidden, moe_bench.kernel_group(fp8.block_shape))
        return x, ops.Fp8Scales(xs, fp8.w13_scale, fp8.w2_scale, fp8.block_shape)

    def experts(out, hidden, w13, w2, tw, ids, fp8):
        x, f = quantized(hidden, fp8)
        return out.copy_(moe_bench.reference_fp8(x, f, w13, w2, tw, ids).to(out.dtype))

    class Plan:
        handle, reason = 1, ""

    def run_routed(plan, out, hidden, w13, w2, logits, k, renorm, tw=None, ids=None, workspace=None, fp8=None):
        ew, eids = checks._expected_routing(logits, k, renorm)
        if tw is not None:
            tw.copy_(ew.float()), ids.copy_(eids)
        return experts(out, hidden, w13, w2, ew.float(), eids, fp8)

    monkeypatch.setattr(ops, "plan_for_routed", lambda *a, **k: Plan())
    monkeypatch.setattr(ops, "run_routed", run_routed)
    monkeypatch.setattr(ops, "moe_routed_into", lambda out, hidden, w13, w2, logits, k, renorm=True, fp8=None, **kw:
                        run_routed(None, out, hidden, w13, w2, logits, k, renorm, fp8=fp8))
    monkeypatch.setattr(ops, "moe_experts_into", lambda out, hidden, w13, w2, tw, ids, fp8=None, **kw:
                        experts(out, hidden, w13, w2, tw, ids, fp8))
    cases = [c for c in checks.routed_cases() if c.get("xq")]
    assert all(c["name"].startswith(("routed fp8 block x16 ", "routed fp8 tensor x16 ")) for c in cases)
    assert sum(c["scales"] == "fp8-block" for c in cases) >= 6 and sum(c["scales"] == "fp8-tensor" for c in cases) >= 3
    small = [c for c in cases if _small(c)]
    assert {c["scales"] for c in small} == {"fp8-block", "fp8-tensor"}
    for c in small:
        r = checks._run_routed_case(c, "cpu")
        assert r["passed"] and r["c_oracle_vs_torch_fp64"] < 1e-6, r
        assert r.get("same_as_quantized_first", c["scales"] == "fp8-tensor"), r  # block: the e4m3 form's bits
        differs = r.get("config_differs_from_quantized_first", "").split()
        assert all(p.startswith("-DOG_") for p in differs if p != "vs"), r


def test_where_the_x16_kernels_sum_in_another_order():
    """gate_up's unroll is the one setting the x16 form of a Qwen3-30B-A3B call at two tokens
    changes against the e4m3 form (x's 16-bit registers): the H200 check found those two forms
    1e-5 apart and the forms with one configuration the same bits (bench/NOTES.md v35)."""
    F8 = torch.float8_e4m3fn
    T, E, H, I, k = 2, 128, 2048, 768, 8
    w13, w2 = torch.empty(E, 2 * I, H, dtype=F8), torch.empty(E, H, I, dtype=F8)
    s13, s2 = torch.empty(E, 2 * I // 128, H // 128), torch.empty(E, H // 128, I // 128)
    logits = torch.empty(T, E, dtype=torch.bfloat16)
    x16 = ops.routed_config(torch.empty(T, H, dtype=torch.bfloat16), w13, w2, logits, k, True,
                            fp8=ops.Fp8Scales(None, s13, s2, (128, 128))).split()
    e4m3 = ops.routed_config(torch.empty(T, H, dtype=F8), w13, w2, logits, k, True,
                             fp8=ops.Fp8Scales(torch.empty(T, H // 128), s13, s2, (128, 128))).split()
    assert len(x16) == len(e4m3) and "-DOG_XQ=1" in x16 and "-DOG_XQ=0" in e4m3
    assert {a.split("=")[0] for a, b in zip(x16, e4m3) if a != b} == {"-DOG_U1", "-DOG_XQ", "-DOG_XG"}


def test_the_checks_quantizer_is_the_c_oracles():
    """quantize_as_the_kernel (the GPU check's e4m3 form of 16-bit hidden states) equals the C
    oracle's quantization bit for bit, on values with exact ties: bf16 ratios to a group's absmax
    land on e4m3 midpoints often (0.5625 / 3.0 * 448 = 84, between 80 and 88), where a quotient an
    ulp off (torch's scalar / tensor is a reciprocal times the scalar) breaks them the other way."""
    shape = MoeShape("small", 4, 256, 64, 2)
    g = torch.Generator().manual_seed(5)
    w13, s13, w2, s2 = moe_bench.make_weights_fp8(shape, "fp8-block", "cpu", seed=1)
    x = (torch.randint(-48, 49, (3, 256), generator=g).float() / 16).bfloat16()  # multiples of 1/16
    x[:, ::128] = 3.0  # absmax 3 in every group
    assert float(x[0, 1]) in [v / 16 for v in range(-48, 49)]
    xq, xs = moe_bench.quantize_as_the_kernel(x, 128)
    assert torch.equal(torch.tensor([0.5625]).mul(torch.full((1,), 448.0) / 3.0).to(torch.float8_e4m3fn).float(),
                       torch.tensor([80.0]))  # the tie to the even encoding
    logits = torch.randn(3, 4, generator=g).bfloat16()
    c16 = ops.moe_routed_reference_cpu(x, w13, w2, logits, 2, True, fp8=moe_bench.fp8_scales("fp8-block", None, s13, s2))
    c8 = ops.moe_routed_reference_cpu(xq, w13, w2, logits, 2, True, fp8=moe_bench.fp8_scales("fp8-block", xs, s13, s2))
    assert torch.equal(c16, c8)
