"""Linear seam: vLLM's unquantized linear method, for decode-sized inputs.

What is patched: `apply(self, layer, x, bias=None)` of `UnquantizedLinearMethod`
(vllm/model_executor/layers/linear.py: every unquantized ColumnParallel, MergedColumnParallel,
QKVParallel, RowParallel and Replicated linear layer, router gates included) and of
`UnquantizedEmbeddingMethod` (vllm/model_executor/layers/vocab_parallel_embedding.py: the lm_head's
projection, which LogitsProcessor calls as `lm_head.quant_method.apply(lm_head, h, bias=...)`). Same
signature in vLLM 0.26.0 (the pinned release), 0.33.0 and 0.34.0 (tested in CI).

Why there: both methods end in one GEMM that vLLM picks per platform, `dispatch_unquantized_gemm()`
(0.26; 0.33: `UnquantizedLinearMethod._gemm_impl`, chosen at construction), which on CUDA is
`default_unquantized_gemm`, i.e. `torch.nn.functional.linear(x, layer.weight, bias)`; 0.34's is
`cuda_unquantized_gemm`, the same call unless the layer has `use_skinny_gemm` (vLLM's measured
skinny-GEMM plans, only for sm_121 shapes in 0.34), whose calls stay vLLM's. The tensor-
parallel layers have already split their weights and pass the bias they want added on this rank
(RowParallelLinear: only rank 0, the others None), so a call here is one plain local linear.
Quantized layers have their own methods (Fp8LinearMethod, AWQ, GPTQ, ...), which never reach this
code; subclasses of the unquantized method (0.33: GateLinear's ROCm method, model-specific
methods) are handed back.

How: the original method is kept. For a call the seam can take (CUDA, bf16/fp16 x and weight of
one dtype, 2-D x, K a multiple of 8, vLLM's GEMM being torch's, no VLLM_BATCH_INVARIANT, no GEMM +
collective fusion pass that matches vLLM's matmuls) the wrapper calls `torch.ops.opgraft.linear`
(opgraft/ops/linear.py): at run time it runs our kernel for 1..linear.max_rows rows and
`torch.nn.functional.linear(x, weight, bias)` (vLLM's own call, bit for bit) for anything else.
Every other call goes to the original method with the same arguments.

torch.compile: vLLM traces the model's forward with Dynamo and drops its guards, so a branch on
the row count in Python would be frozen at the first trace (with the profiling run's thousands of
rows). The row count is therefore decided inside the custom op, which Dynamo sees as opaque (its
fake implementation gives the shape). What the wrapper decides in Python looks only at what does
not change between calls (classes, dtypes, devices, weight shapes, settings). vLLM's compile cache
is keyed by its own settings, not opgraft's: install() adds one factor (OPGRAFT_LINEAR_SEAM: the
opgraft version and the linear variant) to the environment factors vLLM hashes into that key, so a
graph traced with this seam is never reused without it, and the reverse.

Counting (dispatch.stats_of("linear")): the op counts each of its decisions when it runs eagerly
(enforce_eager, the lm_head, the router gate inside vLLM's MoE op, CUDA-graph warm-up and capture;
a graph replay counts nothing). The wrapper counts its own hand-backs per call when it runs
eagerly, and once per trace under Dynamo, with " (at trace)" after the reason; trace_counts() says
how many calls Dynamo routed into the op. A graph loaded from vLLM's compile cache is not traced,
and then only the op's eager decisions are counted.

Block-FP8 layers: `apply` and `process_weights_after_loading` of `Fp8LinearMethod`
(vllm/model_executor/layers/quantization/fp8.py, same signatures in 0.26 and 0.33). With a
weight_block_size vLLM quantizes x per row and block of columns (dynamic e4m3 scales) and runs a
block-scaled GEMM (0.26 on Hopper: FlashInfer's swapAB kernel below 32 rows, which quantizes
inside, DeepGEMM above; DeepGEMM or CUTLASS or Triton elsewhere: `init_fp8_linear_kernel`). Our
kernel (`torch.ops.opgraft.linear_fp8`) does that quantization itself and the same block-scaled
sums. What vLLM's kernel does with rows our kernel does not take cannot be called from a traced
graph by its layer object, so each layer is registered when vLLM has processed its weights, under
its weight (the parameter is an input of the graph; a name would be a constant of it, and every
layer's piece a graph of its own for Inductor to compile, bench/NOTES.md v50): the op hands such
calls to that layer's own `apply`. The layer's eligibility is decided there too, once, in plain
Python (block scales in fp32 of the expected shape, square blocks, vLLM's kernel one of its
block-scaled W8A8 kernels, no Marlin, no power-of-two activation scales, no static activation
scale, an output dtype equal to x's, a weight no other layer has), and kept on the layer as the
reason the seam hands it back ("" if none). Layers of other FP8 methods (per-tensor,
per-channel, compressed-tensors, ModelOpt) keep their own methods.

Kill switches: OPGRAFT_LINEAR=0 installs nothing; OPGRAFT_LINEAR_FP8=0 leaves Fp8LinearMethod
alone; OPGRAFT_LINEAR_VARIANT=passthrough keeps the seam but hands every call back
(OPGRAFT_DISABLE=1 turns all of opgraft off).
Remove it: delete the ("linear", linear_seam) entry of the seam list in opgraft/vllm/__init__.py.
"""

