"""The attention prologue seam against the real vLLM installed from PyPI (0.26 and, in CI, the
newest): the rewrite of Dynamo graphs traced from vLLM's own RMSNorm and RotaryEmbedding (its
custom-op form) and attention op call (what it rewrites, what it leaves alone, the same outputs on
CPU through vLLM's norm and rotary embedding), vLLM's split_graph through the patch (our op splits
the graph where vLLM's attention did), the custom_ops change, the switch and its default, and install.

Without a GPU, vLLM's _C library is not loaded: a stand-in for _C::rotary_embedding with its
schema (in place on query and key, vLLM's forward_static) is registered for the tests.
"""

import copy
import os
from types import SimpleNamespace

import pytest

if os.environ.get("OPGRAFT_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI installs vLLM: a failed import must fail, not skip)
else:
    pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

import vllm.compilation.backends as backends  # noqa: E402
import vllm.ir.ops  # noqa: E402,F401  (registers torch.ops.vllm_ir)
import vllm.model_executor.layers.attention.attention as attention_mod  # noqa: E402
from opgraft.vllm import attn_seam, register, rope_seam, summary  # noqa: E402
from vllm.config import CompilationConfig, DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402
from vllm.utils.torch_utils import _encode_layer_name  # noqa: E402

HQ, HK, D, T = 8, 2, 64, 3
EPS = 1e-6
LAYER = "model.layers.0.self_attn.attn"
ATTN = "vllm::unified_attention_with_output"

if not hasattr(torch.ops._C, "rotary_embedding"):
    _lib = torch.library.Library("_C", "FRAGMENT")
    _lib.define("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
                "Tensor cos_sin_cache, bool is_neox) -> ()")

    def _rope_cpu(positions, query, key, head_size, cos_sin_cache, is_neox):
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        q, k = RotaryEmbedding.forward_static(positions, query, key, head_size, head_size, cos_sin_cache, is_neox)
        query.copy_(q)
        key.copy_(k)

    _lib.impl("rotary_embedding", _rope_cpu, "CPU")
    _lib.impl("rotary_embedding", lambda *a: None, "Meta")


def _fused_qk_norm_rope_cpu(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
                            cos_sin_cache, is_neox, position_ids, forced_token_heads_per_warp=-1):
    """vLLM's fused_qk_norm_rope as its unfused ops compute it, in place on qkv (a CPU stand-in)."""
    T = qkv.shape[0]
    q, k = qkv[:, :num_heads_q * head_dim], qkv[:, num_heads_q * head_dim:(num_heads_q + num_heads_k) * head_dim]
    qn = torch.ops.vllm_ir.rms_norm(q.reshape(T, -1, head_dim), q_weight, eps, None).reshape(T, -1)
    kn = torch.ops.vllm_ir.rms_norm(k.reshape(T, -1, head_dim), k_weight, eps, None).reshape(T, -1)
    torch.ops._C.rotary_embedding(position_ids, qn, kn, head_dim, cos_sin_cache, is_neox)
    q.copy_(qn)
    k.copy_(kn)


@pytest.fixture
def fused_op(monkeypatch):
    """vLLM's fused_qk_norm_rope present (a CPU stand-in through vllm._custom_ops), its calls kept."""
    from vllm import _custom_ops

    calls = []

    def fake(qkv, *args):
        calls.append((qkv.shape, args))
        _fused_qk_norm_rope_cpu(qkv, *args)

    monkeypatch.setattr(_custom_ops, "fused_qk_norm_rope", fake)
    if not hasattr(torch.ops._C, "fused_qk_norm_rope"):
        monkeypatch.setattr(rope_seam, "_has_fused", lambda: True)
    return calls


@pytest.fixture(scope="module")
def cfg():
    return VllmConfig(device_config=DeviceConfig(device="cpu"),
                      compilation_config=CompilationConfig(custom_ops=["+rotary_embedding"]))


@pytest.fixture(scope="module")
def layers(cfg):
    with set_current_vllm_config(cfg):
        rope = get_rope(D, 4096, is_neox_style=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                        dtype=torch.bfloat16)
        qn, kn = RMSNorm(D, eps=EPS), RMSNorm(D, eps=EPS)
    g = torch.Generator().manual_seed(3)
    for n in (qn, kn):
        n.weight.data.copy_((1 + 0.5 * torch.rand(D, generator=g)).to(n.weight.dtype))
    return SimpleNamespace(rope=rope, qn=qn, kn=kn)


def qwen3_attention(layers, norm=True, extra_k_use=False, dummy_dep=False, hq=HQ):
    """Qwen3Attention.forward from the qkv output to the attention op, as vLLM 0.26 runs it
    (Attention.forward's views and op call included)."""
    name = _encode_layer_name(LAYER)

    def f(qkv, positions, output):
        q, k, v = qkv.split([hq * D, HK * D, HK * D], dim=-1)
        if norm:
            qh = layers.qn(q.view(*q.shape[:-1], hq, D))
            q = qh.view(q.shape)
            kh = layers.kn(k.view(*k.shape[:-1], HK, D))
            k = kh.view(k.shape)
        q, k = layers.rope(positions, q, k)
        o = output.view(-1, hq, D)
        dep = torch.ops.vllm.unified_kv_cache_update(k.view(-1, HK, D), v.view(-1, HK, D), name) if dummy_dep else None
        torch.ops.vllm.unified_attention_with_output(q.view(-1, hq, D), k.view(-1, HK, D), v.view(-1, HK, D), o, name,
                                                     kv_cache_dummy_dep=dep)
        return (output, k * 2) if extra_k_use else output

    return f


def trace(cfg, f, inputs=None):
    """The Dynamo graph of f (what vLLM's backend receives), with the inputs it was called with
    (vLLM's weights and buffers lifted among them); inputs: example_inputs() unless given."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        (outs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        vals = [o.meta["example_value"] for o in outs]
        return lambda *args: tuple(torch.zeros(v.shape, dtype=v.dtype) for v in vals)  # traced, not run

    torch._dynamo.reset()
    with set_current_vllm_config(cfg):
        torch.compile(f, backend=backend, fullgraph=True, dynamic=False)(*(inputs or example_inputs()))
    return graphs[0]


def example_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (HQ + 2 * HK) * D, generator=g).to(torch.bfloat16)
    return qkv, torch.tensor([5, 0, 4000]), torch.zeros(T, HQ * D, dtype=torch.bfloat16)


def graph_inputs(gm, ex, seed=0):
    """The graph's inputs with fresh copies of the tensors, qkv drawn with seed."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out = [x.clone() if isinstance(x, torch.Tensor) else x for x in ex]
    out[names.index("l_qkv_")] = example_inputs(seed)[0]
    return out


class FakeImpl:
    """Stands in for a layer's impl: writes out = q (its heads' first dims) + k and v (broadcast),
    so that a changed q, k or v shows."""

    def __init__(self):
        self.calls = 0

    def forward(self, layer, query, key, value, kv_cache, md, output=None, **kw):
        self.calls += 1
        G = query.shape[1] // key.shape[1]
        output.copy_(query + key.repeat_interleave(G, dim=1) + value.repeat_interleave(G, dim=1))
        return output


class attention_context:
    """vLLM's get_attention_context answering with a fake layer whose impl is `impl`."""

    def __init__(self, forward):
        self.layer = SimpleNamespace(impl=SimpleNamespace(forward=forward), layer_name=LAYER)

    def __enter__(self):
        self.saved = attention_mod.get_attention_context
        attention_mod.get_attention_context = lambda name: (None, self.layer, None, None)
        return self.layer

    def __exit__(self, *exc):
        attention_mod.get_attention_context = self.saved


def targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def run(gm, impl, inputs):
    """The graph's output buffer after a run with the layer's impl `impl`."""
    with attention_context(impl.forward):
        out = gm(*inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("norm", [True, False])
def test_the_rewrite_gives_the_prologue_to_the_attention_call(cfg, layers, norm):
    gm, ex = trace(cfg, qwen3_attention(layers, norm))
    before = copy.deepcopy(gm)
    assert "_C.rotary_embedding" in targets(gm) and "vllm.unified_attention_with_output" in targets(gm)
    assert rope_seam.rewrite(gm) == 1
    t = targets(gm)
    assert "opgraft.rope_attention.default" in t
    assert not any(x in t for x in ("_C.rotary_embedding", "vllm.unified_attention_with_output",
                                    "vllm_ir.rms_norm.default"))
    (fused,) = [n for n in gm.graph.nodes if str(n.target) == "opgraft.rope_attention.default"]
    q, k, v, out, name, positions, cache, head_size, neox, qw, kw, eps = fused.args
    assert str(q.target) == str(k.target) == "<built-in function getitem>"  # the raw split outputs
    assert (head_size, neox) == (D, True) and (qw is None) == (not norm) and eps == (EPS if norm else 0.0)
    # the same outputs: our op without a forward_prologue runs vLLM's norm and rotary embedding,
    # then the layer's forward
    want, got = FakeImpl(), FakeImpl()
    a = run(before, want, graph_inputs(before, ex, 1))
    b = run(gm, got, graph_inputs(gm, ex, 1))
    assert want.calls == got.calls == 1
    assert torch.equal(a, b) and bool(a.abs().sum() > 0)
    assert not torch.equal(b, run(gm, FakeImpl(), graph_inputs(gm, ex, 2)))


def test_the_layers_forward_prologue_gets_the_raw_tensors(cfg, layers):
    gm, ex = trace(cfg, qwen3_attention(layers))
    assert rope_seam.rewrite(gm) == 1
    seen = []
    layer = SimpleNamespace(impl=SimpleNamespace(forward_prologue=lambda *a: seen.append(a)), layer_name=LAYER)
    inputs = graph_inputs(gm, ex)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    qkv, positions = inputs[names.index("l_qkv_")], inputs[names.index("l_positions_")]
    saved = attention_mod.get_attention_context
    attention_mod.get_attention_context = lambda name: ("md", layer, "kv", None)
    try:
        gm(*inputs)
    finally:
        attention_mod.get_attention_context = saved
    ((lay, q, k, v, kv, md, o, pro),) = seen
    assert lay is layer and kv == "kv" and md == "md"
    assert torch.equal(q, qkv[:, :HQ * D]) and torch.equal(k, qkv[:, HQ * D:(HQ + HK) * D])
    assert v.shape == (T, HK, D) and o.shape == (T, HQ, D)
    assert pro.positions is positions and pro.cos_sin_cache.shape == (4096, D) and pro.rope_style == 1
    assert torch.equal(pro.q_norm_weight, layers.qn.weight) and torch.equal(pro.k_norm_weight, layers.kn.weight)
    assert pro.eps == EPS


@pytest.mark.parametrize("kw", [dict(extra_k_use=True), dict(dummy_dep=True)])
def test_what_it_leaves_alone(cfg, layers, kw):
    # the rotated key used again after attention; vLLM's own KV-cache update op before attention
    gm, _ = trace(cfg, qwen3_attention(layers, **kw))
    assert rope_seam.rewrite(gm) == 0
    assert "vllm.unified_attention_with_output" in targets(gm)


def test_split_graph_splits_at_our_op_where_it_split_at_attention(cfg, layers, clean_plugin, monkeypatch):
    monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", "1")
    register()
    assert rope_seam.installed() and attn_seam.backend_registered() and "attention kernel, every model)" in summary()
    gm, _ = trace(cfg, qwen3_attention(layers))
    split_gm, items = backends.split_graph(copy.deepcopy(gm), [ATTN])
    splitting = [i for i in items if i.is_splitting_graph]
    assert len(splitting) == 1
    assert "opgraft.rope_attention.default" in targets(getattr(split_gm, splitting[0].submod_name))
    before = rope_seam.fused_total()
    _, items = backends.split_graph(copy.deepcopy(gm), [])  # vLLM does not split at attention: as it was
    assert rope_seam.fused_total() == before and not any(i.is_splitting_graph for i in items)


def test_custom_ops_get_vllms_rotary_embedding_op(clean_plugin, monkeypatch):
    monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", "1")
    register()
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    assert "+rotary_embedding" in cfg.compilation_config.custom_ops
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"),
                     compilation_config=CompilationConfig(custom_ops=["-rotary_embedding"]))
    assert "+rotary_embedding" not in cfg.compilation_config.custom_ops


def test_the_switch_and_the_attention_switches(clean_plugin, monkeypatch):
    from opgraft import dispatch

    warned = []
    monkeypatch.setattr(dispatch, "_warn_once", warned.append)
    for value, state in (("1", True), ("ON", True), ("0", False), ("off", False), ("maybe", None)):
        monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", value)
        assert rope_seam.switch_state() is state and rope_seam.enabled() is (state is not False), value
    assert set(warned) == {"OPGRAFT_ATTENTION_PROLOGUE='maybe' is neither on (1) nor off (0): left at its default"}
    monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", "0")
    register()
    assert not rope_seam.installed() and rope_seam.disabled() == "attention prologue off (OPGRAFT_ATTENTION_PROLOGUE=0)"
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    assert "+rotary_embedding" not in cfg.compilation_config.custom_ops
    monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", "1")
    for switch in ("OPGRAFT_ATTENTION", "OPGRAFT_ATTENTION_CACHE_WRITE"):
        monkeypatch.setenv(switch, "0")
        assert switch in rope_seam.disabled()
        monkeypatch.delenv(switch)
    assert rope_seam.disabled() == ""


class _Model:
    """The parts of vLLM's ModelConfig the defaults read."""

    def __init__(self, experts=128, quantization=None):
        self.experts, self.quantization = experts, quantization

    def get_num_experts(self):
        return self.experts

    def get_hidden_size(self):
        return 2048


def test_by_default_with_the_moe_norm_form_on_moe_models(clean_plugin, monkeypatch):
    """Unset: installed; a model gets it where the norm fusion's MoE form is on for it
    (OPGRAFT_NORM_FUSION_MOE=1, a model with experts; unset, the models with the q/k epilogue, which
    want the seam for that), so none without the epilogue by default; 1: every model."""
    from opgraft.vllm import norm_seam

    monkeypatch.delenv("OPGRAFT_ATTENTION_PROLOGUE", raising=False)
    monkeypatch.delenv("OPGRAFT_NORM_FUSION_MOE", raising=False)
    register()
    assert rope_seam.installed() and norm_seam.installed()
    assert "attention prologue seam installed (q/k norm and rotary embedding in the attention kernel, with the MoE " \
           "norm form where the q/k epilogue rewrote nothing)" in summary()
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))  # no model
    assert "+rotary_embedding" not in cfg.compilation_config.custom_ops and not rope_seam.wanted(cfg)
    of = lambda model: SimpleNamespace(model_config=model)
    for model in (_Model(), _Model(experts=0), _Model(quantization="fp8"), None):
        assert not rope_seam.wanted(of(model))
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "1")
    assert rope_seam.wanted(of(_Model())) and rope_seam.wanted(of(_Model(quantization="fp8")))
    assert not rope_seam.wanted(of(_Model(experts=0)))
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "0")
    assert not rope_seam.wanted(of(_Model()))
    monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", "1")
    assert rope_seam.wanted(of(_Model(experts=0))) and rope_seam.wanted(cfg)


