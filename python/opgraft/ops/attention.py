"""The paged decode-attention op: one query token per sequence against its paged K/V cache, on
libopgraft's kernel.

Tensors (vLLM's FlashAttention views, any strides the guard takes):
  query        [tokens >= batch, heads, head_size]
  key_cache    [num_blocks, block_size, kv_heads, head_size] (value_cache likewise)
  block_table  int32 [>= batch, max_blocks]
  seq_lens     int32 [batch], contiguous: the batch is its length; 0 marks a padded row
  out          [tokens >= batch, heads, head_size]
  key, value   optional: the call's new keys and values [tokens >= batch, kv_heads, head_size], with
               slot_mapping int64 [rows]: the kernel stores row b's into cache slot slot_mapping[b]
               (vLLM's reshape_and_cache_flash) and attends with them as the row's last key
  pro          optional, with key: a QKPrologue, vLLM's q/k RMSNorm and rotary embedding, which the
               kernel applies to the query and the new key first (the key is stored so)

A plan (the guard's decision, the tunables, the compiled kernel) is made once per layout and kept;
the batch, the lengths and the pointers are each call's, so a call is one ctypes crossing with no
host synchronisation and no allocation (CUDA-graph capturable). The workspace of the split
combine is one zeroed buffer per device, grown only outside CUDA graph capture and never freed
(captured graphs keep its address).
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple

import torch

from .. import _lib
from . import PlanCache, current_stream, dtype_code, strides
from . import Plan as _Plan


class QKPrologue(NamedTuple):
    """vLLM's q/k RMSNorm and rotary embedding of a decode call's query and new key, done by the
    kernel (include/opgraft/attention.h says what it computes). Either part may be absent."""
    q_norm_weight: torch.Tensor | None  # [head_size], the query's dtype
    k_norm_weight: torch.Tensor | None
    eps: float
    cos_sin_cache: torch.Tensor | None  # [rows, head_size]: head_size / 2 cosines, then the sines
    positions: torch.Tensor | None      # int64 [>= batch]
    rope_style: int = _lib.ROPE_NONE    # _lib.ROPE_NEOX (vLLM's is_neox_style) or _lib.ROPE_GPTJ

    def layout(self):
        """What of it a plan depends on."""
        cs = self.cos_sin_cache
        return (None if self.q_norm_weight is None else (self.q_norm_weight.dtype, self.k_norm_weight.dtype,
                                                          float(self.eps)),
                self.rope_style, None if cs is None else (cs.shape, cs.stride(), cs.dtype),
                None if self.positions is None else self.positions.dtype)


def _pro_consistent(pro: QKPrologue | None, query, key, batch, dev) -> bool:
    """No prologue, or one whose tensors fit the call's heads (the guard checks dtypes and strides)."""
    if pro is None:
        return True
    D = query.shape[2]
    weights = (pro.q_norm_weight, pro.k_norm_weight)
    norm_ok = all(w is None for w in weights) or all(
        w is not None and w.dim() == 1 and w.shape[0] == D and w.stride(0) == 1 and w.device == dev for w in weights)
    if pro.rope_style == _lib.ROPE_NONE:
        rope_ok = True
    else:
        cs, pos = pro.cos_sin_cache, pro.positions
        rope_ok = (cs is not None and pos is not None and cs.dim() == 2 and cs.shape[1] == D and cs.stride(1) == 1
                   and pos.dim() == 1 and pos.shape[0] >= batch and (pos.numel() <= 1 or pos.stride(0) == 1)
                   and cs.device == dev and pos.device == dev)
    return key is not None and norm_ok and rope_ok


def _set_prologue(a: _lib.AttentionArgs, pro: QKPrologue) -> None:
    if pro.q_norm_weight is not None:
        a.q_norm_weight, a.k_norm_weight = pro.q_norm_weight.data_ptr(), pro.k_norm_weight.data_ptr()
        same = pro.k_norm_weight.dtype == pro.q_norm_weight.dtype
        a.qk_norm_dtype, a.qk_norm_eps = dtype_code(pro.q_norm_weight) if same else 0, float(pro.eps)
    a.rope_style = int(pro.rope_style)
    if pro.rope_style != _lib.ROPE_NONE:
        cs = pro.cos_sin_cache
        a.cos_sin_cache, a.cos_sin_dtype, a.cos_sin_stride, a.rope_rows = (cs.data_ptr(), dtype_code(cs),
                                                                            cs.stride(0), cs.shape[0])
        a.positions, a.positions_dtype = pro.positions.data_ptr(), dtype_code(pro.positions)


