"""The linear op: torch.nn.functional.linear for decode-sized inputs (1..8 rows) on libopgraft's
kernel, and the custom op `opgraft::linear` that vLLM's traced model calls; and its block-FP8
form (e4m3 weights with fp32 block scales, the activations quantized per row and block of
columns inside the kernel, as vLLM's W8A8 block path quantizes them), behind `opgraft::linear_fp8`.

A plan (the guard's decision, the tunables and the compiled kernel) is made once per layout
(rows, sizes, strides, dtypes, bias or not, device) and kept; a call is one ctypes crossing.

`torch.ops.opgraft.linear(x, weight, bias)` decides at run time, on every eager call (and so at
each CUDA-graph capture, never at a replay): our kernel where the plan says yes, otherwise exactly
`torch.nn.functional.linear(x, weight, bias)`, the call vLLM's unquantized GEMM makes. Under
torch.compile the row count is symbolic when the graph is traced, so the decision cannot be taken
there; the op is opaque to Dynamo and its fake implementation gives the output's shape.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from .. import _lib, dispatch
from . import PlanCache, current_stream, dtype_code, strides
from . import Plan as _Plan

# The kernel's own row limit (OG_LINEAR_MAX_ROWS, src/ops/linear/linear.h): larger calls are
# handed back without building a plan key.
MAX_ROWS = 8
_TOO_MANY = f"rows N > {MAX_ROWS} (kernel limit)"


def linear_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None,
                arch: int = 0, weight_scale: torch.Tensor | None = None, block: tuple[int, int] = (0, 0),
                norm: tuple | None = None) -> _lib.LinearArgs:
    """The C argument struct for these tensors (FP8 weights: with their block scales and the block
    shape; norm: (residual, norm_weight, eps[, residual_out[, normed_out]]) of the add + RMSNorm
    form, residual_out None for the contiguous one the op allocates, normed_out (the normalized
    rows) None for none, True for the contiguous one the op allocates, or a tensor like x); dtype
    -1 when their shapes or devices do not describe one linear call (the guard then refuses it)."""
    a = _lib.LinearArgs()
    a.struct_size = ctypes.sizeof(_lib.LinearArgs)
    if norm is not None:
        residual, norm_weight, eps = norm[:3]
        r_out = norm[3] if len(norm) > 3 else None
        h_out = norm[4] if len(norm) > 4 else None
        if not (residual.shape == x.shape and residual.device == x.device and norm_weight.dim() == 1
                and x.dim() == 2 and norm_weight.shape[0] == x.shape[1] and norm_weight.is_contiguous()
                and norm_weight.device == x.device and (r_out is None or r_out.shape == x.shape)
                and (h_out is None or h_out is True or (h_out.shape == x.shape and h_out.dtype == x.dtype
                                                        and h_out.device == x.device))):
            a.dtype = -1
            return a
        if h_out is True:
            a.normed_out, a.normed_out_stride = 16, (ctypes.c_int64 * 2)(x.shape[1], 1)
        elif h_out is not None:
            a.normed_out, a.normed_out_stride = h_out.data_ptr(), strides(h_out, 2)
        a.norm_dtype = dtype_code(residual) if residual.dtype == norm_weight.dtype else -1
        a.norm_eps = eps
        a.residual, a.residual_stride = residual.data_ptr(), strides(residual, 2)
        a.norm_weight = norm_weight.data_ptr()
        if r_out is not None:
            a.residual_out, a.residual_out_stride = r_out.data_ptr(), strides(r_out, 2)
        else:
            a.residual_out, a.residual_out_stride = 16, (ctypes.c_int64 * 2)(x.shape[1], 1)
    if weight_scale is not None:
        if weight_scale.dim() != 2 or weight_scale.device != x.device:
            a.dtype = -1
            return a
        a.block_n, a.block_k = block
        a.scale_dtype = dtype_code(weight_scale)
        a.weight_scale, a.weight_scale_stride = weight_scale.data_ptr(), strides(weight_scale, 2)
    consistent = (
        x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1] and weight.device == x.device
        and (bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0] and bias.is_contiguous()
                              and bias.device == x.device))
        and (out is None or (tuple(out.shape) == (x.shape[0], weight.shape[0]) and out.device == x.device))
    )
    if not consistent:
        a.dtype = -1
        return a
    a.dtype, a.weight_dtype = dtype_code(x), dtype_code(weight)
    a.bias_dtype = dtype_code(bias) if bias is not None else 0
    a.rows, a.out_features, a.in_features = x.shape[0], weight.shape[0], x.shape[1]
    a.x, a.x_stride = x.data_ptr(), strides(x, 2)
    a.weight, a.weight_stride = weight.data_ptr(), strides(weight, 2)
    a.bias = bias.data_ptr() if bias is not None else None
    if out is not None:
        a.out, a.out_dtype, a.out_stride = out.data_ptr(), dtype_code(out), strides(out, 2)
    else:  # the contiguous output the op allocates, in x's dtype
        a.out, a.out_dtype, a.out_stride = 16, a.dtype, (ctypes.c_int64 * 2)(weight.shape[0], 1)
    a.arch = arch
    return a


class Plan(_Plan):
    __slots__ = ()
    destroy = "opgraft_linear_plan_destroy"


_plans = PlanCache(4096)


def _layout_key(x, weight, bias, out, weight_scale=None, block=(0, 0), norm=None):
    return (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype,
            None if bias is None else (bias.shape, bias.stride(), bias.dtype),
            None if out is None else (out.shape, out.stride(), out.dtype),
            None if weight_scale is None else (weight_scale.shape, weight_scale.stride(), weight_scale.dtype, block),
            None if norm is None else (norm[0].shape, norm[0].stride(), norm[0].dtype, norm[1].shape,
                                       norm[1].stride(), norm[1].dtype, float(norm[2]),
                                       *((t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t
                                         for t in norm[3:])))


def plan_for(x, weight, bias=None, out=None, weight_scale=None, block=(0, 0), norm=None, qk=None) -> Plan:
    """The plan of this call's layout, made on first sight (the guard runs then, and only then).
    qk: (head_size, q_heads, qk_heads, pro) of the q/k epilogue (_qk_args). A kernel that cannot be
    built (no NVRTC, a compile error) gives a plan without a handle whose reason says so, and warns
    once: the calls then go to torch (FP8: to the caller's own path)."""
    key = _layout_key(x, weight, bias, out, weight_scale, block, norm)
    if qk is not None:
        key = (key, _qk_layout(*qk))
    plan = _plans.get(key)
    if plan is not None:
        return plan
    if not x.is_cuda:
        plan = Plan(None, "tensors are not on a CUDA device")
    else:
        a = linear_args(x, weight, bias, out, weight_scale=weight_scale, block=block, norm=norm) if qk is None \
            else _qk_args(x, weight, bias, out, *qk, norm)
        if a.dtype == -1:
            plan = Plan(None, "tensor shapes or devices are not those of one linear call")
        else:
            handle = ctypes.c_void_p()
            reason = ctypes.create_string_buffer(256)
            try:
                with torch.cuda.device(x.device):
                    st = _lib.lib().opgraft_linear_plan_create(ctypes.byref(a), ctypes.byref(handle), reason,
                                                               len(reason))
                if st == _lib.OK:
                    plan = Plan(handle.value, "")
                elif st == _lib.EUNSUPPORTED:
                    plan = Plan(None, reason.value.decode(errors="replace"))
                else:
                    _lib.check(st)
            except _lib.OpgraftError as e:
                dispatch._warn_once(f"opgraft linear kernel unavailable, handing calls back to torch: {e}")
                plan = Plan(None, f"kernel error: {_lib.lib().opgraft_status_name(e.status).decode()}")
    return _plans.put(key, plan)


def forget_plans() -> None:
    """Drops every plan (they are re-made, with the tunables as they are now, at the next call)."""
    _plans.clear()


def linear_supports(x, weight, bias=None) -> tuple[bool, str]:
    """(True, "") if the kernel takes the call, else (False, reason)."""
    if x.dim() == 2 and x.shape[0] > MAX_ROWS:
        return False, f"rows {x.shape[0]} > {MAX_ROWS} (kernel limit)"
    plan = plan_for(x, weight, bias)
    if plan.handle is not None and not _aligned(x, weight, bias):
        return False, _MISALIGNED
    return plan.handle is not None, plan.reason


_MISALIGNED = "x or weight not 16-byte aligned, or bias misaligned"


def _aligned(x, weight, bias, out=None) -> bool:
    return not ((x.data_ptr() | weight.data_ptr()) & 15 or (bias is not None and bias.data_ptr() & 1)
                or (out is not None and out.data_ptr() & 1))


def _run(plan: Plan, x, weight, bias, out) -> int:
    return _lib.lib().opgraft_linear_plan_run(plan.handle, x.data_ptr(), weight.data_ptr(),
                                              None if bias is None else bias.data_ptr(), out.data_ptr(),
                                              current_stream(x.device))


def _into(out, plan, aligned, misaligned, run):
    """Runs the kernel of plan() into out, or raises OpgraftError saying why it cannot."""
    for _ in range(2):
        p = plan()
        if p.handle is None:
            raise _lib.OpgraftError(_lib.EUNSUPPORTED, p.reason)
        if not aligned():
            raise _lib.OpgraftError(_lib.EUNSUPPORTED, misaligned)
        st = run(p, out)
        if st != _lib.ESTALE:
            _lib.check(st)
            return out
        forget_plans()  # the tunables changed (or the context): plan again, once
    _lib.check(st)
    return out


def linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """Runs the kernel into out ([M, N], x's dtype). Raises OpgraftError if the kernel cannot take
    the call (linear_supports says why)."""
    return _into(out, lambda: plan_for(x, weight, bias, out), lambda: _aligned(x, weight, bias, out), _MISALIGNED,
                 lambda p, o: _run(p, x, weight, bias, o))


def _ours_or_none(x, weight, bias, what, plan, aligned, misaligned, run):
    """The kernel's output where its plan (plan()) takes the call, else None; each decision
    counted in dispatch.stats_of("linear"). Plans again once where the tunables changed."""
    stats = dispatch.stats_of("linear")
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[0] > MAX_ROWS:
        stats.delegate(_TOO_MANY if x.dim() == 2 and x.shape[0] > MAX_ROWS  # every prefill's: no formatting
                       else "no rows" if x.dim() == 2 else f"x has {x.dim()} dimensions")
        return None
    for _ in range(2):
        p = plan()
        if p.handle is None:
            stats.delegate(p.reason)
            return None
        if not aligned():
            stats.delegate(misaligned)
            return None
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        st = run(p, out)
        if st == _lib.OK:
            stats.take()
            return out
        if st != _lib.ESTALE:
            break
        forget_plans()
    name = _lib.lib().opgraft_status_name(st).decode()
    stats.delegate(f"kernel error: {name}")
    dispatch._warn_once(f"opgraft {what} kernel failed, handing calls back: {name}: "
                        f"{_lib.lib().opgraft_last_error().decode(errors='replace')}")
    return None


def linear_or_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Our kernel where it takes the call, else torch.nn.functional.linear (vLLM's call, bit for
    bit). Counts each decision in dispatch.stats_of("linear")."""
    out = _ours_or_none(x, weight, bias, "linear", lambda: plan_for(x, weight, bias),
                        lambda: _aligned(x, weight, bias), _MISALIGNED, lambda p, o: _run(p, x, weight, bias, o))
    return out if out is not None else torch.nn.functional.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x weight^T (+ bias) for 2-D x: our kernel for 1..8 rows where the guard takes the call,
    else torch.nn.functional.linear."""
    if x.dim() != 2:
        raise ValueError(f"opgraft::linear takes a 2-D x, got {x.dim()} dimensions")
    return linear_or_torch(x, weight, bias)


# ---- block-FP8 weights ------------------------------------------------------------------------

def linear_fp8_supports(x, weight, weight_scale, block, bias=None) -> tuple[bool, str]:
    """(True, "") if the FP8 kernel takes the call, else (False, reason)."""
    if x.dim() == 2 and x.shape[0] > MAX_ROWS:
        return False, f"rows {x.shape[0]} > {MAX_ROWS} (kernel limit)"
    plan = plan_for(x, weight, bias, weight_scale=weight_scale, block=tuple(block))
    if plan.handle is not None and not _aligned_fp8(x, weight, weight_scale, bias):
        return False, _MISALIGNED_FP8
    return plan.handle is not None, plan.reason


_MISALIGNED_FP8 = "x or weight not 16-byte aligned, weight_scale or bias misaligned"


def _aligned_fp8(x, weight, weight_scale, bias, out=None) -> bool:
    return _aligned(x, weight, bias, out) and not weight_scale.data_ptr() & 3


def _run_fp8(plan: Plan, x, weight, weight_scale, bias, out) -> int:
    return _lib.lib().opgraft_linear_plan_run_fp8(plan.handle, x.data_ptr(), weight.data_ptr(), weight_scale.data_ptr(),
                                                  None if bias is None else bias.data_ptr(), out.data_ptr(),
                                                  current_stream(x.device))


def linear_fp8_into(out, x, weight, weight_scale, block, bias=None):
    """Runs the FP8 kernel into out ([M, N], x's dtype). Raises OpgraftError if it cannot take the
    call (linear_fp8_supports says why)."""
    block = tuple(block)
    return _into(out, lambda: plan_for(x, weight, bias, out, weight_scale, block),
                 lambda: _aligned_fp8(x, weight, weight_scale, bias, out), _MISALIGNED_FP8,
                 lambda p, o: _run_fp8(p, x, weight, weight_scale, bias, o))


def linear_fp8_or_none(x, weight, weight_scale, block, bias=None):
    """The FP8 kernel's output where it takes the call, else None (the caller runs its own path).
    Counts each decision in dispatch.stats_of("linear")."""
    block = tuple(block)
    return _ours_or_none(x, weight, bias, "FP8 linear",
                         lambda: plan_for(x, weight, bias, weight_scale=weight_scale, block=block),
                         lambda: _aligned_fp8(x, weight, weight_scale, bias), _MISALIGNED_FP8,
                         lambda p, o: _run_fp8(p, x, weight, weight_scale, bias, o))


# The paths calls go to when the FP8 kernel hands them back, by the weight the call is made with
# (the layer's own parameter, an input of the traced graph, so a graph from vLLM's compile cache
# finds it too): fp8_key(weight) -> fn(x, bias) -> the caller's own output. Not by the layer's
# name: a string argument is a constant of the graph, so every layer's piece would be a graph of
# its own and Inductor would compile each (a block-FP8 Qwen3-30B-A3B: 163 s against stock's 15,
# bench/NOTES.md v50); vLLM hoists its own layer names out of its graphs for the same reason.
_fp8_fallbacks: dict = {}
_fp8_lock = threading.Lock()


def fp8_key(weight: torch.Tensor) -> tuple:
    return (weight.device.type, weight.device.index, weight.data_ptr())


def register_fp8_fallback(weight: torch.Tensor, fn) -> tuple:
    key = fp8_key(weight)
    with _fp8_lock:
        _fp8_fallbacks[key] = fn
    return key


def unregister_fp8_fallback(key: tuple) -> None:
    with _fp8_lock:
        _fp8_fallbacks.pop(key, None)


def fp8_fallback(weight: torch.Tensor):
    return _fp8_fallbacks.get(fp8_key(weight))


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               block_n: int, block_k: int) -> torch.Tensor:
    """Our FP8 kernel where it takes the call, else the path registered for the weight."""
    out = linear_fp8_or_none(x, weight, weight_scale, (block_n, block_k), bias)
    if out is not None:
        return out
    fn = fp8_fallback(weight)
    if fn is None:
        raise RuntimeError("opgraft::linear_fp8: no path registered for this weight to hand the call back to "
                           "(its layer was not loaded in this process with opgraft's linear seam installed)")
    return fn(x, bias)