def test_vllm_builds_the_passes_before_it_splits():
    """The default asks the pass vLLM built for the backend being compiled (norm_seam.moe_form_on):
    that holds while VllmBackend.__call__ configures its pass manager before it splits the graph."""
    import inspect

    src = inspect.getsource(backends.VllmBackend.__call__)
    assert "self.configure_post_pass()" in src and "split_graph(" in src
    assert src.index("self.configure_post_pass()") < src.index("split_graph(")


def test_split_graph_by_default_only_in_moe_graphs_with_the_norm_form(cfg, layers, clean_plugin, monkeypatch):
    """Unset, vLLM's split_graph rewrites a graph only where the pass vLLM built for it (right
    before the split) took the MoE form and the graph has a MoE layer."""
    from opgraft.vllm import norm_seam

    monkeypatch.delenv("OPGRAFT_ATTENTION_PROLOGUE", raising=False)
    register()
    gm, _ = trace(cfg, qwen3_attention(layers))
    moe_gm = copy.deepcopy(gm)
    out = next(n for n in moe_gm.graph.nodes if n.op == "output")
    with moe_gm.graph.inserting_before(out):  # a MoE layer's call (split, never run)
        moe_gm.graph.call_function(norm_seam._moe_forward(), tuple(n for n in moe_gm.graph.nodes if n.op == "placeholder")[:1])
    moe_gm.recompile()

    def rewrote(g):
        before = rope_seam.fused_total()
        backends.split_graph(copy.deepcopy(g), [ATTN])
        return rope_seam.fused_total() - before

    for form, graph, want in ((True, moe_gm, 1), (True, gm, 0), (False, moe_gm, 0)):
        monkeypatch.setattr(norm_seam, "_moe_form", form)
        assert rewrote(graph) == want, (form, graph is gm)
    monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", "1")
    assert rewrote(gm) == 1


