/*
 * opgraft: faster kernels for stock vLLM, behind one C ABI.
 *
 * This is the only public header of libopgraft. Everything here is plain C11 with sized integer
 * types; tensors cross the ABI as raw pointers with shapes and strides counted in elements, and a
 * CUDA stream as an opaque pointer. No CUDA header is needed to use it.
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
#define OPGRAFT_ABI_VERSION 2

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
  XX(ERANGE, -11, "value out of range or buffer too small")

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

/* ---------------------------------------------------------------------------------------------
 * Tunables: each key's value comes from, in order, its environment variable (OPGRAFT_TUNE_ and the
 * key upper-cased with '.' as '_', e.g. OPGRAFT_TUNE_MOE_MAX_TOKENS), the JSON file named by
 * $OPGRAFT_TUNE_FILE, and the baked per-arch table. A malformed value or file logs one warning and
 * the next source is used.
 * ------------------------------------------------------------------------------------------- */
typedef struct opgraft_tune_query {
  const char *key;   /* e.g. "moe.max_tokens" */
  int32_t arch;      /* compute capability as major*10 + minor, e.g. 90 */
  const char *gpu;   /* device name, e.g. "NVIDIA H200"; NULL matches entries without "gpu" */
  const char *shape; /* e.g. "moe:bf16:E128:H2048:I768:k8"; NULL matches entries without it */
  int32_t tokens;    /* the call's token count; entries may restrict it; 0 = any */
} opgraft_tune_query;
/* Resolves one key. source (may be NULL) receives where the value came from:
 * "env:OPGRAFT_TUNE_MOE_MAX_TOKENS", "file:/path/tune.json", "baked:sm_90", "baked:any", or
 * "default" (the key's built-in fallback, used when no table row matches). */
OPGRAFT_EXTERN int32_t opgraft_tune_get(const opgraft_tune_query *q, int64_t *value, char *source,
                                        size_t source_len);
/* Forgets the parsed tune file so the next lookup reads $OPGRAFT_TUNE_FILE again. */
OPGRAFT_EXTERN void opgraft_tune_reload(void);
/* The names of all tunable keys, NULL-terminated. */
OPGRAFT_EXTERN const char *const *opgraft_tune_keys(void);

/* ---------------------------------------------------------------------------------------------
 * MoE experts (fused_experts contract, after routing):
 *   out[t] = sum_j w[t,j] * W2[e] (act(G[e] x_t) * U[e] x_t),  e = topk_ids[t,j]
 * with w13[e] = [G[e]; U[e]] of shape [2I, H] (gate rows first) and w2[e] of shape [I -> H],
 * i.e. [H, I]. With apply_router_weight_on_input the weight scales x_t instead and the sum is
 * unweighted. Accumulation is fp32; out has the activation dtype. Ids outside [0, E) contribute
 * nothing.
 * ------------------------------------------------------------------------------------------- */
typedef enum {
  OPGRAFT_DTYPE_BF16 = 1,
  OPGRAFT_DTYPE_FP16 = 2,
  OPGRAFT_DTYPE_FP32 = 3,
  OPGRAFT_DTYPE_INT32 = 4,
  OPGRAFT_DTYPE_INT64 = 5,
} opgraft_dtype;

typedef enum {
  OPGRAFT_ACT_SILU = 1, /* SwiGLU: silu(gate) * up */
  OPGRAFT_ACT_GELU = 2, /* GeGLU (tanh-free erf form): not implemented by the kernel */
} opgraft_activation;