from __future__ import annotations

import logging
import threading
import weakref

from .. import dispatch
from .compat import add_compile_factor, package_tag, remove_compile_factor, switched_off

logger = logging.getLogger("opgraft")

_PATCH_ATTR = "_opgraft_original_apply"
# The attribute process_weights_after_loading leaves on an FP8 layer: why the seam hands it back.
_FP8_REASON_ATTR = "_opgraft_fp8_reason"
# The key install() adds to the environment factors of vLLM's compile cache.
COMPILE_FACTOR = "OPGRAFT_LINEAR_SEAM"
_APPLY_PARAMS = ("layer", "x", "bias")

_lock = threading.Lock()
_traced_routes = 0
# The device types whose calls may go to the op (the tests add "cpu" to trace the op's path on a
# machine without a GPU: the op then hands every call to torch itself).
DEVICE_TYPES = ("cuda",)


def disabled() -> str:
    """Why the seam must not be installed ("" if it may): OPGRAFT_LINEAR=0."""
    return "linear seam disabled by OPGRAFT_LINEAR=0" if switched_off("OPGRAFT_LINEAR") else ""


def _targets():
    """[(class, the module whose dispatch_unquantized_gemm it calls)] and the GEMMs it may be, or
    ([], None, why)."""
    try:
        from vllm.model_executor.layers import linear as linear_mod
        from vllm.model_executor.layers import utils as utils_mod
        from vllm.model_executor.layers import vocab_parallel_embedding as vpe_mod
    except Exception as e:  # moved or failing import
        return [], None, f"cannot import vllm's linear layers ({type(e).__name__}: {e})"
    out = []
    for mod, name in ((linear_mod, "UnquantizedLinearMethod"), (vpe_mod, "UnquantizedEmbeddingMethod")):
        cls = getattr(mod, name, None)
        if cls is None or not callable(getattr(cls, "apply", None)):
            return [], None, f"vllm's {name}.apply is not where opgraft expects it"
        out.append((cls, mod))
    default = getattr(utils_mod, "default_unquantized_gemm", None)
    if default is None:
        return [], None, "vllm's default_unquantized_gemm is not where opgraft expects it"
    # vLLM 0.34 picks cuda_unquantized_gemm on CUDA: torch's linear too, unless the layer carries
    # a skinny-GEMM plan (use_skinny_gemm), which the wrapper hands back.
    cuda = getattr(utils_mod, "cuda_unquantized_gemm", None)
    return out, (default,) if cuda is None else (default, cuda), ""


def _signature_matches(fn) -> bool:
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return tuple(p.name for p in params) == _APPLY_PARAMS and params[2].default is None


# ---- what runs at trace time must be traceable by Dynamo (no locks, no logging, no os.environ):
# those helpers run once per trace through torch._dynamo.assume_constant_result, which calls them
# while tracing and puts their (constant) result into the graph.

