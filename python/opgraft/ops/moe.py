"""The MoE experts op: fused_experts after routing, on libopgraft's kernels.

A plan (the guard's decision, the tunables and the compiled kernels) is made once per shape,
dtypes, strides, flags and device, and kept; a call is one ctypes crossing with the pointers and
the stream (plan once, run cheap, as FlashInfer's plan/run).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .. import _lib
from . import DTYPES, PlanCache, current_stream, dtype_code, strides
from . import Plan as _Plan

STAGE_GATE_UP, STAGE_DOWN, STAGE_ALL = 1, 2, 3
OUT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, eq=False)
class Fp8Scales:
    """The scales of a call with FP8 (e4m3fn) weights and activations, as vLLM's TritonExperts has
    them (include/opgraft/moe.h describes the layouts): block_shape (block_n, block_k) for block
    scales, None for one scale per expert matrix and one per-tensor activation scale."""

    # a1q_scale: [T, ceil(H/bk)], or one value; None: the hidden states are 16-bit (the output's
    # dtype) and the kernel quantizes them per token and 1 x bk group as vLLM's block quantization
    # would (per-tensor scales: 1 x 128 groups, finer than vLLM's one dynamic scale)
    hidden_scale: torch.Tensor | None
    w13_scale: torch.Tensor  # [E, 2*ceil(I/bn), ceil(H/bk)], or [E] / [E, 1] / [E, 2]
    w2_scale: torch.Tensor  # [E, ceil(H/bn), ceil(I/bk)], or [E] / [E, 1]
    block_shape: tuple | None = None

    def layout_key(self) -> tuple:
        return (self.block_shape,) + tuple(None if t is None else (t.shape, t.stride(), t.dtype) for t in
                                           (self.hidden_scale, self.w13_scale, self.w2_scale))

    def tensors(self) -> tuple:
        return tuple(t for t in (self.hidden_scale, self.w13_scale, self.w2_scale) if t is not None)

    def cpu(self) -> "Fp8Scales":
        return Fp8Scales(*(None if t is None else t.cpu() for t in (self.hidden_scale, self.w13_scale, self.w2_scale)),
                         self.block_shape)


def _ptr(t) -> int | None:
    return None if t is None else t.data_ptr()


def _fp8_hidden_ok(hidden, fp8: Fp8Scales, out_dtype) -> bool:
    """The hidden states of an FP8 call: e4m3 with their scales, or (hidden_scale None) in the
    output's 16-bit dtype."""
    if fp8.hidden_scale is None:
        return hidden.dtype == out_dtype
    return hidden.dtype == torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_fields(a: _lib.MoeArgs, fp8: Fp8Scales, T: int, H: int, I: int, E: int) -> bool:
    """Fills the struct's FP8 fields; False when the scales' shapes are not those of the layout."""
    xs, s13, s2 = fp8.hidden_scale, fp8.w13_scale, fp8.w2_scale
    a.weight_dtype = _lib.DTYPE_FP8_E4M3
    # 16-bit hidden states (no hidden_scale): the kernel quantizes them
    a.hidden_dtype = a.dtype if xs is None else _lib.DTYPE_FP8_E4M3
    same = dtype_code(s13) == dtype_code(s2) and (xs is None or dtype_code(xs) == dtype_code(s13))
    a.scale_dtype = dtype_code(s13) if same else 0
    a.hidden_scale, a.w13_scale, a.w2_scale = _ptr(xs), s13.data_ptr(), s2.data_ptr()
    if fp8.block_shape is not None:
        bn, bk = (int(v) for v in fp8.block_shape)
        a.scale_layout, a.block_n, a.block_k = _lib.SCALE_BLOCK, bn, bk
        if bn < 1 or bk < 1:
            return False
        ok = ((xs is None or tuple(xs.shape) == (T, _cdiv(H, bk)))
              and tuple(s13.shape) == (E, 2 * _cdiv(I, bn), _cdiv(H, bk)) and tuple(s2.shape) == (E, _cdiv(H, bn), _cdiv(I, bk)))
        if xs is not None:
            a.hidden_scale_stride = strides(xs, 2)
        a.w13_scale_stride, a.w2_scale_stride = strides(s13, 3), strides(s2, 3)
        return ok
    a.scale_layout = _lib.SCALE_TENSOR
    if (xs is not None and xs.numel() != 1) or s13.shape[:1] != (E,) or s2.shape[:1] != (E,):
        return False
    halves = s13.numel() // E
    if s13.numel() != E * halves or halves not in (1, 2) or s2.numel() != E:
        return False
    # [E]: one scale an expert (the half's stride 0); [E, 2]: one a half.
    a.w13_scale_stride = (ctypes.c_int64 * 3)(s13.stride(0), s13.stride(1) if halves == 2 else 0, 0)
    a.w2_scale_stride = (ctypes.c_int64 * 3)(s2.stride(0), 0, 0)
    return True


