"""MoE seam: vLLM's Triton experts, after routing.

What is patched: `TritonExperts.apply` in vllm/model_executor/layers/fused_moe/experts/triton_moe.py
(vLLM 0.26.0, the pinned release, and 0.33.0, the newest, both tested in CI with the same
signature; the class that the default unquantized bf16/fp16 path uses on sm_90 and sm_80).
Why there: it runs after vLLM's router and after the modular kernel's prepare step (quantization,
EP dispatch) and before its finalize step, with the fused_experts contract (hidden [T, H],
w1 = w13 [E, 2I, H] gate rows first, w2 [E, H, I], fp32 topk_weights, int32/int64 topk_ids), and
it writes the final weighted sum into `output`. So routing, quantization and parallelism stay
vLLM's. How: the original method is kept; our wrapper writes `output` with our kernel when the
dispatch guard says yes and otherwise calls the original with the same arguments. Calls from
subclasses (LoRA, emulated or weight-only quantized experts), quantized activations, biases and
non-SwiGLU activations always go to the original.
Remove it: delete this module's install() call in opgraft/vllm/__init__.py.
"""

from __future__ import annotations

import logging

from .. import dispatch

logger = logging.getLogger("opgraft")

_PATCH_ATTR = "_opgraft_original_apply"


def _target():
    """The class to patch, or (None, why)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts import triton_moe
    except Exception as e:  # moved or failing import
        return None, f"cannot import vllm's Triton experts module ({type(e).__name__}: {e})"
    cls = getattr(triton_moe, "TritonExperts", None)
    if cls is None or not callable(getattr(cls, "apply", None)):
        return None, "vllm's TritonExperts.apply is not where opgraft expects it"
    return cls, ""


# Parameter names of TritonExperts.apply in vLLM 0.26.0 (and 0.33.0), in order.
_APPLY_PARAMS = ("output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
                 "global_num_experts", "expert_map", "a1q_scale", "a2_scale", "workspace13", "workspace2",
                 "expert_tokens_meta", "apply_router_weight_on_input")


def _signature_matches(fn) -> bool:
    import inspect

    try:
        names = tuple(inspect.signature(fn).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return names == _APPLY_PARAMS


def _activation_name(activation) -> str:
    name = getattr(activation, "name", None) or getattr(activation, "value", None) or str(activation)
    return str(name).lower().split(".")[-1]


def _seam_reason(self, cls, hidden_states, activation, a1q_scale, expert_map) -> str:
    """Why vLLM must keep this call even before our guard looks ("" if nothing)."""
    if type(self) is not cls:
        return f"experts class {type(self).__name__}"
    qc = getattr(self, "quant_config", None)
    if a1q_scale is not None or (qc is not None and getattr(qc, "quant_dtype", None) is not None):
        return "quantized experts"
    if getattr(self, "w1_bias", None) is not None or getattr(self, "w2_bias", None) is not None:
        return "expert biases"
    if getattr(self, "_lora_context", None) is not None:
        return "LoRA"
    act = _activation_name(activation)
    if act != "silu":
        return f"activation {act}"
    return ""


def make_wrapper(cls, original):
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        def delegate():
            return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                            global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                            expert_tokens_meta, apply_router_weight_on_input)

        reason = _seam_reason(self, cls, hidden_states, activation, a1q_scale, expert_map)
        if not reason and expert_map is None and w1.shape[0] != global_num_experts:
            reason = "local experts differ from global experts"
        if not reason and expert_map is not None and expert_map.numel() != global_num_experts:
            reason = "expert_map length differs from the global experts"
        call = dispatch.ExpertsCall(
            hidden_states=hidden_states, w13=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
            activation="silu", apply_router_weight_on_input=bool(apply_router_weight_on_input),
            expert_map=expert_map, delegate=delegate, extra_reason=reason, output=output, workspace=workspace2)
        return dispatch.dispatch("moe", call)

    apply.__doc__ = (original.__doc__ or "") + "\n\n(wrapped by opgraft: see opgraft/vllm/moe_seam.py)"
    setattr(apply, _PATCH_ATTR, original)
    return apply


def install() -> tuple[bool, str]:
    """Patches TritonExperts.apply once; returns (installed, message)."""
    cls, why = _target()
    if cls is None:
        return False, why
    current = cls.__dict__.get("apply")
    if current is not None and hasattr(current, _PATCH_ATTR):
        return True, "MoE experts seam already installed"
    if current is None or not _signature_matches(current):
        return False, "vllm's TritonExperts.apply has an unexpected signature (another vLLM version?)"
    cls.apply = make_wrapper(cls, current)
    return True, "MoE experts seam installed (TritonExperts.apply)"


def uninstall() -> None:
    cls, _ = _target()
    current = cls.__dict__.get("apply") if cls is not None else None
    if current is not None and hasattr(current, _PATCH_ATTR):
        cls.apply = getattr(current, _PATCH_ATTR)


def installed() -> bool:
    cls, _ = _target()
    return cls is not None and hasattr(cls.__dict__.get("apply"), _PATCH_ATTR)