def test_install_and_uninstall(clean_plugin, monkeypatch):
    from opgraft.vllm import _reset_for_tests

    original = backends.split_graph
    ranges = VllmConfig.__dict__["_set_compile_ranges"]
    monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", "1")
    register()
    assert rope_seam.installed() and backends.split_graph is not original
    assert rope_seam.install() == (True, "attention prologue seam already installed")
    _reset_for_tests()
    assert backends.split_graph is original and VllmConfig.__dict__["_set_compile_ranges"] is ranges
    assert not rope_seam.installed()


def test_the_hand_back_uses_vllms_fused_qk_norm_rope_where_it_has_it(cfg, layers, fused_op):
    """The op's hand-back (a layer without forward_prologue here) gives the same outputs through
    vLLM's fused kernel on a copy of q|k|v as through its ops one by one."""
    gm, ex = trace(cfg, qwen3_attention(layers))
    before = copy.deepcopy(gm)
    assert rope_seam.rewrite(gm) == 1
    a = run(before, FakeImpl(), graph_inputs(before, ex, 1))
    inputs = graph_inputs(gm, ex, 1)
    b = run(gm, FakeImpl(), inputs)
    assert torch.equal(a, b)
    ((shape, args),) = fused_op
    assert shape == (T, (HQ + 2 * HK) * D) and args[:4] == (HQ, HK, HK, D) and args[4] == EPS and args[8] is True
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert torch.equal(inputs[names.index("l_qkv_")], example_inputs(1)[0])  # the caller's qkv untouched


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device (the hand-back's choice between ours and vLLM's)."""
    is_cuda = True


def test_the_hand_back_runs_our_prologue_alone_on_cuda_tensors(monkeypatch, fused_op):
    """rope_seam.prologue: CUDA tensors go to ops.attention.qk_prologue as [T, heads, D] views of the
    raw q and k; where the library refuses (or fails) vLLM's ops run instead; CPU tensors go to
    vLLM's at once."""
    from opgraft import _lib
    from opgraft.ops import attention as ops

    qkv = torch.randn((T, (HQ + 2 * HK) * D)).to(torch.bfloat16)
    q, k, v = qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HK) * D], qkv[:, (HQ + HK) * D:].view(T, HK, D)
    w = torch.ones(D, dtype=torch.bfloat16)
    pro = ops.QKPrologue(w, w, EPS, torch.randn((64, D)).to(torch.bfloat16), torch.arange(T), _lib.ROPE_NEOX)
    seen = []

    def ours(query, key, p):
        seen.append((query, key, p))
        return query.float() + 1, key.float() + 1

    monkeypatch.setattr(ops, "qk_prologue", ours)
    gq, gk = q.as_subclass(_OnGpu), k.as_subclass(_OnGpu)
    qn, kn = rope_seam.prologue(gq, gk, pro, D, v)
    ((query, key, p),) = seen
    assert query.shape == (T, HQ, D) and query.data_ptr() == q.data_ptr() and key.shape == (T, HK, D)
    assert key.data_ptr() == k.data_ptr() and p is pro and not fused_op
    assert qn.shape == (T, HQ * D) and torch.equal(qn, q.float() + 1) and torch.equal(kn, k.float() + 1)

    def refuses(query, key, p):
        raise _lib.OpgraftError(_lib.EUNSUPPORTED, "head size 96")

    for stand_in in (refuses, lambda *a: 1 / 0):
        monkeypatch.setattr(ops, "qk_prologue", stand_in)
        fused_op.clear()
        qn, kn = rope_seam.prologue(gq, gk, pro, D, v)
        assert len(fused_op) == 1 and qn.shape == (T, HQ * D)  # vLLM's fused kernel on a copy
    seen.clear()
    monkeypatch.setattr(ops, "qk_prologue", ours)
    fused_op.clear()
    rope_seam.prologue(q, k, pro, D, v)
    assert not seen and len(fused_op) == 1