def _variant() -> str:
    return dispatch.selected_variant("linear")


def _gemm_comms_fused() -> bool:
    """Does vLLM's current config enable a pass that fuses its matmuls with collectives (0.26's
    AsyncTP, pass_config.fuse_gemm_comms)? Such a pass pattern-matches aten.mm, which our op would
    hide from it."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
    except Exception:
        return False
    pc = getattr(getattr(cfg, "compilation_config", None), "pass_config", None)
    return bool(getattr(pc, "fuse_gemm_comms", False))


def _note_hand_back(reason: str) -> bool:
    dispatch.stats_of("linear").delegate(reason)
    dispatch._info_once(f"linear call handed back to vLLM: {reason}")
    return True


def _note_traced_route() -> bool:
    global _traced_routes
    with _lock:
        _traced_routes += 1
    return True


def trace_counts() -> dict:
    """{"routed": calls Dynamo traced into opgraft::linear} in this process."""
    with _lock:
        return {"routed": _traced_routes}


def _reset_trace_counts() -> None:
    global _traced_routes
    with _lock:
        _traced_routes = 0


def _traced(fn):
    """fn as a constant of the traced graph: Dynamo runs it once, at trace."""
    import torch

    const = getattr(getattr(torch, "_dynamo", None), "assume_constant_result", None)
    return const(fn) if const is not None else fn  # every torch vLLM supports has it


def _seam_apply(original, static_reason, ours_for):
    """The apply wrapper of both methods: an eager call of more rows than the kernel takes goes to
    vLLM at once; a static reason (static_reason(self, layer, x, bias, tracing)) hands the call
    back, noted once at trace where traced; else the variant picks between vLLM's original and
    ours_for(self, layer, x, bias, tracing)."""
    import torch

    from ..ops import linear as linear_op

    variant_traced, route_traced = _traced(_variant), _traced(_note_traced_route)
    hand_back_traced = _traced(lambda reason: _note_hand_back(reason + " (at trace)"))
    max_rows, too_many = linear_op.MAX_ROWS, linear_op._TOO_MANY

    def apply(self, layer, x, bias=None):
        def delegate():
            return original(self, layer, x, bias)

        tracing = torch.compiler.is_compiling()
        if not tracing and x.dim() == 2 and x.shape[0] > max_rows:  # an eager prefill's call, at once
            dispatch.stats_of("linear").delegate(too_many)
            return original(self, layer, x, bias)
        name = variant_traced() if tracing else _variant()
        reason = "passthrough variant" if name == "passthrough" else static_reason(self, layer, x, bias, tracing)
        if reason:
            if tracing:
                hand_back_traced(reason)
            else:
                _note_hand_back(reason)
        elif tracing:
            route_traced()

        call = dispatch.LinearCall(x=x, weight=getattr(layer, "weight", None), bias=bias, delegate=delegate,
                                   ours=lambda: ours_for(self, layer, x, bias, tracing), extra_reason=reason)
        return dispatch.variant_fn("linear", name)(call)

    apply.__doc__ = (original.__doc__ or "") + "\n\n(wrapped by opgraft: see opgraft/vllm/linear_seam.py)"
    setattr(apply, _PATCH_ATTR, original)
    return apply


def _make_wrapper(cls, module, torch_gemms, original):
    import torch
    import vllm.envs as envs

    from ..ops import linear as linear_op

    fused_traced = _traced(_gemm_comms_fused)
    half = (torch.bfloat16, torch.float16)

    def static_reason(self, layer, x, bias, tracing) -> str:
        """Why vLLM keeps this call whatever its row count ("" if the op may take it)."""
        if type(self) is not cls:
            return f"linear method {type(self).__name__}"
        if envs.VLLM_BATCH_INVARIANT:
            return "VLLM_BATCH_INVARIANT"
        gemm = getattr(self, "_gemm_impl", None)
        if gemm is None:
            gemm = module.dispatch_unquantized_gemm()
        if gemm not in torch_gemms:
            return "vLLM's GEMM is not torch.nn.functional.linear here"
        if getattr(layer, "use_skinny_gemm", False):
            return "vLLM's skinny GEMM has a plan for this layer"
        if tracing and fused_traced():  # (an Inductor pass: eager calls never meet it)
            return "fuse_gemm_comms (vLLM's GEMM + collective fusion) is on"
        w = getattr(layer, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return "the layer has no two-dimensional weight"
        if x.dim() != 2:
            return "x is not two-dimensional"
        if x.device.type not in DEVICE_TYPES:
            return "tensors are not on a CUDA device"
        if x.dtype not in half or w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
            return "dtypes are not one of bf16 or fp16"
        if w.shape[1] % 8:
            return "in_features is not a multiple of 8"
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.shape[0]):
            return "bias is not [out_features]"
        return ""

    def ours(self, layer, x, bias, tracing):
        # Traced: the opaque op, which decides per call at run time. Eager: the same function
        # without the dispatcher's cost (the lm_head runs eagerly every step).
        if tracing:
            return torch.ops.opgraft.linear(x, layer.weight, bias)
        return linear_op.linear_or_torch(x, layer.weight, bias)

    return _seam_apply(original, static_reason, ours)


def make_wrapper(cls, original):
    """The wrapper of cls.apply around original (tests call it with a recording original)."""
    targets, gemms, why = _targets()
    for c, mod in targets:
        if issubclass(cls, c):
            return _make_wrapper(cls, mod, gemms, original)
    raise ValueError(why or f"{cls.__name__} is not a class the linear seam patches")


def _compile_factor() -> str:
    from ..ops import linear as linear_op

    return (f"{package_tag()}, linear variant {dispatch.selected_variant('linear')}, "
            f"fp8 {'off' if fp8_disabled() else 'on'}, {linear_op.schemas()}")


def _add_compile_factor() -> None:
    add_compile_factor(COMPILE_FACTOR, _compile_factor)


def _remove_compile_factor() -> None:
    remove_compile_factor(COMPILE_FACTOR, _compile_factor)


# ---- block-FP8 layers -----------------------------------------------------------------------

def fp8_disabled() -> bool:
    return switched_off("OPGRAFT_LINEAR_FP8")


def _fp8_target():
    """(Fp8LinearMethod, vLLM's block-scaled kernel base class, e8m0_acts), or (None, None, None,
    why). e8m0_acts(kernel) says whether vLLM's kernel rounds the activation scales of the rows
    our kernel takes (< 32) to powers of two: DeepGEMM's where its E8M0 is in use; not FlashInfer's
    block kernels, whose rows below 32 are quantized by FlashInfer with fp32 scales
    (scale_1x128_kernel<bf16, e4m3, float>, the name in the H200 profile, bench/NOTES.md v32),
    also where DeepGEMM's E8M0 has rounded the weight scales, which our kernel reads as they are."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
            Fp8BlockScaledMMLinearKernel,
        )
        from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
    except Exception as e:
        return None, None, None, f"cannot import vllm's FP8 linear method ({type(e).__name__}: {e})"
    for name in ("apply", "process_weights_after_loading"):
        if not callable(Fp8LinearMethod.__dict__.get(name)):
            return None, None, None, f"vllm's Fp8LinearMethod.{name} is not where opgraft expects it"
    try:
        from vllm.model_executor.kernels.linear.scaled_mm import flashinfer as fi

        fp32_small = tuple(getattr(fi, n) for n in ("FlashInferFp8BlockScaledMMKernel",
                                                     "FlashInferFp8DeepGEMMDynamicBlockScaledKernel")
                           if isinstance(getattr(fi, n, None), type))
    except Exception:
        fp32_small = ()

    def e8m0_acts(kernel) -> bool:
        return not (fp32_small and isinstance(kernel, fp32_small)) and bool(is_deep_gemm_e8m0_used())

    return Fp8LinearMethod, Fp8BlockScaledMMLinearKernel, e8m0_acts, ""