# Registered on the backend keys directly (as vLLM's own direct_register_custom_op does), not with
# torch.library.custom_op: every call of the traced model that has more rows than the kernel takes
# (prefills, mixed batches) pays the op's dispatch, and custom_op's Python autograd and dispatch
# layers cost 2-7 us a call more than this (5 against 7 us under inference_mode, 5 against 12 under
# no_grad, on a CPU, for a call that torch's own linear makes in 3).
_LIB = torch.library.Library("opgraft", "FRAGMENT")


def _define(schema: str, fn) -> None:
    """opgraft::<schema>, with fn as its CUDA and CPU implementation."""
    _LIB.define(schema)
    for key in ("CUDA", "CPU"):
        _LIB.impl(schema.split("(", 1)[0], fn, key)


_define("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", linear)
_define("linear_fp8(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, int block_n, int block_k) -> Tensor",
        linear_fp8)


def schemas() -> str:
    """The schemas of this module's ops: a factor of vLLM's compile-cache key, so that a graph
    traced against one schema is never loaded against another."""
    return "; ".join(str(getattr(torch.ops.opgraft, n).default._schema)
                     for n in ("linear", "linear_fp8", "add_rms_norm_linear", "linear_qk",
                               "add_rms_norm_linear_qk"))


# ---- add + RMSNorm, then the projection ------------------------------------------------------