def test_the_prologue_bench_times_vllms_own_wrapper(fused_op):
    """opgraft bench attention --prologue's vLLM baseline is vLLM's fused_qk_norm_rope wrapper, whose
    import loads vllm._C (the op is not under torch.ops._C before that), called as rope_seam calls it."""
    from opgraft.bench import attention as attn_bench
    from vllm import _custom_ops

    op = attn_bench.vllm_fused_qk_norm_rope()
    assert op is _custom_ops.fused_qk_norm_rope
    qkv = torch.randn(T, (HQ + 2 * HK) * D)
    w = torch.ones(D)
    cache = torch.randn(16, D)
    op(qkv, HQ, HK, HK, D, EPS, w, w, cache, True, torch.zeros(T, dtype=torch.long))
    ((shape, args),) = fused_op
    assert shape == qkv.shape and args[:4] == (HQ, HK, HK, D) and len(args) == 10


# ---- the q/k epilogue form (OPGRAFT_QK_EPILOGUE=1): the norm and rotary embedding in qkv's kernel ----

def qwen3_attention_from_x(layers, norm=True, bias=False, extra_k_use=False):
    """qwen3_attention with the qkv projection in front, as the linear seam's op."""
    inner = qwen3_attention(layers, norm, extra_k_use=extra_k_use)

    def f(x, w, b, positions, output):
        qkv = torch.ops.opgraft.linear(x, w, b if bias else None)
        return inner(qkv, positions, output)

    return f


