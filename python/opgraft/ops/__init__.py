"""The op layer: one module per op (moe, ...) that turns torch tensors into libopgraft calls.

What every op shares is here: dtype codes, strides, the current CUDA stream, plans and their
cache, and the read-ceiling kernel. Only this package and opgraft.bench (which builds tensors to
measure them) import torch.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from .. import _lib

DTYPES = {torch.bfloat16: _lib.DTYPE_BF16, torch.float16: _lib.DTYPE_FP16, torch.float32: _lib.DTYPE_FP32,
          torch.int32: _lib.DTYPE_INT32, torch.int64: _lib.DTYPE_INT64, torch.uint8: _lib.DTYPE_UINT8}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES[torch.float8_e4m3fn] = _lib.DTYPE_FP8_E4M3


def dtype_code(t: torch.Tensor) -> int:
    return DTYPES.get(t.dtype, 0)


def strides(t: torch.Tensor, n: int):
    """t's strides as a ctypes int64[n] (zeros when t does not have n dimensions)."""
    s = list(t.stride()) if t.dim() == n else [0] * n
    return (ctypes.c_int64 * n)(*s)


try:  # the raw stream handle without building a torch.cuda.Stream object (~2 us less a call)
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older or newer torch without the private helper
    _raw_stream = None


def current_stream(device: torch.device) -> int:
    """The current CUDA stream of device, as the integer handle the C ABI takes."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(device).cuda_stream


def stream_read(buf: torch.Tensor, sink: torch.Tensor) -> None:
    """Enqueues one streaming read of buf (the read-ceiling kernel)."""
    _lib.check(_lib.lib().opgraft_stream_read(buf.data_ptr(), buf.numel() * buf.element_size(), sink.data_ptr(), 0,
                                              current_stream(buf.device)))


class Plan:
    """A C plan (or why there is none) for one call layout. Each op's subclass names the C function
    that frees its plans."""

    __slots__ = ("handle", "reason", "workspace_bytes")
    destroy = ""  # opgraft_<op>_plan_destroy

    def __init__(self, handle, reason: str, workspace_bytes: int = 0):
        self.handle, self.reason, self.workspace_bytes = handle, reason, workspace_bytes

    def __del__(self):
        # At interpreter exit the module globals may already be gone: the process frees everything.
        if self.handle and _lib is not None and _lib._lib is not None:
            getattr(_lib._lib, self.destroy)(self.handle)


class PlanCache:
    """An op's plans by layout key. Emptied whole when full: a plan is cheap to make again."""

    def __init__(self, limit: int):
        self._plans: dict = {}
        self._lock = threading.Lock()
        self._limit = limit

    def get(self, key):
        return self._plans.get(key)

    def put(self, key, plan):
        with self._lock:
            if len(self._plans) >= self._limit:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