def _dims(hidden, w13, w2) -> tuple[int, int, int, int]:
    """(T, H, E, I) of a call, -1 where a tensor is not of the rank fused_experts has."""
    T = hidden.shape[0] if hidden.dim() == 2 else -1
    H = hidden.shape[1] if hidden.dim() == 2 else -1
    E = w13.shape[0] if w13.dim() == 3 else -1
    I = w2.shape[2] if w2.dim() == 3 else -1
    return T, H, E, I


def _weights_consistent(hidden, w13, w2, out, dims) -> bool:
    T, H, E, I = dims
    return (w13.dim() == 3 and w2.dim() == 3 and tuple(w13.shape[1:]) == (2 * I, H) and tuple(w2.shape) == (E, H, I)
            and (out is None or (tuple(out.shape) == (T, H) and out.device == hidden.device))
            and w13.device == hidden.device and w2.device == hidden.device)


def _fill_tensors(a: _lib.MoeArgs, hidden, w13, w2, out, k: int, dims, arch: int) -> None:
    """The sizes, the hidden states', weights' and output's fields (out None: a contiguous output
    the caller allocates later) and the arch."""
    T, H, E, I = dims
    a.num_tokens, a.hidden, a.inter, a.num_experts, a.top_k = T, H, I, E, k
    a.hidden_states, a.hidden_states_stride = hidden.data_ptr(), strides(hidden, 2)
    a.w13, a.w13_stride = w13.data_ptr(), strides(w13, 3)
    a.w2, a.w2_stride = w2.data_ptr(), strides(w2, 3)
    if out is not None:
        a.out, a.out_stride = out.data_ptr(), strides(out, 2)
    else:  # a contiguous output the op allocates
        a.out, a.out_stride = 16, (ctypes.c_int64 * 2)(H, 1)
    a.arch = arch


