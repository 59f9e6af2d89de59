"""The op layer: one module per op (moe, ...) that turns torch tensors into libopgraft calls.

What every op shares is here: dtype codes, strides, the current CUDA stream, and the read-ceiling
kernel. Only this package and opgraft.bench (which builds tensors to measure them) import torch.
"""

from __future__ import annotations

import ctypes

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
