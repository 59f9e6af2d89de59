"""MoE routing seam: vLLM's softmax top-k and the experts in our kernels, from the router's logits.

What is patched: `MoERunner._apply_quant_method` in
vllm/model_executor/layers/fused_moe/runner/moe_runner.py (vLLM 0.26.0, the pinned release;
0.33.0 adds a `shared_experts_overlapping` keyword, 0.34.0, tested in CI too, a
`hidden_states_scale` one, set when the input was quantized before a context-parallel all-gather:
such calls stay vLLM's). It
receives the router's logits and runs `router.select_experts` (FusedTopKRouter: vLLM's
topk_softmax kernel) and then the modular kernel, whose TritonExperts.apply the MoE experts seam
wraps. A decode step of a MoE model spends a kernel a layer on that top-k (about 3.6 us a layer at
batch 1 on an H200 for Qwen3-30B-A3B's 128 experts, bench/NOTES.md v27); here the experts kernels
compute it themselves, from the logits, before their first weight load.
What is taken: exactly the layers where routing and experts are plain: FusedTopKRouter with
softmax scoring, no EPLB, no routing capture or replay; no shared experts; the quant method
UnquantizedFusedMoEMethod (bf16/fp16 weights) or Fp8MoEMethod with block scales or per-tensor
scales and dynamic activation scales (its bf16 activations quantized by our gate_up kernel per
token and 1 x block_k group, or 1 x 128 with per-tensor scales, with fp32 scales, where the plan
says so, moe.fp8_quantize; else by the layer's own prepare step, as vLLM's modular kernel does
before TritonExperts.apply: vLLM 0.26 on Hopper rounds block scales up to powers of two where
DeepGEMM's E8M0 is in use, and quantizes per tensor with one dynamic scale), with a modular kernel of
TritonExperts behind the no-dispatch prepare/finalize (one rank's experts, no DP/EP all-to-all), no
expert_map, no apply_router_weight_on_input, and what the experts seam itself would take (no bias,
no LoRA, SwiGLU). The C guard then decides on the shape, before any quantization. Everything else, and every
refusal, runs vLLM's own method (its routing, then the experts seam as before).
OPGRAFT_MOE_ROUTE=0 installs nothing.
Remove it: delete route_seam from seams() in opgraft/vllm/__init__.py.
"""

from __future__ import annotations

import functools
import inspect

from .. import dispatch
from . import moe_seam
from .compat import switched_off

_PATCH_ATTR = "_opgraft_original_apply_quant_method"
_PARAMS = ("hidden_states", "router_logits", "shared_experts_input", "input_ids")
_OPTIONAL = {"shared_experts_overlapping",  # vLLM 0.33
             "hidden_states_scale"}  # 0.34: input quantized before a prefill context-parallel gather


def disabled() -> str:
    """Why the seam must not be installed ("" if it may): OPGRAFT_MOE_ROUTE=0."""
    return "MoE routing seam disabled by OPGRAFT_MOE_ROUTE=0" if switched_off("OPGRAFT_MOE_ROUTE") else ""


def _target():
    try:
        from vllm.model_executor.layers.fused_moe.runner import moe_runner
    except Exception as e:
        return None, f"cannot import vllm's MoE runner ({type(e).__name__}: {e})"
    cls = getattr(moe_runner, "MoERunner", None)
    if cls is None or not callable(getattr(cls, "_apply_quant_method", None)):
        return None, "vllm's MoERunner._apply_quant_method is not where opgraft expects it"
    return cls, ""