def add_rms_norm_reference(x, residual, norm_weight, eps):
    """vLLM's fused_add_rms_norm (vllm/ir/ops/layernorm.py, 0.26 and 0.33) in torch: h = x +
    residual in fp32, residual_out = h rounded, then h * rsqrt(mean(h^2) + eps) rounded and
    multiplied by norm_weight. Returns (normed, residual_out)."""
    h = x.float() + residual.float()
    r = h.to(x.dtype)
    n = (h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)).to(norm_weight.dtype) * norm_weight
    return n.to(x.dtype), r


_MISALIGNED_NORM = "x, residual, norm weight or weight not 16-byte aligned, or bias misaligned"


def _aligned_norm(x, residual, norm_weight, weight, bias) -> bool:
    return _aligned(x, weight, bias) and not (residual.data_ptr() | norm_weight.data_ptr()) & 15


def _run_norm(plan: Plan, x, residual, norm_weight, weight, bias, out, residual_out, normed_out=None) -> int:
    return _lib.lib().opgraft_linear_plan_run_norm(
        plan.handle, x.data_ptr(), residual.data_ptr(), norm_weight.data_ptr(), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), residual_out.data_ptr(),
        None if normed_out is None else normed_out.data_ptr(), current_stream(x.device))


def add_rms_norm_linear_into(out, residual_out, x, residual, norm_weight, eps, weight, bias=None, normed_out=None):
    """Runs the add + RMSNorm kernel into out ([M, N]), residual_out ([M, K]) and, where given,
    normed_out ([M, K], the normalized rows). Raises OpgraftError if the kernel cannot take the
    call."""
    norm = (residual, norm_weight, eps, residual_out, normed_out)
    _into(out, lambda: plan_for(x, weight, bias, out, norm=norm),
          lambda: _aligned_norm(x, residual, norm_weight, weight, bias)
          and not (residual_out.data_ptr() | (0 if normed_out is None else normed_out.data_ptr())) & 15,
          _MISALIGNED_NORM,
          lambda p, o: _run_norm(p, x, residual, norm_weight, weight, bias, o, residual_out, normed_out))
    return out, residual_out


