"""MoE seam: vLLM's Triton experts, after routing.

What is patched: `TritonExperts.apply` in vllm/model_executor/layers/fused_moe/experts/triton_moe.py
(vLLM 0.26.0, the pinned release, and 0.34.0, both tested in CI, and 0.33.0, with the same
signature; the class that the default unquantized bf16/fp16 path uses on sm_90 and sm_80).
Why there: it runs after vLLM's router and after the modular kernel's prepare step (quantization,
EP dispatch) and before its finalize step, with the fused_experts contract (hidden [T, H],
w1 = w13 [E, 2I, H] gate rows first, w2 [E, H, I], fp32 topk_weights, int32/int64 topk_ids), and
it writes the final weighted sum into `output`. So routing, quantization and parallelism stay
vLLM's. How: the original method is kept; our wrapper writes `output` with our kernel when the
dispatch guard says yes and otherwise calls the original with the same arguments. Calls from
subclasses (LoRA, emulated or weight-only quantized experts), quantizations other than the two
FP8 ones below, biases and non-SwiGLU activations always go to the original. vLLM 0.34 declares the
class's input `PaddedStandard`: behind an all-to-all that pads, rows may be garbage with every
topk_ids slot -1; the kernels route a -1 slot nowhere (and such calls, whose ranks hold fewer
experts than the global count without an expert_map, are handed back before that).
Remove it: delete this module's install() call in opgraft/vllm/__init__.py.

FP8 (read in vLLM 0.26.0's and 0.33.0's source: fused_moe/oracle/fp8.py, experts/triton_moe.py,
config.py, prepare_finalize/no_dp_ep.py, modular_kernel.py, quantization/fp8.py):
- Which experts class. Fp8MoEMethod asks select_fp8_moe_backend. On sm_90 (an H200) a block-FP8
  checkpoint (weight key kFp8Static128BlockSym, activations kFp8Dynamic128Sym) gets TRITON first
  under tensor parallelism (TritonExperts: this seam) and FLASHINFER_CUTLASS first under expert
  parallelism (FlashInferExperts, when FlashInfer's CUTLASS MoE supports the config). A per-tensor
  checkpoint with dynamic activation scales (kFp8StaticTensorSym, kFp8DynamicTensorSym) gets
  TritonExperts (FlashInfer and DeepGEMM do not take it; vLLM's CUTLASS is not allowed there);
  with static activation scales FlashInferExperts takes it where FlashInfer is installed.
  compressed-tensors per-channel FP8 goes to CutlassExpertsFp8 / TritonOrCutlassExperts. The
  FlashInferExperts and CUTLASS paths are other classes and stay vLLM's (not wrapped); a
  TritonExperts instance inside TritonOrDeepGemmExperts (DeepGEMM's small-batch fallback) is
  this class and reaches the seam with DeepGEMM's weight layout, whose scales this seam reads by
  their strides (fp32 only: packed UE8M0 scales are refused by the guard).
- What apply() sees. The modular kernel's prepare step (MoEPrepareAndFinalizeNoDPEPModular,
  moe_kernel_quantize_input) has quantized the activations: hidden_states is e4m3fn and
  a1q_scale is [M, ceil(K/block_k)] fp32 per 1 x block_k group (per_token_group_quant_fp8,
  row-major; powers of two where DeepGEMM's UE8M0 is in use) for block FP8, or one dynamic fp32
  scale [1] (scaled_fp8_quant) for per-tensor FP8. The weights are w1 = w13_weight [E, 2N, K] and
  w2 = w2_weight [E, K, N] in e4m3fn; their scales are quant_config.w1_scale / w2_scale:
  w13_weight_scale_inv [E, 2*ceil(N/bn), ceil(K/bk)] and w2_weight_scale_inv [E, ceil(K/bn),
  ceil(N/bk)] fp32 with quant_config.block_shape [bn, bk] (128x128 in the checkpoints; vLLM 0.33
  refines to 64x64 or 32x32 where N/tp is no multiple of 128), or one scale per expert matrix, [E]
  for both, after process_weights_after_loading (the max of the w1 and w3 scales, w13
  requantized). vLLM requires N to be a multiple of bn and its activation quantization K a
  multiple of bk. The second GEMM's input is quantized inside apply() (block: fused
  silu_and_mul_per_block_quant, 1x128 groups; per-tensor: one dynamic scale for all of it); the
  FP8 kernels keep it in e4m3 with one scale per 32 rows instead (finer). output has the model's
  dtype.
- What is taken: exactly those two configurations (block FP8 with the prepare step's a1q_scale,
  per-tensor FP8 with a dynamic activation scale), SiLU, no bias, no SwiGLU clamp or alpha/beta,
  no LoRA, no quantization emulation. Everything else goes to vLLM's own apply with the reason:
  static activation scales, per-token activation or per-channel weight scales, FP8 weight-only
  (w8a16), INT8 (w8a8, w8a16), INT4 (w4a16), MXFP4, NVFP4, W4A8, MXFP8, and scale layouts the
  C guard refuses (e.g. UE8M0 packed into int32). OPGRAFT_MOE_FP8=0 hands every FP8 call back.
- apply_router_weight_on_input: the prepare step has already multiplied the input by the router
  weight (top-1 only) and apply() must not weight again, which the kernels' on-input mode would:
  such calls are handed back, bf16 and FP8 alike.
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


# Parameter names of TritonExperts.apply in vLLM 0.26.0 (and 0.33.0, 0.34.0), in order.
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


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def _quant_name(qc) -> str:
    """The name of a quantization the FP8 kernels do not take, from vLLM's FusedMoEQuantConfig."""
    qdt = getattr(qc, "quant_dtype", None)
    wdt = getattr(qc, "weight_quant_dtype", None)
    if qdt is None:  # weight-only
        names = {"int4": "INT4 weight-only (w4a16)", "mxfp4": "MXFP4 weight-only (w4a16)",
                 "nvfp4": "NVFP4 weight-only (w4a16)", "mxfp8": "MXFP8 weight-only"}
        if isinstance(wdt, str):
            return names.get(wdt, f"{wdt} weight-only")
        if "int8" in _dtype_name(wdt):
            return "INT8 weight-only (w8a16)"
        if "float8" in _dtype_name(wdt):
            return "FP8 weight-only (w8a16)"
        return f"{_dtype_name(wdt)} weight-only"
    if isinstance(qdt, str):
        if wdt == "mxfp4" and qdt in ("fp8", "mxfp8"):
            return f"W4A8 (MXFP4 weights, {qdt} activations)"
        return {"nvfp4": "NVFP4", "mxfp4": "MXFP4 (w4a4)", "mxfp8": "MXFP8"}.get(qdt, qdt)
    if "int8" in _dtype_name(qdt):
        return "INT8 w8a8"
    if "float8" in _dtype_name(qdt) and wdt is not None and "float8" not in _dtype_name(wdt):
        return f"W4A8-style ({_dtype_name(wdt)} weights, FP8 activations)"
    return f"{_dtype_name(qdt)} activations, {_dtype_name(wdt)} weights"


