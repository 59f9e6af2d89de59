/* The decode-attention op's guard ("can we take this call, and why not") and its shape key. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "attention.h"

const char *opgraft__attn_dtype_name(int32_t d) {
  switch (d) {
  case OPGRAFT_DTYPE_BF16: return "bf16";
  case OPGRAFT_DTYPE_FP16: return "fp16";
  case OPGRAFT_DTYPE_FP32: return "fp32";
  case OPGRAFT_DTYPE_INT32: return "int32";
  case OPGRAFT_DTYPE_INT64: return "int64";
  case OPGRAFT_DTYPE_FP8_E4M3: return "fp8_e4m3";
  case OPGRAFT_DTYPE_UINT8: return "uint8";
  }
  return "unknown";
}

void opgraft__attn_shape_key(const opgraft_attention_args *a, char *buf, size_t len) {
  const long long G = a->num_kv_heads > 0 ? a->num_heads / a->num_kv_heads : 0;
  snprintf(buf, len, "attention:%s:D%lld:G%lld:bs%lld", opgraft__attn_dtype_name(a->dtype), (long long)a->head_size, G,
           (long long)a->block_size);
}

#define OG_REASON(...) (snprintf(reason, reason_len, __VA_ARGS__), OPGRAFT_EUNSUPPORTED)

static int mult8(int64_t v) { return v >= 0 && v % 8 == 0; }

/* The arguments are there and of this ABI's size: every entry point's first check. */
static int32_t check_header(const opgraft_attention_args *a, char *reason, size_t reason_len) {
  if (!a) return OG_REASON("no arguments");
  if (a->struct_size < sizeof(opgraft_attention_args))
    return OG_REASON("opgraft_attention_args.struct_size %u < %zu: caller built against an older ABI", a->struct_size,
                     sizeof(opgraft_attention_args));
  return OPGRAFT_OK;
}