def norm_linear_or_none(x, residual, norm_weight, eps, weight, bias=None, normed: bool = False):
    """(out, residual_out) of our kernel where it takes the call, else None; with normed, (out,
    residual_out, normed rows). Counted as the linear op's decisions."""
    outs = []

    def run(p, out):
        outs[:] = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(1 + normed)]
        return _run_norm(p, x, residual, norm_weight, weight, bias, out, *outs)

    norm = (residual, norm_weight, eps, None, True) if normed else (residual, norm_weight, eps)
    out = _ours_or_none(x, weight, bias, "add + RMSNorm linear", lambda: plan_for(x, weight, bias, norm=norm),
                        lambda: _aligned_norm(x, residual, norm_weight, weight, bias), _MISALIGNED_NORM, run)
    return None if out is None else (out, *outs)


# ---- the q/k epilogue: a qkv projection with its query and key heads normalized and rotated ----

def _qk_args(x, weight, bias, out, head_size, q_heads, qk_heads, pro, norm=None) -> _lib.LinearArgs:
    """linear_args with the q/k epilogue's fields (pro: an ops.attention.QKPrologue)."""
    a = linear_args(x, weight, bias, out, norm=norm)
    if a.dtype == -1:
        return a
    a.head_size, a.q_heads, a.qk_heads, a.rope_style = head_size, q_heads, qk_heads, int(pro.rope_style)
    if pro.q_norm_weight is not None:
        a.q_norm_weight, a.k_norm_weight = pro.q_norm_weight.data_ptr(), pro.k_norm_weight.data_ptr()
        a.qk_norm_eps = float(pro.eps)
    if pro.rope_style != _lib.ROPE_NONE:
        cs = pro.cos_sin_cache
        a.cos_sin_cache, a.cos_sin_stride, a.rope_rows = cs.data_ptr(), cs.stride(0), cs.shape[0]
        a.positions = pro.positions.data_ptr()
    return a