def qk_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    K = 72
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    w = (0.2 * torch.randn((HQ + 2 * HK) * D, K, generator=g)).to(torch.bfloat16)
    b = torch.randn((HQ + 2 * HK) * D, generator=g).to(torch.bfloat16)
    return x, w, b, torch.tensor([5, 0, 4000]), torch.zeros(T, HQ * D, dtype=torch.bfloat16)


def qk_trace(cfg, f):
    return trace(cfg, f, qk_inputs())


def qk_graph_inputs(gm, ex, seed):
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out = [t.clone() if isinstance(t, torch.Tensor) else t for t in ex]
    x = qk_inputs(seed)[0]
    out[names.index("l_x_")] = x
    return out


@pytest.mark.parametrize("norm,bias", [(True, False), (False, True)])
def test_the_qk_rewrite_gives_the_norm_and_rotation_to_the_projection(cfg, layers, norm, bias, monkeypatch):
    from opgraft.ops import linear as _linear  # noqa: F401  (registers opgraft::linear and linear_qk)

    monkeypatch.setenv("OPGRAFT_QK_EPILOGUE", "1")
    gm, ex = qk_trace(cfg, qwen3_attention_from_x(layers, norm, bias))
    before = copy.deepcopy(gm)
    assert "opgraft.linear.default" in targets(gm) or "opgraft.linear" in targets(gm)
    assert rope_seam.rewrite_qk(gm) == 1
    t = targets(gm)
    assert "opgraft.linear_qk.default" in t and "vllm.unified_attention_with_output" in t
    assert not any(x in t for x in ("_C.rotary_embedding", "vllm_ir.rms_norm.default", "opgraft.linear.default"))
    (fused,) = [n for n in gm.graph.nodes if str(n.target) == "opgraft.linear_qk.default"]
    x, w, b, positions, cache, qw, kw, eps, head_size, hq, hk, style = fused.args
    assert (head_size, hq, hk, style) == (D, HQ, HK, 1) and (b is None) == (not bias)
    assert (qw is None) == (not norm) and eps == (EPS if norm else 0.0) and cache is not None
    # The same query, key and value reach attention, up to rounding: the CPU stand-in of vLLM's
    # rotary embedding (forward_static) rounds each bf16 operation, ours once from fp32. A head
    # normalized with the other weights, or rotated at another position, is off by far more.
    seen = {}

    def forward(layer, query, key, value, kv_cache, md, output=None, **kw):
        seen.setdefault("qkv", []).append((query.clone(), key.clone(), value.clone()))
        return output

    run(before, SimpleNamespace(forward=forward), qk_graph_inputs(before, ex, 1))
    run(gm, SimpleNamespace(forward=forward), qk_graph_inputs(gm, ex, 1))
    (qa, ka, va), (qc, kc, vc) = seen["qkv"]
    assert torch.equal(va, vc) and bool(qa.abs().sum() > 0)
    for a, c in ((qa, qc), (ka, kc)):
        err = float((a.float() - c.float()).norm() / a.float().norm())
        assert err < 2 ** -7, err