def attention_args(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, out: torch.Tensor | None, scale: float, softcap: float = 0.0,
                   window_left: int = -1, sinks: torch.Tensor | None = None, max_seq_len: int = 0, flags: int = 0,
                   query_len: int = 1, arch: int = 0, key: torch.Tensor | None = None,
                   value: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                   pro: QKPrologue | None = None) -> _lib.AttentionArgs:
    """The C argument struct for these tensors; dtype -1 when their shapes or devices do not
    describe a paged decode-attention call (the guard then refuses it)."""
    a = _lib.AttentionArgs()
    a.struct_size = ctypes.sizeof(_lib.AttentionArgs)
    a.dtype = dtype_code(query) if out is None or out.dtype == query.dtype else 0
    a.kv_dtype = dtype_code(key_cache) if key_cache.dtype == value_cache.dtype else 0
    a.flags, a.query_len = flags, query_len
    dev = query.device
    consistent = (
        query.dim() == 3 and key_cache.dim() == 4 and value_cache.shape == key_cache.shape
        and block_table.dim() == 2 and seq_lens.dim() == 1
        and (seq_lens.numel() <= 1 or seq_lens.stride(0) == 1)
        and query.shape[0] >= seq_lens.shape[0] and block_table.shape[0] >= seq_lens.shape[0]
        and key_cache.shape[3] == query.shape[2] and key_cache.shape[2] >= 1
        and (out is None or (out.dim() == 3 and out.shape[0] >= seq_lens.shape[0] and out.shape[1:] == query.shape[1:]))
        and all(t.device == dev for t in (key_cache, value_cache, block_table, seq_lens))
        and (out is None or out.device == dev)
        and (sinks is None or (sinks.dim() == 1 and sinks.shape[0] == query.shape[1] and sinks.is_contiguous()
                               and sinks.device == dev))
        and _new_consistent(key, value, slot_mapping, key_cache, seq_lens.shape[0], dev)
        and _pro_consistent(pro, query, key, seq_lens.shape[0], dev)
    )
    if not consistent:
        a.dtype = -1
        return a
    a.batch = seq_lens.shape[0]
    a.num_heads, a.head_size = query.shape[1], query.shape[2]
    a.num_blocks, a.block_size, a.num_kv_heads = key_cache.shape[0], key_cache.shape[1], key_cache.shape[2]
    a.max_blocks = block_table.shape[1]
    a.scale, a.softcap, a.window_left = float(scale), float(softcap or 0.0), int(window_left)
    a.q, a.q_stride = query.data_ptr(), strides(query, 3)
    a.k_cache, a.k_stride = key_cache.data_ptr(), strides(key_cache, 4)
    a.v_cache, a.v_stride = value_cache.data_ptr(), strides(value_cache, 4)
    a.block_table, a.block_table_dtype = block_table.data_ptr(), dtype_code(block_table)
    a.block_table_stride = strides(block_table, 2)
    a.seq_lens, a.seq_lens_dtype = seq_lens.data_ptr(), dtype_code(seq_lens)
    if sinks is not None:
        a.sinks, a.sinks_dtype = sinks.data_ptr(), dtype_code(sinks)
    if out is not None:
        a.out, a.out_stride = out.data_ptr(), strides(out, 3)
    else:  # a contiguous output the op allocates
        a.out, a.out_stride = 16, (ctypes.c_int64 * 3)(query.shape[1] * query.shape[2], query.shape[2], 1)
    a.max_seq_len = max(0, int(max_seq_len))
    a.arch = arch
    if key is not None:
        a.k_new, a.k_new_stride = key.data_ptr(), (ctypes.c_int64 * 2)(*key.stride()[:2])
        a.v_new, a.v_new_stride = value.data_ptr(), (ctypes.c_int64 * 2)(*value.stride()[:2])
        a.slot_mapping, a.slot_mapping_dtype = slot_mapping.data_ptr(), dtype_code(slot_mapping)
        a.slot_count = slot_mapping.shape[0]
    if pro is not None:
        _set_prologue(a, pro)
    return a


