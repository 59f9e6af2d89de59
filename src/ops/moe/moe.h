/* Internal declarations of the MoE op (src/ops/moe/): guard.c, config.c, heuristics.c, launch.c,
 * table.c, reference.c. */
#ifndef OPGRAFT_OPS_MOE_H
#define OPGRAFT_OPS_MOE_H

#include "../../core/internal.h"

/* The kernels' hard limits (kernels/moe/): 8-token tiles up to 8 of them, a bitmap of experts in
 * shared memory, and the routing of all tokens in shared memory. */
#define OG_MOE_MAX_TOKENS 64
#define OG_MOE_MAX_EXPERTS 4096
#define OG_MOE_MAX_TOPK 16
#define OG_MOE_MAX_DIM (1 << 20) /* hidden and intermediate sizes: their products stay in int64 */
#define OG_MOE_ROUTE_MAX_EXPERTS 512 /* routing from logits: a warp holds a token's E keys, E/32 a lane */
#define OG_MOE_MIN_ARCH 80 /* mma.sync bf16 and cvt.rn.bf16x2.f32 need sm_80 */
#define OG_MOE_FP8_MIN_ARCH 89 /* mma.sync e4m3 and cvt e4m3x2 need sm_89 */

extern const og_op opgraft__moe_op;

typedef struct og_moe_shape {
  int64_t E, H, I, k;
  int fp8; /* an FP8 key: 1 "moe:fp8block:...", 2 "moe:fp8tensor:...", 0 neither */
} og_moe_shape;
/* Parses a shape key ("moe:bf16:E128:H2048:I768:k8"); 1 on success. */
int opgraft__moe_parse_shape(const char *shape, og_moe_shape *s);
/* heuristics.c: the op's rule (og_op.rule). */
int opgraft__moe_rule(const opgraft_tune_query *q, int64_t *value);

/* guard.c */
const char *opgraft__moe_dtype_name(int32_t d);
/* Are the weights FP8 (the FP8 kernels, moe/moe_fp8.cu)? */
int opgraft__moe_is_fp8(const opgraft_moe_args *a);
void opgraft__moe_shape_key(const opgraft_moe_args *a, char *buf, size_t len);
/* The checks that look only at the arguments (no system calls). */
int32_t opgraft__moe_check_static(const opgraft_moe_args *a, char *reason, size_t reason_len);
/* The checks that need the device and the tunables; arch_out and gpu receive the device. */
int32_t opgraft__moe_check_device(const opgraft_moe_args *a, int32_t *arch_out, char *gpu, size_t gpu_len,
                                  char *reason, size_t reason_len);
/* Is the call routed by the kernels from the router's logits (routing != 0)? */
int opgraft__moe_routed(const opgraft_moe_args *a);
/* FP8 weights with 16-bit hidden states that gate_up quantizes (hidden_dtype == dtype). */
int opgraft__moe_quantizes_x(const opgraft_moe_args *a);
/* The k of the groups gate_up quantizes them in: block_k with block scales, else
 * OG_MOE_X_GROUP. */
#define OG_MOE_X_GROUP 128
int64_t opgraft__moe_x_group(const opgraft_moe_args *a);
/* The pointer checks every run repeats (alignment, NULL), as a reason. */
int32_t opgraft__moe_check_pointers(const opgraft_moe_args *a, char *reason, size_t reason_len);
/* The workspace's act region (FP8 weights: act in f16, its scales from
 * opgraft__moe_act_scale_offset on). */
size_t opgraft__moe_act_bytes(const opgraft_moe_args *a);
size_t opgraft__moe_act_scale_offset(const opgraft_moe_args *a);
/* OPGRAFT_TRACE: per-block phase times after the workspace's counter area (a diagnostic). */
int opgraft__moe_trace_on(void);
int64_t opgraft__moe_trace_blocks(const opgraft_moe_args *a);
size_t opgraft__moe_trace_bytes(const opgraft_moe_args *a);

/* config.c: tunables -> kernel constants */
typedef struct og_moe_cfg {
  int nt, w1, u1, w2, u2, fused, l2_fetch;
  int gu_nt;          /* gate_up's 8-pair tiles in its one-pass path (OG_GU_NT, 1..nt) */
  int pdl;            /* programmatic dependent launch of moe_down (sm_90+) */
  int down_early;     /* with pdl: down's first weight loads before its wait */
  int pdl_in;         /* gate_up a programmatic dependent of the stream's previous kernel (sm_90+) */
  int trigger;        /* moe_down lets the stream's next kernel launch as it starts (sm_90+) */
  int gu_one;         /* one-token calls: gate_up's blocks read their one routing slot only */
  int down_one;       /* one-token calls: each down warp builds its own routing with shuffles */
  int gu_slots;       /* T*k <= 32: gate_up's blocks are (routing slot, tile), routing by ballot */
  int down_warp;      /* T*k <= 32: each down warp builds its own routing with shuffles */
  int trace;          /* OPGRAFT_TRACE: per-block phase times into the workspace */
  int load, down_load; /* the form of gate_up's / down's weight loads (OG_LOAD, OG_DOWN_LOAD) */
  int gu_min_blocks;  /* gate_up's __launch_bounds__ minimum blocks per SM (0: the default rule) */
  int down_min_blocks; /* down's, likewise */
  int gu_ks, down_ks;  /* FP8: the k of gate_up's / down's k-steps, 32 or 64 (OG_GU_KS, OG_DOWN_KS) */
  int gu_rows;         /* FP8: rows of I a gate_up tile, 16 or 32 (OG_GU_ROWS) */
  int xq;              /* FP8: gate_up quantizes 16-bit hidden states itself (OG_XQ) */
} og_moe_cfg;
void opgraft__moe_config(const opgraft_moe_args *a, int32_t arch, const char *gpu, og_moe_cfg *c);
/* The compile options of a configuration; OPGRAFT_EINVAL if they did not fit. */
int32_t opgraft__moe_options(const opgraft_moe_args *a, const og_moe_cfg *c, og_opts *o);
enum { OG_MOE_KERNELS = 3 }; /* gate_up, down, fused (bf16/fp16 weights only) */
/* The entry points of a call's kernels and how many of them the configuration uses. */
void opgraft__moe_fn_names(const opgraft_moe_args *a, char names[OG_MOE_KERNELS][64]);
int opgraft__moe_nkernels(const opgraft_moe_args *a, const og_moe_cfg *c);
#define OG_MOE_SOURCE "moe/moe.cu"
#define OG_MOE_FP8_SOURCE "moe/moe_fp8.cu"
/* The kernel source of a call. */
const char *opgraft__moe_source(const opgraft_moe_args *a);

#endif
