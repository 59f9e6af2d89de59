"""torch-facing MoE experts op: builds the C arguments from tensors and calls libopgraft.

The only module that knows torch. Pointers, shapes, strides and the current CUDA stream cross the
C ABI; no C++ extension is built against torch.
"""

from __future__ import annotations

import ctypes

import torch

from . import _lib

_DTYPES = {torch.bfloat16: _lib.DTYPE_BF16, torch.float16: _lib.DTYPE_FP16, torch.float32: _lib.DTYPE_FP32,
           torch.int32: _lib.DTYPE_INT32, torch.int64: _lib.DTYPE_INT64}


def _dtype_code(t: torch.Tensor) -> int:
    return _DTYPES.get(t.dtype, 0)


def _strides(t: torch.Tensor, n: int):
    s = list(t.stride()) if t.dim() == n else [0] * n
    return (ctypes.c_int64 * n)(*s)


def moe_args(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, out: torch.Tensor | None = None, apply_router_weight_on_input: bool = False,
             expert_map: torch.Tensor | None = None, activation: str = "silu", arch: int = 0) -> _lib.MoeArgs:
    """The C argument struct for these tensors. Shape mismatches are reported by the guard."""
    a = _lib.MoeArgs()
    a.struct_size = ctypes.sizeof(_lib.MoeArgs)
    wdt = _dtype_code(w13)
    a.dtype = _dtype_code(hidden) if _dtype_code(hidden) == wdt == _dtype_code(w2) else 0
    a.activation = {"silu": _lib.ACT_SILU, "gelu": _lib.ACT_GELU}.get(activation, 0)
    a.apply_router_weight_on_input = int(bool(apply_router_weight_on_input))
    T = hidden.shape[0] if hidden.dim() == 2 else -1
    H = hidden.shape[1] if hidden.dim() == 2 else -1
    E = w13.shape[0] if w13.dim() == 3 else -1
    I = w2.shape[2] if w2.dim() == 3 else -1
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else -1
    consistent = (
        w13.dim() == 3 and w2.dim() == 3 and tuple(w13.shape[1:]) == (2 * I, H) and tuple(w2.shape) == (E, H, I)
        and tuple(topk_ids.shape) == (T, k) and tuple(topk_weights.shape) == (T, k)
        and (out is None or tuple(out.shape) == (T, H))
        and all(t.device == hidden.device for t in (w13, w2, topk_weights, topk_ids))
        and (expert_map is None or (expert_map.dtype == torch.int32 and expert_map.dim() == 1
                                    and expert_map.is_contiguous() and expert_map.device == hidden.device))
    )
    if not consistent:
        a.dtype = -1  # the guard refuses with "dtype unknown"; the caller reports shapes
        return a
    a.num_tokens, a.hidden, a.inter, a.num_experts, a.top_k = T, H, I, E, k
    a.hidden_states, a.hidden_states_stride = hidden.data_ptr(), _strides(hidden, 2)
    a.w13, a.w13_stride = w13.data_ptr(), _strides(w13, 3)
    a.w2, a.w2_stride = w2.data_ptr(), _strides(w2, 3)
    a.topk_weights, a.topk_weights_dtype = topk_weights.data_ptr(), _dtype_code(topk_weights)
    a.topk_weights_stride = _strides(topk_weights, 2)
    a.topk_ids, a.topk_ids_dtype = topk_ids.data_ptr(), _dtype_code(topk_ids)
    a.topk_ids_stride = _strides(topk_ids, 2)
    if expert_map is not None:  # vLLM's expert parallelism: global id -> local id or -1
        a.expert_map, a.expert_map_len = expert_map.data_ptr(), expert_map.numel()
    if out is not None:
        a.out, a.out_stride = out.data_ptr(), _strides(out, 2)
    else:  # the op allocates a contiguous output
        a.out, a.out_stride = 16, (ctypes.c_int64 * 2)(H, 1)
    a.arch = arch
    return a


def moe_supports(hidden, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False,
                 expert_map=None, activation="silu") -> tuple[bool, str]:
    """(True, "") if the kernel can take the call, else (False, reason)."""
    if not hidden.is_cuda:
        return False, "tensors are not on a CUDA device"
    a = moe_args(hidden, w13, w2, topk_weights, topk_ids, None, apply_router_weight_on_input, expert_map, activation)
    if a.dtype == -1:
        return False, "tensor shapes or devices are not those of fused_experts"
    reason = ctypes.create_string_buffer(256)
    with torch.cuda.device(hidden.device):
        st = _lib.lib().opgraft_moe_supports(ctypes.byref(a), reason, len(reason))
    return st == _lib.OK, reason.value.decode()


def moe_workspace_bytes(a: _lib.MoeArgs) -> int:
    n = ctypes.c_size_t()
    _lib.check(_lib.lib().opgraft_moe_workspace_size(ctypes.byref(a), ctypes.byref(n)))
    return n.value


STAGE_GATE_UP, STAGE_DOWN, STAGE_ALL = 1, 2, 3


def usable_workspace(t):
    """A caller's scratch tensor as a flat byte view if it is contiguous and 16-byte aligned;
    None otherwise (then the op allocates through torch's caching allocator)."""
    if t is None or not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.data_ptr() % 16:
        return None
    return t.view(-1).view(torch.uint8) if t.numel() else None


def moe_experts_into(out, hidden, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False,
                     workspace=None, stages: int = STAGE_ALL, expert_map=None):
    """Runs the kernel into out ([T, H], the hidden dtype). Raises OpgraftError if unsupported.
    stages selects a part of the computation for profiling (the output is then incomplete).
    expert_map (int32 [global experts]) maps topk_ids to the local experts of w13/w2 or -1."""
    a = moe_args(hidden, w13, w2, topk_weights, topk_ids, out, apply_router_weight_on_input, expert_map)
    if a.dtype == -1:
        raise _lib.OpgraftError(_lib.EUNSUPPORTED, "tensor shapes or devices are not those of fused_experts")
    need = moe_workspace_bytes(a)
    if workspace is None or workspace.numel() * workspace.element_size() < need or workspace.data_ptr() % 16:
        workspace = torch.empty(max(need, 16), dtype=torch.uint8, device=hidden.device)
    stream = torch.cuda.current_stream(hidden.device).cuda_stream
    _lib.check(_lib.lib().opgraft_moe_run_stages(ctypes.byref(a), workspace.data_ptr(), need, stream, stages))
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


def moe_reference_cpu(hidden, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False,
                      expert_map=None) -> torch.Tensor:
    """The C fp64 oracle on CPU tensors; returns float64 [T, H]."""
    t = [x.cpu() for x in (hidden, w13, w2, topk_weights, topk_ids)]
    emap = expert_map.cpu() if expert_map is not None else None
    a = moe_args(*t, None, apply_router_weight_on_input, emap)
    out = torch.empty((t[0].shape[0], t[0].shape[1]), dtype=torch.float64)
    ptr = ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_double))
    _lib.check(_lib.lib().opgraft_moe_reference(ctypes.byref(a), ptr))
    return out


def stream_read(buf: torch.Tensor, sink: torch.Tensor) -> None:
    """Enqueues one streaming read of buf (the read-ceiling kernel)."""
    stream = torch.cuda.current_stream(buf.device).cuda_stream
    _lib.check(_lib.lib().opgraft_stream_read(buf.data_ptr(), buf.numel() * buf.element_size(), sink.data_ptr(), 0,
                                              stream))
