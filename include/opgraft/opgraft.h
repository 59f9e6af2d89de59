/*
 * opgraft: faster kernels for stock vLLM, behind one C ABI.
 *
 * This header is libopgraft's core API (version, status codes, logging, the CUDA runtime, the
 * kernel cache, tunables, the op registry); each op has a header of its own in this folder, and
 * including this one includes them all. Everything is plain C11 with sized integer types;
 * tensors cross the ABI as raw pointers with shapes and strides counted in elements, and a CUDA
 * stream as an opaque pointer. No CUDA header is needed to use it.
 *
 * Errors are values: every function returns an opgraft_status (0 on success, negative on
 * failure) and leaves a message for the calling thread in opgraft_last_error().
 */
#ifndef OPGRAFT_OPGRAFT_H
#define OPGRAFT_OPGRAFT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define OPGRAFT_VERSION_MAJOR 0
#define OPGRAFT_VERSION_MINOR 1
#define OPGRAFT_VERSION_PATCH 0
#define OPGRAFT_VERSION_HEX                                                                        \
  ((OPGRAFT_VERSION_MAJOR << 16) | (OPGRAFT_VERSION_MINOR << 8) | OPGRAFT_VERSION_PATCH)
/* Bumped whenever a struct or signature below changes incompatibly. */
#define OPGRAFT_ABI_VERSION 14

#if defined(_WIN32)
#define OPGRAFT_EXTERN __declspec(dllexport)
#else
#define OPGRAFT_EXTERN __attribute__((visibility("default")))
#endif

/* Status codes: name, value, message. */
#define OPGRAFT_STATUS_MAP(XX)                                                                     \
  XX(OK, 0, "success")                                                                             \
  XX(EINVAL, -1, "invalid argument")                                                               \
  XX(ENOMEM, -2, "out of host memory")                                                             \
  XX(ENOLIB, -3, "a required library (libcuda or libnvrtc) could not be loaded")                   \
  XX(ECUDA, -4, "a CUDA driver call failed")                                                       \
  XX(ENVRTC, -5, "NVRTC failed to compile a kernel")                                               \
  XX(EUNSUPPORTED, -6, "this case is not supported; hand the call back to the caller's kernel")    \
  XX(EIO, -7, "file input/output failed")                                                          \
  XX(EPARSE, -8, "malformed input")                                                                \
  XX(ENOTFOUND, -9, "not found")                                                                   \
  XX(ENODEV, -10, "no CUDA device or context is current on this thread")                           \
  XX(ERANGE, -11, "value out of range or buffer too small")                                       \
  XX(ESTALE, -12, "the plan was made for other tunables or another CUDA context: make a new one")

typedef enum {
#define OPGRAFT_XX(name, value, msg) OPGRAFT_##name = value,
  OPGRAFT_STATUS_MAP(OPGRAFT_XX)
#undef OPGRAFT_XX
} opgraft_status;

/* The library's version as OPGRAFT_VERSION_HEX, and as "major.minor.patch". */
OPGRAFT_EXTERN uint32_t opgraft_version(void);
OPGRAFT_EXTERN const char *opgraft_version_string(void);

/* Static description of a status code; "unknown status" for values outside the table. */
OPGRAFT_EXTERN const char *opgraft_strerror(int32_t status);
/* The status code's name, e.g. "OPGRAFT_EUNSUPPORTED". */
OPGRAFT_EXTERN const char *opgraft_status_name(int32_t status);
/* Detailed message of the last failure on the calling thread ("" if none). */
OPGRAFT_EXTERN const char *opgraft_last_error(void);

/* Log messages (warnings about malformed settings, cache trouble) go to this callback; by default
 * they go to stderr with an "opgraft:" prefix. Pass NULL to restore the default. The callback may
 * run while the library holds internal locks: it must not call back into libopgraft. */
enum { OPGRAFT_LOG_DEBUG = 10, OPGRAFT_LOG_INFO = 20, OPGRAFT_LOG_WARNING = 30 };
typedef void (*opgraft_log_fn)(int32_t level, const char *message, void *user_data);
OPGRAFT_EXTERN void opgraft_set_log_callback(opgraft_log_fn fn, void *user_data);

