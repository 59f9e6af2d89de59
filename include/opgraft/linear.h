/* opgraft's linear op (decode projections). Included by opgraft/opgraft.h. */
#ifndef OPGRAFT_LINEAR_H
#define OPGRAFT_LINEAR_H

#include "opgraft/opgraft.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Linear (torch.nn.functional.linear for a few rows):
 *   out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]),  m < rows <= 8
 * with fp32 accumulation, rounded once to the output dtype. Each weight byte is read once per
 * call; the summation order is fixed, so the same inputs give the same bits every run.
 *
 * Block-FP8 weights (weight_dtype OPGRAFT_DTYPE_FP8_E4M3; vLLM's Fp8LinearMethod with a
 * weight_block_size, DeepSeek-V3 / Qwen3 FP8 checkpoints: 128x128): W e4m3 [N, K] with fp32
 * scales weight_scale [ceil(N/block_n), K/block_k] (vLLM's weight_scale_inv, any strides), and x
 * quantized as vLLM's W8A8 block path does before its GEMM, per row m and group g of block_k
 * columns: amax = max(max_k |x[m,k]|, 1e-10), sx = amax / 448, q = e4m3(x * (448 / amax))
 * (nearest even, saturating; fp32 IEEE arithmetic). Then
 *   out[m, n] = sum_g weight_scale[n / block_n][g] * sx[m][g] * sum_{k in g} q[m, k] * W[n, k]
 * (+ bias[n]); block_n a multiple of 16, block_k a multiple of 64 dividing K; sm_89 or newer.
 *
 * Add + RMSNorm before the projection (16-bit weights; residual set): vLLM's fused_add_rms_norm
 * of x and residual, then the projection of its normalized output, in one launch. Per row m, in
 * fp32: h = x + residual, residual_out = round(h), r = rsqrt(mean_k h^2 + norm_eps), and the
 * projection's input is round(round(h * r) * norm_weight) (round: to dtype, nearest even).
 * ------------------------------------------------------------------------------------------- */
typedef struct opgraft_linear_args {
  uint32_t struct_size; /* sizeof(opgraft_linear_args), checked */
  int32_t dtype;        /* x: OPGRAFT_DTYPE_BF16 or _FP16 */
  int32_t weight_dtype; /* dtype, or OPGRAFT_DTYPE_FP8_E4M3 (block scales below) */
  int32_t bias_dtype;   /* must equal dtype when bias is set */
  int32_t out_dtype;    /* must equal dtype */
  int64_t rows;         /* M: rows of x and out (the tokens of a decode step) */
  int64_t out_features; /* N: rows of weight, columns of out */
  int64_t in_features;  /* K: columns of x and weight, a multiple of 8 */
  const void *x;
  int64_t x_stride[2]; /* [M, K]: a 16-byte aligned base, rows 16-byte aligned, columns contiguous */
  const void *weight;
  int64_t weight_stride[2]; /* [N, K]: likewise (16-byte aligned rows) */
  const void *bias;         /* NULL, or [N] contiguous */
  void *out;
  int64_t out_stride[2]; /* [M, N]: columns contiguous */
  /* The GPU the call runs on, as major*10 + minor, and its name; 0 / NULL = the current device. */
  int32_t arch;
  const char *gpu_name;
  /* FP8 weights only (ABI 8); zero / NULL for 16-bit weights. */
  int32_t block_n, block_k; /* the weight blocks (vLLM's weight_block_size) */
  int32_t scale_dtype;      /* OPGRAFT_DTYPE_FP32 */
  const void *weight_scale;
  int64_t weight_scale_stride[2]; /* [ceil(N/block_n), K/block_k], non-negative */
  /* Add + RMSNorm before the projection (ABI 10); residual NULL = none. residual, residual_out
   * and norm_weight are of norm_dtype, which must equal dtype. */
  int32_t norm_dtype;
  float norm_eps; /* finite, >= 0 */
  const void *residual;
  int64_t residual_stride[2]; /* [M, K]: like x (16-byte aligned rows, columns contiguous) */
  void *residual_out;
  int64_t residual_out_stride[2]; /* [M, K]: likewise; may not overlap x or residual */
  const void *norm_weight;        /* [K] contiguous, 16-byte aligned */
  /* The normalized rows, round(round(h * r) * norm_weight), written where set (ABI 12; NULL = not
   * written; only with a residual): [M, K] of dtype, like residual_out, overlapping no other tensor
   * of the call. A MoE layer's experts read them after its router gate. */
  void *normed_out;
  int64_t normed_out_stride[2];
  /* vLLM's q/k RMSNorm and rotary embedding of the output's heads after the product (ABI 14;
   * 16-bit weights; qk_heads 0 = none). out is then a qkv projection's, head_size columns a head:
   * the first q_heads are queries, the next qk_heads - q_heads keys, the rest values. Each query and
   * key head of every row is normalized with q_norm_weight / k_norm_weight ([head_size] of dtype,
   * both or neither; qk_norm_eps) and rotated by rope_style (OPGRAFT_ROPE_*, attention.h) at
   * position positions[m] (int64 [M]) with cos_sin_cache ([rope_rows, cos_sin_stride] of dtype:
   * head_size / 2 cosines, then the sines; a position outside [0, rope_rows) is not rotated), the
   * same arithmetic and bits as opgraft_attention's prologue on the same product, before they are
   * stored; value heads stay as the product gives them. The kernel runs a head's blocks as one
   * thread-block cluster: sm_90 or newer. */
  int32_t head_size, q_heads, qk_heads, rope_style;
  float qk_norm_eps;
  const void *q_norm_weight, *k_norm_weight;
  const void *cos_sin_cache;
  int64_t cos_sin_stride, rope_rows;
  const void *positions;
} opgraft_linear_args;

/* Can the kernel take this call? OPGRAFT_OK, or OPGRAFT_EUNSUPPORTED with a short reason (e.g.
 * "rows 16 > linear.max_rows 8") written to reason. Looks only at the arguments, never at the
 * data, and needs no GPU when args->arch is set. */
OPGRAFT_EXTERN int32_t opgraft_linear_supports(const opgraft_linear_args *args, char *reason, size_t reason_len);

/* A plan: the guard's decision, the tunables and the compiled kernel for one layout (rows, sizes,
 * dtypes, strides, bias or not, GPU), resolved once, so that a call is one cheap launch. The
 * pointers in args are not kept. On OPGRAFT_EUNSUPPORTED, reason says why (as
 * opgraft_linear_supports). The plan belongs to the CUDA context current at creation. */
typedef struct opgraft_linear_plan opgraft_linear_plan;
OPGRAFT_EXTERN int32_t opgraft_linear_plan_create(const opgraft_linear_args *args, opgraft_linear_plan **plan,
                                                  char *reason, size_t reason_len);
OPGRAFT_EXTERN void opgraft_linear_plan_destroy(opgraft_linear_plan *plan);
/* Runs the plan on tensors laid out as at creation (same strides) on stream (a CUstream; NULL =
 * the legacy default stream). bias must be set iff it was at creation. Misaligned pointers give
 * OPGRAFT_EINVAL; a plan made before the tunables changed, or used under another CUDA context,
 * gives OPGRAFT_ESTALE. Either way nothing runs. Enqueues one kernel: no host synchronisation,
 * no allocation (CUDA-graph capturable). */
OPGRAFT_EXTERN int32_t opgraft_linear_plan_run(const opgraft_linear_plan *plan, const void *x, const void *weight,
                                               const void *bias, void *out, void *stream);
/* The same for a plan of FP8 weights (weight_scale 4-byte aligned); opgraft_linear_plan_run on
 * such a plan, or this one on a 16-bit plan, gives OPGRAFT_EINVAL. */
OPGRAFT_EXTERN int32_t opgraft_linear_plan_run_fp8(const opgraft_linear_plan *plan, const void *x, const void *weight,
                                                   const void *weight_scale, const void *bias, void *out,
                                                   void *stream);

/* The same for a plan made with a residual (add + RMSNorm before the projection): residual,
 * residual_out, norm_weight and normed_out as described above (normed_out set iff it was at
 * creation); opgraft_linear_plan_run on such a plan, or this one on a plan without a residual,
 * gives OPGRAFT_EINVAL. */
OPGRAFT_EXTERN int32_t opgraft_linear_plan_run_norm(const opgraft_linear_plan *plan, const void *x,
                                                    const void *residual, const void *norm_weight,
                                                    const void *weight, const void *bias, void *out,
                                                    void *residual_out, void *normed_out, void *stream);

/* Any plan's run with every pointer taken from args (laid out as at creation; the q/k
 * epilogue's plans run only this way): the checks of the entry points above. */
OPGRAFT_EXTERN int32_t opgraft_linear_plan_run_args(const opgraft_linear_plan *plan, const opgraft_linear_args *args,
                                                    void *stream);
/* The argument-struct form through plans cached inside the library (a convenience for C callers;
 * the Python layer keeps its own plans). The first call for a layout compiles the kernel (NVRTC)
 * or loads it from the cache. */
OPGRAFT_EXTERN int32_t opgraft_linear_run(const opgraft_linear_args *args, void *stream);

/* CPU oracle: the same function in fp64 on host pointers. Writes out_f64 ([M, N], contiguous)
 * when it is not NULL; otherwise rounds to args->out_dtype into args->out. */
OPGRAFT_EXTERN int32_t opgraft_linear_reference(const opgraft_linear_args *args, double *out_f64);

/* Compiles the kernel this call would use for the given arch (needs NVRTC, no GPU) and reports
 * its resources (count receives 1; at most cap entries are written). */
OPGRAFT_EXTERN int32_t opgraft_linear_compile_report(const opgraft_linear_args *args, int32_t arch,
                                                     opgraft_kernel_info *out, int32_t cap, int32_t *count);

/* The kernel configuration a call would get on arch (its compile options and launch shape, e.g.
 * "-DOG_K=2048 ... grid=214 threads=256"), for tools and tests; no GPU needed. */
OPGRAFT_EXTERN int32_t opgraft_linear_describe(const opgraft_linear_args *args, int32_t arch, char *buf,
                                               size_t buf_len);

#ifdef __cplusplus
}
#endif
#endif /* OPGRAFT_LINEAR_H */