typedef struct opgraft_moe_args {
  uint32_t struct_size; /* sizeof(opgraft_moe_args), checked */
  int32_t dtype;        /* hidden states, weights and out: OPGRAFT_DTYPE_BF16 or _FP16 */
  int32_t activation;   /* opgraft_activation */
  int32_t apply_router_weight_on_input;
  int64_t num_tokens;  /* T */
  int64_t hidden;      /* H */
  int64_t inter;       /* I */
  int64_t num_experts; /* E (local experts, the first dimension of w13 and w2) */
  int64_t top_k;       /* k */
  const void *hidden_states;
  int64_t hidden_states_stride[2]; /* [T, H] */
  const void *w13;
  int64_t w13_stride[3]; /* [E, 2I, H] */
  const void *w2;
  int64_t w2_stride[3]; /* [E, H, I] */
  const void *topk_weights;
  int32_t topk_weights_dtype; /* OPGRAFT_DTYPE_FP32 */
  int64_t topk_weights_stride[2];
  const void *topk_ids;
  int32_t topk_ids_dtype; /* OPGRAFT_DTYPE_INT32 or _INT64 */
  int64_t topk_ids_stride[2];
  /* Expert parallelism (vLLM's expert_map): NULL, or an int32 device array [expert_map_len] that
   * maps the global ids in topk_ids to this rank's experts (0..num_experts-1) or to -1 (another
   * rank's expert: no contribution here). Handed back where the tunable moe.expert_map is 0. */
  const void *expert_map;
  void *out;
  int64_t out_stride[2]; /* [T, H] */
  /* The GPU the call runs on, as major*10 + minor, and its name; 0 / NULL = the current device. */
  int32_t arch;
  const char *gpu_name;
  int64_t expert_map_len; /* global experts: the length of expert_map (0 without one) */
} opgraft_moe_args;

/* Can the kernel take this call? OPGRAFT_OK, or OPGRAFT_EUNSUPPORTED with a short reason (e.g.
 * "tokens 64 > moe.max_tokens 16") written to reason. Looks only at the arguments, never at the
 * data, and needs no GPU when args->arch is set. */
OPGRAFT_EXTERN int32_t opgraft_moe_supports(const opgraft_moe_args *args, char *reason,
                                            size_t reason_len);

/* Bytes of device workspace opgraft_moe_run needs for these arguments (16-byte aligned; the
 * contents need not be initialised: the library resets what it uses, on the stream). */
OPGRAFT_EXTERN int32_t opgraft_moe_workspace_size(const opgraft_moe_args *args, size_t *bytes);

/* Runs the experts computation on stream (a CUstream / cudaStream_t; NULL = legacy default).
 * All pointers are device pointers. Enqueues kernels only: no host synchronisation and no
 * allocation, so it can be captured into a CUDA graph. The first call for a shape compiles the
 * kernels (NVRTC) or loads them from the cache. */
OPGRAFT_EXTERN int32_t opgraft_moe_run(const opgraft_moe_args *args, void *workspace,
                                       size_t workspace_bytes, void *stream);

/* Runs only some of the kernels behind opgraft_moe_run, for profiling the time split: stages is
 * a mask of OPGRAFT_MOE_STAGE_*. The output is complete only with OPGRAFT_MOE_STAGE_ALL. */
enum {
  OPGRAFT_MOE_STAGE_GATE_UP = 1, /* act = w * silu(G x) * U x into the workspace */
  OPGRAFT_MOE_STAGE_DOWN = 2,    /* out = sum over experts of W2 act */
  OPGRAFT_MOE_STAGE_ALL = 3,
};
OPGRAFT_EXTERN int32_t opgraft_moe_run_stages(const opgraft_moe_args *args, void *workspace,
                                              size_t workspace_bytes, void *stream, uint32_t stages);

/* CPU oracle: the same function in fp64 on host pointers. Writes out_f64 ([T, H], contiguous) when
 * it is not NULL; otherwise rounds to args->dtype into args->out. */
OPGRAFT_EXTERN int32_t opgraft_moe_reference(const opgraft_moe_args *args, double *out_f64);

/* Compiler resource report of one kernel. */
typedef struct opgraft_kernel_info {
  char name[64];
  int32_t registers;
  int32_t spill_store_bytes;
  int32_t spill_load_bytes;
  int32_t stack_bytes;
  int32_t shared_bytes;
} opgraft_kernel_info;

/* Compiles the kernels this call would use for the given arch (needs NVRTC, no GPU) and reports
 * their resources. count receives the number of kernels (at most cap are written). */
OPGRAFT_EXTERN int32_t opgraft_moe_compile_report(const opgraft_moe_args *args, int32_t arch,
                                                  opgraft_kernel_info *out, int32_t cap,
                                                  int32_t *count);

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
#endif /* OPGRAFT_OPGRAFT_H */