/* ---------------------------------------------------------------------------------------------
 * Runtime: libcuda and libnvrtc are found with dlopen at first use.
 *
 * libnvrtc search order: $OPGRAFT_NVRTC (a file), directories given to opgraft_add_library_dir()
 * (the Python layer passes the lib folder of pip's nvidia packages), $CUDA_HOME/lib64,
 * $CUDA_PATH/lib64, /usr/local/cuda/lib64, then the system loader. libcuda: $OPGRAFT_LIBCUDA, then
 * the system loader (libcuda.so.1).
 * ------------------------------------------------------------------------------------------- */
OPGRAFT_EXTERN int32_t opgraft_add_library_dir(const char *dir);

typedef struct opgraft_runtime_info {
  char nvrtc_path[512]; /* "" when not found */
  char libcuda_path[512];
  int32_t nvrtc_version;  /* major*1000 + minor*10, 0 when not found */
  int32_t driver_version; /* as cuDriverGetVersion, 0 when libcuda is not found */
  char nvrtc_error[256];  /* why libnvrtc was not found */
  char libcuda_error[256];
} opgraft_runtime_info;
/* Tries to load both libraries (once) and reports what was found. Always returns OPGRAFT_OK. */
OPGRAFT_EXTERN int32_t opgraft_runtime_query(opgraft_runtime_info *info);

/* ---------------------------------------------------------------------------------------------
 * Kernel cache. Compiled kernels live in $OPGRAFT_CACHE_DIR, else $XDG_CACHE_HOME/opgraft, else
 * $HOME/.cache/opgraft. A cache directory that cannot be written leaves the cache in memory.
 * ------------------------------------------------------------------------------------------- */
OPGRAFT_EXTERN int32_t opgraft_cache_dir(char *buf, size_t buf_len);
/* Can compiled kernels be kept there? Creates the directory if missing and writes (then removes)
 * a probe file: OPGRAFT_OK, or the failure with opgraft_last_error() saying why (not a directory,
 * not writable, path too long, no directory at all). dir receives the path ("" if none). */
OPGRAFT_EXTERN int32_t opgraft_cache_check(char *dir, size_t dir_len);

/* ---------------------------------------------------------------------------------------------
 * Tunables: each key's value comes from, in order, its environment variable (OPGRAFT_TUNE_ and the
 * key upper-cased with '.' as '_', e.g. OPGRAFT_TUNE_MOE_MAX_TOKENS), the JSON file named by
 * $OPGRAFT_TUNE_FILE, and the baked per-arch table. A malformed value or file logs one warning and
 * the next source is used. Above them all: values set with opgraft_tune_set().
 * ------------------------------------------------------------------------------------------- */
typedef struct opgraft_tune_query {
  const char *key;   /* e.g. "moe.max_tokens" */
  int32_t arch;      /* compute capability as major*10 + minor, e.g. 90 */
  const char *gpu;   /* device name, e.g. "NVIDIA H200"; NULL matches entries without "gpu" */
  const char *shape; /* e.g. "moe:bf16:E128:H2048:I768:k8"; NULL matches entries without it */
  int32_t tokens;    /* the call's token count; entries may restrict it; 0 = any */
} opgraft_tune_query;
/* Resolves one key. source (may be NULL) receives where the value came from: "set" (the override
 * below), "env:OPGRAFT_TUNE_MOE_MAX_TOKENS", "file:/path/tune.json", "baked:sm_90" or "baked:any"
 * (a row of the op's table), "rule" (the op's per-arch heuristics, from the shape), or "default"
 * (the key's built-in fallback). */
OPGRAFT_EXTERN int32_t opgraft_tune_get(const opgraft_tune_query *q, int64_t *value, char *source,
                                        size_t source_len);
