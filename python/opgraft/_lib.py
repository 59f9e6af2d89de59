"""ctypes bindings of libopgraft: the one place that knows the C ABI (include/opgraft/*.h).

The structs here mirror the C ones field by field; tests compare their offsets and sizes with the
layout the library reports (opgraft_abi_layout), so the mirror cannot drift unnoticed."""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
import threading

logger = logging.getLogger("opgraft")

# Status codes, mirrored from OPGRAFT_STATUS_MAP (checked against the library by the tests).
STATUS = {"OK": 0, "EINVAL": -1, "ENOMEM": -2, "ENOLIB": -3, "ECUDA": -4, "ENVRTC": -5, "EUNSUPPORTED": -6,
          "EIO": -7, "EPARSE": -8, "ENOTFOUND": -9, "ENODEV": -10, "ERANGE": -11, "ESTALE": -12}
OK, EINVAL, ENOMEM, ENOLIB, ECUDA, ENVRTC, EUNSUPPORTED = 0, -1, -2, -3, -4, -5, -6
EIO, EPARSE, ENOTFOUND, ENODEV, ERANGE, ESTALE = -7, -8, -9, -10, -11, -12

DTYPE_BF16, DTYPE_FP16, DTYPE_FP32, DTYPE_INT32, DTYPE_INT64, DTYPE_FP8_E4M3, DTYPE_UINT8 = 1, 2, 3, 4, 5, 6, 7
ROPE_NONE, ROPE_NEOX, ROPE_GPTJ = 0, 1, 2  # opgraft_attention_args.rope_style
ACT_SILU, ACT_GELU = 1, 2
# opgraft_moe_scale_layout
SCALE_NONE, SCALE_BLOCK, SCALE_TENSOR = 0, 1, 2
# opgraft_moe_routing
ROUTING_TOPK, ROUTING_SOFTMAX, ROUTING_SOFTMAX_RENORM = 0, 1, 2

_I64_2 = ctypes.c_int64 * 2
_I64_3 = ctypes.c_int64 * 3


class MoeArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("dtype", ctypes.c_int32),
        ("activation", ctypes.c_int32),
        ("apply_router_weight_on_input", ctypes.c_int32),
        ("num_tokens", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("num_experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("hidden_states", ctypes.c_void_p),
        ("hidden_states_stride", _I64_2),
        ("w13", ctypes.c_void_p),
        ("w13_stride", _I64_3),
        ("w2", ctypes.c_void_p),
        ("w2_stride", _I64_3),
        ("topk_weights", ctypes.c_void_p),
        ("topk_weights_dtype", ctypes.c_int32),
        ("topk_weights_stride", _I64_2),
        ("topk_ids", ctypes.c_void_p),
        ("topk_ids_dtype", ctypes.c_int32),
        ("topk_ids_stride", _I64_2),
        ("expert_map", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("out_stride", _I64_2),
        ("arch", ctypes.c_int32),
        ("gpu_name", ctypes.c_char_p),
        ("expert_map_len", ctypes.c_int64),
        # ABI 4: quantized weights (zero for bf16/fp16 weights)
        ("weight_dtype", ctypes.c_int32),
        ("scale_layout", ctypes.c_int32),
        ("block_n", ctypes.c_int32),
        ("block_k", ctypes.c_int32),
        ("scale_dtype", ctypes.c_int32),
        ("hidden_scale", ctypes.c_void_p),
        ("hidden_scale_stride", _I64_2),
        ("w13_scale", ctypes.c_void_p),
        ("w13_scale_stride", _I64_3),
        ("w2_scale", ctypes.c_void_p),
        ("w2_scale_stride", _I64_3),
        ("routing", ctypes.c_int32),
        ("router_logits", ctypes.c_void_p),
        ("router_logits_stride", _I64_2),
        # ABI 9: FP8 weights with 16-bit hidden states the kernel quantizes (dtype), else 0 / e4m3
        ("hidden_dtype", ctypes.c_int32),
    ]


class LinearArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("dtype", ctypes.c_int32),
        ("weight_dtype", ctypes.c_int32),
        ("bias_dtype", ctypes.c_int32),
        ("out_dtype", ctypes.c_int32),
        ("rows", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("x", ctypes.c_void_p),
        ("x_stride", _I64_2),
        ("weight", ctypes.c_void_p),
        ("weight_stride", _I64_2),
        ("bias", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("out_stride", _I64_2),
        ("arch", ctypes.c_int32),
        ("gpu_name", ctypes.c_char_p),
        ("block_n", ctypes.c_int32),
        ("block_k", ctypes.c_int32),
        ("scale_dtype", ctypes.c_int32),
        ("weight_scale", ctypes.c_void_p),
        ("weight_scale_stride", _I64_2),
        ("norm_dtype", ctypes.c_int32),
        ("norm_eps", ctypes.c_float),
        ("residual", ctypes.c_void_p),
        ("residual_stride", _I64_2),
        ("residual_out", ctypes.c_void_p),
        ("residual_out_stride", _I64_2),
        ("norm_weight", ctypes.c_void_p),
        # ABI 12: the add + RMSNorm form's normalized rows, written where set
        ("normed_out", ctypes.c_void_p),
        ("normed_out_stride", _I64_2),
        # ABI 14: the q/k RMSNorm and rotary embedding of a qkv projection's output heads
        ("head_size", ctypes.c_int32),
        ("q_heads", ctypes.c_int32),
        ("qk_heads", ctypes.c_int32),
        ("rope_style", ctypes.c_int32),
        ("qk_norm_eps", ctypes.c_float),
        ("q_norm_weight", ctypes.c_void_p),
        ("k_norm_weight", ctypes.c_void_p),
        ("cos_sin_cache", ctypes.c_void_p),
        ("cos_sin_stride", ctypes.c_int64),
        ("rope_rows", ctypes.c_int64),
        ("positions", ctypes.c_void_p),
    ]


_I64_4 = ctypes.c_int64 * 4
ATTN_MLA, ATTN_ENCODER, ATTN_ALIBI, ATTN_NON_CAUSAL = 1, 2, 4, 8
ATTN_AFTER_QKV = 16  # a launch hint (ABI 14): the qkv projection with the q/k epilogue runs just before


class AttentionArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("dtype", ctypes.c_int32),
        ("kv_dtype", ctypes.c_int32),
        ("flags", ctypes.c_int32),
        ("batch", ctypes.c_int64),
        ("query_len", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_size", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("max_blocks", ctypes.c_int64),
        ("scale", ctypes.c_double),
        ("softcap", ctypes.c_double),
        ("window_left", ctypes.c_int64),
        ("q", ctypes.c_void_p),
        ("q_stride", _I64_3),
        ("k_cache", ctypes.c_void_p),
        ("k_stride", _I64_4),
        ("v_cache", ctypes.c_void_p),
        ("v_stride", _I64_4),
        ("block_table", ctypes.c_void_p),
        ("block_table_dtype", ctypes.c_int32),
        ("block_table_stride", _I64_2),
        ("seq_lens", ctypes.c_void_p),
        ("seq_lens_dtype", ctypes.c_int32),
        ("sinks", ctypes.c_void_p),
        ("sinks_dtype", ctypes.c_int32),
        ("out", ctypes.c_void_p),
        ("out_stride", _I64_3),
        ("max_seq_len", ctypes.c_int64),
        ("arch", ctypes.c_int32),
        ("gpu_name", ctypes.c_char_p),
        ("k_new", ctypes.c_void_p),
        ("k_new_stride", _I64_2),
        ("v_new", ctypes.c_void_p),
        ("v_new_stride", _I64_2),
        ("slot_mapping", ctypes.c_void_p),
        ("slot_mapping_dtype", ctypes.c_int32),
        ("slot_count", ctypes.c_int64),
        # ABI 11: q/k RMSNorm and rotary embedding of the query and the new key
        ("q_norm_weight", ctypes.c_void_p),
        ("k_norm_weight", ctypes.c_void_p),
        ("qk_norm_dtype", ctypes.c_int32),
        ("qk_norm_eps", ctypes.c_double),
        ("rope_style", ctypes.c_int32),
        ("cos_sin_cache", ctypes.c_void_p),
        ("cos_sin_dtype", ctypes.c_int32),
        ("cos_sin_stride", ctypes.c_int64),
        ("rope_rows", ctypes.c_int64),
        ("positions", ctypes.c_void_p),
        ("positions_dtype", ctypes.c_int32),
    ]


class RuntimeInfo(ctypes.Structure):
    _fields_ = [
        ("nvrtc_path", ctypes.c_char * 512),
        ("libcuda_path", ctypes.c_char * 512),
        ("nvrtc_version", ctypes.c_int32),
        ("driver_version", ctypes.c_int32),
        ("nvrtc_error", ctypes.c_char * 256),
        ("libcuda_error", ctypes.c_char * 256),
    ]


class KernelInfo(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * 64),
        ("registers", ctypes.c_int32),
        ("spill_store_bytes", ctypes.c_int32),
        ("spill_load_bytes", ctypes.c_int32),
        ("stack_bytes", ctypes.c_int32),
        ("shared_bytes", ctypes.c_int32),
    ]


class TuneQuery(ctypes.Structure):
    _fields_ = [
        ("key", ctypes.c_char_p),
        ("arch", ctypes.c_int32),
        ("gpu", ctypes.c_char_p),
        ("shape", ctypes.c_char_p),
        ("tokens", ctypes.c_int32),
    ]


# The public structs by their C names, for the layout check.
STRUCTS = {"opgraft_moe_args": MoeArgs, "opgraft_linear_args": LinearArgs, "opgraft_attention_args": AttentionArgs,
           "opgraft_runtime_info": RuntimeInfo, "opgraft_kernel_info": KernelInfo, "opgraft_tune_query": TuneQuery}

_LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_char_p, ctypes.c_void_p)
_P = ctypes.c_void_p

_SIGNATURES = {
    "opgraft_version": (ctypes.c_uint32, []),
    "opgraft_version_string": (ctypes.c_char_p, []),
    "opgraft_strerror": (ctypes.c_char_p, [ctypes.c_int32]),
    "opgraft_status_name": (ctypes.c_char_p, [ctypes.c_int32]),
    "opgraft_last_error": (ctypes.c_char_p, []),
    "opgraft_set_log_callback": (None, [_LOG_FN, ctypes.c_void_p]),
    "opgraft_add_library_dir": (ctypes.c_int32, [ctypes.c_char_p]),
    "opgraft_runtime_query": (ctypes.c_int32, [ctypes.POINTER(RuntimeInfo)]),
    "opgraft_cache_dir": (ctypes.c_int32, [ctypes.c_char_p, ctypes.c_size_t]),
    "opgraft_cache_check": (ctypes.c_int32, [ctypes.c_char_p, ctypes.c_size_t]),
    "opgraft_op_names": (ctypes.POINTER(ctypes.c_char_p), []),
    "opgraft_abi_layout": (ctypes.c_char_p, []),
    "opgraft_tune_space": (ctypes.c_char_p, [ctypes.c_char_p]),
    "opgraft_tune_range": (ctypes.c_int32, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]),
    "opgraft_tune_set": (ctypes.c_int32, [ctypes.c_char_p, ctypes.c_int64]),
    "opgraft_tune_clear": (ctypes.c_int32, [ctypes.c_char_p]),
    "opgraft_tune_generation": (ctypes.c_uint32, []),
    "opgraft_tune_get": (
        ctypes.c_int32,
        [ctypes.POINTER(TuneQuery), ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_size_t],
    ),
    "opgraft_tune_reload": (None, []),
    "opgraft_tune_keys": (ctypes.POINTER(ctypes.c_char_p), []),
    "opgraft_moe_supports": (ctypes.c_int32, [ctypes.POINTER(MoeArgs), ctypes.c_char_p, ctypes.c_size_t]),
    "opgraft_moe_workspace_size": (ctypes.c_int32, [ctypes.POINTER(MoeArgs), ctypes.POINTER(ctypes.c_size_t)]),
    "opgraft_moe_plan_create": (
        ctypes.c_int32, [ctypes.POINTER(MoeArgs), ctypes.POINTER(_P), ctypes.c_char_p, ctypes.c_size_t]),
    "opgraft_moe_plan_destroy": (None, [_P]),
    "opgraft_moe_plan_workspace_size": (ctypes.c_size_t, [_P]),
    "opgraft_moe_plan_run": (ctypes.c_int32, [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
    "opgraft_moe_plan_run_fp8": (ctypes.c_int32, [_P] * 13),
    "opgraft_moe_plan_run_routed": (ctypes.c_int32, [_P] * 10),
    "opgraft_moe_plan_run_routed_fp8": (ctypes.c_int32, [_P] * 13),
    "opgraft_moe_describe": (ctypes.c_int32, [ctypes.POINTER(MoeArgs), ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]),
    "opgraft_moe_run": (
        ctypes.c_int32,
        [ctypes.POINTER(MoeArgs), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
    ),
    "opgraft_moe_run_stages": (
        ctypes.c_int32,
        [ctypes.POINTER(MoeArgs), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint32],
    ),
    "opgraft_moe_reference": (ctypes.c_int32, [ctypes.POINTER(MoeArgs), ctypes.POINTER(ctypes.c_double)]),
    "opgraft_moe_compile_report": (
        ctypes.c_int32,
        [ctypes.POINTER(MoeArgs), ctypes.c_int32, ctypes.POINTER(KernelInfo), ctypes.c_int32,
         ctypes.POINTER(ctypes.c_int32)],
    ),
    "opgraft_linear_supports": (ctypes.c_int32, [ctypes.POINTER(LinearArgs), ctypes.c_char_p, ctypes.c_size_t]),
    "opgraft_linear_plan_create": (
        ctypes.c_int32, [ctypes.POINTER(LinearArgs), ctypes.POINTER(_P), ctypes.c_char_p, ctypes.c_size_t]),
    "opgraft_linear_plan_destroy": (None, [_P]),
    "opgraft_linear_plan_run": (ctypes.c_int32, [_P, _P, _P, _P, _P, _P]),
    "opgraft_linear_plan_run_fp8": (ctypes.c_int32, [_P, _P, _P, _P, _P, _P, _P]),
    "opgraft_linear_plan_run_norm": (ctypes.c_int32, [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
    "opgraft_linear_plan_run_args": (ctypes.c_int32, [_P, ctypes.POINTER(LinearArgs), _P]),
    "opgraft_linear_run": (ctypes.c_int32, [ctypes.POINTER(LinearArgs), ctypes.c_void_p]),
    "opgraft_linear_reference": (ctypes.c_int32, [ctypes.POINTER(LinearArgs), ctypes.POINTER(ctypes.c_double)]),
    "opgraft_linear_compile_report": (
        ctypes.c_int32,
        [ctypes.POINTER(LinearArgs), ctypes.c_int32, ctypes.POINTER(KernelInfo), ctypes.c_int32,
         ctypes.POINTER(ctypes.c_int32)],
    ),
    "opgraft_linear_describe": (
        ctypes.c_int32, [ctypes.POINTER(LinearArgs), ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]),
    "opgraft_attention_supports": (ctypes.c_int32, [ctypes.POINTER(AttentionArgs), ctypes.c_char_p, ctypes.c_size_t]),
    "opgraft_attention_plan_create": (
        ctypes.c_int32, [ctypes.POINTER(AttentionArgs), ctypes.POINTER(_P), ctypes.c_char_p, ctypes.c_size_t]),
    "opgraft_attention_plan_destroy": (None, [_P]),
    "opgraft_attention_plan_workspace_size": (ctypes.c_size_t, [_P]),
    "opgraft_attention_plan_run": (
        ctypes.c_int32, [_P, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, _P]),
    "opgraft_attention_plan_run_update": (
        ctypes.c_int32,
        [_P, _P, _P, _P, _P, ctypes.c_int64, _P, _P, _P, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, _P]),
    "opgraft_attention_plan_run_args": (ctypes.c_int32, [_P, ctypes.POINTER(AttentionArgs), _P, _P]),
    "opgraft_attention_workspace_size": (
        ctypes.c_int32, [ctypes.POINTER(AttentionArgs), ctypes.POINTER(ctypes.c_size_t)]),
    "opgraft_attention_run": (ctypes.c_int32, [ctypes.POINTER(AttentionArgs), _P, ctypes.c_size_t, _P]),
    "opgraft_attention_prologue_run": (
        ctypes.c_int32, [ctypes.POINTER(AttentionArgs), _P, ctypes.POINTER(ctypes.c_int64), _P]),
    "opgraft_attention_reference": (ctypes.c_int32, [ctypes.POINTER(AttentionArgs), ctypes.POINTER(ctypes.c_double)]),
    "opgraft_attention_describe": (
        ctypes.c_int32, [ctypes.POINTER(AttentionArgs), ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]),
    "opgraft_attention_compile_report": (
        ctypes.c_int32,
        [ctypes.POINTER(AttentionArgs), ctypes.c_int32, ctypes.POINTER(KernelInfo), ctypes.c_int32,
         ctypes.POINTER(ctypes.c_int32)],
    ),
    "opgraft_stream_read": (
        ctypes.c_int32,
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p],
    ),
}


class OpgraftError(RuntimeError):
    """A libopgraft call failed; .status holds the C status code."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_log_cb = None


def _candidates() -> list[str]:
    env = os.environ.get("OPGRAFT_LIBRARY")
    if env:  # a file; absolute, so that the loaded library's _name stays its path (compat.tunables_tag)
        return [os.path.abspath(env) if os.sep in env else env]
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "libopgraft.so*")))
    # A source checkout: the library built by `make` / cmake into build/.
    root = os.path.dirname(os.path.dirname(here))
    found += sorted(glob.glob(os.path.join(root, "build", "libopgraft.so*")))
    return found


def nvidia_library_dirs() -> list[str]:
    """Library folders of pip's nvidia-* packages (they carry libnvrtc for torch)."""
    dirs = []
    for entry in sys.path:
        for d in glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib")):
            if glob.glob(os.path.join(d, "libnvrtc.so*")) and d not in dirs:
                dirs.append(d)
    return dirs


def _on_log(level: int, message: bytes, _ud) -> None:
    # The prefix names the source where no handler (or a plain one) prints the bare message.
    text = "opgraft: " + message.decode(errors="replace")
    logger.log(logging.WARNING if level >= 30 else logging.INFO if level >= 20 else logging.DEBUG, "%s", text)


def lib() -> ctypes.CDLL:
    """Loads libopgraft once; raises OpgraftError(ENOLIB) with the places tried."""
    global _lib, _log_cb
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = _candidates()
        errors = []
        handle = None
        for path in tried:
            try:
                handle = ctypes.CDLL(path)
                break
            except (OSError, UnicodeError) as e:  # UnicodeError: a path or message that is not UTF-8
                errors.append(f"{path!r}: {e}")
        if handle is None:
            raise OpgraftError(
                ENOLIB,
                "libopgraft not found (reinstall with `pip install opgraft`, or build it with `make` "
                "in a source checkout, or set OPGRAFT_LIBRARY)" + ("; " + "; ".join(errors) if errors else ""),
            )
        for name, (res, args) in _SIGNATURES.items():
            try:
                fn = getattr(handle, name)
            except AttributeError:  # another library, or a libopgraft older than this package
                raise OpgraftError(ENOLIB, f"{handle._name!r} is not the libopgraft this package needs: it lacks "
                                           f"{name} (rebuild it, reinstall opgraft, or fix OPGRAFT_LIBRARY)") from None
            fn.restype, fn.argtypes = res, args
        for d in nvidia_library_dirs():
            handle.opgraft_add_library_dir(d.encode())
        _log_cb = _LOG_FN(_on_log)
        handle.opgraft_set_log_callback(_log_cb, None)
        _lib = handle
        return handle


def check(status: int) -> None:
    if status != OK:
        l = lib()
        raise OpgraftError(status, f"{l.opgraft_status_name(status).decode()}: {l.opgraft_last_error().decode()}")


def runtime_info() -> dict:
    info = RuntimeInfo()
    lib().opgraft_runtime_query(ctypes.byref(info))
    return {
        "nvrtc_path": info.nvrtc_path.decode(),
        "nvrtc_version": info.nvrtc_version,
        "nvrtc_error": info.nvrtc_error.decode(),
        "libcuda_path": info.libcuda_path.decode(),
        "driver_version": info.driver_version,
        "libcuda_error": info.libcuda_error.decode(),
    }


def cache_dir() -> str:
    buf = ctypes.create_string_buffer(1024)
    check(lib().opgraft_cache_dir(buf, len(buf)))
    return buf.value.decode()


def tune_get(key: str, arch: int = 0, gpu: str | None = None, shape: str | None = None, tokens: int = 0):
    """Returns (value, source) for a tunable key."""
    q = TuneQuery(key.encode(), arch, gpu.encode() if gpu else None, shape.encode() if shape else None, tokens)
    v = ctypes.c_int64()
    src = ctypes.create_string_buffer(1100)
    check(lib().opgraft_tune_get(ctypes.byref(q), ctypes.byref(v), src, len(src)))
    return v.value, src.value.decode()


def _strings(arr) -> list[str]:
    out, i = [], 0
    while arr[i]:
        out.append(arr[i].decode())
        i += 1
    return out


def tune_keys() -> list[str]:
    return _strings(lib().opgraft_tune_keys())


def op_names() -> list[str]:
    """The ops the library registered (their descriptors were valid)."""
    return _strings(lib().opgraft_op_names())


def tune_space(op: str) -> dict:
    """{key: [candidates]} of an op's tunables that the tuner tries, from the op's own table."""
    out = {}
    for k in tune_keys():
        if k.startswith(op + "."):
            text = lib().opgraft_tune_space(k.encode()).decode()
            if text:
                out[k] = [int(v) for v in text.split()]
    return out


def tune_range(key: str) -> tuple[int, int]:
    lo, hi = ctypes.c_int64(), ctypes.c_int64()
    check(lib().opgraft_tune_range(key.encode(), ctypes.byref(lo), ctypes.byref(hi)))
    return lo.value, hi.value


def tune_set(values: dict) -> None:
    """Sets tunables process-wide, above every other source (the tuner's candidates)."""
    for k, v in values.items():
        check(lib().opgraft_tune_set(k.encode(), int(v)))


def tune_clear(key: str | None = None) -> None:
    check(lib().opgraft_tune_clear(key.encode() if key else None))


def cache_check() -> tuple[str, str]:
    """(directory, "") when compiled kernels can be kept on disk there, else (directory or "", why
    not): the library's own check, not a guess."""
    buf = ctypes.create_string_buffer(1024)
    st = lib().opgraft_cache_check(buf, len(buf))
    return buf.value.decode(errors="replace"), "" if st == OK else lib().opgraft_last_error().decode(errors="replace")


def abi_layout() -> dict:
    import json

    return json.loads(lib().opgraft_abi_layout().decode())
