/* CPU oracle for the MoE experts computation: fp64 accumulation on host pointers. Used by the
 * tests and as the CPU path. With FP8 weights it is the exact math of the quantized model: the
 * e4m3 weights and activations dequantized with their scales (as vLLM's prepare step quantized
 * the activations), the intermediate silu(gate) * up kept exact. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"

static double load_act(const opgraft_moe_args *a, const void *base, int64_t idx) {
  return opgraft__half_to_double(a->dtype, ((const uint16_t *)base)[idx]);
}

/* ---- FP8 weights: the dequantized values, with the scales as the header describes them ---- */

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

static double load_f32(const void *base, int64_t idx) { return ((const float *)base)[idx]; }

/* hidden_states[t, h] (any weights; not for 16-bit hidden states with FP8 weights). */
static double load_x(const opgraft_moe_args *a, int64_t t, int64_t h) {
  const int64_t idx = t * a->hidden_states_stride[0] + h * a->hidden_states_stride[1];
  if (!opgraft__moe_is_fp8(a)) return load_act(a, a->hidden_states, idx);
  const double q = opgraft__e4m3_to_double(((const uint8_t *)a->hidden_states)[idx]);
  if (a->scale_layout == OPGRAFT_MOE_SCALE_TENSOR) return q * load_f32(a->hidden_scale, 0);
  return q * load_f32(a->hidden_scale, t * a->hidden_scale_stride[0] + (h / a->block_k) * a->hidden_scale_stride[1]);
}

/* w13[e, r, h]: r < I the gate rows, then the up rows. */
static double load_w13(const opgraft_moe_args *a, int64_t e, int64_t r, int64_t h) {
  const int64_t idx = e * a->w13_stride[0] + r * a->w13_stride[1] + h * a->w13_stride[2];
  if (!opgraft__moe_is_fp8(a)) return load_act(a, a->w13, idx);
  const double q = opgraft__e4m3_to_double(((const uint8_t *)a->w13)[idx]);
  const int64_t *s = a->w13_scale_stride, I = a->inter, up = r >= I;
  if (a->scale_layout == OPGRAFT_MOE_SCALE_TENSOR) return q * load_f32(a->w13_scale, e * s[0] + up * s[1]);
  /* each half has ceil(I / block_n) row blocks, the gate's first */
  const int64_t rb = up ? cdiv(I, a->block_n) + (r - I) / a->block_n : r / a->block_n;
  return q * load_f32(a->w13_scale, e * s[0] + rb * s[1] + (h / a->block_k) * s[2]);
}

/* w2[e, h, i]. */
static double load_w2(const opgraft_moe_args *a, int64_t e, int64_t h, int64_t i) {
  const int64_t idx = e * a->w2_stride[0] + h * a->w2_stride[1] + i * a->w2_stride[2];
  if (!opgraft__moe_is_fp8(a)) return load_act(a, a->w2, idx);
  const double q = opgraft__e4m3_to_double(((const uint8_t *)a->w2)[idx]);
  const int64_t *s = a->w2_scale_stride;
  if (a->scale_layout == OPGRAFT_MOE_SCALE_TENSOR) return q * load_f32(a->w2_scale, e * s[0]);
  return q * load_f32(a->w2_scale, e * s[0] + (h / a->block_n) * s[1] + (i / a->block_k) * s[2]);
}

