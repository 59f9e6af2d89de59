/* opgraft's MoE experts op. Included by opgraft/opgraft.h. */
#ifndef OPGRAFT_MOE_H
#define OPGRAFT_MOE_H

#include "opgraft/opgraft.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * MoE experts (fused_experts contract, after routing):
 *   out[t] = sum_j w[t,j] * W2[e] (act(G[e] x_t) * U[e] x_t),  e = topk_ids[t,j]
 * with w13[e] = [G[e]; U[e]] of shape [2I, H] (gate rows first) and w2[e] of shape [I -> H],
 * i.e. [H, I]. With apply_router_weight_on_input the weight scales x_t instead and the sum is
 * unweighted. Accumulation is fp32; out has the activation dtype. Ids outside [0, E) contribute
 * nothing.
 *
 * FP8 weights (weight_dtype OPGRAFT_DTYPE_FP8_E4M3; the layouts of vLLM's Fp8MoEMethod, read in
 * vLLM 0.26.0 and 0.33.0, model_executor/layers/quantization/fp8.py and fused_moe/):
 *   w13 [E, 2I, H] and w2 [E, H, I] in float8_e4m3fn, and hidden_states [T, H] in e4m3fn too:
 *   the activations as vLLM's prepare step quantized them (moe_kernel_quantize_input), so that
 *   G[e] x_t above reads sum_h (w13_q[e,r,h] * s13(e,r,h)) * (x_q[t,h] * sx(t,h)).
 *   OPGRAFT_MOE_SCALE_BLOCK (weight_block_size [block_n, block_k], DeepSeek-V3 / Qwen3 FP8
 *   checkpoints: 128x128): fp32 scales w13_scale [E, 2*ceil(I/bn), ceil(H/bk)] (the gate's
 *   ceil(I/bn) row blocks, then the up half's), w2_scale [E, ceil(H/bn), ceil(I/bk)]
 *   (vLLM's w13_weight_scale_inv / w2_weight_scale_inv), and per-token groups of bk activations,
 *   hidden_scale [T, ceil(H/bk)] (vLLM's a1q_scale from per_token_group_quant_fp8, fp32, maybe
 *   powers of two where DeepGEMM's UE8M0 is in use: the values are used as they are).
 *   OPGRAFT_MOE_SCALE_TENSOR: one fp32 scale per expert matrix, w13_scale[e * s0 + half * s1]
 *   (half 0 gate, 1 up; s1 = 0 for vLLM's one scale per expert after
 *   process_weights_after_loading) and w2_scale[e * s0], and one dynamic activation scale
 *   hidden_scale[0] (scaled_fp8_quant's per-tensor scale of the call's hidden states).
 *   Scale strides are in elements, non-negative, of any layout (DeepGEMM's transposed scales too).
 *   dtype is then the output's (bf16 or fp16). The intermediate silu(gate) * up * w is kept in
 *   f16 (11 significant bits) on one fp32 scale per (token, slot) and 16 consecutive rows of I,
 *   where vLLM's TritonExperts quantizes it to one e4m3 term per 1x128 group (block) or per
 *   tensor: more precise. With FP8 weights
 *   apply_router_weight_on_input is refused.
 * ------------------------------------------------------------------------------------------- */
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
  /* ---- ABI 4: quantized weights (all zero for bf16/fp16 weights) ---- */
  int32_t weight_dtype; /* 0 (weights in dtype) or OPGRAFT_DTYPE_FP8_E4M3 (hidden_states e4m3 too) */
  int32_t scale_layout; /* opgraft_moe_scale_layout */
  int32_t block_n;      /* OPGRAFT_MOE_SCALE_BLOCK: the weights' block shape (rows, columns) */
  int32_t block_k;
  int32_t scale_dtype;  /* the three scales' dtype: OPGRAFT_DTYPE_FP32 */
  const void *hidden_scale;
  int64_t hidden_scale_stride[2]; /* [T, ceil(H/block_k)]; unused for a per-tensor scale */
  const void *w13_scale;
  int64_t w13_scale_stride[3]; /* [E, 2*ceil(I/block_n), ceil(H/block_k)], or [E] / [E, 2] */
  const void *w2_scale;
  int64_t w2_scale_stride[3]; /* [E, ceil(H/block_n), ceil(I/block_k)], or [E] */
  /* ---- ABI 5: routing inside the kernels (routing 0: topk_weights and topk_ids are inputs) ---- */
  int32_t routing; /* opgraft_moe_routing */
  /* routing != 0: the router's logits [T, num_experts] in dtype (no expert_map, no
   * apply_router_weight_on_input; ABI 7: FP8 weights too, dtype then being the output's).
   * topk_weights (fp32) and topk_ids (int32), both [T, k] contiguous, then receive the routing the
   * kernels computed, or are NULL (not written). */
  const void *router_logits;
  int64_t router_logits_stride[2];
  /* ---- ABI 9: FP8 weights with 16-bit hidden states ---- */
  /* With FP8 weights: 0 or OPGRAFT_DTYPE_FP8_E4M3 (hidden_states e4m3, scaled by hidden_scale), or
   * dtype: hidden_states in dtype, which gate_up quantizes itself per token and 1 x block_k group
   * as vLLM's block-FP8 activation quantization does (amax = max(max |x|, 1e-10) in fp32, scale
   * amax / 448, q = e4m3(x * (448 / amax)), nearest even, saturating); H a multiple of block_k,
   * hidden_scale unused (NULL). With per-tensor scales: in 1 x 128 groups the same way, finer
   * than vLLM's one dynamic scale a call (H a multiple of 128). */
  int32_t hidden_dtype;
} opgraft_moe_args;

/* How the call is routed (opgraft_moe_args.routing). The softmax routings are vLLM's
 * topk_softmax (fused_moe/router/fused_topk_router.py): softmax over the E logits, the k largest
 * (ties to the lower expert id), in decreasing order; _RENORM divides the k weights by their sum. */
typedef enum {
  OPGRAFT_MOE_ROUTING_TOPK = 0,           /* topk_weights and topk_ids given */
  OPGRAFT_MOE_ROUTING_SOFTMAX = 1,        /* from router_logits, softmax top-k */
  OPGRAFT_MOE_ROUTING_SOFTMAX_RENORM = 2, /* the same, renormalized over the k picked */
} opgraft_moe_routing;

/* How FP8 weights are scaled (opgraft_moe_args.scale_layout). */
typedef enum {
  OPGRAFT_MOE_SCALE_NONE = 0,   /* bf16/fp16 weights */
  OPGRAFT_MOE_SCALE_BLOCK = 1,  /* block_n x block_k weight blocks, 1 x block_k activation groups */
  OPGRAFT_MOE_SCALE_TENSOR = 2, /* one scale per expert matrix, one dynamic activation scale */
} opgraft_moe_scale_layout;

/* Can the kernel take this call? OPGRAFT_OK, or OPGRAFT_EUNSUPPORTED with a short reason (e.g.
 * "tokens 64 > moe.max_tokens 16") written to reason. Looks only at the arguments, never at the
 * data, and needs no GPU when args->arch is set. */
OPGRAFT_EXTERN int32_t opgraft_moe_supports(const opgraft_moe_args *args, char *reason,
                                            size_t reason_len);

/* Bytes of device workspace opgraft_moe_run needs for these arguments (16-byte aligned; the
 * contents need not be initialised: the library resets what it uses, on the stream). */
OPGRAFT_EXTERN int32_t opgraft_moe_workspace_size(const opgraft_moe_args *args, size_t *bytes);

/* A plan: the guard's decision, the tunables and the compiled kernels for one (shape, dtypes,
 * strides, flags, GPU), resolved once, so that a call is one cheap launch (FlashInfer's plan/run).
 * The pointers in args are not kept. On OPGRAFT_EUNSUPPORTED, reason says why (as
 * opgraft_moe_supports). The plan belongs to the CUDA context current at creation. */
typedef struct opgraft_moe_plan opgraft_moe_plan;
OPGRAFT_EXTERN int32_t opgraft_moe_plan_create(const opgraft_moe_args *args, opgraft_moe_plan **plan, char *reason,
                                               size_t reason_len);
OPGRAFT_EXTERN void opgraft_moe_plan_destroy(opgraft_moe_plan *plan);
/* Bytes of workspace a run of the plan needs (as opgraft_moe_workspace_size). */
OPGRAFT_EXTERN size_t opgraft_moe_plan_workspace_size(const opgraft_moe_plan *plan);
/* Runs the plan on tensors laid out as at creation (same strides), on stream. Pointers that are
 * misaligned give OPGRAFT_EINVAL; a plan made before the tunables changed, or used under another
 * CUDA context, gives OPGRAFT_ESTALE and runs nothing. expert_map must be set iff it was. */
OPGRAFT_EXTERN int32_t opgraft_moe_plan_run(const opgraft_moe_plan *plan, const void *hidden_states, const void *w13,
                                            const void *w2, const void *topk_weights, const void *topk_ids,
                                            const void *expert_map, void *out, void *workspace, void *stream);
/* The same for a plan with routing != 0: router_logits as at creation; topk_weights and topk_ids
 * receive the routing (or are NULL). opgraft_moe_plan_run refuses such a plan (OPGRAFT_EINVAL) and
 * this one a plan without it. */
OPGRAFT_EXTERN int32_t opgraft_moe_plan_run_routed(const opgraft_moe_plan *plan, const void *hidden_states,
                                                   const void *w13, const void *w2, const void *router_logits,
                                                   void *topk_weights, void *topk_ids, void *out, void *workspace,
                                                   void *stream);
/* The same for a plan of FP8 weights (weight_dtype OPGRAFT_DTYPE_FP8_E4M3), with the three scales
 * laid out as at creation (hidden_scale NULL where the plan's hidden_dtype is dtype: the kernel
 * quantizes the hidden states); opgraft_moe_plan_run refuses such a plan (OPGRAFT_EINVAL) and this
 * one a plan without FP8 weights. */
OPGRAFT_EXTERN int32_t opgraft_moe_plan_run_fp8(const opgraft_moe_plan *plan, const void *hidden_states,
                                                const void *hidden_scale, const void *w13, const void *w13_scale,
                                                const void *w2, const void *w2_scale, const void *topk_weights,
                                                const void *topk_ids, const void *expert_map, void *out,
                                                void *workspace, void *stream);
/* ABI 7: a plan of FP8 weights with routing != 0 (both of the above); the others refuse it. */
OPGRAFT_EXTERN int32_t opgraft_moe_plan_run_routed_fp8(const opgraft_moe_plan *plan, const void *hidden_states,
                                                       const void *hidden_scale, const void *w13,
                                                       const void *w13_scale, const void *w2, const void *w2_scale,
                                                       const void *router_logits, void *topk_weights,
                                                       void *topk_ids, void *out, void *workspace, void *stream);

/* Runs the experts computation on stream (a CUstream / cudaStream_t; NULL = legacy default)
 * through a plan cached inside the library (a convenience for C callers; the Python layer keeps
 * its own plans).
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


/* Compiles the kernels this call would use for the given arch (needs NVRTC, no GPU) and reports
 * their resources. count receives the number of kernels (at most cap are written). */
OPGRAFT_EXTERN int32_t opgraft_moe_compile_report(const opgraft_moe_args *args, int32_t arch,
                                                  opgraft_kernel_info *out, int32_t cap,
                                                  int32_t *count);

/* The kernel configuration a call would get on arch (compile options such as "-DOG_W1=4 ..."),
 * for tools and tests; no GPU needed when args->arch is set. */
OPGRAFT_EXTERN int32_t opgraft_moe_describe(const opgraft_moe_args *args, int32_t arch, char *buf, size_t buf_len);

#ifdef __cplusplus
}
#endif
#endif /* OPGRAFT_MOE_H */
