/* The MoE op's guard ("can we take this call, and why not"), its shape key and its workspace. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"

const char *opgraft__moe_dtype_name(int32_t d) {
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

int opgraft__moe_is_fp8(const opgraft_moe_args *a) { return a->weight_dtype == OPGRAFT_DTYPE_FP8_E4M3; }

int opgraft__moe_routed(const opgraft_moe_args *a) { return a->routing != OPGRAFT_MOE_ROUTING_TOPK; }

int opgraft__moe_quantizes_x(const opgraft_moe_args *a) {
  return opgraft__moe_is_fp8(a) && a->hidden_dtype == a->dtype;
}

int64_t opgraft__moe_x_group(const opgraft_moe_args *a) {
  return a->scale_layout == OPGRAFT_MOE_SCALE_BLOCK ? a->block_k : OG_MOE_X_GROUP;
}

/* The shape key's dtype field: the activations' dtype, or the FP8 weights' scaling. */
static const char *key_dtype(const opgraft_moe_args *a) {
  if (!opgraft__moe_is_fp8(a)) return opgraft__moe_dtype_name(a->dtype);
  return a->scale_layout == OPGRAFT_MOE_SCALE_TENSOR ? "fp8tensor" : "fp8block";
}

void opgraft__moe_shape_key(const opgraft_moe_args *a, char *buf, size_t len) {
  snprintf(buf, len, "moe:%s:E%lld:H%lld:I%lld:k%lld", key_dtype(a), (long long)a->num_experts, (long long)a->hidden,
           (long long)a->inter, (long long)a->top_k);
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* OPGRAFT_TRACE set (and not "0"): the kernels are compiled with OG_TRACE and record per-block
 * phase times (kernels/moe/moe_config.cuh) after the workspace's counter area: [3][blocks][8]
 * u64, blocks = the larger of the two stages' grids, at least 4096 (the cooperative grid). Read
 * when a shape's plan is made and by opgraft_moe_workspace_size; a plan with tracing writes only
 * into a workspace that has room for it. */
int opgraft__moe_trace_on(void) {
  return opgraft__env_switch("OPGRAFT_TRACE") == 1;
}
int64_t opgraft__moe_trace_blocks(const opgraft_moe_args *a) {
  int64_t b = a->num_tokens * a->top_k * (a->inter / 16); /* gate_up's grid is at most this */
  if (a->hidden / 16 > b) b = a->hidden / 16;
  return b > 4096 ? b : 4096;
}
size_t opgraft__moe_trace_bytes(const opgraft_moe_args *a) { return (size_t)(3 * opgraft__moe_trace_blocks(a) * 8 * 8); }

#define OG_REASON(...) (snprintf(reason, reason_len, __VA_ARGS__), OPGRAFT_EUNSUPPORTED)

/* FP8 weights: the scales' layout and dtype, and rows of whole 16-byte chunks (the kernels read
 * 8 bytes a lane at 8-byte aligned offsets). */
static int32_t check_fp8(const opgraft_moe_args *a, char *reason, size_t reason_len) {
  const int32_t L = a->scale_layout;
  if (L != OPGRAFT_MOE_SCALE_BLOCK && L != OPGRAFT_MOE_SCALE_TENSOR)
    return OG_REASON("FP8 weights with scale layout %d (128x128-style block or per-tensor scales supported)", L);
  if (a->scale_dtype != OPGRAFT_DTYPE_FP32)
    return OG_REASON("FP8 scales of dtype %s (fp32 expected)", opgraft__moe_dtype_name(a->scale_dtype));
  if (a->apply_router_weight_on_input) return OG_REASON("apply_router_weight_on_input with FP8 weights");
  if (L == OPGRAFT_MOE_SCALE_BLOCK &&
      (a->block_n < 32 || a->block_n % 32 || a->block_k < 32 || a->block_k % 32 || a->block_n > 65536 ||
       a->block_k > 65536))
    return OG_REASON("FP8 weight blocks %dx%d (multiples of 32 supported)", a->block_n, a->block_k);
  const int xq = opgraft__moe_quantizes_x(a);
  if (!xq && a->hidden_dtype != 0 && a->hidden_dtype != OPGRAFT_DTYPE_FP8_E4M3)
    return OG_REASON("FP8 weights with hidden states of dtype %s (e4m3, or the output's dtype)",
                     opgraft__moe_dtype_name(a->hidden_dtype));
  const int64_t xg = opgraft__moe_x_group(a);
  if (xq && xg > 128) return OG_REASON("16-bit hidden states with block_k %lld (at most 128)", (long long)xg);
  if (xq && a->hidden % xg)
    return OG_REASON("16-bit hidden states with H %lld not a multiple of %s %lld", (long long)a->hidden,
                     L == OPGRAFT_MOE_SCALE_BLOCK ? "block_k" : "the quantization group", (long long)xg);
  for (int i = 0; i < 3; ++i)
    if (a->w13_scale_stride[i] < 0 || a->w2_scale_stride[i] < 0 || (i < 2 && !xq && a->hidden_scale_stride[i] < 0))
      return OG_REASON("negative FP8 scale strides");
  /* e4m3 rows; 16-bit hidden states passed the generic check (16-byte rows) */
  if (a->w13_stride[0] % 16 || a->w13_stride[1] % 16 || a->w2_stride[0] % 16 || a->w2_stride[1] % 16 ||
      (!xq && a->hidden_states_stride[0] % 16))
    return OG_REASON("FP8 row strides are not multiples of 16 bytes");
  return OPGRAFT_OK;
}

/* Routing from the router's logits: softmax top-k of bf16/fp16 logits over at most
 * OG_MOE_ROUTE_MAX_EXPERTS experts, the outputs contiguous int32 / fp32. */
static int32_t check_routing(const opgraft_moe_args *a, char *reason, size_t reason_len) {
  if (a->routing != OPGRAFT_MOE_ROUTING_SOFTMAX && a->routing != OPGRAFT_MOE_ROUTING_SOFTMAX_RENORM)
    return OG_REASON("routing %d (softmax top-k, renormalized or not, supported)", a->routing);
  if (a->expert_map) return OG_REASON("routing from logits with an expert_map");
  if (a->apply_router_weight_on_input) return OG_REASON("routing from logits with apply_router_weight_on_input");
  if (a->num_experts > OG_MOE_ROUTE_MAX_EXPERTS)
    return OG_REASON("routing from logits over %lld experts (at most %d)", (long long)a->num_experts,
                     OG_MOE_ROUTE_MAX_EXPERTS);
  if (a->topk_ids_dtype != OPGRAFT_DTYPE_INT32) return OG_REASON("routing from logits into int64 topk_ids");
  if (a->router_logits_stride[1] != 1 || (a->num_tokens > 0 && a->router_logits_stride[0] < a->num_experts))
    return OG_REASON("router_logits rows are not contiguous [T, E] rows");
  if (a->num_tokens > 1 && (a->topk_weights_stride[0] != a->top_k || a->topk_ids_stride[0] != a->top_k))
    return OG_REASON("routing outputs are not contiguous [T, k]");
  return OPGRAFT_OK;
}

/* The checks that look only at the arguments. */
int32_t opgraft__moe_check_static(const opgraft_moe_args *a, char *reason, size_t reason_len) {
  if (!a) return OG_REASON("no arguments");
  if (a->struct_size < sizeof(opgraft_moe_args))
    return OG_REASON("opgraft_moe_args.struct_size %u < %zu: caller built against an older ABI",
                     a->struct_size, sizeof(opgraft_moe_args));
  if (a->dtype != OPGRAFT_DTYPE_BF16 && a->dtype != OPGRAFT_DTYPE_FP16)
    return OG_REASON("dtype %s (the kernel takes bf16 and fp16)", opgraft__moe_dtype_name(a->dtype));
  if (a->weight_dtype != 0 && a->weight_dtype != a->dtype && !opgraft__moe_is_fp8(a))
    return OG_REASON("weights dtype %s (the kernel takes bf16/fp16 weights and FP8 e4m3 with block or per-tensor "
                     "scales)",
                     opgraft__moe_dtype_name(a->weight_dtype));
  if (!opgraft__moe_is_fp8(a) && a->scale_layout != OPGRAFT_MOE_SCALE_NONE)
    return OG_REASON("scale layout %d with unquantized weights", a->scale_layout);
  if (a->activation != OPGRAFT_ACT_SILU) return OG_REASON("activation %d is not SwiGLU (silu)", a->activation);
  if (a->expert_map && (a->expert_map_len < 1 || a->expert_map_len > OG_MOE_MAX_EXPERTS))
    return OG_REASON("expert_map of %lld global experts (1..%d supported)", (long long)a->expert_map_len,
                     OG_MOE_MAX_EXPERTS);
  if (a->topk_weights_dtype != OPGRAFT_DTYPE_FP32)
    return OG_REASON("topk_weights dtype %s (fp32 expected)", opgraft__moe_dtype_name(a->topk_weights_dtype));
  if (a->topk_ids_dtype != OPGRAFT_DTYPE_INT32 && a->topk_ids_dtype != OPGRAFT_DTYPE_INT64)
    return OG_REASON("topk_ids dtype %s (int32 or int64 expected)", opgraft__moe_dtype_name(a->topk_ids_dtype));
  const int64_t T = a->num_tokens, H = a->hidden, I = a->inter, E = a->num_experts, k = a->top_k;
  if (T < 0) return OG_REASON("negative token count %lld", (long long)T);
  if (H < 32 || H % 32) return OG_REASON("hidden size %lld is not a positive multiple of 32", (long long)H);
  if (I < 32 || I % 32) return OG_REASON("intermediate size %lld is not a positive multiple of 32", (long long)I);
  if (H > OG_MOE_MAX_DIM || I > OG_MOE_MAX_DIM) return OG_REASON("hidden/intermediate size too large");
  if (E < 1 || E > OG_MOE_MAX_EXPERTS) return OG_REASON("%lld experts (1..%d supported)", (long long)E, OG_MOE_MAX_EXPERTS);
  if (k < 1 || k > OG_MOE_MAX_TOPK) return OG_REASON("top_k %lld (1..%d supported)", (long long)k, OG_MOE_MAX_TOPK);
  /* A rank of an expert-parallel model may hold fewer experts than a token picks (DeepSeek-V3 at
   * EP 64: 4 local experts, top-8); the rest of a token's slots are other ranks'. */
  if (k > E && !a->expert_map) return OG_REASON("top_k %lld > %lld experts", (long long)k, (long long)E);
  if (a->hidden_states_stride[1] != 1 || a->w13_stride[2] != 1 || a->w2_stride[2] != 1 ||
      a->out_stride[1] != 1 || a->topk_weights_stride[1] != 1 || a->topk_ids_stride[1] != 1)
    return OG_REASON("a tensor's last dimension is not contiguous");
  /* The products below fit in int64 (H and I are bounded above; the row strides first). */
  if (a->w13_stride[1] < H || a->w13_stride[1] > INT64_MAX / (2 * I) || a->w13_stride[0] < 2 * I * a->w13_stride[1] ||
      a->w2_stride[1] < I || a->w2_stride[1] > INT64_MAX / H || a->w2_stride[0] < H * a->w2_stride[1])
    return OG_REASON("weight strides do not describe plain [E, 2I, H] / [E, H, I] tensors");
  if (a->w13_stride[0] % 8 || a->w13_stride[1] % 8 || a->w2_stride[0] % 8 || a->w2_stride[1] % 8 ||
      a->hidden_states_stride[0] % 8)
    return OG_REASON("row strides are not multiples of 16 bytes");
  if (T > 0 && (a->hidden_states_stride[0] < H || a->out_stride[0] < H ||
                a->topk_weights_stride[0] < k || a->topk_ids_stride[0] < k))
    return OG_REASON("row strides smaller than the rows");
  int32_t st = opgraft__moe_routed(a) ? check_routing(a, reason, reason_len) : OPGRAFT_OK;
  return !st && opgraft__moe_is_fp8(a) ? check_fp8(a, reason, reason_len) : st;
}

int32_t opgraft__moe_check_pointers(const opgraft_moe_args *a, char *reason, size_t reason_len) {
  if (a->expert_map && ((uintptr_t)a->expert_map & 3u)) return OG_REASON("expert_map misaligned");
  const int routed = opgraft__moe_routed(a); /* topk_weights, topk_ids: optional outputs */
  if (a->num_tokens > 0 && (!a->hidden_states || !a->w13 || !a->w2 || !a->out ||
                            (routed ? !a->router_logits : !a->topk_weights || !a->topk_ids)))
    return OG_REASON("a tensor pointer is NULL");
  if (routed && ((uintptr_t)a->router_logits & 1u)) return OG_REASON("router_logits misaligned");
  if (!aligned16(a->hidden_states) || !aligned16(a->w13) || !aligned16(a->w2))
    return OG_REASON("hidden_states or weights not 16-byte aligned");
  if (((uintptr_t)a->out & 1u) || ((uintptr_t)a->topk_weights & 3u) ||
      ((uintptr_t)a->topk_ids & (a->topk_ids_dtype == OPGRAFT_DTYPE_INT64 ? 7u : 3u)))
    return OG_REASON("out, topk_weights or topk_ids misaligned");
  if (opgraft__moe_is_fp8(a) && a->num_tokens > 0) {
    if ((!a->hidden_scale && !opgraft__moe_quantizes_x(a)) || !a->w13_scale || !a->w2_scale)
      return OG_REASON("an FP8 scale pointer is NULL");
    if (((uintptr_t)a->hidden_scale | (uintptr_t)a->w13_scale | (uintptr_t)a->w2_scale) & 3u)
      return OG_REASON("FP8 scales misaligned");
  }
  return OPGRAFT_OK;
}

/* The checks that need the device (arch, name) and the tunables: done once per plan. */
int32_t opgraft__moe_check_device(const opgraft_moe_args *a, int32_t *arch_out, char *gpu, size_t gpu_len,
                            char *reason, size_t reason_len) {
  const int64_t T = a->num_tokens;
  int32_t arch = a->arch;
  if (gpu && gpu_len) opgraft__copy(gpu, gpu_len, a->gpu_name);
  if (!arch) {
    const int32_t st = opgraft__current_device(NULL, &arch, gpu, gpu_len);
    if (st) return OG_REASON("no GPU: %s", opgraft_last_error());
  }
  if (arch < OG_MOE_MIN_ARCH) return OG_REASON("sm_%d is older than sm_%d", arch, OG_MOE_MIN_ARCH);
  if (T > OG_MOE_MAX_TOKENS) return OG_REASON("%lld tokens > %d (kernel limit)", (long long)T, OG_MOE_MAX_TOKENS);
  char shape[128];
  opgraft__moe_shape_key(a, shape, sizeof shape);
  const char *g = gpu && *gpu ? gpu : NULL;
  if (opgraft__moe_is_fp8(a)) {
    if (arch < OG_MOE_FP8_MIN_ARCH)
      return OG_REASON("FP8 weights on sm_%d: the FP8 kernels need sm_%d (mma.sync e4m3)", arch, OG_MOE_FP8_MIN_ARCH);
    if (opgraft__env_switch("OPGRAFT_MOE_FP8") == 0) return OG_REASON("OPGRAFT_MOE_FP8 is off (FP8 MoE calls are handed back)");
    if (!opgraft__tune_value("moe.fp8", arch, g, shape, (int32_t)T))
      return OG_REASON("moe.fp8 is 0 on sm_%d at T=%lld (FP8 MoE call handed back)", arch, (long long)T);
    if (opgraft__moe_quantizes_x(a) && !opgraft__tune_value("moe.fp8_quantize", arch, g, shape, (int32_t)T))
      return OG_REASON("moe.fp8_quantize is 0 on sm_%d at T=%lld (16-bit hidden states with FP8 weights: quantize "
                       "them first)", arch, (long long)T);
  }
  const int64_t max_t = opgraft__tune_value("moe.max_tokens", arch, g, shape, (int32_t)T);
  if (T > max_t) return OG_REASON("%lld tokens > moe.max_tokens %lld", (long long)T, (long long)max_t);
  if (a->expert_map && !opgraft__tune_value("moe.expert_map", arch, g, shape, (int32_t)T))
    return OG_REASON("expert_map is set and moe.expert_map is 0 (expert parallelism is handed back)");
  if (opgraft__moe_routed(a)) {
    if (opgraft__env_switch("OPGRAFT_MOE_ROUTE") == 0) return OG_REASON("OPGRAFT_MOE_ROUTE is off (routing stays vLLM's)");
    if (!opgraft__tune_value("moe.route", arch, g, shape, (int32_t)T))
      return OG_REASON("moe.route is 0 on sm_%d at T=%lld (routing stays vLLM's)", arch, (long long)T);
  }
  if (arch_out) *arch_out = arch;
  return OPGRAFT_OK;
}

int32_t opgraft_moe_supports(const opgraft_moe_args *args, char *reason, size_t reason_len) {
  char local[256];
  if (!reason || !reason_len) reason = local, reason_len = sizeof local;
  reason[0] = 0;
  char gpu[256];
  int32_t st = opgraft__moe_check_static(args, reason, reason_len);
  if (!st) st = opgraft__moe_check_pointers(args, reason, reason_len);
  if (!st) st = opgraft__moe_check_device(args, NULL, gpu, sizeof gpu, reason, reason_len);
  if (st) opgraft__fail(st, "MoE call not supported: %s", reason);
  return st;
}

static size_t pad256(size_t n) { return (n + 255u) & ~(size_t)255u; }

size_t opgraft__moe_act_scale_offset(const opgraft_moe_args *a) {
  return pad256((size_t)a->num_tokens * (size_t)a->top_k * (size_t)a->inter * 2u);
}

size_t opgraft__moe_act_bytes(const opgraft_moe_args *a) {
  const size_t slots = (size_t)a->num_tokens * (size_t)a->top_k;
  /* FP8 weights: act in f16, then one fp32 scale per slot and 16 rows of I. */
  if (opgraft__moe_is_fp8(a)) return opgraft__moe_act_scale_offset(a) + pad256(slots * (size_t)(a->inter / 16) * 4u);
  return pad256(slots * (size_t)a->inter * 2u);
}

int32_t opgraft_moe_workspace_size(const opgraft_moe_args *a, size_t *bytes) {
  if (!a || !bytes || a->struct_size < sizeof(opgraft_moe_args))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_moe_workspace_size: bad arguments");
  if (a->num_tokens < 0 || a->top_k < 0 || a->inter < 0)
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_moe_workspace_size: negative size");
  /* act: [T*k, I] in the activation dtype (FP8 weights: f16, then scales), padded to 256
   * bytes, then 256 bytes for the fused kernel's barrier counter. */
  *bytes = opgraft__moe_act_bytes(a) + 256u + (opgraft__moe_trace_on() ? opgraft__moe_trace_bytes(a) : 0u);
  return OPGRAFT_OK;
}