/* The FP8 arguments the oracle understands: OPGRAFT_OK, or why not. */
static int32_t check_fp8(const opgraft_moe_args *a) {
  if (a->scale_dtype != OPGRAFT_DTYPE_FP32) return opgraft__fail(OPGRAFT_EUNSUPPORTED, "FP8 scales must be fp32");
  if (a->scale_layout == OPGRAFT_MOE_SCALE_BLOCK) {
    if (a->block_n < 1 || a->block_k < 1) return opgraft__fail(OPGRAFT_EINVAL, "FP8 blocks %dx%d", a->block_n, a->block_k);
  } else if (a->scale_layout != OPGRAFT_MOE_SCALE_TENSOR) {
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "FP8 scale layout %d", a->scale_layout);
  }
  const int xq = opgraft__moe_quantizes_x(a);
  if (xq && a->hidden % opgraft__moe_x_group(a))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "16-bit hidden states need H a multiple of the quantization group");
  if (a->num_tokens > 0 && ((!a->hidden_scale && !xq) || !a->w13_scale || !a->w2_scale))
    return opgraft__fail(OPGRAFT_EINVAL, "NULL FP8 scale");
  return OPGRAFT_OK;
}

static int64_t load_id(const opgraft_moe_args *a, int64_t t, int64_t j) {
  const int64_t idx = t * a->topk_ids_stride[0] + j * a->topk_ids_stride[1];
  return a->topk_ids_dtype == OPGRAFT_DTYPE_INT64 ? ((const int64_t *)a->topk_ids)[idx]
                                                  : ((const int32_t *)a->topk_ids)[idx];
}

/* Routing from logits (routing != 0): token t's k largest logits, ties to the lower id, in
 * decreasing order, and their softmax weights (over all E, or over the k for _RENORM). */
static void route_token(const opgraft_moe_args *a, int64_t t, int64_t *ids, double *w) {
  const int64_t E = a->num_experts, K = a->top_k;
  const uint16_t *row = (const uint16_t *)a->router_logits + t * a->router_logits_stride[0];
  double all = 0, picked = 0;
  for (int64_t j = 0; j < K; ++j) {
    int64_t best = -1;
    double bv = 0;
    for (int64_t e = 0; e < E; ++e) {
      int used = 0;
      for (int64_t i = 0; i < j; ++i) used |= ids[i] == e;
      const double v = opgraft__half_to_double(a->dtype, row[e * a->router_logits_stride[1]]);
      if (!used && (best < 0 || v > bv)) best = e, bv = v;
    }
    ids[j] = best, w[j] = bv;
  }
  const double mx = w[0];
  for (int64_t e = 0; e < E; ++e)
    all += opgraft__exp(opgraft__half_to_double(a->dtype, row[e * a->router_logits_stride[1]]) - mx);
  for (int64_t j = 0; j < K; ++j) picked += (w[j] = opgraft__exp(w[j] - mx));
  const double sum = a->routing == OPGRAFT_MOE_ROUTING_SOFTMAX_RENORM ? picked : all;
  for (int64_t j = 0; j < K; ++j) w[j] /= sum;
}

