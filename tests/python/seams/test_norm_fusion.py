"""The norm fusion seam against the real vLLM installed from PyPI (0.26 and, in CI, the newest): the
post-grad pass on traced graphs (what it fuses, what it leaves alone, bit for bit on CPU, where
opgraft::add_rms_norm_linear is vLLM's norm followed by opgraft::linear), run alone, inside vLLM's
own PostGradPassManager and under Inductor; and the patch of PostGradPassManager.configure.
"""

import json
import operator
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

if os.environ.get("OPGRAFT_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI installs vLLM: a failed import must fail, not skip)
else:
    pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

import vllm.ir.ops  # noqa: E402,F401  (registers torch.ops.vllm_ir)
from opgraft.ops import linear as _linear_op  # noqa: E402,F401  (registers torch.ops.opgraft)
from opgraft.vllm import _reset_for_tests, linear_seam, norm_seam, register, summary  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from vllm.compilation.passes.pass_manager import PostGradPassManager  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NORM = torch.ops.vllm_ir.fused_add_rms_norm.default
LINEAR = torch.ops.opgraft.linear.default
FUSED = torch.ops.opgraft.add_rms_norm_linear.default
EPS = 1e-6
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def rows(monkeypatch):
    """linear.norm_rows as a GPU would answer it (without one it is 0: nothing is fused); a test
    sets rows.value to change it."""
    class Rows:
        value = 8
        asked = []

    def allowed(N, K, dtype):
        Rows.asked.append((N, K, dtype))
        return Rows.value

    monkeypatch.setattr(norm_seam, "rows_allowed", allowed)
    return Rows


@pytest.fixture
def clean(clean_plugin, monkeypatch):
    monkeypatch.delenv("OPGRAFT_NORM_FUSION", raising=False)
    norm_seam._reset_fused_total()


@pytest.fixture(scope="module")
def cfg():
    return VllmConfig(device_config=DeviceConfig(device="cpu"))


def tensors(M=3, K=64, N=48, dtype=BF16, norm_dtype=None, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(M, K, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(K, generator=g).to(norm_dtype or dtype)
    W = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, r, w, W, b


def pattern(x, r, w, W, b):
    n, r2 = NORM(x, r, w, EPS, None)
    return LINEAR(n, W, b), r2


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def run_pass(gm, cfg):
    with set_current_vllm_config(cfg):
        p = norm_seam.pass_class()(cfg)
        p(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return p


def fuse_and_compare(fn, args, cfg, mode="fake"):
    """Traces fn, runs the pass; returns (pass, graph targets) after checking the graph still
    computes fn's bits."""
    gm = make_fx(fn, tracing_mode=mode)(*args)
    ref = gm(*args)
    p = run_pass(gm, cfg)
    got = gm(*args)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    return p, targets(gm)


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
@pytest.mark.parametrize("dtype,bias", [(BF16, True), (BF16, False), (torch.float16, True)])
def test_pattern_is_fused_bit_for_bit(clean, cfg, mode, dtype, bias):
    p, t = fuse_and_compare(pattern, tensors(dtype=dtype, bias=bias), cfg, mode)
    assert t.count(FUSED) == 1 and NORM not in t and LINEAR not in t
    assert p.fused == 1 and norm_seam.fused_total() == 1


LINEAR_QK = torch.ops.opgraft.linear_qk.default
FUSED_QK = torch.ops.opgraft.add_rms_norm_linear_qk.default


def qk_pattern(x, r, w, W, b, pos, cs, qw, kw):
    n, r2 = NORM(x, r, w, EPS, None)
    return LINEAR_QK(n, W, b, pos, cs, qw, kw, EPS, 16, 2, 1, 1), r2


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_the_q_k_epilogues_projection_is_fused_bit_for_bit(clean, cfg, mode):
    """norm -> opgraft.linear_qk (rope_seam's q/k epilogue form) ==> opgraft.add_rms_norm_linear_qk,
    its epilogue's arguments passed on: the same bits on the CPU (vLLM's norm, then linear_qk)."""
    g = torch.Generator().manual_seed(4)
    x, r, w, W, b = tensors(N=64, K=64)  # heads of 16: 2 query, 1 key, 1 value
    extra = (torch.tensor([1, 7, 3]), (2 * torch.rand(10, 16, generator=g) - 1).to(BF16),
             (0.5 + torch.rand(16, generator=g)).to(BF16), (0.5 + torch.rand(16, generator=g)).to(BF16))
    p, t = fuse_and_compare(qk_pattern, (x, r, w, W, b, *extra), cfg, mode)
    assert t.count(FUSED_QK) == 1 and NORM not in t and LINEAR_QK not in t
    assert p.fused == 1


def test_two_layers_and_an_unused_residual(clean, cfg):
    def two(x, r, w, W, b):
        y, r2 = pattern(x, r, w, W, b)
        n, _ = NORM(y[:, :64], r2, w, EPS)  # the second residual output unused
        return (LINEAR(n, W, bias=b),)

    p, t = fuse_and_compare(two, tensors(N=96), cfg, "symbolic")
    assert t.count(FUSED) == 2 and NORM not in t and LINEAR not in t and p.fused == 2


def normed_twice(x, r, w, W, b):
    n, r2 = NORM(x, r, w, EPS)
    return LINEAR(n, W, b), r2, n * 2


def variance_size(x, r, w, W, b):
    n, r2 = NORM(x, r, w, EPS, 32)
    return LINEAR(n, W, b), r2


def aten_linear(x, r, w, W, b):
    n, r2 = NORM(x, r, w, EPS)
    return torch.nn.functional.linear(n, W, b), r2


def no_norm_weight(x, r, w, W, b):
    n, r2 = NORM(x, r, None, EPS)
    return LINEAR(n, W, b), r2


def weight_made_after_norm(x, r, w, W, b):
    n, r2 = NORM(x, r, w, EPS)
    return LINEAR(n, W * 2, b), r2


@pytest.mark.parametrize("fn,kw", [
    (normed_twice, {}), (variance_size, {}), (aten_linear, {}), (no_norm_weight, {}),
    (weight_made_after_norm, {}), (pattern, {"dtype": torch.float32}), (pattern, {"norm_dtype": torch.float32}),
], ids=["normed-output-reused", "variance-size", "aten-linear", "no-norm-weight", "weight-after-norm", "fp32",
        "norm-weight-fp32"])
def test_other_graphs_are_left_alone(clean, cfg, fn, kw):
    args = tensors(**kw)
    before = targets(make_fx(fn, tracing_mode="fake")(*args))
    p, t = fuse_and_compare(fn, args, cfg)
    assert t == before and FUSED not in t and p.fused == 0 and norm_seam.fused_total() == 0


def test_pass_inside_vllms_pass_manager(clean, cfg):
    """register() patches configure; vLLM's manager then runs our pass before its IR lowering."""
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.config.utils import Range

    register()
    assert norm_seam.installed() and "norm fusion seam installed" in summary()
    m = PostGradPassManager()
    with set_current_vllm_config(cfg):
        m.configure(cfg)
    ours = [q for q in m.passes if isinstance(q, norm_seam.pass_class())]
    assert len(ours) == 1 and m.passes[-1] is ours[0]
    args = tensors()
    gm = make_fx(pattern, tracing_mode="fake")(*args)  # static weight shapes, as vLLM's parameters
    ref = gm(*args)
    with pass_context(Range(1, 8)):
        with_ours = m.uuid()  # the manager's Inductor cache key covers our pass
        m.passes.pop()
        assert m.uuid() != with_ours
        m.passes.append(ours[0])
        m.fix_functionalization = lambda graph: None  # its rotary targets need vllm._C, absent on CPU
        m(gm.graph)
    gm.recompile()
    assert targets(gm).count(FUSED) == 1 and NORM not in targets(gm)
    assert all(torch.equal(a, b) for a, b in zip(ref, gm(*args)))
    assert ours[0].fused == 1


def test_inductor_compiles_the_fused_graph(clean, cfg):
    import torch._inductor.config as inductor_config

    p = norm_seam.pass_class()(cfg)
    args = tensors(M=5)
    torch._dynamo.reset()
    try:
        with set_current_vllm_config(cfg), \
                inductor_config.patch(post_grad_custom_post_pass=p, force_disable_caches=True):
            got = torch.compile(pattern, backend="inductor", fullgraph=True, dynamic=True)(*args)
    finally:
        torch._dynamo.reset()
    assert p.fused == 1
    assert all(torch.equal(a, b) for a, b in zip(pattern(*args), got))


def test_pass_uuid_is_stable_and_differs_from_the_base(cfg):
    from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass

    a, b = norm_seam.pass_class()(cfg), norm_seam.pass_class()(cfg)
    assert a.uuid() == b.uuid() and a.uuid() != VllmInductorPass.uuid(a)


def test_install_uninstall_and_compile_factor(clean, cfg, monkeypatch):
    import vllm.envs as envs

    monkeypatch.delenv("OPGRAFT_NORM_FUSION_MOE", raising=False)
    original = PostGradPassManager.__dict__["configure"]
    register()
    patched = PostGradPassManager.__dict__["configure"]
    assert patched is not original and patched._opgraft_original_configure is original
    assert norm_seam.install() == (True, "norm fusion seam already installed")
    assert PostGradPassManager.__dict__["configure"] is patched
    factor = lambda: envs.compile_factors().get(norm_seam.COMPILE_FACTOR, "")
    assert factor().endswith("norm fusion on, MoE layers with the q/k epilogue")
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "0")
    assert factor().endswith("norm fusion on")
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "1")
    assert factor().endswith("norm fusion on, MoE layers too")
    m = PostGradPassManager()
    with set_current_vllm_config(cfg):
        m.configure(cfg)
        m.configure(cfg)  # vLLM's own passes repeat; ours is added once
    assert sum(isinstance(q, norm_seam.pass_class()) for q in m.passes) == 1
    _reset_for_tests()
    assert PostGradPassManager.__dict__["configure"] is original and not norm_seam.installed()
    assert norm_seam.COMPILE_FACTOR not in envs.compile_factors()
    m = PostGradPassManager()
    with set_current_vllm_config(cfg):
        m.configure(cfg)
    assert not any(isinstance(q, norm_seam.pass_class()) for q in m.passes)


def test_kill_switch_installs_nothing(clean, monkeypatch):
    monkeypatch.setenv("OPGRAFT_NORM_FUSION", "0")
    original = PostGradPassManager.__dict__["configure"]
    register()
    assert linear_seam.installed() and not norm_seam.installed()
    assert PostGradPassManager.__dict__["configure"] is original
    assert "norm fusion disabled by OPGRAFT_NORM_FUSION=0" in summary()


def test_linear_switched_off_turns_fusion_off_quietly(clean, monkeypatch, caplog):
    monkeypatch.setenv("OPGRAFT_LINEAR", "0")
    with caplog.at_level("WARNING"):
        register()
    assert not norm_seam.installed() and "norm fusion off with the linear seam" in summary()
    assert "norm fusion seam not installed" not in caplog.text


def test_refused_without_the_linear_op(clean, monkeypatch):
    installed, why = norm_seam.install()
    assert not installed and "linear seam is not installed" in why
    assert linear_seam.install()[0]
    monkeypatch.setenv("OPGRAFT_LINEAR_VARIANT", "passthrough")
    installed, why = norm_seam.install()
    assert not installed and "passthrough" in why and not norm_seam.installed()


def test_moved_or_changed_api_is_not_patched(clean, monkeypatch):
    assert linear_seam.install()[0]

    def configure(self, config, new_argument=None):
        pass

    monkeypatch.setattr(PostGradPassManager, "configure", configure)
    installed, why = norm_seam.install()
    assert not installed and "unexpected signature" in why
    assert PostGradPassManager.__dict__["configure"] is configure
    monkeypatch.delattr(PostGradPassManager, "configure")
    installed, why = norm_seam.install()
    assert not installed and "not where opgraft expects" in why


def test_getitem_meta_and_op_order(clean, cfg):
    """The new node sits where the norm was; its outputs carry the replaced nodes' fake values."""
    gm = make_fx(pattern, tracing_mode="fake")(*tensors())
    old = {n.target: n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem}
    y_val = old[LINEAR].meta["val"]
    run_pass(gm, cfg)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert nodes[0].target is FUSED and [n.target for n in nodes[1:]] == [operator.getitem] * 2
    assert nodes[0].meta["val"][0] is y_val and nodes[1].meta["val"] is y_val
    assert nodes[0].args[3] == EPS and nodes[0].args[5].op == "placeholder"


LAYERS_PROBE = textwrap.dedent("""
    import json, socket, torch
    import torch._inductor.config as inductor_config
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.config.utils import Range
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg), torch.inference_mode():
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import QKVParallelLinear
        from opgraft.vllm import linear_seam, norm_seam, register
        linear_seam.DEVICE_TYPES = ("cuda", "cpu")  # CPU calls into the op (which hands them to torch)
        norm_seam.rows_allowed = lambda N, K, dtype: 8  # as a GPU would answer
        register()
        dt = torch.bfloat16
        torch.manual_seed(0)

        class Layer(torch.nn.Module):  # a decoder layer's input_layernorm, then its qkv projection
            def __init__(self):
                super().__init__()
                self.norm = RMSNorm(64, eps=1e-6, dtype=dt)
                self.qkv = QKVParallelLinear(64, 16, 4, 2, bias=True, params_dtype=dt)

            def forward(self, h, res):
                h, res = self.norm(h, res)
                return self.qkv(h)[0], res

        layer = Layer()
        for p in layer.parameters():
            p.data.normal_()
        h, r = torch.randn(3, 64).to(dt), torch.randn(3, 64).to(dt)
        ref = layer(h.clone(), r.clone())
        seen = []

        class Spy(norm_seam.pass_class()):
            def __call__(self, graph):
                seen.append(sorted({str(n.target) for n in graph.nodes if n.op == "call_function"}))
                super().__call__(graph)
                seen.append(sorted({str(n.target) for n in graph.nodes if n.op == "call_function"}))

        spy = Spy(cfg)
        with pass_context(Range(1, 8)), inductor_config.patch(
                pre_grad_custom_pass=VllmIRInplaceFunctionalizationPass(cfg), post_grad_custom_post_pass=spy,
                force_disable_caches=True):
            out = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=True)(h.clone(), r.clone())
    print(json.dumps({"before": seen[0], "after": seen[1], "fused": spy.fused,
                      "equal": [bool(torch.equal(a, b)) for a, b in zip(ref, out)]}))
""")


def test_real_vllm_layers_are_fused_under_inductor():
    """vLLM's RMSNorm with a residual, then a QKVParallelLinear through the linear seam, compiled by
    Inductor with vLLM's pre-grad IR functionalization and our pass: fused, and vLLM's bits."""
    e = dict(os.environ)
    for k in ("OPGRAFT_DISABLE", "OPGRAFT_LINEAR", "OPGRAFT_LINEAR_VARIANT", "OPGRAFT_NORM_FUSION", "VLLM_PLUGINS"):
        e.pop(k, None)
    e["OPGRAFT_FORCE_PLATFORM"] = "1"
    e["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), e.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", LAYERS_PROBE], capture_output=True, text=True, env=e, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"vllm_ir.fused_add_rms_norm.default", "opgraft.linear.default"} <= set(res["before"]), res
    assert "opgraft.add_rms_norm_linear.default" in res["after"] and "opgraft.linear.default" not in res["after"]
    assert res["fused"] == 1 and res["equal"] == [True, True]


def test_only_graphs_of_the_rows_the_shape_allows(clean, cfg, rows):
    """A graph compiled for a range of token counts is fused only where the shape's
    linear.norm_rows covers the whole range; graphs of more tokens than the kernel takes are
    never offered to the pass."""
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.config.utils import Range

    p = norm_seam.pass_class()(cfg)
    assert p.is_applicable_for_range(Range(1, 2)) and p.is_applicable_for_range(Range(8, 8))
    assert not p.is_applicable_for_range(Range(3, 8192)) and not p.is_applicable_for_range(Range(1, 9))
    args = tensors()
    for value, rng, fused in ((2, Range(1, 2), 1), (1, Range(1, 2), 0), (0, Range(1, 1), 0), (4, Range(3, 4), 1)):
        rows.value = value
        rows.asked.clear()
        gm = make_fx(pattern, tracing_mode="fake")(*args)
        with set_current_vllm_config(cfg), pass_context(rng):
            q = norm_seam.pass_class()(cfg)
            q(gm.graph)
        assert q.fused == fused, (value, rng)
        assert rows.asked == [(48, 64, BF16)]


class Qwen3MoeModel:
    """The parts of vLLM's ModelConfig the seam's compile ranges read (Qwen3-30B-A3B's)."""
    dtype = BF16

    def get_hidden_size(self):
        return 2048

    def get_num_attention_heads(self, pc):
        return 32

    def get_num_kv_heads(self, pc):
        return 4

    def get_head_size(self):
        return 128

    def get_num_experts(self):
        return 128


def ranges_config(model=Qwen3MoeModel(), max_tokens=8192):
    """What VllmConfig._set_compile_ranges reads of a config, before vLLM's endpoints."""
    from types import SimpleNamespace

    return SimpleNamespace(compilation_config=SimpleNamespace(compile_ranges_endpoints=None), model_config=model,
                           parallel_config=None, scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens))


