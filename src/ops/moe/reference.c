/* CPU oracle for the MoE experts computation: fp64 accumulation on host pointers. Used by the
 * tests and as the CPU path. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"

static double load_act(const opgraft_moe_args *a, const void *base, int64_t idx) {
  return opgraft__half_to_double(a->dtype, ((const uint16_t *)base)[idx]);
}

static int64_t load_id(const opgraft_moe_args *a, int64_t t, int64_t j) {
  const int64_t idx = t * a->topk_ids_stride[0] + j * a->topk_ids_stride[1];
  return a->topk_ids_dtype == OPGRAFT_DTYPE_INT64 ? ((const int64_t *)a->topk_ids)[idx]
                                                  : ((const int32_t *)a->topk_ids)[idx];
}

int32_t opgraft_moe_reference(const opgraft_moe_args *a, double *out_f64) {
  if (!a || a->struct_size < sizeof *a) return opgraft__fail(OPGRAFT_EINVAL, "bad arguments");
  if ((a->dtype != OPGRAFT_DTYPE_BF16 && a->dtype != OPGRAFT_DTYPE_FP16) ||
      a->activation != OPGRAFT_ACT_SILU || a->topk_weights_dtype != OPGRAFT_DTYPE_FP32 ||
      (a->topk_ids_dtype != OPGRAFT_DTYPE_INT32 && a->topk_ids_dtype != OPGRAFT_DTYPE_INT64))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "the reference covers bf16/fp16 SwiGLU");
  if (a->expert_map && a->expert_map_len < 1) return opgraft__fail(OPGRAFT_EINVAL, "expert_map without a length");
  const int64_t T = a->num_tokens, H = a->hidden, I = a->inter, E = a->num_experts, K = a->top_k;
  if (T < 0 || H < 1 || I < 1 || E < 1 || K < 1) return opgraft__fail(OPGRAFT_EINVAL, "bad sizes");
  if (T == 0) return OPGRAFT_OK;
  if (!a->hidden_states || !a->w13 || !a->w2 || !a->topk_weights || !a->topk_ids || (!out_f64 && !a->out))
    return opgraft__fail(OPGRAFT_EINVAL, "NULL tensor");
  double *x = malloc(sizeof(double) * (size_t)H), *act = malloc(sizeof(double) * (size_t)I);
  double *acc = malloc(sizeof(double) * (size_t)H);
  if (!x || !act || !acc) {
    free(x), free(act), free(acc);
    return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  }
  const float *tw = a->topk_weights;
  for (int64_t t = 0; t < T; ++t) {
    memset(acc, 0, sizeof(double) * (size_t)H);
    for (int64_t j = 0; j < K; ++j) {
      int64_t e = load_id(a, t, j);
      if (a->expert_map) /* global id -> this rank's expert, or -1 */
        e = (e >= 0 && e < a->expert_map_len) ? ((const int32_t *)a->expert_map)[e] : -1;
      if (e < 0 || e >= E) continue; /* not routed here */
      const double w = tw[t * a->topk_weights_stride[0] + j * a->topk_weights_stride[1]];
      const double xs = a->apply_router_weight_on_input ? w : 1.0;
      for (int64_t h = 0; h < H; ++h)
        x[h] = xs * load_act(a, a->hidden_states, t * a->hidden_states_stride[0] + h * a->hidden_states_stride[1]);
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        const int64_t gr = e * a->w13_stride[0] + i * a->w13_stride[1];
        const int64_t ur = e * a->w13_stride[0] + (I + i) * a->w13_stride[1];
        for (int64_t h = 0; h < H; ++h) {
          g += load_act(a, a->w13, gr + h * a->w13_stride[2]) * x[h];
          u += load_act(a, a->w13, ur + h * a->w13_stride[2]) * x[h];
        }
        act[i] = g / (1.0 + opgraft__exp(-g)) * u;
      }
      const double ow = a->apply_router_weight_on_input ? 1.0 : w;
      for (int64_t h = 0; h < H; ++h) {
        double y = 0;
        const int64_t r = e * a->w2_stride[0] + h * a->w2_stride[1];
        for (int64_t i = 0; i < I; ++i) y += load_act(a, a->w2, r + i * a->w2_stride[2]) * act[i];
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
  free(x), free(act), free(acc);
  return OPGRAFT_OK;
}