def _signature_matches(fn) -> bool:
    try:
        names = tuple(inspect.signature(fn).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return names[:4] == _PARAMS and set(names[4:]) <= _OPTIONAL


@functools.lru_cache(maxsize=1)  # route_reason asks at every call
def _classes():
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    return FusedTopKRouter, UnquantizedFusedMoEMethod, MoEPrepareAndFinalizeNoDPEPModular, TritonExperts


@functools.lru_cache(maxsize=1)
def _fp8_method_class():
    try:
        from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
    except Exception:  # no FP8 method where opgraft expects it: FP8 layers keep vLLM's routing
        return None
    return Fp8MoEMethod


def _fp8_block(experts):
    """The weight blocks of the experts' FP8 quant config, or None."""
    b = getattr(getattr(experts, "quant_config", None), "block_shape", None)
    return None if b is None else (int(b[0]), int(b[1]))


def _fp8_reason(hidden_states, experts, experts_cls, layer) -> str:
    """The experts seam's checks on the e4m3 activations and scales that the layer's prepare step
    would make of hidden_states (their layout only: meta tensors, nothing computed)."""
    from ..ops import moe

    if getattr(experts, "expects_unquantized_inputs", False):
        return "experts that quantize their own inputs"
    block = _fp8_block(experts)
    xq, xs = moe.fp8_activations_like(hidden_states, None if block is None else block[1], device="meta")
    reason, fp8 = moe_seam._seam_reason(experts, experts_cls, xq, layer.activation, xs, layer.expert_map,
                                        layer.w13_weight, layer.w2_weight, layer.apply_router_weight_on_input)
    return reason or ("" if fp8 is not None else "FP8 layer without FP8 scales")


def route_reason(runner, hidden_states, router_logits, overlapping=False, hidden_states_scale=None) -> str:
    """Why vLLM must route this layer's call itself ("" when our kernels may take it)."""
    if hidden_states_scale is not None:
        return "hidden states quantized before the MoE runner"
    router_cls, method_cls, pf_cls, experts_cls = _classes()
    router = getattr(runner, "router", None)
    if type(router) is not router_cls:
        return f"router {type(router).__name__}"
    if getattr(router, "scoring_func", None) != "softmax":
        return f"scoring function {getattr(router, 'scoring_func', None)}"
    if getattr(router, "eplb_state", None) is not None:
        return "EPLB"
    if getattr(router, "capture_fn", None) is not None or getattr(router, "_routing_replay_out", None) is not None:
        return "routed-experts capture"
    if getattr(runner, "_shared_experts", None) is not None or overlapping:
        return "shared experts"
    layer = getattr(runner, "routed_experts", None)
    qm = getattr(layer, "quant_method", None)
    fp8_layer = _fp8_method_class() is not None and type(qm) is _fp8_method_class()
    if type(qm) is not method_cls and not fp8_layer:
        return f"quant method {type(qm).__name__}"
    mk = getattr(qm, "moe_kernel", None)
    if mk is None or mk.is_monolithic:
        return "no modular experts kernel"
    if type(mk.prepare_finalize) is not pf_cls:
        return f"prepare/finalize {type(mk.prepare_finalize).__name__}"
    experts = mk.fused_experts
    w13, w2 = layer.w13_weight, layer.w2_weight
    if hidden_states.dim() != 2:
        return "hidden states not [T, H]"
    if fp8_layer:
        reason = _fp8_reason(hidden_states, experts, experts_cls, layer)
    else:
        reason, fp8 = moe_seam._seam_reason(experts, experts_cls, hidden_states, layer.activation, None,
                                            layer.expert_map, w13, w2, layer.apply_router_weight_on_input)
        reason = reason or ("FP8 weights" if fp8 is not None else "")
    if reason:
        return reason
    if layer.expert_map is not None:
        return "expert_map"
    if w13.shape[0] != layer.global_num_experts:
        return "local experts differ from global experts"
    if hidden_states.dim() != 2 or router_logits.dim() != 2 or router_logits.dtype != hidden_states.dtype:
        return "router logits not [T, E] in the hidden states' dtype"
    return ""


def make_wrapper(original):
    def _apply_quant_method(self, hidden_states, router_logits, shared_experts_input, input_ids=None, **kw):
        def delegate():
            return original(self, hidden_states, router_logits, shared_experts_input, input_ids, **kw)

        if hidden_states.dim() != 2 or hidden_states.shape[0] > moe_seam._MAX_TOKENS:  # a prefill's
            return delegate()
        reason = route_reason(self, hidden_states, router_logits, kw.get("shared_experts_overlapping", False),
                              kw.get("hidden_states_scale"))
        call = dispatch.RoutedExpertsCall(hidden_states, None, None, router_logits, 0, True, delegate, reason)
        if not reason:  # the layer is one route_reason knows: its weights and its router's k
            layer = self.routed_experts
            call.w13, call.w2 = layer.w13_weight, layer.w2_weight
            call.top_k, call.renormalize = int(self.router.top_k), bool(self.router.renormalize)
            if type(layer.quant_method) is not _classes()[1]:  # Fp8MoEMethod: vLLM's prepare quantizes
                mk = layer.quant_method.moe_kernel
                qc = mk.fused_experts.quant_config
                call.fp8_weights = (qc.w1_scale, qc.w2_scale, _fp8_block(mk.fused_experts))
                call.quantize = lambda: mk.prepare_finalize.prepare(
                    hidden_states, None, None, layer.global_num_experts, None, False, qc,
                    defer_input_quant=False)[:2]
        res = dispatch.dispatch_routed(call)
        return res if isinstance(res, tuple) else (None, res)

    _apply_quant_method.__doc__ = (original.__doc__ or "") + "\n\n(wrapped by opgraft: see opgraft/vllm/route_seam.py)"
    setattr(_apply_quant_method, _PATCH_ATTR, original)
    return _apply_quant_method


def install() -> tuple[bool, str]:
    """Patches MoERunner._apply_quant_method once; returns (installed, message)."""
    cls, why = _target()
    if cls is None:
        return False, why
    current = cls.__dict__.get("_apply_quant_method")
    if current is not None and hasattr(current, _PATCH_ATTR):
        return True, "MoE routing seam already installed"
    if current is None or not _signature_matches(current):
        return False, "vllm's MoERunner._apply_quant_method has an unexpected signature (another vLLM version?)"
    try:
        _classes()
    except Exception as e:
        return False, f"vllm's router or experts classes moved ({type(e).__name__}: {e})"
    cls._apply_quant_method = make_wrapper(current)
    return True, "MoE routing seam installed (MoERunner._apply_quant_method)"


def uninstall() -> None:
    cls, _ = _target()
    current = cls.__dict__.get("_apply_quant_method") if cls is not None else None
    if current is not None and hasattr(current, _PATCH_ATTR):
        cls._apply_quant_method = getattr(current, _PATCH_ATTR)


def installed() -> bool:
    cls, _ = _target()
    return cls is not None and hasattr(cls.__dict__.get("_apply_quant_method"), _PATCH_ATTR)
