/* opgraft's paged decode-attention op. Included by opgraft/opgraft.h. */
#ifndef OPGRAFT_ATTENTION_H
#define OPGRAFT_ATTENTION_H

#include "opgraft/opgraft.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Paged decode attention: one query token per sequence against the sequence's paged K/V cache.
 * For sequence b and query head h (kv head h / G, G = num_heads / num_kv_heads), over the keys
 * j < L = seq_lens[b] (with window_left >= 0 only j >= L - 1 - window_left):
 *   s_j = scale * q[b,h] . k_j           (with softcap > 0: s_j = softcap * tanh(s_j / softcap))
 *   out[b,h] = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sinks[h]))   (no sinks: without the last term)
 * Key j of sequence b lives in cache block block_table[b][j / block_size] at row j % block_size.
 * This is vLLM's decode attention with FlashAttention's window, soft-cap and sink semantics, as
 * read in vLLM 0.26.0 and 0.33.0 (v1/attention/backends/flash_attn.py): window_left is the left
 * edge of FlashAttention's (sliding_window - 1, 0) window of a causal decoder; the soft cap applies
 * after the scale; a sink is a per-head logit in the softmax's denominator (FA3's s_aux). The K and
 * V caches are the views FlashAttentionImpl.forward splits from vLLM's cache (logical (blocks,
 * kv_heads, block_size, 2*D), physically [block, token, head, K|V] or [block, head, token, K|V]):
 * any strides that are multiples of 16 bytes, taken from the tensors. Rows with L <= 0 (vLLM's
 * padding of a CUDA-graph batch: seq_len 0, block-table row 0) are written as zeros, which is what
 * FlashAttention gives a row without keys. A block id outside [0, num_blocks) contributes no keys.
 * Accumulation is fp32; out has the query's dtype.
 * ------------------------------------------------------------------------------------------- */
enum {
  OPGRAFT_ATTN_MLA = 1,        /* multi-head latent attention (a compressed cache): not supported */
  OPGRAFT_ATTN_ENCODER = 2,    /* encoder, encoder-only or cross attention: not supported */
  OPGRAFT_ATTN_ALIBI = 4,      /* ALiBi position biases: not supported */
  OPGRAFT_ATTN_NON_CAUSAL = 8, /* non-causal attention: not supported */
  /* A hint, not a need (ABI 14): the kernel before this call on its stream is the qkv projection
   * that made q and k_new (opgraft_linear_args' q/k epilogue), so the call may launch early and
   * load its first keys while that projection runs (attention.pdl_pro). Only a launch choice. */
  OPGRAFT_ATTN_AFTER_QKV = 16,
};