def _fp8_call(self, qc, hidden_states, w1, w2, a1q_scale):
    """For a quantized call: ((hidden_scale, w13_scale, w2_scale, block_shape), "") when it is one
    of the two FP8 configurations the kernels take (block FP8, or per-tensor FP8 with a dynamic
    activation scale), else (None, why vLLM keeps it)."""
    import torch

    e4m3 = getattr(torch, "float8_e4m3fn", None)
    qdt = getattr(qc, "quant_dtype", None)
    wdt = getattr(qc, "weight_quant_dtype", None)
    if e4m3 is None or qdt != e4m3 or wdt != e4m3:
        if qdt is not None and qdt == getattr(torch, "float8_e4m3fnuz", object()):
            return None, "FP8 e4m3fnuz (ROCm)"
        return None, f"quantization {_quant_name(qc)}"
    if getattr(self, "quantization_emulation", False):
        return None, "FP8 quantization emulation"
    if qc.per_out_ch_quant:
        return None, "per-channel FP8 weight scales"
    if qc.per_act_token_quant:
        return None, "per-token FP8 activation scales"
    if getattr(qc, "g1_alphas", None) is not None or getattr(qc, "a1_gscale", None) is not None:
        return None, "FP8 with combined dequantization scales (FlashInfer's form)"
    block = qc.block_shape
    if block is None and qc.a1_scale is not None:
        return None, "static FP8 activation scales (FlashInferExperts' path on sm_90)"
    if a1q_scale is None:
        return None, "FP8 weights without the prepare step's activation scales"
    w1s, w2s = qc.w1_scale, qc.w2_scale
    if not isinstance(w1s, torch.Tensor) or not isinstance(w2s, torch.Tensor) or not isinstance(a1q_scale, torch.Tensor):
        return None, "FP8 scales that are not tensors"
    if hidden_states.dtype != e4m3 or w1.dtype != e4m3 or w2.dtype != e4m3:
        return None, (f"FP8 config with {_dtype_name(hidden_states.dtype)} hidden states and "
                      f"{_dtype_name(w1.dtype)} weights")
    return (a1q_scale, w1s, w2s, None if block is None else (int(block[0]), int(block[1]))), ""