def test_compile_ranges_get_the_qkv_endpoint(clean, rows, monkeypatch):
    """install() wraps VllmConfig._set_compile_ranges: after vLLM's endpoints it adds the qkv
    projection's linear.norm_rows (a graph for 1..E tokens, fused; vLLM's own above)."""
    from vllm.config import VllmConfig

    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "0")  # the router's rows are not asked
    monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", "0")  # its wrapper of the same method would be outermost

    calls = []

    def original(self):
        calls.append(self)
        self.compilation_config.compile_ranges_endpoints = [8192]

    patched = norm_seam._make_set_compile_ranges(original)

    rows.value = 2
    c = ranges_config()
    patched(c)
    assert c.compilation_config.compile_ranges_endpoints == [2, 8192] and rows.asked[-1] == (5120, 2048, BF16)
    for value, model, max_tokens in ((0, Qwen3MoeModel(), 8192), (1, Qwen3MoeModel(), 8192), (2, None, 8192),
                                      (2, Qwen3MoeModel(), 2)):
        rows.value = value
        c = ranges_config(model, max_tokens)
        patched(c)
        assert c.compilation_config.compile_ranges_endpoints == [8192], (value, model, max_tokens)
    register()
    assert hasattr(VllmConfig.__dict__["_set_compile_ranges"], norm_seam._PATCH_ATTR)
    _reset_for_tests()
    assert not hasattr(VllmConfig.__dict__["_set_compile_ranges"], norm_seam._PATCH_ATTR)