typedef struct opgraft_attention_args {
  uint32_t struct_size; /* sizeof(opgraft_attention_args), checked */
  int32_t dtype;        /* q, out: OPGRAFT_DTYPE_BF16 or _FP16 */
  int32_t kv_dtype;     /* the K/V cache's dtype: must be dtype (an FP8 cache is handed back) */
  int32_t flags;        /* OPGRAFT_ATTN_*: what the call needs (each one is refused) and hints */
  int64_t batch;        /* sequences: rows of q, out, block_table and seq_lens */
  int64_t query_len;    /* query tokens per sequence: the kernel takes 1 */
  int64_t num_heads;    /* query heads */
  int64_t num_kv_heads;
  int64_t head_size;    /* 64, 128 or 256 */
  int64_t block_size;   /* tokens per cache block: a multiple of 16 */
  int64_t num_blocks;   /* blocks in the cache */
  int64_t max_blocks;   /* columns of block_table */
  double scale;         /* softmax scale (> 0) */
  double softcap;       /* logits soft cap, 0 = none */
  int64_t window_left;  /* -1 = no sliding window */
  const void *q;
  int64_t q_stride[3]; /* [batch, num_heads, head_size] */
  const void *k_cache;
  int64_t k_stride[4]; /* [num_blocks, block_size, num_kv_heads, head_size] */
  const void *v_cache;
  int64_t v_stride[4]; /* as k_stride */
  const void *block_table;
  int32_t block_table_dtype; /* OPGRAFT_DTYPE_INT32 */
  int64_t block_table_stride[2];
  const void *seq_lens;
  int32_t seq_lens_dtype; /* OPGRAFT_DTYPE_INT32, [batch] contiguous */
  const void *sinks;      /* NULL, or [num_heads] logits (fp32 or dtype) */
  int32_t sinks_dtype;
  void *out;
  int64_t out_stride[3]; /* [batch, num_heads, head_size] */
  /* An upper bound of seq_lens (0 = unknown): it only caps the number of splits. Lengths are read
   * on the device, so a CUDA graph captured with one bound replays correctly with any lengths. */
  int64_t max_seq_len;
  /* The GPU the call runs on, as major*10 + minor, and its name; 0 / NULL = the current device. */
  int32_t arch;
  const char *gpu_name;
  /* ---- ABI 6: the call's KV-cache write (vLLM's reshape_and_cache_flash) inside the kernel ----
   * k_new NULL: the cache already holds every key. Otherwise the call first stores row b's new
   * key and value (k_new, v_new: [batch, num_kv_heads, head_size] through their strides, dims
   * contiguous) into cache slot slot_mapping[b] (block slot / block_size, row slot % block_size;
   * rows b >= slot_count and slots < 0 store nothing), then attends as above. A row's key L-1 is
   * read from k_new / v_new, not from the cache: a decode row's slot must be its last key's place
   * in the block table, as in vLLM. Plans of such calls run through opgraft_attention_plan_run_update. */
  const void *k_new;
  int64_t k_new_stride[2]; /* [batch, num_kv_heads] */
  const void *v_new;
  int64_t v_new_stride[2];
  const void *slot_mapping;
  int32_t slot_mapping_dtype; /* OPGRAFT_DTYPE_INT64 */
  int64_t slot_count;         /* rows of slot_mapping (a run's value, not the plan's) */
  /* ---- ABI 11: vLLM's q/k RMSNorm and rotary embedding of the query and the new key, in the kernel
   * (only with k_new). With q_norm_weight and k_norm_weight (both or neither; [head_size] in
   * qk_norm_dtype, which must be dtype), each head x of q and of k_new first becomes
   *   round(round(x * rsqrt(mean(x^2) + qk_norm_eps)) * w)       (vLLM's RMSNorm over a head);
   * with rope_style NEOX or GPTJ, each head is then rotated by its row's position p = positions[b]
   * (int64 [batch]) through cos_sin_cache (rope_rows rows of cos_sin_stride elements, in
   * cos_sin_dtype, which must be dtype: the head_size / 2 cosines of row p, then their sines;
   * rotary_dim is head_size): NEOX pairs dim i with i + head_size / 2, GPTJ dim 2i with 2i + 1,
   *   (x1, x2) -> round(x1 cos_i - x2 sin_i), round(x2 cos_i + x1 sin_i)   (fp32).
   * A position outside [0, rope_rows) is not rotated. The new key is stored normalized and
   * rotated, as vLLM stores it after its own norm and rotary embedding. Plans of such calls run
   * through opgraft_attention_plan_run_args. */
  const void *q_norm_weight;
  const void *k_norm_weight;
  int32_t qk_norm_dtype;
  double qk_norm_eps;
  int32_t rope_style; /* OPGRAFT_ROPE_* */
  const void *cos_sin_cache;
  int32_t cos_sin_dtype;
  int64_t cos_sin_stride; /* elements between rows; a row's dims are contiguous */
  int64_t rope_rows;
  const void *positions;
  int32_t positions_dtype; /* OPGRAFT_DTYPE_INT64, [batch] contiguous */
} opgraft_attention_args;

enum {
  OPGRAFT_ROPE_NONE = 0,
  OPGRAFT_ROPE_NEOX = 1, /* vLLM's is_neox_style: dim i with i + head_size / 2 */
  OPGRAFT_ROPE_GPTJ = 2, /* dim 2i with 2i + 1 */
};

/* Can the kernel take this call? OPGRAFT_OK, or OPGRAFT_EUNSUPPORTED with a short reason (e.g.
 * "head size 96 (64, 128 or 256 supported)") written to reason. Looks only at the arguments,
 * never at the data, and needs no GPU when args->arch is set. */
OPGRAFT_EXTERN int32_t opgraft_attention_supports(const opgraft_attention_args *args, char *reason,
                                                  size_t reason_len);

/* A plan: the guard's decision, the tunables and the compiled kernel for one layout (dtypes,
 * heads, head size, block size, strides, options, GPU) and batch, resolved once: the guard's batch
 * limit and the tuned rows depend on the batch. The lengths, max_seq_len and the pointers are a
 * run's, and a run takes at most the plan's batch; the pointers in args are not kept. On
 * OPGRAFT_EUNSUPPORTED, reason says why. The plan belongs to the CUDA context current at
 * creation. */
typedef struct opgraft_attention_plan opgraft_attention_plan;
OPGRAFT_EXTERN int32_t opgraft_attention_plan_create(const opgraft_attention_args *args,
                                                     opgraft_attention_plan **plan, char *reason,
                                                     size_t reason_len);
OPGRAFT_EXTERN void opgraft_attention_plan_destroy(opgraft_attention_plan *plan);
/* Bytes of device workspace a run of the plan needs (16-byte aligned). It must be zeroed once
 * before its first use; every run leaves it zeroed where it matters (the split counters), so one
 * workspace serves every call of the plan on one stream, CUDA graphs included. Two runs that may
 * execute at the same time need two workspaces. */
