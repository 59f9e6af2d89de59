"""The MoE routing seam (opgraft/vllm/route_seam.py) against the real vLLM classes: what it
patches, which layers it takes, and that every refusal runs vLLM's own method with the same
arguments. The runner is a stand-in holding real vLLM router, method and kernel objects."""

import os
import types

import pytest

if os.environ.get("OPGRAFT_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from opgraft import dispatch  # noqa: E402
from opgraft.vllm import register, route_seam  # noqa: E402
from vllm.model_executor.layers.fused_moe import modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (  # noqa: E402
    MoEPrepareAndFinalizeNoDPEPModular,
)
from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter  # noqa: E402
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner  # noqa: E402
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod  # noqa: E402


@pytest.fixture
def clean(clean_plugin):
    pass


def _runner(monkeypatch, E=4, k=2, H=64, I=32):
    experts = TritonExperts.__new__(TritonExperts)
    for attr in ("quant_config", "w1_bias", "w2_bias", "_lora_context"):
        try:
            getattr(experts, attr)
        except Exception:
            monkeypatch.setattr(TritonExperts, attr, None, raising=False)
    impl = mk.FusedMoEKernelModularImpl.__new__(mk.FusedMoEKernelModularImpl)
    impl.prepare_finalize = MoEPrepareAndFinalizeNoDPEPModular.__new__(MoEPrepareAndFinalizeNoDPEPModular)
    impl.fused_experts = experts
    kernel = mk.FusedMoEKernel.__new__(mk.FusedMoEKernel)
    kernel.impl = impl
    qm = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    qm.moe_kernel = kernel
    g = torch.Generator().manual_seed(0)
    layer = types.SimpleNamespace(
        quant_method=qm, w13_weight=torch.randn(E, 2 * I, H, generator=g).bfloat16(),
        w2_weight=torch.randn(E, H, I, generator=g).bfloat16(), activation=MoEActivation.SILU, expert_map=None,
        apply_router_weight_on_input=False, global_num_experts=E)
    router = FusedTopKRouter(top_k=k, global_num_experts=E, scoring_func="softmax", renormalize=True)
    return types.SimpleNamespace(router=router, routed_experts=layer, _shared_experts=None)


def _inputs(T=3, E=4, H=64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(T, H, generator=g).bfloat16(), torch.randn(T, E, generator=g).bfloat16()


class _Original:
    def __init__(self):
        self.calls = []

    def __call__(self, runner, *args, **kw):
        self.calls.append((runner, args, kw))
        return (None, "vllm's result")


def test_install_patches_the_real_runner_once(clean):
    original = MoERunner.__dict__["_apply_quant_method"]
    assert route_seam._signature_matches(original)
    assert route_seam.install()[0] and route_seam.installed()
    wrapped = MoERunner.__dict__["_apply_quant_method"]
    assert route_seam.install() == (True, "MoE routing seam already installed")
    assert MoERunner.__dict__["_apply_quant_method"] is wrapped
    route_seam.uninstall()
    assert MoERunner.__dict__["_apply_quant_method"] is original


def test_register_installs_it_and_its_kill_switch_does_not(clean, monkeypatch):
    register()
    assert route_seam.installed()
    from opgraft.vllm import _reset_for_tests

    _reset_for_tests()
    monkeypatch.setenv("OPGRAFT_MOE_ROUTE", "0")
    register()
    assert not route_seam.installed()


def test_unexpected_signature_is_not_patched(clean, monkeypatch):
    def other(self, hidden_states, router_logits):
        pass

    monkeypatch.setattr(MoERunner, "_apply_quant_method", other)
    assert route_seam.install()[0] is False
    assert MoERunner.__dict__["_apply_quant_method"] is other


def test_the_signatures_of_each_tested_vllm_match():
    def v026(self, hidden_states, router_logits, shared_experts_input, input_ids=None):
        pass

    def v033(self, hidden_states, router_logits, shared_experts_input, input_ids=None,
             shared_experts_overlapping=False):
        pass

    def v034(self, hidden_states, router_logits, shared_experts_input, input_ids=None,
             shared_experts_overlapping=False, hidden_states_scale=None):
        pass

    def unknown(self, hidden_states, router_logits, shared_experts_input, input_ids=None, x_scale=None):
        pass

    assert all(route_seam._signature_matches(f) for f in (v026, v033, v034))
    assert not route_seam._signature_matches(unknown)


def test_a_plain_layer_reaches_the_guard(clean, monkeypatch):
    r = _runner(monkeypatch)
    x, logits = _inputs()
    assert route_seam.route_reason(r, x, logits) == ""


def _edits(monkeypatch):
    """(edit of a plain runner, the reason it gives)."""
    def router(**kw):
        return lambda r: setattr(r, "router", FusedTopKRouter(top_k=2, global_num_experts=4, **kw))

    def attr(path, value):
        def f(r):
            obj = r
            for p in path[:-1]:
                obj = getattr(obj, p)
            setattr(obj, path[-1], value)
        return f

    return [
        (router(scoring_func="sigmoid"), "scoring function sigmoid"),
        (attr(("router", "eplb_state"), object()), "EPLB"),
        (attr(("router", "capture_fn"), lambda ids: None), "routed-experts capture"),
        (attr(("_shared_experts",), object()), "shared experts"),
        (attr(("routed_experts", "expert_map"), torch.arange(4, dtype=torch.int32)), "expert_map"),
        (attr(("routed_experts", "global_num_experts"), 8), "local experts differ from global experts"),
        (attr(("routed_experts", "apply_router_weight_on_input"), True),
         "router weight already applied to the input (vLLM's prepare step)"),
        (attr(("routed_experts", "activation"), MoEActivation.GELU), "activation gelu"),
        (attr(("routed_experts", "quant_method", "moe_kernel", "impl", "prepare_finalize"), object()),
         "prepare/finalize object"),
        (lambda r: setattr(r, "router", types.SimpleNamespace(top_k=2)), "router SimpleNamespace"),
    ]


def test_each_refusal_names_its_reason(clean, monkeypatch):
    x, logits = _inputs()
    for edit, reason in _edits(monkeypatch):
        r = _runner(monkeypatch)
        edit(r)
        assert route_seam.route_reason(r, x, logits) == reason
    r = _runner(monkeypatch)
    assert route_seam.route_reason(r, x, logits.float()) == "router logits not [T, E] in the hidden states' dtype"
    assert route_seam.route_reason(r, x, logits, overlapping=True) == "shared experts"
    r.routed_experts.quant_method = object()
    assert route_seam.route_reason(r, x, logits) == "quant method object"


def test_a_refusal_runs_vllms_method_with_the_same_arguments(clean, monkeypatch):
    orig = _Original()
    wrapped = route_seam.make_wrapper(orig)
    x, logits = _inputs()
    r = _runner(monkeypatch)
    shared_in = object()
    # CPU tensors: the C guard is never reached, the op's plan says why
    assert wrapped(r, x, logits, shared_in, None) == (None, "vllm's result")
    (runner, args, kw), = orig.calls
    assert runner is r and args[0] is x and args[1] is logits and args[2] is shared_in and args[3] is None
    s = dispatch.stats()
    assert s["moe_route"]["delegated_by_reason"] == {"tensors are not on a CUDA device": 1}
    assert "moe" not in s or s["moe"]["taken"] == 0
    # vLLM 0.33's keyword passes through
    wrapped(r, x, logits, shared_in, None, shared_experts_overlapping=True)
    assert orig.calls[-1][2] == {"shared_experts_overlapping": True}
    assert dispatch.stats()["moe_route"]["delegated_by_reason"]["shared experts"] == 1
    # vLLM 0.34's keyword: input quantized before a context-parallel gather stays vLLM's
    scale = torch.ones(3, 1)
    wrapped(r, x, logits, shared_in, None, hidden_states_scale=scale)
    assert orig.calls[-1][2] == {"hidden_states_scale": scale}
    assert dispatch.stats()["moe_route"]["delegated_by_reason"]["hidden states quantized before the MoE runner"] == 1


def test_other_variants_and_prefills_go_straight_to_vllm(clean, monkeypatch):
    orig = _Original()
    wrapped = route_seam.make_wrapper(orig)
    r = _runner(monkeypatch)
    monkeypatch.setenv("OPGRAFT_MOE_EXPERTS", "passthrough")
    wrapped(r, *_inputs(), None, None)
    monkeypatch.delenv("OPGRAFT_MOE_EXPERTS")
    monkeypatch.setattr(route_seam, "route_reason", lambda *a, **k: pytest.fail("a prefill reached the checks"))
    wrapped(r, *_inputs(T=65), None, None)
    assert len(orig.calls) == 2 and dispatch.stats().get("moe_route", {}).get("delegated", 0) == 0


def test_routed_args_and_guard_without_a_gpu():
    """The C guard on a routed call at sm_90 (no GPU needed with arch set)."""
    import ctypes

    from opgraft import _lib
    from opgraft.ops import moe

    def reason(**kw):
        T, E, H, I, k = kw.pop("T", 1), kw.pop("E", 128), 2048, 768, kw.pop("k", 8)
        x = torch.empty(T, H, dtype=torch.bfloat16)
        w13, w2 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16), torch.empty(E, H, I, dtype=torch.bfloat16)
        logits = kw.pop("logits", torch.empty(T, E, dtype=torch.bfloat16))
        a = moe.moe_routed_args(x, w13, w2, logits, k, True, arch=90, **kw)
        for f, v in kw.pop("fields", {}).items():
            setattr(a, f, v)
        buf = ctypes.create_string_buffer(256)
        st = _lib.lib().opgraft_moe_supports(ctypes.byref(a), buf, len(buf))
        return "" if st == _lib.OK else buf.value.decode()

    assert reason() == ""
    assert reason(E=1024) == "routing from logits over 1024 experts (at most 512)"
    assert reason(T=8) == "moe.route is 0 on sm_90 at T=8 (routing stays vLLM's)"  # the shipped rule
    assert reason(T=2, logits=torch.empty(2, 256, dtype=torch.bfloat16)[:, :128]) == ""
    assert reason(T=2, logits=torch.empty(128, 2, dtype=torch.bfloat16).T) == \
        "router_logits rows are not contiguous [T, E] rows"
    assert reason(T=2, topk_ids=torch.empty(2, 8, dtype=torch.int64)) == "routing from logits into int64 topk_ids"
    a = moe.moe_routed_args(torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(4, 64, 64, dtype=torch.bfloat16),
                            torch.empty(4, 64, 32, dtype=torch.bfloat16), torch.empty(1, 4, dtype=torch.float32), 2,
                            True)
    assert a.dtype == 0  # fp32 logits: refused as a dtype mismatch
    os.environ["OPGRAFT_MOE_ROUTE"] = "0"
    try:
        assert reason() == "OPGRAFT_MOE_ROUTE is off (routing stays vLLM's)"
    finally:
        del os.environ["OPGRAFT_MOE_ROUTE"]