def test_the_qk_rewrite_leaves_a_rotated_key_used_elsewhere(cfg, layers, monkeypatch):
    monkeypatch.setenv("OPGRAFT_QK_EPILOGUE", "1")
    gm, _ = qk_trace(cfg, qwen3_attention_from_x(layers, extra_k_use=True))
    assert rope_seam.rewrite_qk(gm) == 0
    assert "_C.rotary_embedding" in targets(gm)


def test_unset_the_qk_rewrite_follows_linear_qk_epilogue_by_shape(cfg, layers, monkeypatch):
    """OPGRAFT_QK_EPILOGUE unset: each projection as the linear op's linear.qk_epilogue says for its
    [N, K] and dtype on this GPU (asked here of a stand-in: without a GPU every key is 0); 0 forces
    none, whatever the key says."""
    from opgraft.vllm import norm_seam

    asked = []

    def tunable(key, N, K, dtype):
        asked.append((key, N, K, dtype))
        return int(N == (HQ + 2 * HK) * D and K == 72)

    monkeypatch.setattr(norm_seam, "linear_tunable", tunable)
    monkeypatch.delenv("OPGRAFT_QK_EPILOGUE", raising=False)
    gm, _ = qk_trace(cfg, qwen3_attention_from_x(layers))
    assert rope_seam.rewrite_qk(copy.deepcopy(gm)) == 1
    assert asked == [("linear.qk_epilogue", (HQ + 2 * HK) * D, 72, torch.bfloat16)]
    monkeypatch.setattr(norm_seam, "linear_tunable", lambda *a: 0)
    assert rope_seam.rewrite_qk(copy.deepcopy(gm)) == 0
    monkeypatch.setattr(norm_seam, "linear_tunable", tunable)
    monkeypatch.setenv("OPGRAFT_QK_EPILOGUE", "0")
    assert rope_seam.rewrite_qk(copy.deepcopy(gm)) == 0


