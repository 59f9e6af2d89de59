/* Kernel parameters of the MoE experts kernels, shared by the host launcher (C11) and the kernels
 * (NVRTC C++): plain types only, passed by value as the kernels' single parameter. Strides are in
 * elements. */
#ifndef OPGRAFT_MOE_PARAMS_H
#define OPGRAFT_MOE_PARAMS_H

typedef struct og_moe_params {
  const void *x;        /* [T, H] activations */
  const void *w13;      /* [E, 2I, H], gate rows first */
  const void *w2;       /* [E, H, I] */
  const float *topk_w;  /* [T, k] */
  const void *topk_ids; /* [T, k], int32 or int64 (OG_IDS64) */
  void *act;            /* workspace [T*k, I]: silu(gate)*up, router weight applied */
  void *out;            /* [T, H] */
  unsigned *sync;       /* moe_fused's barrier counter (zeroed before each launch), or NULL */
  const int *emap;      /* OG_EMAP: global expert id -> local id or -1, [emap_len] */
  long long x_stride;
  long long w13_estride, w13_rstride;
  long long w2_estride, w2_rstride;
  long long topk_w_stride, topk_ids_stride;
  long long out_stride;
  int T;
  int emap_len;
  unsigned long long *trace; /* OG_TRACE: per-block phase times, [3 kernels][trace_blocks][8], or NULL */
  int trace_blocks;
  /* OG_ROUTE (routing from the router's logits; topk_w and topk_ids unused): */
  const void *logits;      /* [T, E] in the hidden states' dtype, row stride logits_stride */
  int *route_ids;          /* the routing gate_up computed, [T, k] contiguous int32, or NULL */
  float *route_w;          /* its weights, [T, k] contiguous fp32, or NULL */
  long long logits_stride;
} og_moe_params;

#endif