def _qk_layout(head_size, q_heads, qk_heads, pro):
    """What of the q/k epilogue a plan depends on (with the call's layout key)."""
    return ("qk", head_size, q_heads, qk_heads, pro.layout())


def linear_qk_into(out, x, weight, bias, head_size: int, q_heads: int, qk_heads: int, pro, norm=None):
    """The projection into out ([M, N], N = heads * head_size: q_heads query heads, then qk_heads -
    q_heads key heads, then value heads), its query and key heads normalized and rotated as pro (an
    ops.attention.QKPrologue: norm weights, eps, rotary cache, positions, style) says, in one
    launch; with norm (residual, norm_weight, eps, residual_out) the add + RMSNorm form. Raises
    OpgraftError where the library refuses the call (the message says why)."""
    qk = (head_size, q_heads, qk_heads, pro)
    return _into(out, lambda: plan_for(x, weight, bias, out, norm=norm, qk=qk),
                 lambda: _aligned(x, weight, bias, out) if norm is None
                 else _aligned_norm(x, norm[0], norm[1], weight, bias) and not norm[3].data_ptr() & 15,
                 _MISALIGNED if norm is None else _MISALIGNED_NORM,
                 lambda p, o: _lib.lib().opgraft_linear_plan_run_args(
                     p.handle, ctypes.byref(_qk_args(x, weight, bias, o, *qk, norm)), current_stream(x.device)))