/* Forgets the parsed tune file so the next lookup reads $OPGRAFT_TUNE_FILE again. */
OPGRAFT_EXTERN void opgraft_tune_reload(void);
/* The names of all tunable keys of every registered op, NULL-terminated. */
OPGRAFT_EXTERN const char *const *opgraft_tune_keys(void);
/* The values `opgraft tune` tries for a key, as a space-separated list ("1 2 4 8 16"); "" for keys
 * the tuner leaves alone (thresholds, switches that are not a speed choice) or unknown keys. */
OPGRAFT_EXTERN const char *opgraft_tune_space(const char *key);
/* The range [lo, hi] a key accepts; OPGRAFT_ENOTFOUND for an unknown key. */
OPGRAFT_EXTERN int32_t opgraft_tune_range(const char *key, int64_t *lo, int64_t *hi);
/* Process-wide values that rank above every other source (the tuner's candidates): set one key,
 * or clear one (key) or all (NULL). Each change makes existing plans stale (OPGRAFT_ESTALE). */
OPGRAFT_EXTERN int32_t opgraft_tune_set(const char *key, int64_t value);
OPGRAFT_EXTERN int32_t opgraft_tune_clear(const char *key);
/* A counter that changes whenever the tunables may have changed (reload, set, clear). */
OPGRAFT_EXTERN uint32_t opgraft_tune_generation(void);

/* ---------------------------------------------------------------------------------------------
 * Ops. Each op (its header: opgraft/<op>.h) registers a descriptor with the core: its name, its
 * kernel sources, its tunable keys and baked rows. An op whose descriptor is malformed is refused
 * at load (one warning) and its calls fail with OPGRAFT_EUNSUPPORTED.
 * ------------------------------------------------------------------------------------------- */
/* The names of the registered ops, NULL-terminated, e.g. {"moe", "attention", NULL}. */
OPGRAFT_EXTERN const char *const *opgraft_op_names(void);

/* The dtypes tensors of any op may have. */
typedef enum {
  OPGRAFT_DTYPE_BF16 = 1,
  OPGRAFT_DTYPE_FP16 = 2,
  OPGRAFT_DTYPE_FP32 = 3,
  OPGRAFT_DTYPE_INT32 = 4,
  OPGRAFT_DTYPE_INT64 = 5,
  OPGRAFT_DTYPE_FP8_E4M3 = 6, /* float8_e4m3fn: 4 exponent bits, 3 mantissa bits, no infinities */
  OPGRAFT_DTYPE_UINT8 = 7,
} opgraft_dtype;

/* Compiler resource report of one kernel. */
typedef struct opgraft_kernel_info {
  char name[64];
  int32_t registers;
  int32_t spill_store_bytes;
  int32_t spill_load_bytes;
  int32_t stack_bytes;
  int32_t shared_bytes;
} opgraft_kernel_info;

/* The layout of every public struct, as the compiler laid it out: a JSON object
 * {"abi": N, "structs": {"opgraft_moe_args": {"size": S, "fields": {"dtype": [offset, size], ...}}},
 * "status": {"OPGRAFT_OK": 0, ...}}, so that bindings (the Python layer's ctypes mirror) can check
 * theirs. A static string. */
OPGRAFT_EXTERN const char *opgraft_abi_layout(void);

/* ---------------------------------------------------------------------------------------------
 * Measurement helper: reads `bytes` of device memory at data (16-byte aligned, bytes a multiple of
 * 16) with 16-byte streaming loads, enqueued on stream. sink is 4 bytes of device memory that is
 * written only in the unlikely case the data's XOR equals a fixed constant. grid = 0 picks 4 blocks
 * of 512 threads per multiprocessor. Timing it gives the read ceiling of the GPU.
 * ------------------------------------------------------------------------------------------- */
OPGRAFT_EXTERN int32_t opgraft_stream_read(const void *data, size_t bytes, void *sink, int32_t grid,
                                           void *stream);

#ifdef __cplusplus
}
#endif

/* The ops' own headers. */
#include "opgraft/moe.h"
#include "opgraft/linear.h"
#include "opgraft/attention.h"

#endif /* OPGRAFT_OPGRAFT_H */