def moe_args(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, out: torch.Tensor | None = None, apply_router_weight_on_input: bool = False,
             expert_map: torch.Tensor | None = None, activation: str = "silu", arch: int = 0,
             fp8: Fp8Scales | None = None, out_dtype: torch.dtype | None = None) -> _lib.MoeArgs:
    """The C argument struct for these tensors; dtype -1 when the shapes or devices are not those
    of fused_experts (the guard then refuses the call). With fp8 the weights and hidden states are
    e4m3 and dtype is the output's (out's, else out_dtype)."""
    a = _lib.MoeArgs()
    a.struct_size = ctypes.sizeof(_lib.MoeArgs)
    wdt = dtype_code(w13)
    if fp8 is None:
        a.dtype = dtype_code(hidden) if dtype_code(hidden) == wdt == dtype_code(w2) else 0
    else:
        odt = out.dtype if out is not None else out_dtype
        a.dtype = DTYPES[odt] if odt in OUT_DTYPES else 0
        if not (wdt == dtype_code(w2) == _lib.DTYPE_FP8_E4M3 and _fp8_hidden_ok(hidden, fp8, odt)):
            a.dtype = 0
    a.activation = {"silu": _lib.ACT_SILU, "gelu": _lib.ACT_GELU}.get(activation, 0)
    a.apply_router_weight_on_input = int(bool(apply_router_weight_on_input))
    dims = T, H, E, I = _dims(hidden, w13, w2)
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else -1
    consistent = (
        _weights_consistent(hidden, w13, w2, out, dims)
        and tuple(topk_ids.shape) == (T, k) and tuple(topk_weights.shape) == (T, k)
        and all(t.device == hidden.device for t in (topk_weights, topk_ids))
        and (expert_map is None or (expert_map.dtype == torch.int32 and expert_map.dim() == 1
                                    and expert_map.is_contiguous() and expert_map.device == hidden.device))
        and (fp8 is None or all(t.device == hidden.device for t in fp8.tensors()))
    )
    if consistent and fp8 is not None:
        consistent = _fp8_fields(a, fp8, T, H, I, E)
    if not consistent:
        a.dtype = -1
        return a
    _fill_tensors(a, hidden, w13, w2, out, k, dims, arch)
    a.topk_weights, a.topk_weights_dtype = topk_weights.data_ptr(), dtype_code(topk_weights)
    a.topk_weights_stride = strides(topk_weights, 2)
    a.topk_ids, a.topk_ids_dtype = topk_ids.data_ptr(), dtype_code(topk_ids)
    a.topk_ids_stride = strides(topk_ids, 2)
    if expert_map is not None:  # vLLM's expert parallelism: global id -> local id or -1
        a.expert_map, a.expert_map_len = expert_map.data_ptr(), expert_map.numel()
    return a


# The kernels' token limit (OG_MOE_MAX_TOKENS, src/ops/moe/moe.h): the seam hands larger calls (a
# prefill's) back before it builds anything.
MAX_TOKENS = 64


class Plan(_Plan):
    __slots__ = ()
    destroy = "opgraft_moe_plan_destroy"


_plans = PlanCache(1024)


def _layout_key(hidden, w13, w2, topk_weights, topk_ids, out, on_input, expert_map, activation, fp8=None,
                out_dtype=None):
    return (hidden.shape, hidden.stride(), hidden.dtype, hidden.device, w13.shape, w13.stride(), w13.dtype,
            w2.shape, w2.stride(), w2.dtype, topk_weights.shape, topk_weights.stride(), topk_weights.dtype,
            topk_ids.shape, topk_ids.stride(), topk_ids.dtype, None if out is None else (out.stride(), out.dtype),
            bool(on_input), None if expert_map is None else (expert_map.numel(), expert_map.dtype), activation,
            None if fp8 is None else fp8.layout_key(), out_dtype)


def _create(a: _lib.MoeArgs, device) -> Plan:
    """The library's plan for these arguments, or the guard's reason as a plan without a handle."""
    handle = ctypes.c_void_p()
    reason = ctypes.create_string_buffer(256)
    with torch.cuda.device(device):
        st = _lib.lib().opgraft_moe_plan_create(ctypes.byref(a), ctypes.byref(handle), reason, len(reason))
    if st == _lib.EUNSUPPORTED:
        return Plan(None, reason.value.decode(errors="replace"))
    _lib.check(st)
    return Plan(handle.value, "", _lib.lib().opgraft_moe_plan_workspace_size(handle.value))


def _run_plan(plan: Plan, workspace, device, launch, replan):
    """launch(plan, workspace pointer) -> status, once more with replan() after forget_plans() when
    the plan is stale (the tunables or the context changed). A workspace tensor is used where it is
    contiguous, 16-byte aligned and large enough (no view is made of it); otherwise one comes from
    torch's caching allocator."""
    for _ in range(2):
        if plan.handle is None:
            raise _lib.OpgraftError(_lib.EUNSUPPORTED, plan.reason)
        need = plan.workspace_bytes
        ws = workspace.data_ptr() if workspace is not None else 0
        if (not ws or ws % 16 or workspace.numel() * workspace.element_size() < need
                or not workspace.is_contiguous()):
            ws = torch.empty(max(need, 16), dtype=torch.uint8, device=device).data_ptr()
        st = launch(plan, ws)
        if st != _lib.ESTALE:
            break
        forget_plans()
        plan = replan()
    _lib.check(st)