def test_compile_ranges_get_the_router_endpoint_with_the_moe_form(clean, monkeypatch):
    """With OPGRAFT_NORM_FUSION_MOE=1 a MoE model's router gate adds its own linear.norm_rows where
    they are more than the qkv's: a graph where only the router's norm is fused."""
    rows = {(5120, 2048): 2, (128, 2048): 8}
    monkeypatch.setattr(norm_seam, "rows_allowed", lambda N, K, dtype: rows.get((N, K), 0))

    def original(self):
        self.compilation_config.compile_ranges_endpoints = [8192]

    patched = norm_seam._make_set_compile_ranges(original)

    def endpoints():
        c = ranges_config()
        patched(c)
        return c.compilation_config.compile_ranges_endpoints

    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "0")
    assert endpoints() == [2, 8192]
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "1")
    assert endpoints() == [2, 8, 8192]
    c = ranges_config(SimpleNamespace(dtype=BF16, get_hidden_size=lambda: 2048, get_num_experts=lambda: 0))
    assert norm_seam.router_rows(c) == 0  # no experts
    monkeypatch.delenv("OPGRAFT_NORM_FUSION_MOE")  # the default: the models with the q/k epilogue
    assert endpoints() == [2, 8192]  # the attention prologue seam (the epilogue's) not installed
    from opgraft.vllm import rope_seam

    qk = []
    monkeypatch.setattr(rope_seam, "installed", lambda: True)
    monkeypatch.setattr(rope_seam, "qk_model", lambda c: qk.append(c) or c.model_config.dtype == BF16)
    assert endpoints() == [2, 8, 8192] and qk
    assert norm_seam.moe_enabled(ranges_config()) and not norm_seam.moe_enabled()  # no config: the switch
    monkeypatch.setattr(rope_seam, "qk_model", lambda c: False)
    assert endpoints() == [2, 8192]
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "1")
    rows[(128, 2048)] = 2  # the same rows as the qkv's: one endpoint
    assert endpoints() == [2, 8192]


