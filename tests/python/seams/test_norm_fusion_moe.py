"""The norm fusion pass's MoE form (opgraft/vllm/norm_seam.py): vLLM's add + RMSNorm before a MoE
layer's moe_forward becomes opgraft::add_rms_norm_moe, whose router gate makes the logits and the
normalized rows in one launch. Graphs are compiled by Inductor with vLLM's pre-grad IR
functionalization, as vLLM compiles its pieces; the MoE layer is a MoERunner with a real
ReplicatedLinear gate whose _forward_impl stands in for routing and experts."""

import logging
import os

import pytest

if os.environ.get("OPGRAFT_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI installs vLLM: a failed import must fail, not skip)
else:
    pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

import torch._inductor.config as inductor_config  # noqa: E402
import vllm.ir.ops  # noqa: E402,F401  (registers torch.ops.vllm_ir)
from opgraft import dispatch  # noqa: E402
from opgraft.ops import linear as linear_op  # noqa: E402
from opgraft.vllm import norm_seam  # noqa: E402
from vllm.compilation.passes.inductor_pass import pass_context  # noqa: E402
from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.utils import Range  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner  # noqa: E402
from vllm.model_executor.layers.linear import ReplicatedLinear  # noqa: E402
from vllm.utils.torch_utils import _encode_layer_name  # noqa: E402

NAME = "model.layers.0.mlp.experts"
FUSED = "opgraft.add_rms_norm_moe.default"
EPS = 1e-6
BF16 = torch.bfloat16
H, E = 64, 8


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    """vLLM's weight parameters ask for the tensor-parallel rank: one rank, without initializing
    torch.distributed in the test process."""
    import vllm.model_executor.parameter as parameter

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)


@pytest.fixture(autouse=True)
def moe_on(monkeypatch):
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "1")
    monkeypatch.setattr(norm_seam, "rows_allowed", lambda N, K, dtype: 8)  # as a GPU would answer
    norm_seam._reset_fused_total()
    norm_seam._moe_refusals.clear()


def make_runner(cfg, dtype=BF16, seed=0):
    """A MoERunner registered for moe_forward under NAME: its router gate vLLM's ReplicatedLinear,
    its _forward_impl routing-and-experts stand-in a function of the hidden states and the gate's
    output (it records which gate it called)."""
    r = MoERunner.__new__(MoERunner)
    torch.nn.Module.__init__(r)
    with set_current_vllm_config(cfg):
        r.gate = ReplicatedLinear(H, E, bias=False, params_dtype=dtype, disable_tp=True)
    r.gate.weight.data.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(seed)).to(dtype))
    r._fse_fuse_gate = False
    r.layer_name = NAME
    r.gates_called = []

    def forward_impl(h, router_logits, shared_experts_input, input_ids=None):
        logits, _ = r.gate(h)
        r.gates_called.append(type(r.gate).__name__)
        return (h.float() * 2 + logits.float().sum(-1, keepdim=True)).to(h.dtype)

    r._forward_impl = forward_impl
    cfg.compilation_config.static_forward_context[NAME] = r
    return r


def decoder_tail(name, other_use=False, input_ids=None):
    """A Qwen3-MoE layer from its post-attention norm: fused_add_rms_norm, then the MoE layer
    (moe_forward(h, h, ...) as FusedMoE calls it with the router inside the runner)."""

    def f(x, res, w):
        n, r2 = torch.ops.vllm_ir.fused_add_rms_norm.maybe_inplace(x, res, w, EPS, None)
        out = torch.ops.vllm.moe_forward(n, n, None, input_ids, name, 0)
        return (out, r2, n + 1) if other_use else (out, r2)

    return f