int32_t opgraft__attn_check_static(const opgraft_attention_args *a, char *reason, size_t reason_len) {
  const int32_t st = check_header(a, reason, reason_len);
  if (st) return st;
  if (a->flags & OPGRAFT_ATTN_MLA) return OG_REASON("MLA (latent attention) is not supported");
  if (a->flags & OPGRAFT_ATTN_ENCODER) return OG_REASON("encoder or cross attention is not supported");
  if (a->flags & OPGRAFT_ATTN_ALIBI) return OG_REASON("ALiBi is not supported");
  if (a->flags & OPGRAFT_ATTN_NON_CAUSAL) return OG_REASON("non-causal attention is not supported");
  if (a->flags & ~(OPGRAFT_ATTN_MLA | OPGRAFT_ATTN_ENCODER | OPGRAFT_ATTN_ALIBI | OPGRAFT_ATTN_NON_CAUSAL |
                   OPGRAFT_ATTN_AFTER_QKV))
    return OG_REASON("unknown flags 0x%x", (unsigned)a->flags);
  if (a->dtype != OPGRAFT_DTYPE_BF16 && a->dtype != OPGRAFT_DTYPE_FP16)
    return OG_REASON("dtype %s (the kernel takes bf16 and fp16)", opgraft__attn_dtype_name(a->dtype));
  if (a->kv_dtype == OPGRAFT_DTYPE_FP8_E4M3 || a->kv_dtype == OPGRAFT_DTYPE_UINT8)
    return OG_REASON("FP8 KV cache (the kernel reads bf16 and fp16 caches)");
  if (a->kv_dtype != a->dtype)
    return OG_REASON("KV cache dtype %s differs from the query's %s", opgraft__attn_dtype_name(a->kv_dtype),
                     opgraft__attn_dtype_name(a->dtype));
  if (a->query_len != 1)
    return OG_REASON("%lld query tokens per sequence (the kernel takes 1: decode only)", (long long)a->query_len);
  if (a->batch < 0 || a->batch > OG_ATTN_MAX_BATCH)
    return OG_REASON("batch %lld (0..%d supported)", (long long)a->batch, OG_ATTN_MAX_BATCH);
  const int64_t D = a->head_size, H = a->num_heads, Hk = a->num_kv_heads;
  if (D != 64 && D != 128 && D != 256) return OG_REASON("head size %lld (64, 128 or 256 supported)", (long long)D);
  if (Hk < 1 || H < 1 || H % Hk) return OG_REASON("%lld query heads over %lld kv heads", (long long)H, (long long)Hk);
  if (Hk > 65535) return OG_REASON("%lld kv heads (at most 65535)", (long long)Hk);
  const int64_t G = H / Hk;
  if (G > OG_ATTN_MAX_GROUP)
    return OG_REASON("%lld query heads per kv head (at most %d)", (long long)G, OG_ATTN_MAX_GROUP);
  /* Two 8-head tiles of 256-dim heads need more registers than a thread has. */
  if (G > 8 && D == 256) return OG_REASON("%lld query heads per kv head with head size 256 (at most 8)", (long long)G);
  if (a->block_size < 16 || a->block_size % 16 || a->block_size > OG_ATTN_MAX_BLOCK)
    return OG_REASON("block size %lld (a multiple of 16 up to %d supported)", (long long)a->block_size,
                     OG_ATTN_MAX_BLOCK);
  if (a->num_blocks < 1 || a->num_blocks > INT32_MAX || a->max_blocks < 1 || a->max_blocks > INT32_MAX / a->block_size)
    return OG_REASON("cache of %lld blocks, block table of %lld columns", (long long)a->num_blocks,
                     (long long)a->max_blocks);
  if (!(a->scale > 0) || !isfinite(a->scale)) return OG_REASON("softmax scale %g", a->scale);
  if (!(a->softcap >= 0) || !isfinite(a->softcap)) return OG_REASON("logits soft cap %g", a->softcap);
  if (a->window_left < -1 || a->window_left > INT32_MAX) return OG_REASON("window %lld", (long long)a->window_left);
  if (a->max_seq_len < 0) return OG_REASON("negative max_seq_len %lld", (long long)a->max_seq_len);
  if (a->block_table_dtype != OPGRAFT_DTYPE_INT32)
    return OG_REASON("block table dtype %s (int32 expected)", opgraft__attn_dtype_name(a->block_table_dtype));
  if (a->seq_lens_dtype != OPGRAFT_DTYPE_INT32)
    return OG_REASON("seq_lens dtype %s (int32 expected)", opgraft__attn_dtype_name(a->seq_lens_dtype));
  if (a->sinks && a->sinks_dtype != OPGRAFT_DTYPE_FP32 && a->sinks_dtype != a->dtype)
    return OG_REASON("sinks dtype %s (fp32 or the query's expected)", opgraft__attn_dtype_name(a->sinks_dtype));
  if (a->q_stride[2] != 1 || a->out_stride[2] != 1 || a->k_stride[3] != 1 || a->v_stride[3] != 1)
    return OG_REASON("a head's dims are not contiguous");
  if (a->block_table_stride[1] != 1 || a->block_table_stride[0] < 0)
    return OG_REASON("block table rows are not contiguous");
  /* Every 16-byte access of the kernel starts at a multiple of 8 elements. */
  if (!mult8(a->q_stride[0]) || !mult8(a->q_stride[1]) || !mult8(a->out_stride[0]) || !mult8(a->out_stride[1]))
    return OG_REASON("query or output strides are not multiples of 16 bytes");
  for (int i = 0; i < 3; ++i)
    if (!mult8(a->k_stride[i]) || !mult8(a->v_stride[i]))
      return OG_REASON("KV cache strides are not multiples of 16 bytes");
  if (a->k_new) {
    if (a->slot_mapping_dtype != OPGRAFT_DTYPE_INT64)
      return OG_REASON("slot mapping dtype %s (int64 expected)", opgraft__attn_dtype_name(a->slot_mapping_dtype));
    if (a->slot_count < 0) return OG_REASON("negative slot count %lld", (long long)a->slot_count);
    for (int i = 0; i < 2; ++i)
      if (!mult8(a->k_new_stride[i]) || !mult8(a->v_new_stride[i]))
        return OG_REASON("new key or value strides are not multiples of 16 bytes");
  }
  return opgraft__attn_check_prologue(a, reason, reason_len);
}