def test_unset_the_moe_form_follows_the_epilogue_rows(monkeypatch):
    """OPGRAFT_NORM_FUSION_MOE unset, through the library's real rows (the GPU a stand-in): on for
    Qwen3-30B-A3B where its qkv has linear.qk_epilogue 1 (the H100's row) and the epilogue's seam
    is installed; off on the H200 (no row), for another model's qkv, and without that seam."""
    from opgraft.vllm import rope_seam

    model = Qwen3MoeModel()
    config = SimpleNamespace(model_config=model, parallel_config=None)
    for k in ("OPGRAFT_NORM_FUSION_MOE", "OPGRAFT_QK_EPILOGUE") + tuple(k for k in os.environ if k.startswith("OPGRAFT_TUNE")):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(rope_seam, "installed", lambda: True)
    monkeypatch.setattr(norm_seam, "_device", lambda: (90, "NVIDIA H100 80GB HBM3"))
    assert norm_seam.moe_enabled(config)
    monkeypatch.setattr(norm_seam, "_device", lambda: (90, "NVIDIA H200"))
    assert not norm_seam.moe_enabled(config)
    monkeypatch.setattr(norm_seam, "_device", lambda: (90, "NVIDIA H100 80GB HBM3"))
    model.get_num_kv_heads = lambda pc: 8  # another qkv shape: no row
    assert not norm_seam.moe_enabled(config)
    model.get_num_kv_heads = lambda pc: 4
    monkeypatch.setattr(rope_seam, "installed", lambda: False)
    assert not norm_seam.moe_enabled(config)