def inputs(T=3, dtype=BF16, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, res = torch.randn(T, H, generator=g).to(dtype), (4 * torch.randn(T, H, generator=g)).to(dtype)
    return x, res, (torch.rand(H, generator=g) + 0.5).to(dtype)


def compile_and_run(cfg, f, args, end=2, manager=None):
    """f compiled by Inductor for a range of 1..end tokens with the pass (or vLLM's pass manager
    holding it) after vLLM's pre-grad functionalization; returns (outputs, the pass or manager,
    the post-grad graph's call targets)."""
    seen = []

    class Spy(norm_seam.pass_class()):
        def __call__(self, graph):
            (manager or super().__call__)(graph)
            seen.append({str(n.target) for n in graph.nodes if n.op == "call_function"})

    torch._dynamo.reset()
    spy = Spy(cfg)
    x, res, w = (a.clone() for a in args)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(res, 0)
    with set_current_vllm_config(cfg), set_forward_context(None, cfg), torch.inference_mode(), \
            pass_context(Range(1, end)), inductor_config.patch(
                pre_grad_custom_pass=VllmIRInplaceFunctionalizationPass(cfg), post_grad_custom_post_pass=spy,
                force_disable_caches=True):
        out = torch.compile(f, backend="inductor", fullgraph=True)(x, res, w)
    return out, spy, seen[-1]


def eager(cfg, f, args):
    with set_current_vllm_config(cfg), set_forward_context(None, cfg), torch.inference_mode():
        return f(*(a.clone() for a in args))


@pytest.fixture
def cfg():
    return VllmConfig(device_config=DeviceConfig(device="cpu"))


@pytest.mark.parametrize("layer_name", ["str", "LayerName"])
def test_norm_and_moe_layer_are_fused_and_give_vllms_bits(cfg, layer_name):
    r = make_runner(cfg)
    name = NAME if layer_name == "str" else _encode_layer_name(NAME)
    f, args = decoder_tail(name), inputs()
    ref = eager(cfg, f, args)
    out, spy, targets = compile_and_run(cfg, f, args)
    assert FUSED in targets and "vllm_ir.fused_add_rms_norm.default" not in targets, targets
    assert not any("moe_forward" in t or "auto_functionalized" in t for t in targets), targets
    assert spy.fused_moe == 1 and norm_seam.fused_moe_total() == 1
    # No GPU: the kernel refuses and the op runs vLLM's norm, then the layer: the same bits.
    assert all(torch.equal(a, b) for a, b in zip(ref, out))
    assert r.gates_called == ["ReplicatedLinear", "ReplicatedLinear"]


def test_the_pass_in_vllms_pass_manager(cfg, clean_plugin):
    """register() puts the pass into vLLM's PostGradPassManager, which runs it before its IR
    lowering and cleanups: the MoE form survives them."""
    from opgraft.vllm import register
    from vllm.compilation.passes.pass_manager import PostGradPassManager

    r = make_runner(cfg)
    register()
    assert norm_seam.installed()
    m = PostGradPassManager()
    with set_current_vllm_config(cfg):
        m.configure(cfg)
    ours = [q for q in m.passes if isinstance(q, norm_seam.pass_class())]
    assert len(ours) == 1 and ours[0].moe
    m.fix_functionalization = lambda graph: None  # its rotary targets need vllm._C, absent on CPU
    f, args = decoder_tail(NAME), inputs()
    ref = eager(cfg, f, args)
    out, _, targets = compile_and_run(cfg, f, args, manager=m)
    assert FUSED in targets and ours[0].fused_moe == 1, targets
    assert all(torch.equal(a, b) for a, b in zip(ref, out)) and r.gates_called == ["ReplicatedLinear"] * 2


class FakeKernel:
    """The linear kernel's add + RMSNorm form with the normalized rows, in torch on the CPU: the
    norm as vLLM's, the gate's product by torch.nn.functional.linear (the gate's own call)."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(linear_op, "norm_linear_or_none", self)

    def __call__(self, x, residual, norm_weight, eps, weight, bias=None, normed=False):
        self.calls.append((tuple(x.shape), tuple(weight.shape), normed))
        h, r = linear_op.add_rms_norm_reference(x, residual, norm_weight, eps)
        return torch.nn.functional.linear(h, weight, bias), r, h


def test_taken_calls_hand_the_runner_the_logits_made_with_the_norm(cfg, monkeypatch):
    r = make_runner(cfg)
    gate = r.gate
    kernel = FakeKernel(monkeypatch)
    f, args = decoder_tail(NAME), inputs()
    ref = eager(cfg, f, args)
    out, spy, targets = compile_and_run(cfg, f, args)
    assert FUSED in targets and spy.fused_moe == 1
    assert kernel.calls == [((3, H), (E, H), True)]
    assert r.gates_called[-1] == "RouterLogits" and r.gate is gate  # the stand-in for that call only
    assert all(torch.equal(a, b) for a, b in zip(ref, out))


def test_vllms_own_forward_impl_routes_with_the_logits_made(cfg, monkeypatch):
    """MoERunner._forward_impl as this vLLM has it (what follows the gate stubbed: dispatch, the
    quant method, combine): the router logits it hands on are the ones the op made with the norm,
    and the hidden states the normalized rows."""
    import contextlib
    import inspect
    import types

    r = make_runner(cfg)
    del r._forward_impl  # the class's own
    r.routed_experts = types.SimpleNamespace(_ensure_moe_quant_config_init=lambda: None)
    r._shared_experts = None
    seen = {}

    def apply(self, hidden_states, router_logits, shared_experts_input, input_ids=None, **kw):
        seen.update(h=hidden_states, logits=router_logits)
        return None, hidden_states * 3

    # vLLM 0.34's dispatch also hands on the scales of input quantized before a context-parallel
    # gather, and _apply_quant_method takes them
    own = MoERunner._apply_quant_method
    own = getattr(own, "_opgraft_original_apply_quant_method", own)
    scaled = "hidden_states_scale" in inspect.signature(own).parameters
    monkeypatch.setattr(MoERunner, "_apply_quant_method", apply)
    monkeypatch.setattr(MoERunner, "_sequence_parallel_context", lambda self: contextlib.nullcontext())
    monkeypatch.setattr(MoERunner, "_maybe_dispatch",
                        lambda self, h, logits: (h, logits, None) if scaled else (h, logits))
    monkeypatch.setattr(MoERunner, "_maybe_combine", lambda self, shared, h: h)
    if hasattr(MoERunner, "_maybe_sync_shared_experts_stream"):  # vLLM 0.26
        monkeypatch.setattr(MoERunner, "_maybe_sync_shared_experts_stream", lambda self, sei: None)
    FakeKernel(monkeypatch)
    x, res, w = inputs()
    gate = r.gate
    with set_current_vllm_config(cfg), set_forward_context(None, cfg), torch.inference_mode():
        out, r2 = norm_seam.moe_op()(x, res, w, EPS, NAME)
    h, r_ref = linear_op.add_rms_norm_reference(x, res, w, EPS)
    assert torch.equal(seen["h"], h) and torch.equal(r2, r_ref) and torch.equal(out, h * 3)
    assert torch.equal(seen["logits"], torch.nn.functional.linear(h, gate.weight)) and r.gate is gate


def test_the_gate_is_put_back_when_the_layer_fails(cfg, monkeypatch):
    r = make_runner(cfg)
    gate = r.gate
    FakeKernel(monkeypatch)

    def failing(h, logits, sei, ids=None):
        raise RuntimeError("experts failed")

    r._forward_impl = failing
    x, res, w = inputs()
    with set_current_vllm_config(cfg), set_forward_context(None, cfg), pytest.raises(RuntimeError, match="experts"):
        norm_seam.moe_op()(x, res, w, EPS, NAME)
    assert r.gate is gate


def test_a_gate_refused_at_run_time_runs_vllms_norm_and_layer(cfg, monkeypatch):
    r = make_runner(cfg)
    kernel = FakeKernel(monkeypatch)
    x, res, w = inputs()
    stats = dispatch.stats_of("linear")
    before = stats.snapshot()
    r._fse_fuse_gate = True  # after the graph was made: the op itself must notice
    with set_current_vllm_config(cfg), set_forward_context(None, cfg), torch.inference_mode():
        out, r2 = norm_seam.moe_op()(x, res, w, EPS, NAME)
        r._fse_fuse_gate = False
        ref = decoder_tail(NAME)(x.clone(), res.clone(), w)
    assert kernel.calls == [] and torch.equal(out, ref[0]) and torch.equal(r2, ref[1])
    after = stats.snapshot()
    assert after["delegated"] == before["delegated"] + 1
    assert any("router gate: router gate fused with a shared expert's gate" in k for k in after["delegated_by_reason"])


def refusal(kind, cfg, monkeypatch):
    """The graph function of a case the pass must leave as it is, after making the case."""
    runner = cfg.compilation_config.static_forward_context[NAME]
    if kind == "switch off":
        monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "0")
    elif kind == "quantized gate":
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        # another method (a quantized one, to the pass): a subclass, which still computes
        runner.gate.quant_method = type("OtherLinearMethod", (UnquantizedLinearMethod,), {})()
    elif kind == "shared expert gate":
        runner._fse_fuse_gate = True
    elif kind == "rows":
        monkeypatch.setattr(norm_seam, "rows_allowed", lambda N, K, dtype: 1)  # a range of 1..2 needs two
    return decoder_tail(NAME, other_use=kind == "normed rows used elsewhere")


@pytest.mark.parametrize("kind", ["switch off", "quantized gate", "shared expert gate", "rows",
                                  "normed rows used elsewhere"])
def test_refusals_leave_vllms_graph(cfg, monkeypatch, kind, caplog):
    make_runner(cfg)
    f, args = refusal(kind, cfg, monkeypatch), inputs()
    ref = eager(cfg, f, args)
    caplog.set_level(logging.INFO, logger=dispatch.logger.name)
    out, spy, targets = compile_and_run(cfg, f, args)
    assert FUSED not in targets and spy.fused_moe == 0, targets
    assert all(torch.equal(a, b) for a, b in zip(ref, out))
    if kind in ("quantized gate", "shared expert gate"):
        assert any("stays vLLM's" in m for m in caplog.messages), caplog.messages


def test_no_moe_layers_found_fuses_nothing(cfg):
    assert norm_seam.moe_rows(BF16, H) == (0, "no MoE layers found")
    make_runner(cfg)
    with set_current_vllm_config(cfg):
        assert norm_seam.moe_rows(BF16, H) == (8, "")
        assert norm_seam.moe_rows(BF16, 2 * H)[1] == f"{NAME}: router gate of {H} inputs, hidden states of {2 * H}"
        assert "not 2-D in the hidden states' dtype" in norm_seam.moe_rows(torch.float16, H)[1]


def test_the_pass_says_whether_every_moe_layer_takes_the_form(cfg, monkeypatch):
    """What the attention prologue's default asks (moe_form_on): the MoE form on for the config and
    every MoE layer of its model taking it, the layers found through the config outside a forward
    context."""
    from types import SimpleNamespace

    def model(dtype=BF16):
        return SimpleNamespace(model_config=SimpleNamespace(dtype=dtype, get_hidden_size=lambda: H),
                               compilation_config=cfg.compilation_config)

    assert not norm_seam._model_takes_form(model())  # no MoE layers
    make_runner(cfg)
    assert norm_seam._model_takes_form(model()) and not norm_seam._model_takes_form(model(torch.float16))
    cfg.compilation_config.static_forward_context[NAME]._fse_fuse_gate = True
    assert not norm_seam._model_takes_form(model())
    assert not norm_seam._model_takes_form(cfg)  # no model config
    asked = []
    monkeypatch.setattr(norm_seam, "_model_takes_form", lambda c: asked.append(c) or True)
    norm_seam.pass_class()(cfg)
    assert norm_seam.moe_form_on() and asked == [cfg]
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "0")
    norm_seam.pass_class()(cfg)
    assert not norm_seam.moe_form_on()


def test_uuid_and_compile_factor_follow_the_switch(cfg, monkeypatch):
    on = norm_seam.pass_class()(cfg)
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "0")
    off = norm_seam.pass_class()(cfg)
    assert on.moe and not off.moe and on.uuid() != off.uuid()
    assert "MoE" not in norm_seam._compile_factor()
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "1")
    assert "MoE" in norm_seam._compile_factor()


@pytest.mark.parametrize("switch", ["1", "0", ""])
def test_the_op_is_registered_with_the_seam(switch):
    """A graph vLLM loads from its compile cache may call the op before any pass is built: the
    seam registers it when it installs with the switch on or unset (unset: on for the models with
    the q/k epilogue, which only a config tells), not with it off."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGRAFT_") and k != "VLLM_PLUGINS"}
    env.update(OPGRAFT_FORCE_PLATFORM="1", OPGRAFT_NORM_FUSION_MOE=switch,
               PYTHONPATH=os.pathsep.join([os.path.join(root, "python"), env.get("PYTHONPATH", "")]))
    probe = ("import torch\nfrom opgraft.vllm import norm_seam, register, summary\nregister()\n"
             "print(norm_seam.installed(), hasattr(torch.ops.opgraft, 'add_rms_norm_moe'), 'MoE layers too' in summary())")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    installed, registered, said = r.stdout.split()[-3:]
    assert installed == "True" and registered == str(switch != "0") and said == str(switch == "1"), r.stdout