def plan_for(hidden, w13, w2, topk_weights, topk_ids, out=None, apply_router_weight_on_input=False,
             expert_map=None, activation="silu", fp8: Fp8Scales | None = None, out_dtype=None) -> Plan:
    """The plan of this call's layout, made on first sight (the guard runs then, and only then)."""
    key = _layout_key(hidden, w13, w2, topk_weights, topk_ids, out, apply_router_weight_on_input, expert_map,
                      activation, fp8, out_dtype)
    return _plan_once(key, hidden, lambda: moe_args(hidden, w13, w2, topk_weights, topk_ids, out,
                                                    apply_router_weight_on_input, expert_map, activation, fp8=fp8,
                                                    out_dtype=out_dtype),
                      "tensor shapes or devices are not those of fused_experts" if fp8 is None else
                      "tensor or FP8 scale shapes or devices are not those of vLLM's FP8 fused_experts")


def _plan_once(key, hidden, make_args, refusal: str) -> Plan:
    """The cached plan of key, else one made now from make_args() (refusal: the reason when those
    arguments do not describe a call) and kept."""
    plan = _plans.get(key)
    if plan is not None:
        return plan
    if not hidden.is_cuda:
        plan = Plan(None, "tensors are not on a CUDA device")
    else:
        a = make_args()
        plan = Plan(None, refusal) if a.dtype == -1 else _create(a, hidden.device)
    return _plans.put(key, plan)


def forget_plans() -> None:
    """Drops every plan (they are re-made, with the tunables as they are now, at the next call)."""
    _plans.clear()


def moe_supports(hidden, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False,
                 expert_map=None, activation="silu", fp8: Fp8Scales | None = None,
                 out_dtype=torch.bfloat16) -> tuple[bool, str]:
    """(True, "") if the kernel can take the call, else (False, reason). out_dtype: FP8 calls' output."""
    plan = plan_for(hidden, w13, w2, topk_weights, topk_ids, None, apply_router_weight_on_input, expert_map,
                    activation, fp8, out_dtype if fp8 is not None else None)
    return plan.handle is not None, plan.reason


def moe_experts_into(out, hidden, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False,
                     workspace=None, stages: int = STAGE_ALL, expert_map=None, fp8: Fp8Scales | None = None):
    """Runs the kernel into out ([T, H], the hidden dtype; with fp8, bf16 or fp16). Raises
    OpgraftError if unsupported. stages selects a part of the computation for profiling (the
    output is then incomplete). expert_map (int32 [global experts]) maps topk_ids to the local
    experts of w13/w2 or -1. fp8: the scales of e4m3 weights and hidden states."""
    if stages != STAGE_ALL:
        return _run_stages(out, hidden, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input, workspace,
                           stages, expert_map, fp8)
    plan = plan_for(hidden, w13, w2, topk_weights, topk_ids, out, apply_router_weight_on_input, expert_map, fp8=fp8)
    return run(plan, out, hidden, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input, workspace,
               expert_map, fp8)


def run(plan: Plan, out, hidden, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False,
        workspace=None, expert_map=None, fp8: Fp8Scales | None = None):
    """Runs a plan made for these tensors' layout (plan_for) into out: one ctypes crossing (see
    _run_plan for the workspace)."""
    emap = None if expert_map is None else expert_map.data_ptr()

    def launch(plan, ws):
        if fp8 is None:
            return _lib._lib.opgraft_moe_plan_run(
                plan.handle, hidden.data_ptr(), w13.data_ptr(), w2.data_ptr(), topk_weights.data_ptr(),
                topk_ids.data_ptr(), emap, out.data_ptr(), ws, current_stream(hidden.device))
        return _lib._lib.opgraft_moe_plan_run_fp8(
            plan.handle, hidden.data_ptr(), _ptr(fp8.hidden_scale), w13.data_ptr(),
            fp8.w13_scale.data_ptr(), w2.data_ptr(), fp8.w2_scale.data_ptr(), topk_weights.data_ptr(),
            topk_ids.data_ptr(), emap, out.data_ptr(), ws, current_stream(hidden.device))

    _run_plan(plan, workspace, hidden.device, launch,
              lambda: plan_for(hidden, w13, w2, topk_weights, topk_ids, out, apply_router_weight_on_input,
                               expert_map, fp8=fp8))
    return out