/* The q/k norm and rotary embedding's arguments (ABI 11). */
int32_t opgraft__attn_check_prologue(const opgraft_attention_args *a, char *reason, size_t reason_len) {
  const int norm = a->q_norm_weight || a->k_norm_weight;
  if (a->rope_style < OPGRAFT_ROPE_NONE || a->rope_style > OPGRAFT_ROPE_GPTJ)
    return OG_REASON("unknown rotary embedding style %d", a->rope_style);
  if (!norm && a->rope_style == OPGRAFT_ROPE_NONE) return OPGRAFT_OK;
  if (!a->k_new) return OG_REASON("q/k norm or rotary embedding without the call's new keys (the kernel applies them to those)");
  if (norm) {
    if (!a->q_norm_weight || !a->k_norm_weight) return OG_REASON("a q norm weight without a k norm weight, or the reverse");
    if (a->qk_norm_dtype != a->dtype)
      return OG_REASON("q/k norm weight dtype %s (the query's %s expected)", opgraft__attn_dtype_name(a->qk_norm_dtype),
                       opgraft__attn_dtype_name(a->dtype));
    if (!(a->qk_norm_eps >= 0) || !isfinite(a->qk_norm_eps) || a->qk_norm_eps > 1.0)
      return OG_REASON("q/k norm epsilon %g", a->qk_norm_eps);
  }
  if (a->rope_style != OPGRAFT_ROPE_NONE) {
    if (a->cos_sin_dtype != a->dtype)
      return OG_REASON("cos/sin cache dtype %s (the query's %s expected)", opgraft__attn_dtype_name(a->cos_sin_dtype),
                       opgraft__attn_dtype_name(a->dtype));
    if (a->rope_rows < 1 || a->rope_rows > INT32_MAX) return OG_REASON("cos/sin cache of %lld rows", (long long)a->rope_rows);
    if (a->cos_sin_stride < a->head_size || !mult8(a->cos_sin_stride))
      return OG_REASON("cos/sin cache row stride %lld (at least the head size, a multiple of 16 bytes)",
                       (long long)a->cos_sin_stride);
    if (a->positions_dtype != OPGRAFT_DTYPE_INT64)
      return OG_REASON("positions dtype %s (int64 expected)", opgraft__attn_dtype_name(a->positions_dtype));
  }
  return OPGRAFT_OK;
}

/* The prologue alone (opgraft_attention_prologue_run): only the fields it reads. */
int32_t opgraft__attn_check_prologue_alone(const opgraft_attention_args *a, const int64_t k_out_stride[2], char *reason,
                                           size_t reason_len) {
  const int32_t st = check_header(a, reason, reason_len);
  if (st) return st;
  if (a->dtype != OPGRAFT_DTYPE_BF16 && a->dtype != OPGRAFT_DTYPE_FP16)
    return OG_REASON("dtype %s (the kernel takes bf16 and fp16)", opgraft__attn_dtype_name(a->dtype));
  const int64_t D = a->head_size;
  if (D != 64 && D != 128 && D != 256) return OG_REASON("head size %lld (64, 128 or 256 supported)", (long long)D);
  if (a->num_heads < 1 || a->num_kv_heads < 1 || a->num_heads + a->num_kv_heads > 65536)
    return OG_REASON("%lld query heads and %lld kv heads", (long long)a->num_heads, (long long)a->num_kv_heads);
  if (a->batch < 0 || a->batch > INT32_MAX) return OG_REASON("%lld rows (0..%d supported)", (long long)a->batch, INT32_MAX);
  if (!a->q_norm_weight && !a->k_norm_weight && a->rope_style == OPGRAFT_ROPE_NONE)
    return OG_REASON("neither q/k norm nor rotary embedding: nothing to do");
  if (!k_out_stride) return OG_REASON("no output key strides");
  if (a->q_stride[2] != 1 || a->out_stride[2] != 1) return OG_REASON("a head's dims are not contiguous");
  if (!mult8(a->q_stride[0]) || !mult8(a->q_stride[1]) || !mult8(a->out_stride[0]) || !mult8(a->out_stride[1]) ||
      !mult8(a->k_new_stride[0]) || !mult8(a->k_new_stride[1]) || !mult8(k_out_stride[0]) || !mult8(k_out_stride[1]))
    return OG_REASON("query, key or output strides are not multiples of 16 bytes");
  return opgraft__attn_check_prologue(a, reason, reason_len);
}