def test_the_ops_layer_name_is_vllms_type():
    """The layer name is of vLLM's type: LayerName with torch >= 2.11, a graph input that vLLM hoists
    (a str would be a constant of the graph and make every layer's piece a graph of its own)."""
    from vllm.utils.torch_utils import LayerNameType

    arg = [a for a in norm_seam.moe_op()._schema.arguments if a.name == "layer_name"][0]
    assert (str(arg.type) == "str") == (LayerNameType is str), str(arg.type)


def test_malformed_switch_warns_once_and_keeps_the_default(monkeypatch):
    warned = []
    monkeypatch.setattr(dispatch, "_warn_once", warned.append)
    monkeypatch.setenv("OPGRAFT_NORM_FUSION_MOE", "maybe")
    assert norm_seam.moe_switch() is None and not norm_seam.moe_enabled()
    assert set(warned) == {"OPGRAFT_NORM_FUSION_MOE='maybe' is neither on (1) nor off (0): left at its default"}


def test_fake_gives_the_shapes_of_vllms_op():
    op = norm_seam.moe_op()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, res, w = torch.empty(5, H, dtype=BF16), torch.empty(5, H, dtype=BF16), torch.empty(H, dtype=BF16)
        out, r = op(x, res, w, EPS, NAME)
    assert out.shape == (5, H) and r.shape == (5, H) and out.dtype == BF16