def _run_stages(out, hidden, w13, w2, topk_weights, topk_ids, on_input, workspace, stages, expert_map, fp8=None):
    a = moe_args(hidden, w13, w2, topk_weights, topk_ids, out, on_input, expert_map, fp8=fp8)
    if a.dtype == -1:
        raise _lib.OpgraftError(_lib.EUNSUPPORTED, "tensor shapes or devices are not those of fused_experts")
    n = ctypes.c_size_t()
    _lib.check(_lib.lib().opgraft_moe_workspace_size(ctypes.byref(a), ctypes.byref(n)))
    need = n.value
    if workspace is None or workspace.numel() * workspace.element_size() < need or workspace.data_ptr() % 16:
        workspace = torch.empty(max(need, 16), dtype=torch.uint8, device=hidden.device)
    _lib.check(_lib.lib().opgraft_moe_run_stages(ctypes.byref(a), workspace.data_ptr(), need,
                                                 current_stream(hidden.device), stages))
    return out


@torch.library.custom_op("opgraft::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """fused_experts for decode: SwiGLU experts after routing, summed with the router weights."""
    out = torch.empty((hidden.shape[0], hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
    return moe_experts_into(out, hidden, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input)


@moe_experts.register_fake
def _(hidden, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False):
    return hidden.new_empty((hidden.shape[0], hidden.shape[1]))


@torch.library.custom_op("opgraft::moe_experts_fp8", mutates_args=())
def moe_experts_fp8(hidden: torch.Tensor, hidden_scale: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                    w2: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    block_n: int = 0, block_k: int = 0, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fused_experts with FP8 weights for decode: e4m3 hidden states and weights with their
    scales (block_n x block_k blocks, or block_n = 0 for per-tensor scales), output out_dtype."""
    fp8 = Fp8Scales(hidden_scale, w13_scale, w2_scale, (block_n, block_k) if block_n else None)
    out = torch.empty((hidden.shape[0], hidden.shape[1]), dtype=out_dtype, device=hidden.device)
    return moe_experts_into(out, hidden, w13, w2, topk_weights, topk_ids, fp8=fp8)


@moe_experts_fp8.register_fake
def _(hidden, hidden_scale, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, block_n=0, block_k=0,
      out_dtype=torch.bfloat16):
    return hidden.new_empty((hidden.shape[0], hidden.shape[1]), dtype=out_dtype)


def moe_reference_cpu(hidden, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False,
                      expert_map=None, fp8: Fp8Scales | None = None) -> torch.Tensor:
    """The C fp64 oracle on CPU tensors; returns float64 [T, H]. With fp8: the exact math of the
    quantized model (dequantized e4m3 weights and activations, exact intermediate)."""
    t = [x.cpu() for x in (hidden, w13, w2, topk_weights, topk_ids)]
    emap = expert_map.cpu() if expert_map is not None else None
    if fp8 is not None:
        fp8 = fp8.cpu()
    a = moe_args(*t, None, apply_router_weight_on_input, emap, fp8=fp8, out_dtype=torch.bfloat16)
    out = torch.empty((t[0].shape[0], t[0].shape[1]), dtype=torch.float64)
    ptr = ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_double))
    _lib.check(_lib.lib().opgraft_moe_reference(ctypes.byref(a), ptr))
    return out


# ---- routing inside the kernels: the router's logits in, vLLM's topk_softmax done by the kernels ----


