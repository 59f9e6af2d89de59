"""The MoE routing seam on FP8 layers, against the real vLLM classes: Fp8MoEMethod with a modular
kernel of TritonExperts (built as vLLM builds it, with its FP8 quant configs) behind the no-dispatch
prepare/finalize. Which layers reach the guard, that the kernel quantizes the bf16 activations
itself where its plan says so, and that otherwise the layer's activations are quantized (by vLLM's
own prepare step) only once the plan takes the call."""

import os
import types

import pytest

if os.environ.get("OPGRAFT_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from opgraft import dispatch  # noqa: E402
from opgraft.vllm import route_seam  # noqa: E402
from vllm.model_executor.layers.fused_moe import config as fmc  # noqa: E402
from vllm.model_executor.layers.fused_moe import modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (  # noqa: E402
    MoEPrepareAndFinalizeNoDPEPModular,
)
from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter  # noqa: E402
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod  # noqa: E402

E, H, I, K, T = 4, 256, 128, 2, 3
F8 = torch.float8_e4m3fn


@pytest.fixture
def clean(clean_plugin):
    pass


def _moe_config():
    return fmc.FusedMoEConfig(num_experts=E, experts_per_token=K, hidden_dim=H, intermediate_size=I,
                              num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU,
                              device="cpu", routing_method=fmc.RoutingMethodType.Renormalize,
                              moe_parallel_config=fmc.FusedMoEParallelConfig.make_no_parallel(),
                              in_dtype=torch.bfloat16, intermediate_size_per_partition=I)


def _block_config():
    return fmc.fp8_w8a8_moe_quant_config(w1_scale=torch.rand(E, 2 * I // 128, H // 128),
                                         w2_scale=torch.rand(E, H // 128, I // 128), block_shape=[128, 128])


def _runner(qc=None):
    experts = TritonExperts(_moe_config(), qc if qc is not None else _block_config())
    impl = mk.FusedMoEKernelModularImpl.__new__(mk.FusedMoEKernelModularImpl)
    impl.prepare_finalize = MoEPrepareAndFinalizeNoDPEPModular()
    impl.fused_experts = experts
    kernel = mk.FusedMoEKernel.__new__(mk.FusedMoEKernel)
    kernel.impl = impl
    qm = Fp8MoEMethod.__new__(Fp8MoEMethod)
    qm.moe_kernel = kernel
    g = torch.Generator().manual_seed(0)
    layer = types.SimpleNamespace(
        quant_method=qm, w13_weight=(torch.randn(E, 2 * I, H, generator=g) * 0.1).to(F8),
        w2_weight=(torch.randn(E, H, I, generator=g) * 0.1).to(F8), activation=MoEActivation.SILU, expert_map=None,
        apply_router_weight_on_input=False, global_num_experts=E)
    router = FusedTopKRouter(top_k=K, global_num_experts=E, scoring_func="softmax", renormalize=True)
    return types.SimpleNamespace(router=router, routed_experts=layer, _shared_experts=None)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(T, H, generator=g).bfloat16(), torch.randn(T, E, generator=g).bfloat16()


def test_a_block_fp8_layer_reaches_the_guard(clean):
    x, logits = _inputs()
    assert route_seam.route_reason(_runner(), x, logits) == ""


def _tensor_config(**kw):
    return fmc.fp8_w8a8_moe_quant_config(w1_scale=torch.rand(E), w2_scale=torch.rand(E), **kw)


def test_a_per_tensor_fp8_layer_reaches_the_guard(clean):
    """Per-tensor weight scales with a dynamic activation scale (TritonExperts' per-tensor path)."""
    x, logits = _inputs()
    assert route_seam.route_reason(_runner(_tensor_config()), x, logits) == ""


def test_fp8_layers_it_leaves_to_vllm(clean):
    x, logits = _inputs()
    static = _tensor_config(a1_scale=torch.ones(1))
    assert route_seam.route_reason(_runner(static), x, logits).startswith("static FP8 activation scales")
    biased = fmc.fp8_w8a8_moe_quant_config(w1_scale=torch.rand(E, 2 * I // 128, H // 128),
                                           w2_scale=torch.rand(E, H // 128, I // 128), block_shape=[128, 128],
                                           w1_bias=torch.zeros(E, 2 * I))
    assert route_seam.route_reason(_runner(biased), x, logits) == "expert biases"
    r = _runner()
    r.routed_experts.w13_weight = r.routed_experts.w13_weight.bfloat16()
    assert route_seam.route_reason(r, x, logits).startswith("FP8 config with")


class _Original:
    def __init__(self):
        self.calls = 0

    def __call__(self, runner, *args, **kw):
        self.calls += 1
        return (None, "vllm's result")


def test_a_refused_fp8_call_is_never_quantized(clean, monkeypatch):
    """CPU tensors: the plan refuses the call before the layer's prepare step would run."""
    orig = _Original()
    wrapped = route_seam.make_wrapper(orig)
    r = _runner()
    monkeypatch.setattr(MoEPrepareAndFinalizeNoDPEPModular, "prepare",
                        lambda *a, **k: pytest.fail("quantized a call the plan refuses"))
    assert wrapped(r, *_inputs(), None, None) == (None, "vllm's result")
    assert orig.calls == 1
    assert dispatch.stats()["moe_route"]["delegated_by_reason"] == {"tensors are not on a CUDA device": 1}


def test_the_quantization_is_the_layers_prepare_step(clean, monkeypatch):
    """What the call's quantize runs: the layer's prepare_finalize.prepare on the hidden states with
    the experts' quant config, as vLLM's modular kernel calls it before TritonExperts.apply."""
    seen = {}

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, on_input, quant_config, defer_input_quant):
        seen.update(a1=a1, num_experts=num_experts, expert_map=expert_map, on_input=on_input, qc=quant_config,
                    defer=defer_input_quant)
        return "a1q", "a1q_scale", None, None, None

    monkeypatch.setattr(MoEPrepareAndFinalizeNoDPEPModular, "prepare", prepare)
    captured = {}
    monkeypatch.setattr(dispatch, "dispatch_routed", lambda call: captured.setdefault("call", call) and "ours")
    r = _runner()
    x, logits = _inputs()
    route_seam.make_wrapper(_Original())(r, x, logits, None, None)
    call = captured["call"]
    assert call.extra_reason == "" and call.fp8_weights[2] == (128, 128)
    qc = r.routed_experts.quant_method.moe_kernel.fused_experts.quant_config
    assert call.fp8_weights[0] is qc.w1_scale and call.fp8_weights[1] is qc.w2_scale
    assert call.quantize() == ("a1q", "a1q_scale")
    assert seen["a1"] is x and seen["num_experts"] == E and seen["expert_map"] is None
    assert seen["on_input"] is False and seen["qc"] is qc and seen["defer"] is False


class _FakePlan:
    def __init__(self, take, reason=""):
        self.handle, self.reason = (1 if take else None), reason


@pytest.mark.parametrize("scales", ["fp8-block", "fp8-tensor"])
@pytest.mark.parametrize("kernel_quantizes", [True, False])
def test_who_quantizes_the_activations(clean, monkeypatch, kernel_quantizes, scales):
    """The plan for bf16 hidden states (Fp8Scales without hidden_scale) first: where it takes the
    call, the layer's prepare step never runs and the kernel gets the bf16 hidden states; where it
    refuses (OPGRAFT_TUNE_MOE_FP8_QUANTIZE=0, say), vLLM's quantization runs once and the kernel gets e4m3."""
    from opgraft.ops import moe

    plans, runs, quantized = [], [], []

    def plan_for_routed(x, w13, w2, logits, top_k, renorm, out=None, topk_weights=None, topk_ids=None, fp8=None):
        plans.append((x.dtype, fp8.hidden_scale is None))
        if fp8.hidden_scale is None:
            return _FakePlan(kernel_quantizes, "moe.fp8_quantize is 0 on sm_90 at T=1")
        return _FakePlan(True)

    monkeypatch.setattr(moe, "plan_for_routed", plan_for_routed)
    monkeypatch.setattr(moe, "run_routed", lambda plan, out, x, *a, fp8=None, **k: runs.append((x, fp8)))
    r = _runner(_tensor_config() if scales == "fp8-tensor" else None)
    x, logits = _inputs()
    xq, xs = torch.empty(T, H, dtype=F8), torch.empty(T, H // 128) if scales == "fp8-block" else torch.empty(1)
    monkeypatch.setattr(MoEPrepareAndFinalizeNoDPEPModular, "prepare",
                        lambda *a, **k: quantized.append(1) or (xq, xs, None, None, None))
    route_seam.make_wrapper(_Original())(r, x, logits, None, None)
    ran_x, ran_fp8 = runs[0]
    assert (ran_fp8.block_shape is None) == (scales == "fp8-tensor")
    if kernel_quantizes:
        assert plans == [(torch.bfloat16, True)] and not quantized
        assert ran_x is x and ran_fp8.hidden_scale is None
        assert dispatch.stats()["moe"]["taken_by_kind"] == {f"routed+{scales}+kernel-quant": 1}
    else:
        assert plans == [(torch.bfloat16, True), (F8, False), (F8, False)] and quantized == [1]
        assert ran_x is xq and ran_fp8.hidden_scale is xs
        assert dispatch.stats()["moe"]["taken_by_kind"] == {f"routed+{scales}": 1}


def test_routed_fp8_args_and_guard_without_a_gpu():
    """The C guard on a routed FP8 call at sm_90 (no GPU needed with arch set)."""
    import ctypes

    from opgraft import _lib
    from opgraft.ops import moe

    def reason(T=1, logits_dtype=torch.bfloat16, bf16_x=False):
        E_, H_, I_, k = 128, 2048, 768, 8
        x = torch.empty(T, H_, dtype=torch.bfloat16 if bf16_x else F8)
        w13, w2 = torch.empty(E_, 2 * I_, H_, dtype=F8), torch.empty(E_, H_, I_, dtype=F8)
        fp8 = moe.Fp8Scales(None if bf16_x else torch.empty(T, H_ // 128), torch.empty(E_, 2 * I_ // 128, H_ // 128),
                            torch.empty(E_, H_ // 128, I_ // 128), (128, 128))
        a = moe.moe_routed_args(x, w13, w2, torch.empty(T, E_, dtype=logits_dtype), k, True, arch=90, fp8=fp8)
        if a.dtype == -1:
            return "inconsistent"
        buf = ctypes.create_string_buffer(256)
        st = _lib.lib().opgraft_moe_supports(ctypes.byref(a), buf, len(buf))
        return "" if st == _lib.OK else buf.value.decode()

    assert reason() == ""
    assert reason(T=2) == ""
    assert reason(T=4) == "moe.route is 0 on sm_90 at T=4 (routing stays vLLM's)"  # FP8's rule: 2 tokens
    assert reason(logits_dtype=torch.float32).startswith("dtype")
    # bf16 hidden states: the rule takes them on sm_90 (gate_up quantizes them) up to the seam's 2 tokens
    assert reason(bf16_x=True) == "" and reason(T=2, bf16_x=True) == ""
    assert reason(bf16_x=True, logits_dtype=torch.float16).startswith("dtype")  # x is not in the logits' dtype
    os.environ["OPGRAFT_TUNE_MOE_FP8_QUANTIZE"] = "0"
    try:
        _lib.lib().opgraft_tune_reload()
        assert reason(bf16_x=True).startswith("moe.fp8_quantize is 0 on sm_90 at T=1")
        assert reason() == ""  # e4m3 hidden states do not look at it
    finally:
        del os.environ["OPGRAFT_TUNE_MOE_FP8_QUANTIZE"]
        _lib.lib().opgraft_tune_reload()


def test_routed_per_tensor_fp8_with_bf16_hidden_states_without_a_gpu():
    """Per-tensor scales with the bf16 hidden states (gate_up's 1 x 128 groups): the guard takes
    them up to two tokens on sm_90 (the routing seam's), and refuses an H the groups do not divide."""
    import ctypes

    from opgraft import _lib
    from opgraft.ops import moe

    def reason(T=1, H_=4096):
        E_, I_, k = 8, 14336, 2
        x = torch.empty(T, H_, dtype=torch.bfloat16)
        w13, w2 = torch.empty(E_, 2 * I_, H_, dtype=F8), torch.empty(E_, H_, I_, dtype=F8)
        fp8 = moe.Fp8Scales(None, torch.empty(E_), torch.empty(E_), None)
        a = moe.moe_routed_args(x, w13, w2, torch.empty(T, E_, dtype=torch.bfloat16), k, True, arch=90, fp8=fp8)
        assert a.dtype != -1
        buf = ctypes.create_string_buffer(256)
        st = _lib.lib().opgraft_moe_supports(ctypes.byref(a), buf, len(buf))
        return "" if st == _lib.OK else buf.value.decode()

    assert reason() == "" and reason(T=2) == ""
    assert reason(T=3).startswith("moe.fp8_quantize is 0 on sm_90 at T=3")  # Mixtral-8x7B: e4m3 from three
    assert "not a multiple of the quantization group 128" in reason(H_=4096 + 64)