def qk_reference(q, k, pro, head_size: int):
    """vLLM's q/k RMSNorm (vllm_ir rms_norm: x in fp32 * rsqrt(mean(x^2) + eps), rounded, times the
    weight) and rotary embedding (in fp32 from the normed values, rounded once) of q [T, Hq, D] and
    k [T, Hk, D], in torch: new tensors. The hand-back where our prologue kernel is not available."""
    def one(t, w):
        if w is not None:
            f = t.float()
            t = (f * torch.rsqrt(f.pow(2).mean(dim=-1, keepdim=True) + pro.eps)).to(t.dtype) * w
        if pro.rope_style == _lib.ROPE_NONE:
            return t.clone()
        T, D = t.shape[0], head_size
        pos = pro.positions[:T]
        ok = (pos >= 0) & (pos < pro.cos_sin_cache.shape[0])
        cs = pro.cos_sin_cache[pos.clamp(0, pro.cos_sin_cache.shape[0] - 1)].float()
        cos, sin = cs[:, None, :D // 2], cs[:, None, D // 2:]
        f = t.float()
        if pro.rope_style == _lib.ROPE_NEOX:
            x1, x2 = f[..., :D // 2], f[..., D // 2:]
            r = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = f[..., 0::2], f[..., 1::2]
            r = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.where(ok[:, None, None], r, f).to(t.dtype)

    return one(q, pro.q_norm_weight), one(k, pro.k_norm_weight)


def linear_qk(x, weight, bias, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps: float, head_size: int,
              q_heads: int, kv_heads: int, rope_style: int) -> torch.Tensor:
    """A qkv projection (q_heads query, kv_heads key and kv_heads value heads of head_size) with its
    query and key heads normalized and rotated: our kernel with the q/k epilogue for 1..8 rows where
    it takes the call; otherwise the linear op, then the prologue alone on its q and k (our kernel,
    ABI 13, in place in the projection's output; or qk_reference, and the three parts joined).
    Counted as the linear op's decisions."""
    from .attention import QKPrologue, qk_prologue

    if x.dim() != 2:
        raise ValueError(f"opgraft::linear_qk takes a 2-D x, got {x.dim()} dimensions")
    D, hqk = head_size, q_heads + kv_heads
    pro = QKPrologue(q_norm_weight, k_norm_weight, eps, cos_sin_cache, positions, rope_style)
    stats = dispatch.stats_of("linear_qk")  # the epilogue's decisions; a hand-back's projection counts as linear's
    if x.is_cuda and 1 <= x.shape[0] <= MAX_ROWS:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        try:
            linear_qk_into(out, x, weight, bias, D, q_heads, hqk, pro)
            stats.take()
            return out
        except _lib.OpgraftError as e:
            stats.delegate(str(e))
    else:
        stats.delegate(_TOO_MANY if x.shape[0] > MAX_ROWS else "no rows" if x.shape[0] < 1 else
                       "tensors are not on a CUDA device")
    y = linear_or_torch(x, weight, bias)
    T = y.shape[0]
    q, k = y[:, :q_heads * D].view(T, q_heads, D), y[:, q_heads * D:hqk * D].view(T, kv_heads, D)
    if y.is_cuda:
        try:
            qk_prologue(q, k, pro, in_place=True)  # y is this call's own: no copy of q|k|v
            return y
        except _lib.OpgraftError:
            pass
    qn, kn = qk_reference(q, k, pro, D)
    return torch.cat((qn.reshape(T, -1), kn.reshape(T, -1), y[:, hqk * D:]), dim=-1)


_define("linear_qk(Tensor x, Tensor weight, Tensor? bias, Tensor? positions, Tensor? cos_sin_cache, "
        "Tensor? q_norm_weight, Tensor? k_norm_weight, float eps, int head_size, int q_heads, int kv_heads, "
        "int rope_style) -> Tensor", linear_qk)


@torch.library.register_fake("opgraft::linear_qk")
def _(x, weight, bias, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, head_size, q_heads, kv_heads,
      rope_style):
    if x.dim() != 2:
        raise ValueError(f"opgraft::linear_qk takes a 2-D x, got {x.dim()} dimensions")
    return x.new_empty((x.shape[0], weight.shape[0]))


def add_rms_norm(x, residual, norm_weight, eps):
    """vLLM's own add + RMSNorm where vLLM is loaded (its IR op, whichever implementation vLLM
    selected), else the same function in torch."""
    ir = getattr(torch.ops, "vllm_ir", None)
    op = getattr(ir, "fused_add_rms_norm", None) if ir is not None else None
    if op is not None:
        return op.default(x, residual, norm_weight, eps)
    return add_rms_norm_reference(x, residual, norm_weight, eps)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None):
    """(linear(add_rms_norm(x, residual)), x + residual): vLLM's fused_add_rms_norm followed by the
    projection of its normalized output. Our kernel does both in one launch where it takes the
    call; otherwise vLLM's add + RMSNorm, then the linear op (our plain kernel or torch's)."""
    if x.dim() != 2:
        raise ValueError(f"opgraft::add_rms_norm_linear takes a 2-D x, got {x.dim()} dimensions")
    out = norm_linear_or_none(x, residual, norm_weight, eps, weight, bias)
    if out is not None:
        return out
    n, r = add_rms_norm(x, residual, norm_weight, eps)
    return linear_or_torch(n, weight, bias), r


_define("add_rms_norm_linear(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor weight, "
        "Tensor? bias=None) -> (Tensor, Tensor)", add_rms_norm_linear)


@torch.library.register_fake("opgraft::add_rms_norm_linear")
def _(x, residual, norm_weight, eps, weight, bias=None):
    if x.dim() != 2:
        raise ValueError(f"opgraft::add_rms_norm_linear takes a 2-D x, got {x.dim()} dimensions")
    return x.new_empty((x.shape[0], weight.shape[0])), x.new_empty(x.shape)


def add_rms_norm_linear_qk(x, residual, norm_weight, eps, weight, bias, positions, cos_sin_cache, q_norm_weight,
                           k_norm_weight, qk_eps, head_size, q_heads, kv_heads, rope_style):
    """(linear_qk(add_rms_norm(x, residual)), x + residual): the add + RMSNorm form of the q/k
    epilogue's projection, one launch where our kernel takes the call; otherwise vLLM's add +
    RMSNorm, then linear_qk."""
    from .attention import QKPrologue

    if x.dim() != 2:
        raise ValueError(f"opgraft::add_rms_norm_linear_qk takes a 2-D x, got {x.dim()} dimensions")
    if x.is_cuda and 1 <= x.shape[0] <= MAX_ROWS:
        out, r_out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device), torch.empty_like(x)
        pro = QKPrologue(q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, rope_style)
        try:
            linear_qk_into(out, x, weight, bias, head_size, q_heads, q_heads + kv_heads, pro,
                           norm=(residual, norm_weight, eps, r_out))
            dispatch.stats_of("linear_qk").take()
            return out, r_out
        except _lib.OpgraftError as e:
            dispatch.stats_of("linear_qk").delegate(str(e))
    n, r = add_rms_norm(x, residual, norm_weight, eps)
    return linear_qk(n, weight, bias, positions, cos_sin_cache, q_norm_weight, k_norm_weight, qk_eps, head_size,
                     q_heads, kv_heads, rope_style), r