def moe_routed_args(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
                    top_k: int, renormalize: bool, out: torch.Tensor | None = None,
                    topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
                    arch: int = 0, fp8: Fp8Scales | None = None) -> _lib.MoeArgs:
    """The C argument struct of a call routed from router_logits ([T, E], the hidden dtype) by
    softmax top-k (renormalized over the k picked where renormalize); topk_weights (fp32) and
    topk_ids (int32) [T, k], where given, receive the routing. With fp8 the hidden states and
    weights are e4m3 and the logits' dtype is the output's. dtype -1 when shapes or devices are not
    those of such a call."""
    a = _lib.MoeArgs()
    a.struct_size = ctypes.sizeof(_lib.MoeArgs)
    if fp8 is None:
        a.dtype = (dtype_code(hidden) if dtype_code(hidden) == dtype_code(w13) == dtype_code(w2) == dtype_code(router_logits)
                   else 0)
    else:
        ldt = router_logits.dtype
        fp8_in = dtype_code(w13) == dtype_code(w2) == _lib.DTYPE_FP8_E4M3 and _fp8_hidden_ok(hidden, fp8, ldt)
        a.dtype = DTYPES[ldt] if fp8_in and ldt in OUT_DTYPES and (out is None or out.dtype == ldt) else 0
    a.activation = _lib.ACT_SILU
    a.routing = _lib.ROUTING_SOFTMAX_RENORM if renormalize else _lib.ROUTING_SOFTMAX
    dims = T, H, E, I = _dims(hidden, w13, w2)
    k = int(top_k)
    outs = [t for t in (topk_weights, topk_ids) if t is not None]
    consistent = (
        _weights_consistent(hidden, w13, w2, out, dims)
        and tuple(router_logits.shape) == (T, E) and all(tuple(t.shape) == (T, k) for t in outs)
        and all(t.device == hidden.device for t in [router_logits] + outs)
        and (fp8 is None or all(t.device == hidden.device for t in fp8.tensors()))
    )
    if consistent and fp8 is not None:
        consistent = _fp8_fields(a, fp8, T, H, I, E)
    if not consistent:
        a.dtype = -1
        return a
    _fill_tensors(a, hidden, w13, w2, out, k, dims, arch)
    a.router_logits, a.router_logits_stride = router_logits.data_ptr(), strides(router_logits, 2)
    a.topk_weights_dtype = dtype_code(topk_weights) if topk_weights is not None else _lib.DTYPE_FP32
    a.topk_ids_dtype = dtype_code(topk_ids) if topk_ids is not None else _lib.DTYPE_INT32
    a.topk_weights_stride = strides(topk_weights, 2) if topk_weights is not None else (ctypes.c_int64 * 2)(k, 1)
    a.topk_ids_stride = strides(topk_ids, 2) if topk_ids is not None else (ctypes.c_int64 * 2)(k, 1)
    a.topk_weights = topk_weights.data_ptr() if topk_weights is not None else None
    a.topk_ids = topk_ids.data_ptr() if topk_ids is not None else None
    return a