int32_t opgraft_moe_reference(const opgraft_moe_args *a, double *out_f64) {
  if (!a || a->struct_size < sizeof *a) return opgraft__fail(OPGRAFT_EINVAL, "bad arguments");
  if ((a->dtype != OPGRAFT_DTYPE_BF16 && a->dtype != OPGRAFT_DTYPE_FP16) ||
      a->activation != OPGRAFT_ACT_SILU || a->topk_weights_dtype != OPGRAFT_DTYPE_FP32 ||
      (a->topk_ids_dtype != OPGRAFT_DTYPE_INT32 && a->topk_ids_dtype != OPGRAFT_DTYPE_INT64) ||
      (a->weight_dtype != 0 && a->weight_dtype != a->dtype && !opgraft__moe_is_fp8(a)))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "the reference covers bf16/fp16 SwiGLU, with bf16/fp16 or FP8 weights");
  int32_t st;
  if (opgraft__moe_is_fp8(a) && (st = check_fp8(a))) return st;
  if (a->expert_map && a->expert_map_len < 1) return opgraft__fail(OPGRAFT_EINVAL, "expert_map without a length");
  const int64_t T = a->num_tokens, H = a->hidden, I = a->inter, E = a->num_experts, K = a->top_k;
  if (T < 0 || H < 1 || I < 1 || E < 1 || K < 1) return opgraft__fail(OPGRAFT_EINVAL, "bad sizes");
  if (T == 0) return OPGRAFT_OK;
  const int routed = opgraft__moe_routed(a);
  if (routed && (a->routing != OPGRAFT_MOE_ROUTING_SOFTMAX && a->routing != OPGRAFT_MOE_ROUTING_SOFTMAX_RENORM))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "routing %d", a->routing);
  if (routed && (K > OG_MOE_MAX_TOPK || K > E || a->expert_map))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "routing from logits with these arguments");
  if (!a->hidden_states || !a->w13 || !a->w2 || (routed ? !a->router_logits : !a->topk_weights || !a->topk_ids) ||
      (!out_f64 && !a->out))
    return opgraft__fail(OPGRAFT_EINVAL, "NULL tensor");
  double *x = malloc(sizeof(double) * (size_t)H), *act = malloc(sizeof(double) * (size_t)I);
  double *acc = malloc(sizeof(double) * (size_t)H), *xt = malloc(sizeof(double) * (size_t)H);
  if (!x || !act || !acc || !xt) {
    free(x), free(act), free(acc), free(xt);
    return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  }
  /* 16-bit hidden states with FP8 weights: each token's row quantized as gate_up does */
  const int xq = opgraft__moe_quantizes_x(a);
  const float *tw = a->topk_weights;
  for (int64_t t = 0; t < T; ++t) {
    int64_t rid[OG_MOE_MAX_TOPK] = {0};
    double rw[OG_MOE_MAX_TOPK] = {0};
    if (routed) route_token(a, t, rid, rw);
    memset(acc, 0, sizeof(double) * (size_t)H);
    const uint16_t *row = (const uint16_t *)a->hidden_states + t * a->hidden_states_stride[0];
    if (!xq) {
      for (int64_t h = 0; h < H; ++h) xt[h] = load_x(a, t, h);
    } else {
      const int64_t xg = opgraft__moe_x_group(a);
      for (int64_t h0 = 0; h0 < H; h0 += xg) {
        const double sx = opgraft__e4m3_quantize_group(a->dtype, row + h0 * a->hidden_states_stride[1],
                                                       a->hidden_states_stride[1], xg, xt + h0);
        for (int64_t h = h0; h < h0 + xg; ++h) xt[h] *= sx;
      }
    }
    for (int64_t j = 0; j < K; ++j) {
      int64_t e = routed ? rid[j] : load_id(a, t, j);
      if (a->expert_map) /* global id -> this rank's expert, or -1 */
        e = (e >= 0 && e < a->expert_map_len) ? ((const int32_t *)a->expert_map)[e] : -1;
      if (e < 0 || e >= E) continue; /* not routed here */
      const double w = routed ? rw[j] : tw[t * a->topk_weights_stride[0] + j * a->topk_weights_stride[1]];
      const double xs = a->apply_router_weight_on_input ? w : 1.0;
      for (int64_t h = 0; h < H; ++h) x[h] = xs * xt[h];
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int64_t h = 0; h < H; ++h) {
          g += load_w13(a, e, i, h) * x[h];
          u += load_w13(a, e, I + i, h) * x[h];
        }
        act[i] = g / (1.0 + opgraft__exp(-g)) * u;
      }
      const double ow = a->apply_router_weight_on_input ? 1.0 : w;
      for (int64_t h = 0; h < H; ++h) {
        double y = 0;
        for (int64_t i = 0; i < I; ++i) y += load_w2(a, e, h, i) * act[i];
        acc[h] += ow * y;
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      if (out_f64) {
        out_f64[t * H + h] = acc[h];
      } else {
        uint16_t *o = (uint16_t *)a->out + t * a->out_stride[0] + h * a->out_stride[1];
        *o = opgraft__double_to_half(a->dtype, acc[h]);
      }
    }
  }
  free(x), free(act), free(acc), free(xt);
  return OPGRAFT_OK;
}
