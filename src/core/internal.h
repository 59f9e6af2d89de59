/* Internal declarations of libopgraft's core (not installed), shared with the ops. Non-static
 * internal names use the opgraft__ prefix. The core names no op: the ops register descriptors
 * (og_op, below) in src/ops/ops.c. */
#ifndef OPGRAFT_INTERNAL_H
#define OPGRAFT_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "opgraft/opgraft.h"

#if defined(__GNUC__)
#define OG_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define OG_PRINTF(a, b)
#endif

/* ---- status.c ---- */
/* Records a message for opgraft_last_error() and returns status. */
int32_t opgraft__fail(int32_t status, const char *fmt, ...) OG_PRINTF(2, 3);
void opgraft__log(int32_t level, const char *fmt, ...) OG_PRINTF(2, 3);
/* Logs a warning only the first time this exact message is seen in the process. */
void opgraft__warn_once(const char *fmt, ...) OG_PRINTF(1, 2);
/* An environment switch read as the Python layer reads one (python/opgraft/vllm/compat.py): 0 for
 * 0, false, no or off (any case, blanks around ignored), -1 unset or blank, 1 anything else. */
int opgraft__env_switch(const char *name);
/* snprintf that always terminates and never overflows; returns dst. */
char *opgraft__copy(char *dst, size_t len, const char *src);
/* stat, fstat and exp bound to the glibc symbol versions the wheel may need (src/core/compat.c). */
struct stat;
int opgraft__stat(const char *path, struct stat *sb);
int opgraft__fstat(int fd, struct stat *sb);
double opgraft__exp(double x);

/* ---- hash.c ---- */
typedef struct og_hash {
  uint64_t a, b;
} og_hash;
void opgraft__hash_init(og_hash *h);
void opgraft__hash_update(og_hash *h, const void *data, size_t len);
/* Writes 32 hex digits and a terminator. */
void opgraft__hash_hex(const og_hash *h, char out[33]);
uint64_t opgraft__fnv1a64(const void *data, size_t len);

/* ---- half.c: bf16 / fp16 (dtype OPGRAFT_DTYPE_BF16 or _FP16) on the host, for the CPU oracles ---- */
double opgraft__half_to_double(int32_t dtype, uint16_t h);
double opgraft__e4m3_to_double(uint8_t b);
/* The 16-bit values x[i * stride], i < n, quantized as the FP8 kernels quantize activations per
 * 1 x block_k group (og_fp8.cuh): amax = max(max |x|, 1e-10) in fp32, q[i] = e4m3(x * (448 /
 * amax)) (fp32 product, nearest even, saturating). Returns the group's scale amax / 448. */
float opgraft__e4m3_quantize_group(int32_t dtype, const uint16_t *x, int64_t stride, int64_t n, double *q);
/* Rounds to the nearest even value of the dtype (infinity past its largest finite value). */
uint16_t opgraft__double_to_half(int32_t dtype, double d);
/* The oracles' q/k RMSNorm (weights w [D], or NULL) and rotary embedding (style 0 none, 1 NeoX,
 * 2 GPT-J; cos_sin [rope_rows, cs_stride]: D/2 cosines, then the sines) of one head's D 16-bit
 * values x at position pos, in place, rounded where vLLM rounds: the normalized value, its product
 * with the weight, the rotated value. A position outside [0, rope_rows) is not rotated. */
void opgraft__qk_head_ref(int32_t dtype, int64_t D, uint16_t *x, const void *w, double eps, int32_t rope_style,
                          const void *cos_sin, int64_t cs_stride, int64_t rope_rows, int64_t pos);

/* ---- runtime.c: libcuda and libnvrtc through dlopen, with our own minimal declarations ---- */
typedef int og_CUresult;
typedef int og_CUdevice;
typedef struct og_CUctx_st *og_CUcontext;
typedef struct og_CUmod_st *og_CUmodule;
typedef struct og_CUfunc_st *og_CUfunction;
typedef struct og_CUstream_st *og_CUstream;
typedef int og_nvrtcResult;
typedef struct og_nvrtcProgram_st *og_nvrtcProgram;