def fp8_activations_like(hidden: torch.Tensor, block_k: int | None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty tensors laid out as vLLM's FP8 quantization of hidden [T, H] lays out its result:
    e4m3 [T, H] and fp32 scales [T, ceil(H / block_k)], or [1] per tensor (block_k None); a plan
    looks at layouts only."""
    T, H = hidden.shape
    device = hidden.device if device is None else device
    return (torch.empty((T, H), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((T, _cdiv(H, block_k)) if block_k is not None else (1,), dtype=torch.float32, device=device))


def _routed_key(hidden, w13, w2, router_logits, top_k, renormalize, out, topk_weights, topk_ids, fp8=None):
    def lay(t):
        return None if t is None else (t.shape, t.stride(), t.dtype)

    return ("routed", hidden.shape, hidden.stride(), hidden.dtype, hidden.device, w13.shape, w13.stride(), w13.dtype,
            w2.shape, w2.stride(), w2.dtype, lay(router_logits), int(top_k), bool(renormalize),
            None if out is None else (out.stride(), out.dtype), lay(topk_weights), lay(topk_ids),
            None if fp8 is None else fp8.layout_key())


def plan_for_routed(hidden, w13, w2, router_logits, top_k, renormalize, out=None, topk_weights=None,
                    topk_ids=None, fp8: Fp8Scales | None = None) -> Plan:
    """The plan of a routed call's layout, made on first sight (the guard runs then)."""
    key = _routed_key(hidden, w13, w2, router_logits, top_k, renormalize, out, topk_weights, topk_ids, fp8)
    return _plan_once(key, hidden, lambda: moe_routed_args(hidden, w13, w2, router_logits, top_k, renormalize, out,
                                                           topk_weights, topk_ids, fp8=fp8),
                      "tensor shapes or devices are not those of a routed MoE call")


def routed_config(hidden, w13, w2, router_logits, top_k, renormalize, fp8: Fp8Scales | None = None,
                  arch: int = 90) -> str:
    """The kernels' configuration of a routed call's layout on arch, as compile options
    ("-DOG_W1=4 ..."); two layouts whose options agree run the same sums in the same order."""
    a = moe_routed_args(hidden, w13, w2, router_logits, top_k, renormalize, arch=arch, fp8=fp8)
    buf = ctypes.create_string_buffer(4096)
    _lib.check(_lib.lib().opgraft_moe_describe(ctypes.byref(a), arch, buf, len(buf)))
    return buf.value.decode()


def run_routed(plan: Plan, out, hidden, w13, w2, router_logits, top_k, renormalize, topk_weights=None,
               topk_ids=None, workspace=None, fp8: Fp8Scales | None = None):
    """Runs a routed plan (plan_for_routed) into out: the kernels route from router_logits and,
    where topk_weights / topk_ids are given, write the routing there."""
    tw = None if topk_weights is None else topk_weights.data_ptr()
    ids = None if topk_ids is None else topk_ids.data_ptr()

    def launch(plan, ws):
        if fp8 is None:
            return _lib._lib.opgraft_moe_plan_run_routed(
                plan.handle, hidden.data_ptr(), w13.data_ptr(), w2.data_ptr(), router_logits.data_ptr(), tw, ids,
                out.data_ptr(), ws, current_stream(hidden.device))
        return _lib._lib.opgraft_moe_plan_run_routed_fp8(
            plan.handle, hidden.data_ptr(), _ptr(fp8.hidden_scale), w13.data_ptr(), fp8.w13_scale.data_ptr(),
            w2.data_ptr(), fp8.w2_scale.data_ptr(), router_logits.data_ptr(), tw, ids, out.data_ptr(), ws,
            current_stream(hidden.device))

    _run_plan(plan, workspace, hidden.device, launch,
              lambda: plan_for_routed(hidden, w13, w2, router_logits, top_k, renormalize, out, topk_weights,
                                      topk_ids, fp8))
    return out


def moe_routed_into(out, hidden, w13, w2, router_logits, top_k: int, renormalize: bool = True,
                    topk_weights=None, topk_ids=None, workspace=None, fp8: Fp8Scales | None = None):
    """The experts with vLLM's softmax top-k routing done by the kernels, into out ([T, H]; with
    fp8, e4m3 hidden states and weights, out in the logits' dtype)."""
    plan = plan_for_routed(hidden, w13, w2, router_logits, top_k, renormalize, out, topk_weights, topk_ids, fp8)
    return run_routed(plan, out, hidden, w13, w2, router_logits, top_k, renormalize, topk_weights, topk_ids,
                      workspace, fp8)


def moe_routed_reference_cpu(hidden, w13, w2, router_logits, top_k: int, renormalize: bool = True,
                             fp8: Fp8Scales | None = None) -> torch.Tensor:
    """The C fp64 oracle of a routed call on CPU tensors; float64 [T, H]."""
    t = [x.cpu() for x in (hidden, w13, w2, router_logits)]
    if fp8 is not None:
        fp8 = fp8.cpu()
    a = moe_routed_args(*t, top_k, renormalize, fp8=fp8)
    out = torch.empty((t[0].shape[0], t[0].shape[1]), dtype=torch.float64)
    _lib.check(_lib.lib().opgraft_moe_reference(ctypes.byref(a), ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_double))))
    return out