def test_qk_model_asks_for_the_ranks_qkv_shape(monkeypatch):
    from types import SimpleNamespace

    from opgraft.vllm import norm_seam

    mc = SimpleNamespace(get_hidden_size=lambda: 2048, get_num_attention_heads=lambda pc: 32 // pc.tp,
                         get_num_kv_heads=lambda pc: 4 // pc.tp, get_head_size=lambda: 128, dtype=torch.bfloat16)
    config = SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(tp=2))
    seen = []
    monkeypatch.setattr(norm_seam, "linear_tunable", lambda key, N, K, dt: seen.append((key, N, K, dt)) or 1)
    monkeypatch.delenv("OPGRAFT_QK_EPILOGUE", raising=False)
    assert rope_seam.qk_model(config) and seen == [("linear.qk_epilogue", (16 + 2 * 2) * 128, 2048, torch.bfloat16)]
    assert not rope_seam.qk_model(None) and not rope_seam.qk_model(SimpleNamespace())
    monkeypatch.setenv("OPGRAFT_QK_EPILOGUE", "0")
    assert not rope_seam.qk_model(config)
    monkeypatch.setenv("OPGRAFT_QK_EPILOGUE", "1")
    assert rope_seam.qk_model(None)


def test_the_compile_factor_follows_what_decides_the_epilogue(monkeypatch, tmp_path):
    """A graph traced with one decision must not be reused with another: the factor changes with the
    switch, and where it is unset, with the tune file's bytes and the OPGRAFT_TUNE_ environment."""
    monkeypatch.delenv("OPGRAFT_QK_EPILOGUE", raising=False)
    monkeypatch.delenv("OPGRAFT_TUNE_FILE", raising=False)
    seen = [rope_seam._compile_factor()]
    f = tmp_path / "tune.json"
    f.write_text('{"version": 1, "entries": []}')
    monkeypatch.setenv("OPGRAFT_TUNE_FILE", str(f))
    seen.append(rope_seam._compile_factor())
    f.write_text('{"version": 1, "entries": [{"values": {"linear.qk_epilogue": 1}}]}')
    seen.append(rope_seam._compile_factor())
    monkeypatch.setenv("OPGRAFT_TUNE_LINEAR_QK_EPILOGUE", "1")
    seen.append(rope_seam._compile_factor())
    monkeypatch.setenv("OPGRAFT_QK_EPILOGUE", "1")
    seen.append(rope_seam._compile_factor())
    monkeypatch.setenv("OPGRAFT_QK_EPILOGUE", "0")
    seen.append(rope_seam._compile_factor())
    assert len(set(seen)) == len(seen), seen
    assert rope_seam._compile_factor() == seen[-1]