def _new_consistent(key, value, slot_mapping, key_cache, batch, dev) -> bool:
    """No new keys, or new keys and values shaped as the cache's rows with a 1-D slot mapping."""
    if key is None and value is None and slot_mapping is None:
        return True
    return (key is not None and value is not None and slot_mapping is not None
            and key.dim() == 3 and value.shape == key.shape and key.shape[1:] == key_cache.shape[2:]
            and key.shape[0] >= batch and key.stride(2) == 1 and value.stride(2) == 1
            and key.dtype == key_cache.dtype and value.dtype == key_cache.dtype
            and slot_mapping.dim() == 1 and (slot_mapping.numel() <= 1 or slot_mapping.stride(0) == 1)
            and all(t.device == dev for t in (key, value, slot_mapping)))


class Plan(_Plan):
    """args: with a prologue, the argument struct the plan was made from (its layout is the
    plan's): a run copies it and sets the call's pointers (opgraft_attention_plan_run_args)."""
    __slots__ = ("args",)
    destroy = "opgraft_attention_plan_destroy"

    def __init__(self, handle, reason: str, workspace_bytes: int = 0, args=None):
        super().__init__(handle, reason, workspace_bytes)
        self.args = args


_plans = PlanCache(1024)


def _layout_key(query, key_cache, value_cache, block_table, seq_lens, out, scale, softcap, window_left, sinks, flags,
                query_len, key=None, value=None, slot_mapping=None, pro=None):
    # The batch is part of a plan (its guard limit and tuned rows depend on it); the lengths are not.
    return (seq_lens.shape[0], query.shape[1:], query.stride(), query.dtype, query.device, key_cache.shape,
            key_cache.stride(), key_cache.dtype, value_cache.shape, value_cache.stride(), value_cache.dtype,
            block_table.shape[1:], block_table.stride(), block_table.dtype, seq_lens.dtype, None if out is None else (out.stride(), out.dtype),
            float(scale), float(softcap or 0.0), int(window_left),
            None if sinks is None else (sinks.shape, sinks.dtype), flags, query_len,
            None if key is None else (key.shape[1:], key.stride(), key.dtype, value.shape[1:], value.stride(),
                                      value.dtype, slot_mapping.dtype, slot_mapping.dim()),
            None if pro is None else pro.layout())


def _capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:  # pragma: no cover - a torch without CUDA
        return False


# The static configurations prepare() compiled and loaded the kernel for (with the tunables of
# that time): a plan of one of them can be made under CUDA graph capture, as it loads nothing.
_prepared: set = set()


# The kernel's batch limit (OG_ATTN_MAX_BATCH, src/ops/attention/attention.h: the grid's z).
MAX_BATCH = 65535


def _static_key(a: _lib.AttentionArgs, device_index: int):
    return (device_index, a.batch, a.flags, a.dtype, a.num_heads // max(1, a.num_kv_heads), a.head_size, a.softcap > 0,
            a.window_left >= 0, a.sinks_dtype if a.sinks else None, bool(a.k_new), bool(a.q_norm_weight), a.rope_style,
            _lib.lib().opgraft_tune_generation())