static int aligned(const void *p, unsigned n) { return ((uintptr_t)p & (n - 1u)) == 0; }

int32_t opgraft__attn_check_pointers(const opgraft_attention_args *a, char *reason, size_t reason_len) {
  if (a->batch > 0 && (!a->q || !a->k_cache || !a->v_cache || !a->block_table || !a->seq_lens || !a->out))
    return OG_REASON("a tensor pointer is NULL");
  if (!aligned(a->q, 16) || !aligned(a->k_cache, 16) || !aligned(a->v_cache, 16) || !aligned(a->out, 16))
    return OG_REASON("query, output or KV cache not 16-byte aligned");
  if (a->k_new && (!a->v_new || (a->slot_count > 0 && !a->slot_mapping)))
    return OG_REASON("new keys without new values or a slot mapping");
  if (!aligned(a->k_new, 16) || !aligned(a->v_new, 16) || !aligned(a->slot_mapping, 8))
    return OG_REASON("new keys, values or slot mapping misaligned");
  if ((a->q_norm_weight || a->k_norm_weight) && (!a->q_norm_weight || !a->k_norm_weight))
    return OG_REASON("q/k norm weights: one is NULL");
  if (a->rope_style != OPGRAFT_ROPE_NONE && a->batch > 0 && (!a->cos_sin_cache || !a->positions))
    return OG_REASON("rotary embedding without a cos/sin cache or positions");
  if (!aligned(a->q_norm_weight, 16) || !aligned(a->k_norm_weight, 16) || !aligned(a->cos_sin_cache, 16) ||
      !aligned(a->positions, 8))
    return OG_REASON("q/k norm weights, cos/sin cache or positions misaligned");
  if (!aligned(a->block_table, 4) || !aligned(a->seq_lens, 4) ||
      !aligned(a->sinks, a->sinks_dtype == OPGRAFT_DTYPE_FP32 ? 4u : 2u))
    return OG_REASON("block table, seq_lens or sinks misaligned");
  return OPGRAFT_OK;
}

int32_t opgraft__attn_check_device(const opgraft_attention_args *a, int32_t *arch_out, char *gpu, size_t gpu_len,
                                   char *reason, size_t reason_len) {
  int32_t arch = a->arch;
  if (gpu && gpu_len) opgraft__copy(gpu, gpu_len, a->gpu_name);
  if (!arch) {
    const int32_t st = opgraft__current_device(NULL, &arch, gpu, gpu_len);
    if (st) return OG_REASON("no GPU: %s", opgraft_last_error());
  }
  if (arch < OG_ATTN_MIN_ARCH) return OG_REASON("sm_%d is older than sm_%d", arch, OG_ATTN_MIN_ARCH);
  char shape[128];
  opgraft__attn_shape_key(a, shape, sizeof shape);
  const int64_t max_batch =
      opgraft__tune_value("attention.max_batch", arch, gpu && *gpu ? gpu : NULL, shape, (int32_t)a->batch);
  if (a->batch > max_batch)
    return OG_REASON("batch %lld > attention.max_batch %lld", (long long)a->batch, (long long)max_batch);
  if (arch_out) *arch_out = arch;
  return OPGRAFT_OK;
}

int32_t opgraft_attention_supports(const opgraft_attention_args *args, char *reason, size_t reason_len) {
  char local[256];
  if (!reason || !reason_len) reason = local, reason_len = sizeof local;
  reason[0] = 0;
  char gpu[256];
  int32_t st = opgraft__attn_check_static(args, reason, reason_len);
  if (!st) st = opgraft__attn_check_pointers(args, reason, reason_len);
  if (!st) st = opgraft__attn_check_device(args, NULL, gpu, sizeof gpu, reason, reason_len);
  if (st) opgraft__fail(st, "attention call not supported: %s", reason);
  return st;
}