struct og_CUlaunchConfig;
typedef struct og_cuda_api {
  og_CUresult (*cuInit)(unsigned int);
  og_CUresult (*cuDriverGetVersion)(int *);
  og_CUresult (*cuCtxGetCurrent)(og_CUcontext *);
  og_CUresult (*cuCtxGetDevice)(og_CUdevice *);
  og_CUresult (*cuDeviceGetAttribute)(int *, int, og_CUdevice);
  og_CUresult (*cuDeviceGetName)(char *, int, og_CUdevice);
  og_CUresult (*cuModuleLoadData)(og_CUmodule *, const void *);
  og_CUresult (*cuModuleGetFunction)(og_CUfunction *, og_CUmodule, const char *);
  og_CUresult (*cuLaunchKernel)(og_CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                unsigned, unsigned, og_CUstream, void **, void **);
  og_CUresult (*cuGetErrorString)(og_CUresult, const char **);
  og_CUresult (*cuLaunchKernelEx)(const struct og_CUlaunchConfig *, og_CUfunction, void **, void **);
  og_CUresult (*cuMemsetD32Async)(unsigned long long, unsigned int, size_t, og_CUstream);
  og_CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int *, og_CUfunction, int, size_t);
  og_CUresult (*cuFuncSetAttribute)(og_CUfunction, int, int);
  og_CUresult (*cuOccupancyMaxActiveClusters)(int *, og_CUfunction, const struct og_CUlaunchConfig *);
} og_cuda_api;

/* CUlaunchAttribute / CUlaunchConfig as documented in the driver API (cuda.h, CUDA 12 and 13). */
typedef struct og_CUlaunchAttribute {
  int id;
  char pad[4];
  union {
    char bytes[64];
    int flag; /* the int-valued attributes: cooperative, programmaticStreamSerializationAllowed */
    unsigned dim[3]; /* clusterDim */
    void *align;
  } value;
} og_CUlaunchAttribute;
enum {
  OG_LAUNCH_ATTRIBUTE_COOPERATIVE = 2,
  OG_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4,
  OG_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
};
typedef struct og_CUlaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  og_CUstream stream;
  og_CUlaunchAttribute *attrs;
  unsigned num_attrs;
} og_CUlaunchConfig;

typedef struct og_nvrtc_api {
  og_nvrtcResult (*nvrtcVersion)(int *, int *);
  og_nvrtcResult (*nvrtcCreateProgram)(og_nvrtcProgram *, const char *, const char *, int,
                                       const char *const *, const char *const *);
  og_nvrtcResult (*nvrtcCompileProgram)(og_nvrtcProgram, int, const char *const *);
  og_nvrtcResult (*nvrtcGetProgramLogSize)(og_nvrtcProgram, size_t *);
  og_nvrtcResult (*nvrtcGetProgramLog)(og_nvrtcProgram, char *);
  og_nvrtcResult (*nvrtcGetCUBINSize)(og_nvrtcProgram, size_t *);
  og_nvrtcResult (*nvrtcGetCUBIN)(og_nvrtcProgram, char *);
  og_nvrtcResult (*nvrtcDestroyProgram)(og_nvrtcProgram *);
  const char *(*nvrtcGetErrorString)(og_nvrtcResult);
} og_nvrtc_api;

/* Return the loaded API, or NULL with the error recorded (opgraft_last_error). */
const og_cuda_api *opgraft__cuda(void);
const og_nvrtc_api *opgraft__nvrtc(void);
/* NVRTC version as major*1000 + minor*10, 0 if not loaded. */
int32_t opgraft__nvrtc_version(void);
/* Checks a driver call; on failure records "what: CUDA error N (name)" and returns OPGRAFT_ECUDA. */
int32_t opgraft__cu_check(og_CUresult r, const char *what);

/* The current context's device: compute capability (major*10+minor) and name. */
int32_t opgraft__current_device(og_CUcontext *ctx, int32_t *arch, char *name, size_t name_len);
/* What every op's plan starts with: the context and tunables generation it was made under. */
typedef struct og_plan_head {
  og_CUcontext ctx;
  uint32_t tune_gen;
} og_plan_head;

/* ---- plan_cache.c: the plans of the argument-struct entry points (plans made with malloc, each
 * starting with an og_plan_head) ---- */
