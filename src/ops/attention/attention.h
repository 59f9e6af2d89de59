/* Internal declarations of the decode-attention op (src/ops/attention/): guard.c, config.c,
 * heuristics.c, launch.c, table.c, reference.c. */
#ifndef OPGRAFT_OPS_ATTENTION_H
#define OPGRAFT_OPS_ATTENTION_H

#include "../../core/internal.h"

#define OG_ATTN_MIN_ARCH 80    /* mma.sync bf16 and cvt.rn.bf16x2.f32 need sm_80 */
#define OG_ATTN_MAX_GROUP 16   /* query heads per kv head: two 8-head column tiles */
#define OG_ATTN_MAX_BLOCK 4096 /* tokens per cache block */
#define OG_ATTN_MAX_BATCH 65535 /* the grid's z dimension */
/* The most blocks one launch puts in the split tree, on any GPU (sizes the workspace of
 * opgraft_attention_run, which has no plan to ask). */
#define OG_ATTN_MAX_SLOTS 2048

extern const og_op opgraft__attention_op;

typedef struct og_attn_shape {
  int64_t D, G, bs;
} og_attn_shape;
/* Parses a shape key ("attention:bf16:D128:G8:bs16"); 1 on success. */
int opgraft__attn_parse_shape(const char *shape, og_attn_shape *s);
/* heuristics.c: the op's rule (og_op.rule). */
int opgraft__attn_rule(const opgraft_tune_query *q, int64_t *value);

/* guard.c */
const char *opgraft__attn_dtype_name(int32_t d);
void opgraft__attn_shape_key(const opgraft_attention_args *a, char *buf, size_t len);
/* The checks that look only at the arguments (no system calls, no pointers). */
int32_t opgraft__attn_check_static(const opgraft_attention_args *a, char *reason, size_t reason_len);
/* Its part for the q/k norm and rotary embedding (ABI 11). */
int32_t opgraft__attn_check_prologue(const opgraft_attention_args *a, char *reason, size_t reason_len);
/* The checks of opgraft_attention_prologue_run's arguments (the prologue alone). */
int32_t opgraft__attn_check_prologue_alone(const opgraft_attention_args *a, const int64_t k_out_stride[2], char *reason,
                                           size_t reason_len);
/* Alignment and NULL checks of the pointers a call carries. */
int32_t opgraft__attn_check_pointers(const opgraft_attention_args *a, char *reason, size_t reason_len);
/* The checks that need the device; arch_out and gpu receive the device. */
int32_t opgraft__attn_check_device(const opgraft_attention_args *a, int32_t *arch_out, char *gpu, size_t gpu_len,
                                   char *reason, size_t reason_len);

/* config.c: tunables -> kernel constants */
typedef struct og_attn_cfg {
  int warps;       /* warps per block (OG_W) */
  int min_blocks;  /* __launch_bounds__ minimum blocks per SM (OG_MIN_BLOCKS, 1 = none) */
  int min_chunk;   /* tokens a split takes at least */
  int max_splits;  /* splits of one sequence at most */
  int load;        /* K/V load form (og_load_stream) */
  int pdl;         /* programmatic dependent launch (sm_90+); 2: the first round's K and V before the
                    * wait, only with the cache write and without a window */
  int trigger;     /* lets the next kernel start while the blocks run (sm_90+) */
  int cluster;     /* blocks a thread-block cluster merging splits on chip at most (sm_90+; 1 = none):
                    * 2, 4 or 8, a launch taking 4 or 8 (opgraft__attn_cluster_of) */
  int fan32;       /* the combine's fan-in 32 where it saves a level (opgraft__attn_fan_of), with
                    * its own entry point (OG_FAN32); only with max_splits > 16 */
  int vpf;         /* a tile's V loaded with its K, a tile ahead (OG_VPF); only where the registers
                    * it takes leave the warps as they are */
  int round;       /* tiles a warp loads at once, 1 or 2 (OG_ROUND); 2 only where the registers it
                    * takes leave the warps as they are, and never with the V prefetch */
  int softcap, window, sinks; /* the options' code paths (OG_SOFTCAP, OG_WINDOW, OG_SINKS) */
  int update;                 /* the call writes its new keys and values (OG_UPDATE) */
  int qknorm, rope;           /* q/k RMSNorm, rotary embedding (OG_QKNORM, OG_ROPE: OPGRAFT_ROPE_*) */
} og_attn_cfg;
void opgraft__attn_config(const opgraft_attention_args *a, int32_t arch, const char *gpu, og_attn_cfg *c);
int32_t opgraft__attn_options(const opgraft_attention_args *a, const og_attn_cfg *c, og_opts *o);
/* The kernel entry point of a dtype at a fan-in (log2; 5: attention_decode_fan32_*, else 16's). */
void opgraft__attn_fn_name(int32_t dtype, int fan_log2, char name[64]);
/* The prologue-alone kernel's compile options (OG_QK_ONLY) and entry point. */
int32_t opgraft__attn_prologue_options(const opgraft_attention_args *a, og_opts *o);
void opgraft__attn_prologue_fn_name(int32_t dtype, char name[64]);
/* The shape checks a compile-only call needs (no device). */
int32_t opgraft__attn_compile_check(const opgraft_attention_args *a, const char *what);
/* Bytes of workspace for a launch of at most max_slots blocks in split calls, up to max_splits
 * splits a sequence (og_attn_tree's slots and counters). */
size_t opgraft__attn_workspace_bytes(const opgraft_attention_args *a, int64_t max_slots, int max_splits);
/* Where the partials' maxima/sums and outputs start in that workspace (the counters are first). */
void opgraft__attn_workspace_offsets(const opgraft_attention_args *a, int64_t max_slots, int max_splits,
                                     size_t *ml_off, size_t *part_off);
#define OG_ATTN_SOURCE "attention/attention.cu"

/* launch.c: the cluster size (1, 4 or 8; at most `cluster` and S) for a launch of S splits a
 * group over `groups` groups, and S lowered to a multiple of it with every cluster resident at
 * once (resident_of[log2 size] of them): the largest size that keeps at least 70% of the splits,
 * else 1 (S unchanged). */
int opgraft__attn_cluster_of(int cluster, const int resident_of[4], int64_t groups, int *S);
/* launch.c: the combine tree's fan-in (its log2: the kernel entry point the launch takes) for a
 * launch of S splits a group: with fan32, 32 where 16 would take two levels and 32 one
 * (16 < S <= 36, S lowered to 32 at most), else 16 (S unchanged). */
int opgraft__attn_fan_of(int fan32, int *S);

#endif
