/* Internal declarations of the linear op (src/ops/linear/): guard.c, config.c, heuristics.c,
 * launch.c, table.c, reference.c. */
#ifndef OPGRAFT_OPS_LINEAR_H
#define OPGRAFT_OPS_LINEAR_H

#include "../../core/internal.h"
#include "../../../kernels/linear/linear_params.h"

/* The kernel's limits (kernels/linear/linear.cu): the rows are the tokens of one MMA tile, and K
 * is a compile-time constant of 16-byte chunks. */
#define OG_LINEAR_MAX_ROWS 8
#define OG_LINEAR_MAX_K (1 << 20)
#define OG_LINEAR_MAX_N (1 << 30)
#define OG_LINEAR_MIN_ARCH 80     /* mma.sync bf16 and cvt.rn.bf16.f32 need sm_80 */
#define OG_LINEAR_FP8_MIN_ARCH 89 /* cvt between f32, e4m3x2 and f16x2 needs sm_89 */

/* The add + RMSNorm form keeps its normalized rows in shared memory (kernels/linear/linear.cu,
 * linear_params.h); above 48 KB the plan raises the kernel's limit, which sm_80's 163 KB a block
 * allows up to this. */
#define OG_LINEAR_NORM_MAX_SMEM (96 * 1024)
#define OG_LINEAR_NORM_SMEM(rows, K) ((rows) * ((K) + OG_LINEAR_NORM_PAD) * 2)

extern const og_op opgraft__linear_op;

typedef struct og_linear_shape {
  int64_t N, K;
  int fp8; /* FP8 weights ("linear:fp8:...") */
} og_linear_shape;
/* Parses a shape key ("linear:bf16:N5120:K2048", "linear:fp8:N5120:K2048"); 1 on success. */
int opgraft__linear_parse_shape(const char *shape, og_linear_shape *s);
/* heuristics.c: the op's rule (og_op.rule). */
int opgraft__linear_rule(const opgraft_tune_query *q, int64_t *value);

/* guard.c */
const char *opgraft__linear_dtype_name(int32_t d);
int opgraft__linear_is_fp8(const opgraft_linear_args *a);
void opgraft__linear_shape_key(const opgraft_linear_args *a, char *buf, size_t len);
/* The checks that look only at the arguments (no system calls). */
int32_t opgraft__linear_check_static(const opgraft_linear_args *a, char *reason, size_t reason_len);
/* The pointer checks every run repeats (NULL, alignment), as a reason. */
int32_t opgraft__linear_check_pointers(const opgraft_linear_args *a, char *reason, size_t reason_len);
/* What is wrong with a q/k epilogue call's own pointers (NULL where they are right): the guard's
 * check and a plan run's. */
const char *opgraft__linear_qk_pointer_problem(const opgraft_linear_args *a);
/* The checks that need the device and the tunables; arch_out and gpu receive the device. */
int32_t opgraft__linear_check_device(const opgraft_linear_args *a, int32_t *arch_out, char *gpu, size_t gpu_len,
                                     char *reason, size_t reason_len);

/* config.c: tunables -> kernel constants and launch shape */
typedef struct og_linear_cfg {
  int warps;      /* OG_WARPS: warps a block, splitting K */
  int tiles;      /* OG_TILES: 8-row tiles of W a block (FP8: 16-row tiles) */
  int unroll;     /* OG_U: k-steps a warp loads before its MMAs (FP8: block_k groups) */
  int min_blocks; /* OG_MINB: launch-bounds minimum blocks per SM (0: none) */
  int load;       /* OG_LOAD: the weight load's form (og_common.cuh) */
  int l2_fetch;   /* OG_L2_FETCH: 0, 128 or 256 */
  int pdl;        /* OG_PDL: programmatic dependent launch (sm_90+); 2 with an L2 prefetch */
  int trigger;    /* OG_TRIGGER: lets the stream's next kernel launch as the blocks start (sm_90+) */
} og_linear_cfg;
void opgraft__linear_config(const opgraft_linear_args *a, int32_t arch, const char *gpu, og_linear_cfg *c);
/* The compile options of a configuration; OPGRAFT_EINVAL if they did not fit. */
int32_t opgraft__linear_options(const opgraft_linear_args *a, const og_linear_cfg *c, og_opts *o);
/* Blocks of a call: one per 8 * tiles output features (FP8: 16 * tiles). */
unsigned opgraft__linear_grid(const opgraft_linear_args *a, const og_linear_cfg *c);
void opgraft__linear_fn_name(const opgraft_linear_args *a, char name[64]);
/* The kernel source of a call. */
const char *opgraft__linear_source(const opgraft_linear_args *a);

#endif