def plan_for(query, key_cache, value_cache, block_table, seq_lens, out=None, scale=1.0, softcap=0.0, window_left=-1,
             sinks=None, flags=0, query_len=1, key=None, value=None, slot_mapping=None, pro=None) -> Plan:
    """The plan of this call's layout, made on first sight (the guard runs then, and only then).
    Under CUDA graph capture a plan is made only where prepare() already loaded its kernel
    (compiling and loading one then could break the capture); otherwise the call is refused for
    now and planned at the next call outside a capture."""
    lkey = _layout_key(query, key_cache, value_cache, block_table, seq_lens, out, scale, softcap, window_left, sinks,
                       flags, query_len, key, value, slot_mapping, pro)
    plan = _plans.get(lkey)
    if plan is not None:
        return plan
    if not query.is_cuda:
        plan = Plan(None, "tensors are not on a CUDA device")
    else:
        a = attention_args(query, key_cache, value_cache, block_table, seq_lens, out, scale, softcap, window_left,
                           sinks, 0, flags, query_len, key=key, value=value, slot_mapping=slot_mapping, pro=pro)
        if a.dtype == -1:
            plan = Plan(None, "tensor shapes or devices are not those of paged decode attention")
        else:
            reason = ctypes.create_string_buffer(256)
            st = _lib.lib().opgraft_attention_supports(ctypes.byref(a), reason, len(reason)) if a.batch else _lib.OK
            if st == _lib.EUNSUPPORTED:
                plan = Plan(None, reason.value.decode(errors="replace"))
            elif _capturing() and _static_key(a, _device_index(query.device)) not in _prepared:
                return Plan(None, "kernel not prepared before CUDA graph capture")  # not kept
            else:
                handle = ctypes.c_void_p()
                with torch.cuda.device(query.device):
                    st = _lib.lib().opgraft_attention_plan_create(ctypes.byref(a), ctypes.byref(handle), reason,
                                                                  len(reason))
                if st == _lib.OK:
                    plan = Plan(handle.value, "", _lib.lib().opgraft_attention_plan_workspace_size(handle.value),
                                None if pro is None else a)
                    reserve_workspace(query.device, plan.workspace_bytes)
                elif st == _lib.EUNSUPPORTED:
                    plan = Plan(None, reason.value.decode(errors="replace"))
                else:
                    _lib.check(st)
    return _plans.put(lkey, plan)


def forget_plans() -> None:
    """Drops every plan (they are re-made, with the tunables as they are now, at the next call)."""
    _plans.clear()


# ---- the split combine's workspace: one zeroed buffer per device ----------------------------

_workspaces: dict = {}  # device index -> uint8 tensor
_retired: list = []  # smaller buffers a captured graph may still use: kept alive
_ws_lock = threading.Lock()