OPGRAFT_EXTERN size_t opgraft_attention_plan_workspace_size(const opgraft_attention_plan *plan);
/* Runs the plan for batch sequences (at most the plan's) on tensors laid out as at creation, on
 * stream. No host synchronisation and no allocation: capturable into a CUDA graph. sinks must be
 * set iff it was at creation. Misaligned or NULL pointers give OPGRAFT_EINVAL; a plan made before
 * the tunables changed, or used under another CUDA context, gives OPGRAFT_ESTALE and runs
 * nothing. */
OPGRAFT_EXTERN int32_t opgraft_attention_plan_run(const opgraft_attention_plan *plan, const void *q,
                                                  const void *k_cache, const void *v_cache,
                                                  const void *block_table, const void *seq_lens,
                                                  const void *sinks, void *out, void *workspace,
                                                  int64_t batch, int64_t max_seq_len, void *stream);

/* The same for a plan made with k_new set: the call's new keys and values are stored into the
 * cache at slot_mapping's slots (slot_count rows) as well. opgraft_attention_plan_run refuses such
 * a plan (OPGRAFT_EINVAL), and this function a plan made without k_new or with q/k norm or rotary
 * embedding (opgraft_attention_plan_run_args runs those). */
OPGRAFT_EXTERN int32_t opgraft_attention_plan_run_update(const opgraft_attention_plan *plan, const void *q,
                                                         const void *k_new, const void *v_new,
                                                         const void *slot_mapping, int64_t slot_count,
                                                         const void *k_cache, const void *v_cache,
                                                         const void *block_table, const void *seq_lens,
                                                         const void *sinks, void *out, void *workspace,
                                                         int64_t batch, int64_t max_seq_len, void *stream);

/* Runs the plan with the pointers, batch, max_seq_len and slot_count of args (its layout must be
 * the plan's): the only run entry point of a plan made with q/k norm or rotary embedding, and one
 * for every other plan too. */
OPGRAFT_EXTERN int32_t opgraft_attention_plan_run_args(const opgraft_attention_plan *plan,
                                                       const opgraft_attention_args *args, void *workspace,
                                                       void *stream);

/* ABI 13: the q/k RMSNorm and rotary embedding of ABI 11 alone on args->batch token rows (a
 * prefill's, or any the decode kernel does not take), with the same bits as the kernel's: row t's
 * query heads q[t] (q_stride[0..1]: [rows, num_heads, head_size]) go to out[t] (out_stride[0..1]),
 * its key heads k_new[t] (k_new_stride: [rows, num_kv_heads, head_size]) to k_out[t]
 * (k_out_stride), each head normalized and rotated by positions[t] as ABI 11 says. out may be q
 * itself and k_out k_new itself (the same pointer and strides: in place); any other overlap of an
 * output with an input is undefined. Reads
 * only dtype, batch, the heads, head_size, those tensors and the norm and rotary fields (at least
 * one of the two); the cache fields are ignored. Needs sm_80 or newer; no host synchronisation or
 * allocation once the kernel is compiled (its first call per layout compiles it). */
OPGRAFT_EXTERN int32_t opgraft_attention_prologue_run(const opgraft_attention_args *args, void *k_out,
                                                      const int64_t k_out_stride[2], void *stream);

/* Bytes of workspace opgraft_attention_run needs for these arguments on any GPU (an upper bound
 * of the plan's), zeroed once as above. */
OPGRAFT_EXTERN int32_t opgraft_attention_workspace_size(const opgraft_attention_args *args, size_t *bytes);
/* Runs the call through a plan cached inside the library (a convenience for C callers). */
OPGRAFT_EXTERN int32_t opgraft_attention_run(const opgraft_attention_args *args, void *workspace,
                                             size_t workspace_bytes, void *stream);

/* CPU oracle: the same function in fp64 on host pointers. Writes out_f64 ([batch, num_heads,
 * head_size], contiguous) when it is not NULL; otherwise rounds to args->dtype into args->out.
 * With k_new set it stores the new keys and values into the host cache first, as the kernel does
 * (normalized and rotated first where args ask for it). */
OPGRAFT_EXTERN int32_t opgraft_attention_reference(const opgraft_attention_args *args, double *out_f64);

/* Compiles the kernel this call would use for the given arch (needs NVRTC, no GPU) and reports
 * its resources. count receives the number of kernels (at most cap are written). */
OPGRAFT_EXTERN int32_t opgraft_attention_compile_report(const opgraft_attention_args *args, int32_t arch,
                                                        opgraft_kernel_info *out, int32_t cap,
                                                        int32_t *count);

/* The kernel configuration a call would get on arch (compile options such as "-DOG_W=4 ..."). */
OPGRAFT_EXTERN int32_t opgraft_attention_describe(const opgraft_attention_args *args, int32_t arch, char *buf,
                                                  size_t buf_len);

#ifdef __cplusplus
}
#endif
#endif /* OPGRAFT_ATTENTION_H */