def test_the_qk_op_on_the_cpu_is_the_c_oracle():
    """opgraft::linear_qk on CPU tensors (the linear op, then qk_reference) against the library's
    fp64 oracle of the same call, within two roundings: NeoX with the norm, GPT-J alone, the norm
    alone; a position outside the rotary cache is not rotated."""
    import ctypes

    from opgraft import _lib
    from opgraft.ops import linear as ops

    g = torch.Generator().manual_seed(5)
    for style, norm in ((1, True), (2, False), (0, True)):
        M, K, hq, hk = 3, 72, 4, 2
        N = (hq + 2 * hk) * D
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        w = (0.2 * torch.randn(N, K, generator=g)).to(torch.bfloat16)
        qw = (0.5 + torch.rand(D, generator=g)).to(torch.bfloat16) if norm else None
        kw = (0.5 + torch.rand(D, generator=g)).to(torch.bfloat16) if norm else None
        cs = (2 * torch.rand(40, D, generator=g) - 1).to(torch.bfloat16) if style else None
        pos = torch.tensor([3, 45, 0]) if style else None
        y = torch.ops.opgraft.linear_qk(x, w, None, pos, cs, qw, kw, EPS, D, hq, hk, style)
        a = ops.linear_args(x, w, None, None)
        a.head_size, a.q_heads, a.qk_heads, a.rope_style = D, hq, hq + hk, style
        if norm:
            a.q_norm_weight, a.k_norm_weight, a.qk_norm_eps = qw.data_ptr(), kw.data_ptr(), EPS
        if style:
            a.cos_sin_cache, a.cos_sin_stride, a.rope_rows, a.positions = cs.data_ptr(), D, 40, pos.data_ptr()
        ref = torch.empty(M, N, dtype=torch.float64)
        _lib.check(_lib.lib().opgraft_linear_reference(ctypes.byref(a),
                                                       ctypes.cast(ref.data_ptr(), ctypes.POINTER(ctypes.c_double))))
        diff = (y.double() - ref).abs()
        assert bool((diff <= ref.abs() * 2 ** -6 + 1e-6).all()), (style, norm, float(diff.max()))
        assert torch.equal(y[:, (hq + hk) * D:], torch.nn.functional.linear(x, w)[:, (hq + hk) * D:])


def test_split_graph_gives_the_projection_the_epilogue_under_the_switch(cfg, layers, clean_plugin, monkeypatch):
    monkeypatch.setenv("OPGRAFT_QK_EPILOGUE", "1")
    monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", "1")
    register()
    assert rope_seam.installed() and "in the qkv projection's kernel)" in summary()
    gm, _ = qk_trace(cfg, qwen3_attention_from_x(layers))
    before, prologue = rope_seam.qk_fused_total(), rope_seam.fused_total()
    split_gm, items = backends.split_graph(copy.deepcopy(gm), [ATTN])
    assert rope_seam.qk_fused_total() == before + 1 and rope_seam.fused_total() == prologue
    splitting = [i for i in items if i.is_splitting_graph]
    assert len(splitting) == 1  # vLLM's attention, as before
    assert "vllm.unified_attention_with_output" in targets(getattr(split_gm, splitting[0].submod_name))
    pieces = [targets(getattr(split_gm, i.submod_name)) for i in items if not i.is_splitting_graph]
    assert any("opgraft.linear_qk.default" in t for t in pieces)
    assert not any("_C.rotary_embedding" in t for t in pieces)