def _device_index(device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def reserve_workspace(device, nbytes: int) -> None:
    """Makes the device's workspace at least nbytes (zeroed). Outside CUDA graph capture only."""
    idx = _device_index(device)
    ws = _workspaces.get(idx)
    if nbytes <= 0 or (ws is not None and ws.numel() >= nbytes):
        return
    if _capturing():
        raise _lib.OpgraftError(_lib.EUNSUPPORTED, "the attention workspace would be allocated under CUDA graph capture")
    with _ws_lock:
        ws = _workspaces.get(idx)
        if ws is None or ws.numel() < nbytes:
            if ws is not None:
                _retired.append(ws)
            _workspaces[idx] = torch.zeros(nbytes, dtype=torch.uint8, device=torch.device("cuda", idx))


def workspace(device, nbytes: int) -> torch.Tensor | None:
    """The device's workspace if it has nbytes (None when nbytes is 0)."""
    if nbytes <= 0:
        return None
    ws = _workspaces.get(_device_index(device))
    if ws is None or ws.numel() < nbytes:
        reserve_workspace(device, nbytes)
        ws = _workspaces[_device_index(device)]
    return ws


def prepare(num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, device, softcap: float = 0.0,
            window_left: int = -1, sinks_dtype: torch.dtype | None = None, block_size: int = 16,
            batches=(1,), update: bool = False, qk_norm: bool = False,
            rope_style: int = _lib.ROPE_NONE, flags: int = 0) -> tuple[bool, str]:
    """Compiles and loads the kernel for a layer's static configuration at each of batches (the
    CUDA-graph capture sizes: a plan is per batch) and reserves the workspace, so that a call under
    CUDA graph capture only makes its plan. update: the variant that writes the call's new keys
    and values; qk_norm, rope_style: with update, the variant that normalizes and rotates the query
    and the new key first; flags: the calls' hints (_lib.ATTN_AFTER_QKV). (True, "") or (False, why
    the layer's calls will be handed back), from batch 1; a larger batch the guard refuses is simply
    not prepared."""
    ok, why = True, ""
    for b in sorted({1, *batches}):
        took, reason = _prepare_one(num_heads, num_kv_heads, head_size, dtype, device, softcap, window_left,
                                    sinks_dtype, block_size, b, update=update, qk_norm=qk_norm, rope_style=rope_style,
                                    flags=flags)
        if b == 1:
            ok, why = took, reason
            if not ok:
                break
    return ok, why


def _prepare_one(num_heads, num_kv_heads, head_size, dtype, device, softcap, window_left, sinks_dtype, block_size,
                 batch, update=False, qk_norm=False, rope_style=_lib.ROPE_NONE, flags=0) -> tuple[bool, str]:
    code = {torch.bfloat16: _lib.DTYPE_BF16, torch.float16: _lib.DTYPE_FP16}.get(dtype)
    if code is None:
        return False, f"dtype {dtype} (the kernel takes bf16 and fp16)"
    a = _lib.AttentionArgs()
    a.struct_size = ctypes.sizeof(_lib.AttentionArgs)
    a.dtype = a.kv_dtype = code
    a.flags = flags
    a.batch, a.query_len, a.num_heads, a.num_kv_heads, a.head_size = batch, 1, num_heads, num_kv_heads, head_size
    a.block_size, a.num_blocks, a.max_blocks = block_size, 1, 1
    a.scale, a.softcap, a.window_left = 1.0, float(softcap or 0.0), int(window_left)
    fake = 1 << 20  # never dereferenced: a plan keeps no pointers
    a.q = a.k_cache = a.v_cache = a.block_table = a.seq_lens = a.out = fake
    a.q_stride[:] = a.out_stride[:] = [num_heads * head_size, head_size, 1]
    a.k_stride[:] = a.v_stride[:] = [block_size * num_kv_heads * head_size, num_kv_heads * head_size, head_size, 1]
    a.block_table_dtype = a.seq_lens_dtype = _lib.DTYPE_INT32
    a.block_table_stride[:] = [1, 1]
    if sinks_dtype is not None:
        a.sinks, a.sinks_dtype = fake, {torch.float32: _lib.DTYPE_FP32, torch.bfloat16: _lib.DTYPE_BF16,
                                        torch.float16: _lib.DTYPE_FP16}.get(sinks_dtype, 0)
    if update:
        a.k_new = a.v_new = a.slot_mapping = fake
        a.k_new_stride[:] = a.v_new_stride[:] = [num_kv_heads * head_size, head_size]
        a.slot_mapping_dtype = _lib.DTYPE_INT64
    if qk_norm:
        a.q_norm_weight = a.k_norm_weight = fake
        a.qk_norm_dtype, a.qk_norm_eps = code, 1e-6
    if rope_style != _lib.ROPE_NONE:
        a.rope_style, a.cos_sin_cache, a.positions = rope_style, fake, fake
        a.cos_sin_dtype, a.cos_sin_stride, a.rope_rows, a.positions_dtype = code, head_size, 1, _lib.DTYPE_INT64
    key = _static_key(a, _device_index(device))
    if key in _prepared:  # another layer of the same configuration did it (and reserved the workspace)
        return True, ""
    handle = ctypes.c_void_p()
    reason = ctypes.create_string_buffer(256)
    with torch.cuda.device(device):
        st = _lib.lib().opgraft_attention_plan_create(ctypes.byref(a), ctypes.byref(handle), reason, len(reason))
    if st == _lib.EUNSUPPORTED:
        return False, reason.value.decode(errors="replace")
    _lib.check(st)
    try:
        reserve_workspace(device, _lib.lib().opgraft_attention_plan_workspace_size(handle.value))
    finally:
        _lib.lib().opgraft_attention_plan_destroy(handle.value)
    _prepared.add(key)
    return True, ""


def supports(query, key_cache, value_cache, block_table, seq_lens, out=None, scale=1.0, softcap=0.0, window_left=-1,
             sinks=None, flags=0, query_len=1, key=None, value=None, slot_mapping=None, pro=None) -> tuple[bool, str]:
    """(True, "") if the kernel can take the call, else (False, reason)."""
    plan = plan_for(query, key_cache, value_cache, block_table, seq_lens, out, scale, softcap, window_left, sinks,
                    flags, query_len, key, value, slot_mapping, pro)
    return plan.handle is not None, plan.reason


def attention_decode_into(out, query, key_cache, value_cache, block_table, seq_lens, scale, softcap=0.0,
                          window_left=-1, sinks=None, max_seq_len=0, key=None, value=None, slot_mapping=None,
                          pro=None, flags=0):
    """Runs the kernel into out (rows 0 .. batch-1). Raises OpgraftError if unsupported.
    max_seq_len is an upper bound of seq_lens (0 = unknown): it caps the split count only. With
    key, value and slot_mapping the kernel also stores them into the cache, with pro normalized and
    rotated first, the query too (see the module's text); flags: hints (_lib.ATTN_AFTER_QKV)."""
    plan = plan_for(query, key_cache, value_cache, block_table, seq_lens, out, scale, softcap, window_left, sinks,
                    flags, key=key, value=value, slot_mapping=slot_mapping, pro=pro)
    return run(plan, out, query, key_cache, value_cache, block_table, seq_lens, scale, softcap, window_left, sinks,
               max_seq_len, key, value, slot_mapping, pro, flags)


def run_args(plan_args: _lib.AttentionArgs, query, key_cache, value_cache, block_table, seq_lens, out, sinks,
             max_seq_len, key, value, slot_mapping, pro) -> _lib.AttentionArgs:
    """attention_args of a call whose layout is the plan's, for a few µs rather than tens: a copy of
    the struct the plan was made from with this call's pointers and counts."""
    a = _lib.AttentionArgs.from_buffer_copy(plan_args)
    a.q, a.k_cache, a.v_cache, a.out = query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr()
    a.block_table, a.seq_lens = block_table.data_ptr(), seq_lens.data_ptr()
    a.sinks = None if sinks is None else sinks.data_ptr()
    a.batch, a.max_seq_len = seq_lens.shape[0], max(0, int(max_seq_len))
    a.k_new, a.v_new, a.slot_mapping = key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr()
    a.slot_count = slot_mapping.shape[0]
    _set_prologue(a, pro)
    return a


def run(plan: Plan, out, query, key_cache, value_cache, block_table, seq_lens, scale, softcap=0.0, window_left=-1,
        sinks=None, max_seq_len=0, key=None, value=None, slot_mapping=None, pro=None, flags=0):
    """Runs a plan made for these tensors' layout (plan_for) into out: one ctypes crossing."""
    for _ in range(2):
        if plan.handle is None:
            raise _lib.OpgraftError(_lib.EUNSUPPORTED, plan.reason)
        ws = workspace(query.device, plan.workspace_bytes)
        tail = (block_table.data_ptr(), seq_lens.data_ptr(), None if sinks is None else sinks.data_ptr(),
                out.data_ptr(), None if ws is None else ws.data_ptr(), seq_lens.shape[0], max(0, int(max_seq_len)),
                current_stream(query.device))
        if pro is not None:
            a = run_args(plan.args, query, key_cache, value_cache, block_table, seq_lens, out, sinks, max_seq_len, key,
                         value, slot_mapping, pro)
            st = _lib.lib().opgraft_attention_plan_run_args(plan.handle, ctypes.byref(a), tail[4], tail[7])
        elif key is None:
            st = _lib.lib().opgraft_attention_plan_run(plan.handle, query.data_ptr(), key_cache.data_ptr(),
                                                       value_cache.data_ptr(), *tail)
        else:
            st = _lib.lib().opgraft_attention_plan_run_update(
                plan.handle, query.data_ptr(), key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr(),
                slot_mapping.shape[0], key_cache.data_ptr(), value_cache.data_ptr(), *tail)
        if st != _lib.ESTALE:
            _lib.check(st)
            return out
        forget_plans()  # the tunables changed (or the context): plan again, once
        plan = plan_for(query, key_cache, value_cache, block_table, seq_lens, out, scale, softcap, window_left, sinks,
                        flags, key=key, value=value, slot_mapping=slot_mapping, pro=pro)
    _lib.check(st)
    return out


def qk_prologue(query: torch.Tensor, key: torch.Tensor, pro: QKPrologue,
                in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The prologue alone (the library's opgraft_attention_prologue_run): query [rows, heads, D] and
    key [rows, kv_heads, D] normalized and rotated as the decode kernel does it, row r at position
    pro.positions[r], into new contiguous tensors, or with in_place into query and key themselves
    (returned). For the rows the decode kernel does not take (a prefill's). Raises OpgraftError
    where the library refuses the call (the message says why)."""
    rows, dev = query.shape[0], query.device
    if (query.dim() != 3 or key.dim() != 3 or key.shape[0] != rows or key.shape[2] != query.shape[2]
            or key.dtype != query.dtype or key.device != dev or not _pro_consistent(pro, query, key, rows, dev)):
        raise _lib.OpgraftError(_lib.EINVAL, "query, key and prologue tensors do not describe one call")
    if not query.is_cuda:
        raise _lib.OpgraftError(_lib.EUNSUPPORTED, "tensors are not on a CUDA device")
    if key.stride(2) != 1:  # the struct has no key dims' stride; the guard checks the query's
        raise _lib.OpgraftError(_lib.EUNSUPPORTED, "a key head's dims are not contiguous")
    if in_place:
        q_out, k_out = query, key
    else:
        q_out, k_out = torch.empty_like(query, memory_format=torch.contiguous_format), torch.empty_like(
            key, memory_format=torch.contiguous_format)
    a, ko = prologue_args(query, key, q_out, k_out, pro)
    _lib.check(_lib.lib().opgraft_attention_prologue_run(ctypes.byref(a), k_out.data_ptr(), ko, current_stream(dev)))
    return q_out, k_out


def prologue_args(query, key, q_out, k_out, pro: QKPrologue):
    """The library's arguments for the prologue alone of query and key into q_out and k_out: the
    struct, and k_out's strides (int64[2])."""
    a = _lib.AttentionArgs()
    a.struct_size = ctypes.sizeof(_lib.AttentionArgs)
    a.dtype, a.batch = dtype_code(query), query.shape[0]
    a.num_heads, a.num_kv_heads, a.head_size = query.shape[1], key.shape[1], query.shape[2]
    a.q, a.out, a.k_new = query.data_ptr(), q_out.data_ptr(), key.data_ptr()
    a.q_stride, a.out_stride = strides(query, 3), strides(q_out, 3)
    a.k_new_stride[0], a.k_new_stride[1] = key.stride(0), key.stride(1)
    _set_prologue(a, pro)
    return a, (ctypes.c_int64 * 2)(*k_out.stride()[:2])


@torch.library.custom_op("opgraft::paged_decode_attention", mutates_args=())
def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, softcap: float = 0.0,
                           window_left: int = -1, sinks: torch.Tensor | None = None,
                           max_seq_len: int = 0) -> torch.Tensor:
    """Decode attention over a paged cache: [batch, heads, head_size] for the batch's queries."""
    out = torch.empty((seq_lens.shape[0], query.shape[1], query.shape[2]), dtype=query.dtype, device=query.device)
    return attention_decode_into(out, query, key_cache, value_cache, block_table, seq_lens, scale, softcap,
                                 window_left, sinks, max_seq_len)


@paged_decode_attention.register_fake
def _(query, key_cache, value_cache, block_table, seq_lens, scale, softcap=0.0, window_left=-1, sinks=None,
      max_seq_len=0):
    return query.new_empty((seq_lens.shape[0], query.shape[1], query.shape[2]))


def reference_cpu(query, key_cache, value_cache, block_table, seq_lens, scale, softcap=0.0, window_left=-1,
                  sinks=None, key=None, value=None, slot_mapping=None, pro=None) -> torch.Tensor:
    """The C fp64 oracle on CPU copies of the tensors (strides kept); float64 [batch, heads, D].
    With key, value and slot_mapping it stores the new rows into the cache first (normalized and
    rotated with pro), as the kernel does: into the caller's cache where it is on the CPU already."""
    # The copies stay named until the call: the struct holds their addresses, not references.
    cpu = lambda x: None if x is None else x.cpu()
    t = [x.cpu() for x in (query, key_cache, value_cache, block_table, seq_lens)]
    sinks, key, value, slot_mapping = (cpu(x) for x in (sinks, key, value, slot_mapping))
    if pro is not None:
        pro = QKPrologue(*(cpu(x) if isinstance(x, torch.Tensor) else x for x in pro))
    a = attention_args(*t, None, scale, softcap, window_left, sinks, key=key, value=value,
                       slot_mapping=slot_mapping, pro=pro)
    if a.dtype == -1:
        raise _lib.OpgraftError(_lib.EINVAL, "tensor shapes do not describe paged decode attention")
    out = torch.empty((t[4].shape[0], t[0].shape[1], t[0].shape[2]), dtype=torch.float64)
    _lib.check(_lib.lib().opgraft_attention_reference(ctypes.byref(a),
                                                       ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_double))))
    return out