typedef struct og_plan_cache {
  pthread_mutex_t lock;
  int n, next, cap;
  void **slots; /* cap of them */
} og_plan_cache;
/* A static cache of cap plans: OG_PLAN_CACHE(plans, 128); */
#define OG_PLAN_CACHE(name, cap)   \
  static void *name##_slots[cap]; \
  static og_plan_cache name = {PTHREAD_MUTEX_INITIALIZER, 0, 0, cap, name##_slots}
/* Copies into out (size bytes) the first plan made in ctx under the current tunables that
 * match(plan, key) accepts; 1 if there is one. */
int opgraft__plan_cache_find(og_plan_cache *c, og_CUcontext ctx, int (*match)(const void *plan, const void *key),
                             const void *key, void *out, size_t size);
/* Keeps plan (the cache owns it from now on); when full, frees the oldest to make room. */
void opgraft__plan_cache_put(og_plan_cache *c, void *plan);

/* The driver API and the thread's current context (OPGRAFT_ENODEV where there is none). */
int32_t opgraft__current_ctx(const og_cuda_api **cu, og_CUcontext *ctx);
/* OPGRAFT_ESTALE (with the reason) when a plan with this head cannot run in ctx now; what names
 * the plan ("<op> plan"). */
int32_t opgraft__plan_check(og_CUcontext ctx, const og_plan_head *plan, const char *what);

/* ---- jit.c ---- */
typedef struct og_source {
  const char *path; /* under kernels/, e.g. "<op>/<op>.cu" or "common/og_common.cuh" */
  const char *name; /* the file name, as #include names it (unique over all folders) */
  const char *text;
} og_source;
/* The embedded kernel sources (kernels_embed.c, generated at build time). */
extern const og_source opgraft__sources[];
extern const int opgraft__num_sources;
/* By path ("<op>/<op>.cu"). */
const og_source *opgraft__find_source(const char *path);
/* The hash (hex) of the embedded files the cubin of the source at path depends on (common/ and
 * the source's own folder): computed each call by the first, once per source by the second. */
void opgraft__hash_sources(const char *path, char hex[33]);
void opgraft__source_hash(const char *path, char hex[33]);

typedef struct og_cubin {
  char *data;
  size_t size;
  char *log; /* compiler log (resource report), may be NULL */
} og_cubin;
void opgraft__cubin_free(og_cubin *c);

/* Compiles the source at `path` with the given options for sm_<arch>. Every embedded file is
 * offered to NVRTC as a header by its name. */
int32_t opgraft__compile(const char *path, const char *const *opts, int nopts, int32_t arch,
                         og_cubin *out);
/* Returns a cubin for (source, options, arch), with its compiler log: from memory, the disk cache,
 * or a fresh compile written back to the disk cache. The key hashes the files under common/ and
 * those in the source's own folder, so one op's kernels do not invalidate another's. */
int32_t opgraft__cubin_cached(const char *path, const char *const *opts, int nopts, int32_t arch,
                              og_cubin *out);
/* Loads (once per context) the module for (source, options, arch) and resolves the functions. */
int32_t opgraft__get_functions(const char *path, const char *const *opts, int nopts, int32_t arch,
                               const char *const *fn_names, int nfn, og_CUfunction *fns);
/* Options for one compile: a fixed array of formatted strings (the ops' configurations). */
enum { OG_MAX_OPTS = 48, OG_OPT_LEN = 48 };
typedef struct og_opts {
  char buf[OG_MAX_OPTS][OG_OPT_LEN];
  const char *ptr[OG_MAX_OPTS];
  int n, overflow;
} og_opts;
void opgraft__opt(og_opts *o, const char *fmt, ...) OG_PRINTF(2, 3);
/* 0, or an error (OPGRAFT_EINVAL, recorded) if the options did not fit. */
int32_t opgraft__opts_check(const og_opts *o, const char *what);
/* The options joined by spaces into buf (for describe functions). */
int32_t opgraft__opts_join(const og_opts *o, char *buf, size_t len);
/* Parses an NVRTC/ptxas verbose log for one entry function's resources. */
int32_t opgraft__parse_resources(const char *log, const char *fn_name, opgraft_kernel_info *info);

/* Cache file format, exposed for tests. A file holds the cubin and the compiler log. */
int32_t opgraft__cache_path(const char *key, char *path, size_t len);
int32_t opgraft__cache_store(const char *key, const og_cubin *c);
int32_t opgraft__cache_load(const char *key, og_cubin *out);

/* ---- json.c: a strict, small JSON reader for tune files ---- */
typedef enum { OG_JSON_NULL, OG_JSON_BOOL, OG_JSON_NUMBER, OG_JSON_STRING, OG_JSON_ARRAY, OG_JSON_OBJECT } og_json_type;
typedef struct og_json {
  og_json_type type;
  double number;
  int boolean;
  char *string;                /* OG_JSON_STRING's value */
  struct og_json *child, *next; /* first element or member; next sibling */
  char *key;                    /* member name when inside an object */
} og_json;
/* Parses text; on error returns NULL and writes "line L, column C: what" to err. */
og_json *opgraft__json_parse(const char *text, size_t len, char *err, size_t err_len);
void opgraft__json_free(og_json *j);
const og_json *opgraft__json_get(const og_json *obj, const char *key);

/* ---- abi.c: opgraft_abi_layout(), a JSON text built once ---- */
typedef struct og_sbuf {
  char *p;
  size_t n, cap;
  int failed, items, fields;
} og_sbuf;
void opgraft__sbuf_put(og_sbuf *b, const char *fmt, ...) OG_PRINTF(2, 3);
void opgraft__abi_struct(og_sbuf *b, const char *name, size_t size);
void opgraft__abi_field(og_sbuf *b, const char *name, size_t offset, size_t size);
void opgraft__abi_end(og_sbuf *b);
#define OG_ABI_STRUCT(b, type) opgraft__abi_struct((b), #type, sizeof(type))
#define OG_ABI_FIELD(b, type, field) \
  opgraft__abi_field((b), #field, offsetof(type, field), sizeof(((type *)0)->field))

/* ---- tune.c and registry.c: tunables and the ops that own them ---- */
typedef struct og_tunable {
  const char *key; /* "<op>.<name>" */
  int64_t lo, hi;  /* the values the op accepts */
  int64_t fallback; /* used when no row and no rule give a value */
  const char *space; /* the tuner's candidates, e.g. "1 2 4 8 16" (NULL: the tuner leaves it alone) */
} og_tunable;

typedef struct og_tune_entry {
  int32_t arch; /* 0 = any */
  const char *gpu;
  const char *shape;
  int32_t tokens_lo, tokens_hi; /* 0, 0 = any */
  const char *key;
  int64_t value;
  const char *why;
} og_tune_entry;
/* What an op tells the core (one descriptor an op, listed in src/ops/ops.c). */
typedef struct og_op {
  const char *name;       /* lower case; its tunable keys start with "<name>." */
  const char *kernel_dir; /* its folder under kernels/ (NULL: no kernels) */
  const og_tunable *tunables;
  int ntunables;
  const og_tune_entry *rows; /* the baked per-arch table; each row says why it holds */
  int nrows;
  /* The op's heuristics: a value for q->key derived from q's shape, arch and tokens, used when
   * no row matches; returns 1 and sets *value, or 0 (no rule for that key). May be NULL. */
  int (*rule)(const opgraft_tune_query *q, int64_t *value);
  /* Writes the op's public structs into the layout (OG_ABI_STRUCT / OG_ABI_FIELD). May be NULL. */
  void (*abi)(struct og_sbuf *b);
} og_op;

/* src/ops/ops.c: every op, NULL-terminated. */
extern const og_op *const opgraft__op_list[];
/* The ops whose descriptors are valid (checked at first use; a refused one warns once). */
const og_op *const *opgraft__ops(int *n);
/* Checks a descriptor: its name, kernel folder, keys (prefix, ranges, fallbacks, no duplicate
 * among themselves or with the earlier ops) and rows (known keys, values in range, token ranges).
 * Returns 0, or -1 with err written. */
int opgraft__op_check(const og_op *op, const og_op *const *earlier, int nearlier, char *err, size_t len);
/* The tunable named key among the valid ops, and its op (may be NULL); NULL if unknown. */
const og_tunable *opgraft__find_tunable(const char *key, const og_op **op);
/* Is the op registered (its descriptor valid)? */
int opgraft__op_ok(const og_op *op);

/* Bumped by opgraft_tune_reload/set/clear: plans made before are stale. */
uint32_t opgraft__tune_generation(void);
/* Convenience: resolves key (0 with a warning for an unknown key). */
int64_t opgraft__tune_value(const char *key, int32_t arch, const char *gpu, const char *shape,
                            int32_t tokens);
/* The row among rows[0..n) that matches q best (most specific, then the later), or -1. */
int opgraft__best_row(const og_tune_entry *rows, int n, const opgraft_tune_query *q);

#endif