def _activation_params_reason(self, qc) -> str:
    """A SwiGLU with a clamp or alpha/beta (vLLM 0.26: quant_config.gemm1_*; 0.33:
    activation_config, also from the model's swiglu_limit) is not the kernels' silu(g) * u."""
    ac = getattr(self, "activation_config", None)
    if ac is not None:
        if getattr(ac, "clamp_limit", None) is not None or getattr(ac, "alpha", 1.0) != 1.0 or getattr(ac, "beta", 0.0) != 0.0:
            return "SwiGLU with a clamp limit or alpha/beta"
        if getattr(ac, "activation_situ_beta", None) is not None or getattr(ac, "activation_situ_linear_beta", None) is not None:
            return "SwiGLU with a clamp limit or alpha/beta"
    if qc is not None and any(getattr(qc, k, None) is not None for k in ("gemm1_clamp_limit", "gemm1_alpha", "gemm1_beta")):
        return "SwiGLU with a clamp limit or alpha/beta"
    return ""


def _seam_reason(self, cls, hidden_states, activation, a1q_scale, expert_map, w1=None, w2=None,
                 apply_router_weight_on_input=False):
    """(why vLLM must keep this call even before our guard looks, or "", and the FP8 scales of a
    call the FP8 kernels may take, or None)."""
    if type(self) is not cls:
        return f"experts class {type(self).__name__}", None
    qc = getattr(self, "quant_config", None)
    fp8 = None
    quantized = a1q_scale is not None or (qc is not None and (getattr(qc, "quant_dtype", None) is not None
                                                             or getattr(qc, "weight_quant_dtype", None) is not None))
    if quantized:
        if qc is None:
            return "quantized activations without a quant config", None
        fp8, why = _fp8_call(self, qc, hidden_states, w1, w2, a1q_scale)
        if fp8 is None:
            return why, None
    if getattr(self, "w1_bias", None) is not None or getattr(self, "w2_bias", None) is not None:
        return "expert biases", None
    if getattr(self, "_lora_context", None) is not None:
        return "LoRA", None
    if getattr(self, "post_gemm2_hook", None) is not None:  # vLLM 0.33: unfinalized rows go elsewhere
        return "a post-GEMM2 hook", None
    act = _activation_name(activation)
    if act != "silu":
        return f"activation {act}", None
    why = _activation_params_reason(self, qc)
    if why:
        return why, None
    if apply_router_weight_on_input:
        return "router weight already applied to the input (vLLM's prepare step)", None
    return "", fp8


_MAX_TOKENS = 64  # opgraft.ops.moe.MAX_TOKENS (not imported here: torch loads with the first call)
_TOO_MANY = f"N tokens > {_MAX_TOKENS} (kernel limit)"


def make_wrapper(cls, original):
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        def delegate():
            return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                            global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                            expert_tokens_meta, apply_router_weight_on_input)

        T = hidden_states.shape[0] if hidden_states.dim() == 2 else 0
        if T > _MAX_TOKENS:  # a prefill's call: nothing else to look at (its host time is the TTFT's)
            dispatch.stats_of("moe").delegate(_TOO_MANY)
            return delegate()
        reason, fp8 = _seam_reason(self, cls, hidden_states, activation, a1q_scale, expert_map, w1, w2,
                                   apply_router_weight_on_input)
        if not reason and expert_map is None and w1.shape[0] != global_num_experts:
            reason = "local experts differ from global experts"
        if not reason and expert_map is not None and expert_map.numel() != global_num_experts:
            reason = "expert_map length differs from the global experts"
        call = dispatch.ExpertsCall(
            hidden_states=hidden_states, w13=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
            activation="silu", apply_router_weight_on_input=bool(apply_router_weight_on_input),
            expert_map=expert_map, delegate=delegate, extra_reason=reason, output=output, workspace=workspace2,
            fp8_scales=fp8)
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