def test_rows_allowed_asks_the_linear_op(monkeypatch):
    """Without the fixture: the linear op's linear.norm_rows for the shape on this process's GPU
    (through vLLM's platform), 0 without one or for other dtypes."""
    from opgraft import _lib

    monkeypatch.undo()
    monkeypatch.setattr(norm_seam, "_device", lambda: (90, "NVIDIA H200"))
    assert norm_seam.rows_allowed(5120, 2048, BF16) == _lib.tune_get("linear.norm_rows", 90, "NVIDIA H200",
                                                                      "linear:bf16:N5120:K2048", 1)[0] == 2
    assert norm_seam.rows_allowed(28672, 4096, BF16) == 0
    assert norm_seam.rows_allowed(5120, 2048, torch.float32) == 0
    monkeypatch.setattr(norm_seam, "_device", lambda: (0, None))
    assert norm_seam.rows_allowed(5120, 2048, BF16) == 0


def test_doctor_reports_the_norm_fusion(clean, capsys, monkeypatch):
    from opgraft import cli

    def line():
        assert cli.main(["doctor"]) == 0
        return [x[22:].strip() for x in capsys.readouterr().out.splitlines() if x.startswith("norm fusion")]

    off = "off (OPGRAFT_NORM_FUSION_MOE=1 turns it on)"
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "0")
    assert line() == ["ready: add + RMSNorm in the qkv projection's kernel, in graphs of up to linear.norm_rows tokens",
                      off]
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "1")
    assert line()[1].startswith("ready: add + RMSNorm in a MoE layer's router gate")
    assert line()[1].endswith("(OPGRAFT_NORM_FUSION_MOE=1)")
    monkeypatch.delenv("OPGRAFT_NORM_FUSION_MOE")
    assert line()[1].endswith("(models with the q/k epilogue; OPGRAFT_NORM_FUSION_MOE=1 every MoE model)")
    monkeypatch.setenv("OPGRAFT_NORM_FUSION", "0")
    assert line() == ["norm fusion disabled by OPGRAFT_NORM_FUSION=0"] * 2
    monkeypatch.delenv("OPGRAFT_NORM_FUSION")
    monkeypatch.setenv("OPGRAFT_LINEAR", "0")
    assert line() == ["norm fusion off with the linear seam (OPGRAFT_LINEAR=0)"] * 2