def fp8_scale_of(layer):
    """The layer's block scales (vLLM names them weight_scale_inv for block-FP8 checkpoints)."""
    s = getattr(layer, "weight_scale_inv", None)
    return s if s is not None else getattr(layer, "weight_scale", None)


# fp8_key(weight) -> weakref of the layer registered under its weight
_fp8_layers: dict = {}


def _fp8_layer_reason(method, layer, block_kernel_cls, e8m0_acts) -> str:
    """Why the seam must hand this layer back whatever the call ("" if it may take it)."""
    import torch

    if not getattr(method, "block_quant", False):
        return "FP8 linear without block scales"
    if getattr(method, "use_marlin", False):
        return "FP8 linear on vLLM's Marlin kernel"
    if getattr(method, "act_q_static", False):
        return "FP8 linear with a static activation scale"
    kernel = getattr(method, "fp8_linear", None)
    if not isinstance(kernel, block_kernel_cls):
        return f"vLLM's FP8 kernel {type(kernel).__name__} is not a block-scaled one"
    if e8m0_acts(kernel):
        return f"DeepGEMM E8M0 activation scales ({type(kernel).__name__})"
    block = list(getattr(method, "weight_block_size", None) or [])
    if len(block) != 2 or block[0] != block[1]:
        return f"FP8 weight blocks {block} (vLLM groups the activations by block[0], the kernel by block[1])"
    w, sc = getattr(layer, "weight", None), fp8_scale_of(layer)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != getattr(torch, "float8_e4m3fn", None):
        return "the layer's weight is not a two-dimensional float8_e4m3fn tensor"
    N, K = w.shape
    want = (-(-N // block[0]), -(-K // block[1]))
    if not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32 or tuple(sc.shape) != want:
        return f"the layer's FP8 scales are not fp32 {list(want)}"
    return ""


def _register_fp8_layer(method, layer, original_apply, block_kernel_cls, e8m0_acts) -> None:
    from ..ops import linear as linear_op

    reason = _fp8_layer_reason(method, layer, block_kernel_cls, e8m0_acts)
    name = getattr(layer, "prefix", "") or "an FP8 layer"
    if not reason:
        key = linear_op.fp8_key(layer.weight)
        with _lock:
            other = _fp8_layers.get(key)
            other = other() if other is not None else None
            if other is not None and other is not layer:
                reason = "its weight is another FP8 layer's (the weight finds a call's layer)"
                setattr(other, _FP8_REASON_ATTR, reason)
                linear_op.unregister_fp8_fallback(key)
            else:
                _fp8_layers[key] = ref = weakref.ref(layer)

                def hand_back(x, bias):
                    lay = ref()
                    if lay is None:
                        raise RuntimeError(f"opgraft::linear_fp8: layer {name!r} no longer exists")
                    return original_apply(lay.quant_method, lay, x, bias)

                linear_op.register_fp8_fallback(layer.weight, hand_back)
    setattr(layer, _FP8_REASON_ATTR, reason)


def _make_fp8_wrappers(cls, block_kernel_cls, e8m0_acts, original_apply, original_pwal):
    import torch
    import vllm.envs as envs

    from ..ops import linear as linear_op

    fused_traced = _traced(_gemm_comms_fused)
    half = (torch.bfloat16, torch.float16)

    def process_weights_after_loading(self, layer):
        original_pwal(self, layer)
        if type(self) is cls:
            _register_fp8_layer(self, layer, original_apply, block_kernel_cls, e8m0_acts)

    def static_reason(self, layer, x, bias, tracing) -> str:
        if type(self) is not cls:
            return f"linear method {type(self).__name__}"
        if envs.VLLM_BATCH_INVARIANT:
            return "VLLM_BATCH_INVARIANT"
        layer_reason = getattr(layer, _FP8_REASON_ATTR, None)
        if layer_reason is None:
            return "FP8 layer not registered (its weights were processed before the seam was installed)"
        if layer_reason:
            return layer_reason
        if tracing and fused_traced():
            return "fuse_gemm_comms (vLLM's GEMM + collective fusion) is on"
        if x.dim() != 2:
            return "x is not two-dimensional"
        if x.device.type not in DEVICE_TYPES:
            return "tensors are not on a CUDA device"
        if x.dtype not in half or getattr(self, "out_dtype", None) != x.dtype:
            return "x is not bf16 or fp16 of the layer's output dtype"
        if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1 or bias.shape[0] != layer.weight.shape[0]):
            return "bias is not [out_features] of x's dtype"
        return ""

    def ours(self, layer, x, bias, tracing):
        bn, bk = self.weight_block_size
        if tracing:
            return torch.ops.opgraft.linear_fp8(x, layer.weight, fp8_scale_of(layer), bias, bn, bk)
        out = linear_op.linear_fp8_or_none(x, layer.weight, fp8_scale_of(layer), (bn, bk), bias)
        return out if out is not None else original_apply(self, layer, x, bias)

    apply = _seam_apply(original_apply, static_reason, ours)
    setattr(process_weights_after_loading, _PATCH_ATTR, original_pwal)
    return apply, process_weights_after_loading


def _install_fp8() -> str:
    """Patches Fp8LinearMethod once; returns what it did (for the install message)."""
    if fp8_disabled():
        return "FP8 linear layers left to vLLM by OPGRAFT_LINEAR_FP8=0"
    cls, block_cls, e8m0, why = _fp8_target()
    if cls is None:
        return f"FP8 linear layers left to vLLM: {why}"
    cur_apply, cur_pwal = cls.__dict__["apply"], cls.__dict__["process_weights_after_loading"]
    if hasattr(cur_apply, _PATCH_ATTR):
        return "Fp8LinearMethod.apply"
    if not _signature_matches(cur_apply):
        return "FP8 linear layers left to vLLM: Fp8LinearMethod.apply has an unexpected signature"
    cls.apply, cls.process_weights_after_loading = _make_fp8_wrappers(cls, block_cls, e8m0, cur_apply, cur_pwal)
    return "Fp8LinearMethod.apply"


def _uninstall_fp8() -> None:
    cls, _, _, _ = _fp8_target()
    if cls is None:
        return
    for name in ("apply", "process_weights_after_loading"):
        current = cls.__dict__.get(name)
        if current is not None and hasattr(current, _PATCH_ATTR):
            setattr(cls, name, getattr(current, _PATCH_ATTR))
    from ..ops import linear as linear_op

    with _lock:
        for key in list(_fp8_layers):
            linear_op.unregister_fp8_fallback(key)
        _fp8_layers.clear()


def fp8_installed() -> bool:
    cls, _, _, _ = _fp8_target()
    return cls is not None and hasattr(cls.__dict__.get("apply"), _PATCH_ATTR)


def install() -> tuple[bool, str]:
    """Patches the methods once; returns (installed, message)."""
    targets, gemms, why = _targets()
    if not targets:
        return False, why
    for cls, _ in targets:
        current = cls.__dict__.get("apply")
        if current is None or (not hasattr(current, _PATCH_ATTR) and not _signature_matches(current)):
            return False, f"vllm's {cls.__name__}.apply has an unexpected signature (another vLLM version?)"
    try:
        from ..ops import linear as _op  # noqa: F401  (registers torch.ops.opgraft.linear)
    except Exception as e:
        return False, f"the linear op cannot be loaded ({type(e).__name__}: {e})"
    if all(hasattr(cls.__dict__["apply"], _PATCH_ATTR) for cls, _ in targets):
        return True, "linear seam already installed"
    for cls, mod in targets:
        current = cls.__dict__["apply"]
        if not hasattr(current, _PATCH_ATTR):
            cls.apply = _make_wrapper(cls, mod, gemms, current)
    fp8 = _install_fp8()
    _add_compile_factor()
    return True, f"linear seam installed (UnquantizedLinearMethod.apply, UnquantizedEmbeddingMethod.apply; {fp8})"


def uninstall() -> None:
    targets, _, _ = _targets()
    for cls, _ in targets:
        current = cls.__dict__.get("apply")
        if current is not None and hasattr(current, _PATCH_ATTR):
            cls.apply = getattr(current, _PATCH_ATTR)
    _uninstall_fp8()
    _remove_compile_factor()


def installed() -> bool:
    targets, _, _ = _targets()
    return bool(targets) and all(hasattr(cls.__dict__.get("apply"), _PATCH_ATTR) for cls, _ in targets)
