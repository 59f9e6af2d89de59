/* The linear op's guard ("can we take this call, and why not") and its shape key. */
#include <stdio.h>
#include <string.h>

#include "linear.h"

const char *opgraft__linear_dtype_name(int32_t d) {
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

int opgraft__linear_is_fp8(const opgraft_linear_args *a) { return a->weight_dtype == OPGRAFT_DTYPE_FP8_E4M3; }

/* The dtype field is x's, or "fp8" for FP8 weights (of either x dtype). */
void opgraft__linear_shape_key(const opgraft_linear_args *a, char *buf, size_t len) {
  snprintf(buf, len, "linear:%s:N%lld:K%lld", opgraft__linear_is_fp8(a) ? "fp8" : opgraft__linear_dtype_name(a->dtype),
           (long long)a->out_features, (long long)a->in_features);
}

#define OG_REASON(...) (snprintf(reason, reason_len, __VA_ARGS__), OPGRAFT_EUNSUPPORTED)

int32_t opgraft__linear_check_static(const opgraft_linear_args *a, char *reason, size_t reason_len) {
  if (!a) return OG_REASON("no arguments");
  if (a->struct_size < sizeof(opgraft_linear_args))
    return OG_REASON("opgraft_linear_args.struct_size %u < %zu: caller built against an older ABI", a->struct_size,
                     sizeof(opgraft_linear_args));
  if (a->dtype != OPGRAFT_DTYPE_BF16 && a->dtype != OPGRAFT_DTYPE_FP16)
    return OG_REASON("dtype %s (the kernel takes bf16 and fp16)", opgraft__linear_dtype_name(a->dtype));
  const int fp8 = opgraft__linear_is_fp8(a);
  if ((a->weight_dtype != a->dtype && !fp8) || a->out_dtype != a->dtype || (a->bias && a->bias_dtype != a->dtype))
    return OG_REASON("dtype mismatch: x %s, weight %s, bias %s, out %s", opgraft__linear_dtype_name(a->dtype),
                     opgraft__linear_dtype_name(a->weight_dtype),
                     a->bias ? opgraft__linear_dtype_name(a->bias_dtype) : "none",
                     opgraft__linear_dtype_name(a->out_dtype));
  const int64_t M = a->rows, N = a->out_features, K = a->in_features;
  if (M < 0) return OG_REASON("negative row count %lld", (long long)M);
  if (M > OG_LINEAR_MAX_ROWS) return OG_REASON("rows %lld > %d (kernel limit)", (long long)M, OG_LINEAR_MAX_ROWS);
  if (K < 8 || K % 8) return OG_REASON("in_features %lld is not a positive multiple of 8", (long long)K);
  if (K > OG_LINEAR_MAX_K) return OG_REASON("in_features %lld > %d", (long long)K, OG_LINEAR_MAX_K);
  if (N < 1 || N > OG_LINEAR_MAX_N) return OG_REASON("out_features %lld outside 1..%d", (long long)N, OG_LINEAR_MAX_N);
  if (a->x_stride[1] != 1 || a->weight_stride[1] != 1 || a->out_stride[1] != 1)
    return OG_REASON("a tensor's last dimension is not contiguous");
  if (a->weight_stride[0] < K)
    return OG_REASON("weight row stride %lld < in_features %lld", (long long)a->weight_stride[0], (long long)K);
  if (a->weight_stride[0] % (fp8 ? 16 : 8))
    return OG_REASON("weight row stride %lld is not a multiple of 16 bytes", (long long)a->weight_stride[0]);
  if (fp8) {
    if (a->scale_dtype != OPGRAFT_DTYPE_FP32)
      return OG_REASON("FP8 weight scales of dtype %s (fp32 expected)", opgraft__linear_dtype_name(a->scale_dtype));
    if (a->block_n < 16 || a->block_n % 16 || a->block_k < 64 || a->block_k % 64 || K % a->block_k)
      return OG_REASON("FP8 weight blocks %dx%d with in_features %lld (block_n a multiple of 16, block_k a multiple "
                       "of 64 dividing in_features)", a->block_n, a->block_k, (long long)K);
    if (a->weight_scale_stride[0] < 0 || a->weight_scale_stride[1] < 0) return OG_REASON("negative FP8 scale strides");
  } else if (a->weight_scale || a->block_n || a->block_k) {
    return OG_REASON("weight scales or blocks given with %s weights", opgraft__linear_dtype_name(a->weight_dtype));
  }
  if (a->residual) {
    if (fp8) return OG_REASON("add + RMSNorm with FP8 weights (the norm form takes 16-bit weights)");
    if (a->norm_dtype != a->dtype)
      return OG_REASON("dtype mismatch: x %s, norm %s", opgraft__linear_dtype_name(a->dtype),
                       opgraft__linear_dtype_name(a->norm_dtype));
    if (!(a->norm_eps >= 0.f && a->norm_eps <= 1.f)) return OG_REASON("norm_eps %g outside 0..1", (double)a->norm_eps);
    if (a->residual_stride[1] != 1 || a->residual_out_stride[1] != 1)
      return OG_REASON("residual's last dimension is not contiguous");
    if (M > 1 && (a->residual_stride[0] < K || a->residual_out_stride[0] < K || a->residual_stride[0] % 8 ||
                  a->residual_out_stride[0] % 8))
      return OG_REASON("residual row strides %lld / %lld (at least in_features, multiples of 8 elements)",
                       (long long)a->residual_stride[0], (long long)a->residual_out_stride[0]);
    if (OG_LINEAR_NORM_SMEM(M, K) > OG_LINEAR_NORM_MAX_SMEM)
      return OG_REASON("add + RMSNorm of %lld rows of %lld: %lld bytes of shared memory > %d", (long long)M,
                       (long long)K, (long long)OG_LINEAR_NORM_SMEM(M, K), OG_LINEAR_NORM_MAX_SMEM);
    if (a->normed_out && (a->normed_out_stride[1] != 1 || (M > 1 && (a->normed_out_stride[0] < K ||
                                                                       a->normed_out_stride[0] % 8))))
      return OG_REASON("normed_out strides [%lld, %lld] (rows of at least in_features, a multiple of 8 elements; "
                       "columns contiguous)", (long long)a->normed_out_stride[0], (long long)a->normed_out_stride[1]);
  } else if (a->residual_out || a->norm_weight || a->normed_out) {
    return OG_REASON("residual_out, norm_weight or normed_out given without a residual");
  }
  if (a->qk_heads) {
    const int64_t D = a->head_size;
    if (fp8) return OG_REASON("q/k norm and rotary embedding with FP8 weights (the epilogue takes 16-bit weights)");
    if (D != 64 && D != 128 && D != 256) return OG_REASON("head_size %lld (the q/k epilogue takes 64, 128, 256)", (long long)D);
    if (N % D) return OG_REASON("out_features %lld is not a multiple of head_size %lld", (long long)N, (long long)D);
    if (a->q_heads < 1 || a->qk_heads < a->q_heads || a->qk_heads > N / D)
      return OG_REASON("q_heads %d, qk_heads %d with %lld heads (1 <= q_heads <= qk_heads <= heads)", a->q_heads,
                       a->qk_heads, (long long)(N / D));
    if (!a->q_norm_weight != !a->k_norm_weight) return OG_REASON("one of q_norm_weight and k_norm_weight is NULL");
    if (a->q_norm_weight && !(a->qk_norm_eps >= 0.f && a->qk_norm_eps <= 1.f))
      return OG_REASON("qk_norm_eps %g outside 0..1", (double)a->qk_norm_eps);
    if (a->rope_style != OPGRAFT_ROPE_NONE && a->rope_style != OPGRAFT_ROPE_NEOX && a->rope_style != OPGRAFT_ROPE_GPTJ)
      return OG_REASON("unknown rotary embedding style %d", a->rope_style);
    if (!a->q_norm_weight && a->rope_style == OPGRAFT_ROPE_NONE) return OG_REASON("a q/k epilogue with no norm and no rotation");
    if (a->rope_style != OPGRAFT_ROPE_NONE && (a->rope_rows < 1 || a->cos_sin_stride < D || a->cos_sin_stride % 8))
      return OG_REASON("rotary cache of %lld rows, row stride %lld (at least head_size, a multiple of 8 elements)",
                       (long long)a->rope_rows, (long long)a->cos_sin_stride);
  } else if (a->q_heads || a->q_norm_weight || a->k_norm_weight || a->rope_style) {
    return OG_REASON("q/k epilogue arguments given with qk_heads 0");
  }
  /* One row needs no row stride (a [1, K] view may carry any). */
  if (M > 1 && a->x_stride[0] < K)
    return OG_REASON("x row stride %lld < in_features %lld", (long long)a->x_stride[0], (long long)K);
  if (M > 1 && a->x_stride[0] % 8)
    return OG_REASON("x row stride %lld is not a multiple of 8 elements (16 bytes)", (long long)a->x_stride[0]);
  if (M > 1 && a->out_stride[0] < N)
    return OG_REASON("out row stride %lld < out_features %lld", (long long)a->out_stride[0], (long long)N);
  return OPGRAFT_OK;
}

const char *opgraft__linear_qk_pointer_problem(const opgraft_linear_args *a) {
  if (a->rope_style && (!a->cos_sin_cache || !a->positions)) return "cos_sin_cache or positions is NULL";
  if (((uintptr_t)a->q_norm_weight | (uintptr_t)a->k_norm_weight | (uintptr_t)a->cos_sin_cache) & 15u ||
      ((uintptr_t)a->positions & 7u))
    return "a q/k epilogue pointer is misaligned";
  return NULL;
}

int32_t opgraft__linear_check_pointers(const opgraft_linear_args *a, char *reason, size_t reason_len) {
  if (a->rows > 0 && (!a->x || !a->weight || !a->out)) return OG_REASON("a tensor pointer is NULL");
  if ((((uintptr_t)a->x | (uintptr_t)a->weight) & 15u)) return OG_REASON("x or weight not 16-byte aligned");
  if ((((uintptr_t)a->out | (uintptr_t)a->bias) & 1u)) return OG_REASON("out or bias misaligned");
  if (a->residual && a->rows > 0) {
    if (!a->residual_out || !a->norm_weight) return OG_REASON("residual_out or norm_weight is NULL");
    if (((uintptr_t)a->residual | (uintptr_t)a->residual_out | (uintptr_t)a->norm_weight |
         (uintptr_t)a->normed_out) & 15u)
      return OG_REASON("residual, residual_out, norm_weight or normed_out not 16-byte aligned");
  }
  const char *qk = a->qk_heads && a->rows > 0 ? opgraft__linear_qk_pointer_problem(a) : NULL;
  if (qk) return OG_REASON("%s", qk);
  if (opgraft__linear_is_fp8(a) && a->rows > 0 && (!a->weight_scale || ((uintptr_t)a->weight_scale & 3u)))
    return OG_REASON("FP8 weight scales NULL or misaligned");
  return OPGRAFT_OK;
}

int32_t opgraft__linear_check_device(const opgraft_linear_args *a, int32_t *arch_out, char *gpu, size_t gpu_len,
                                     char *reason, size_t reason_len) {
  int32_t arch = a->arch;
  if (gpu && gpu_len) opgraft__copy(gpu, gpu_len, a->gpu_name);
  if (!arch) {
    const int32_t st = opgraft__current_device(NULL, &arch, gpu, gpu_len);
    if (st) return OG_REASON("no GPU: %s", opgraft_last_error());
  }
  if (arch < OG_LINEAR_MIN_ARCH) return OG_REASON("sm_%d is older than sm_%d", arch, OG_LINEAR_MIN_ARCH);
  if (opgraft__linear_is_fp8(a) && arch < OG_LINEAR_FP8_MIN_ARCH)
    return OG_REASON("FP8 weights on sm_%d: the kernel needs sm_%d (cvt e4m3x2)", arch, OG_LINEAR_FP8_MIN_ARCH);
  if (a->qk_heads && arch < 90)
    return OG_REASON("the q/k epilogue on sm_%d: it needs thread-block clusters (sm_90)", arch);
  char shape[96];
  opgraft__linear_shape_key(a, shape, sizeof shape);
  const char *g = gpu && *gpu ? gpu : NULL;
  const int64_t max_rows = opgraft__tune_value("linear.max_rows", arch, g, shape, (int32_t)a->rows);
  if (a->rows > max_rows)
    return OG_REASON("rows %lld > linear.max_rows %lld", (long long)a->rows, (long long)max_rows);
  if (arch_out) *arch_out = arch;
  return OPGRAFT_OK;
}

int32_t opgraft_linear_supports(const opgraft_linear_args *args, char *reason, size_t reason_len) {
  char local[256];
  if (!reason || !reason_len) reason = local, reason_len = sizeof local;
  reason[0] = 0;
  char gpu[256];
  int32_t st = opgraft__linear_check_static(args, reason, reason_len);
  if (!st) st = opgraft__linear_check_pointers(args, reason, reason_len);
  if (!st) st = opgraft__linear_check_device(args, NULL, gpu, sizeof gpu, reason, reason_len);
  if (st) opgraft__fail(st, "linear call not supported: %s", reason);
  return st;
}