_define("add_rms_norm_linear_qk(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor weight, "
        "Tensor? bias, Tensor? positions, Tensor? cos_sin_cache, Tensor? q_norm_weight, Tensor? k_norm_weight, "
        "float qk_eps, int head_size, int q_heads, int kv_heads, int rope_style) -> (Tensor, Tensor)",
        add_rms_norm_linear_qk)


@torch.library.register_fake("opgraft::add_rms_norm_linear_qk")
def _(x, residual, norm_weight, eps, weight, bias, positions, cos_sin_cache, q_norm_weight, k_norm_weight, qk_eps,
      head_size, q_heads, kv_heads, rope_style):
    return x.new_empty((x.shape[0], weight.shape[0])), x.new_empty(x.shape)


@torch.library.register_fake("opgraft::linear_fp8")
def _(x, weight, weight_scale, bias, block_n, block_k):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("opgraft::linear")
def _(x, weight, bias=None):
    if x.dim() != 2:
        raise ValueError(f"opgraft::linear takes a 2-D x, got {x.dim()} dimensions")
    return x.new_empty((x.shape[0], weight.shape[0]))


def linear_reference_cpu(x, weight, bias=None, weight_scale=None, block=(0, 0), norm=None) -> torch.Tensor:
    """The C fp64 oracle on CPU copies of the tensors (FP8 weights: with their block scales; norm:
    the add + RMSNorm form's CPU (residual, norm_weight, eps, residual_out[, normed_out]), those
    written); returns float64 [M, N]."""
    xc, wc = x.detach().cpu(), weight.detach().cpu()
    bc = bias.detach().cpu().contiguous() if bias is not None else None
    sc = weight_scale.detach().cpu() if weight_scale is not None else None
    a = linear_args(xc, wc, bc, weight_scale=sc, block=tuple(block), norm=norm)
    if a.dtype == -1:
        raise ValueError("tensor shapes are not those of one linear call")
    out = torch.empty((xc.shape[0], wc.shape[0]), dtype=torch.float64)
    ptr = ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_double))
    _lib.check(_lib.lib().opgraft_linear_reference(ctypes.byref(a), ptr))
    return out


def add_rms_norm_linear_reference_cpu(x, residual, norm_weight, eps, weight, bias=None, normed=False):
    """The C fp64 oracle of the add + RMSNorm form: (float64 [M, N], residual_out [M, K]), with
    normed also the normalized rows [M, K]."""
    rc, nc = residual.detach().cpu(), norm_weight.detach().cpu().contiguous()
    r_out = torch.empty(x.shape, dtype=x.dtype)
    h_out = torch.empty(x.shape, dtype=x.dtype) if normed else None
    out = linear_reference_cpu(x, weight, bias, norm=(rc, nc, eps, r_out, h_out))
    return (out, r_out, h_out) if normed else (out, r_out)


def linear_fp8_reference_cpu(x, weight, weight_scale, block, bias=None) -> torch.Tensor:
    """The C fp64 oracle of the FP8 form (the activations quantized as the kernel does)."""
    return linear_reference_cpu(x, weight, bias, weight_scale, block)
