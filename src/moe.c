/* MoE experts: the dispatch guard, the launcher of kernels/moe_decode.cu, and its compile report. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/moe_params.h"
#include "internal.h"

/* The kernels' hard limits (kernels/moe_decode.cu): 8-token tiles up to 8 of them, a bitmap of
 * experts in shared memory, and the routing of all tokens in shared memory. */
#define OG_MAX_TOKENS 64
#define OG_MAX_EXPERTS 4096
#define OG_MAX_TOPK 16
#define OG_MIN_ARCH 80 /* mma.sync bf16 and cvt.rn.bf16x2.f32 need sm_80 */

static const char *dtype_name(int32_t d) {
  switch (d) {
  case OPGRAFT_DTYPE_BF16: return "bf16";
  case OPGRAFT_DTYPE_FP16: return "fp16";
  case OPGRAFT_DTYPE_FP32: return "fp32";
  case OPGRAFT_DTYPE_INT32: return "int32";
  case OPGRAFT_DTYPE_INT64: return "int64";
  }
  return "unknown";
}

static void shape_key(const opgraft_moe_args *a, char *buf, size_t len) {
  snprintf(buf, len, "moe:%s:E%lld:H%lld:I%lld:k%lld", dtype_name(a->dtype), (long long)a->num_experts,
           (long long)a->hidden, (long long)a->inter, (long long)a->top_k);
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* OPGRAFT_TRACE set (and not "0"): the kernels are compiled with OG_TRACE and record per-block
 * phase times (kernels/moe_decode.cu) after the workspace's counter area: [3][blocks][8] u64,
 * blocks = the larger of the two stages' grids, at least 4096 (the cooperative grid). Read when a
 * shape's plan is made and by opgraft_moe_workspace_size; a plan with tracing writes only into a
 * workspace that has room for it. */
static int trace_on(void) {
  const char *v = getenv("OPGRAFT_TRACE");
  return v && *v && strcmp(v, "0") != 0;
}
static int64_t trace_blocks(const opgraft_moe_args *a) {
  int64_t b = a->num_tokens * a->top_k * (a->inter / 16); /* gate_up's grid is at most this */
  if (a->hidden / 16 > b) b = a->hidden / 16;
  return b > 4096 ? b : 4096;
}
static size_t trace_bytes(const opgraft_moe_args *a) { return (size_t)(3 * trace_blocks(a) * 8 * 8); }

typedef struct og_moe_cfg {
  int nt, w1, u1, w2, u2, fused, prefetch, l2_fetch;
  int gu_nt; /* gate_up's 8-pair tiles in its one-pass path (OG_GU_NT, 1..nt) */
  int w2pf_mb, w2pf_last; /* W2 bytes (MiB) requested into L2 during gate_up; with evict_last */
  int pdl; /* programmatic dependent launch of moe_down (sm_90+) */
  int down_early; /* with pdl: down's first weight loads before its wait */
  int pdl_in; /* gate_up a programmatic dependent of the stream's previous kernel (sm_90+) */
  int gu_one; /* one-token calls: gate_up's blocks read their one routing slot only */
  int down_one; /* one-token calls: each down warp builds its own routing with shuffles */
  int gu_slots; /* T*k <= 32: gate_up's blocks are (routing slot, tile), routing by ballot */
  int down_warp; /* T*k <= 32: each down warp builds its own routing with shuffles */
  int trace; /* OPGRAFT_TRACE: per-block phase times into the workspace (a diagnostic) */
  int load, down_load; /* the form of gate_up's / down's weight loads (OG_LOAD, OG_DOWN_LOAD) */
  int gu_min_blocks; /* gate_up's __launch_bounds__ minimum blocks per SM (0: the default rule) */
  int down_min_blocks; /* down's, likewise */
  int stream, sw, ss, spt, kc; /* moe_stream (sm_90): on, consumer warps, ring slots, 8-pair tiles, chunk */
  int opb;                 /* moe_stream: bytes of shared memory for x's or act's rows */
  int stream_blocks;       /* moe_stream: at most this many blocks (0: as many as fit) */
  int stream_ef;           /* moe_stream: the copies' lines first for eviction from L2 */
} og_moe_cfg;

/* moe_stream's shared memory (kernels/moe_decode.cu): OG_SS ring slots, the consumer warps'
 * reduction buffers, x's or act's rows, 2*OG_SS mbarriers. */
#define OG_STREAM_SMEM_CAP (227 * 1024) /* opt-in shared memory of a block on sm_90 */
static unsigned stream_smem(const og_moe_cfg *c) {
  const int tiles = c->spt > c->nt ? c->spt : c->nt;
  const int slot = 16 * (2 * c->kc + 64); /* 16 rows of kc elements, padded by 64 bytes */
  return (unsigned)(c->ss * slot + c->sw * tiles * 2 * 4 * 32 * 4 + c->opb + 2 * c->ss * 8);
}

/* Resolves the kernel configuration; clamps keep the static shared memory under 48 KB and the
 * operand registers of one k-step group under what compiles without spills (checked by the
 * compile tests for every token tile count). */
static void moe_config(const opgraft_moe_args *a, int32_t arch, const char *gpu, og_moe_cfg *c) {
  char shape[128];
  shape_key(a, shape, sizeof shape);
  const int32_t T = (int32_t)a->num_tokens;
  c->nt = T <= 0 ? 1 : (T + 7) / 8;
  c->w1 = (int)opgraft__tune_value("moe.gate_up.warps", arch, gpu, shape, T);
  c->u1 = (int)opgraft__tune_value("moe.gate_up.unroll", arch, gpu, shape, T);
  c->w2 = (int)opgraft__tune_value("moe.down.warps", arch, gpu, shape, T);
  c->u2 = (int)opgraft__tune_value("moe.down.unroll", arch, gpu, shape, T);
  c->fused = opgraft__tune_value("moe.fused", arch, gpu, shape, T) != 0;
  c->prefetch = (int)opgraft__tune_value("moe.prefetch", arch, gpu, shape, T);
  const int64_t f = opgraft__tune_value("moe.l2_fetch", arch, gpu, shape, T);
  c->l2_fetch = f >= 256 ? 256 : f >= 128 ? 128 : 0; /* the hint has two sizes */
  c->w2pf_mb = (int)opgraft__tune_value("moe.w2_prefetch", arch, gpu, shape, T);
  c->w2pf_last = c->w2pf_mb > 0 && opgraft__tune_value("moe.w2_prefetch_last", arch, gpu, shape, T) != 0;
  c->pdl = arch >= 90 ? (int)opgraft__tune_value("moe.pdl", arch, gpu, shape, T) : 0;
  c->down_early = c->pdl && opgraft__tune_value("moe.down.early", arch, gpu, shape, T) != 0;
  c->pdl_in = arch >= 90 && opgraft__tune_value("moe.pdl_in", arch, gpu, shape, T) != 0;
  c->trace = trace_on();
  c->load = (int)opgraft__tune_value("moe.load", arch, gpu, shape, T);
  /* sm_90 only: on sm_80 the forms without an L2 policy (0, 3, 4) make Mixtral-8x7B's down spill
   * (test_compile), so down keeps form 1 there. */
  c->down_load = arch >= 90 ? (int)opgraft__tune_value("moe.down_load", arch, gpu, shape, T) : 1;
  /* gate_up's one-pass token tiles: fewer than the call's only for the two kernels (the fused
   * kernel's stages share one reduction buffer and one register budget). */
  const int64_t gnt = opgraft__tune_value("moe.gate_up.nt", arch, gpu, shape, T);
  c->gu_nt = !c->fused && gnt >= 1 && gnt < c->nt ? (int)gnt : c->nt;
  /* The one-slot gate_up: one token, and nothing that needs the list of used experts there (the
   * W2 prefetch walks it). */
  c->gu_one = T == 1 && c->w2pf_mb == 0 && opgraft__tune_value("moe.gate_up.one_token", arch, gpu, shape, T) != 0;
  c->down_one = T == 1 && opgraft__tune_value("moe.down.one_token", arch, gpu, shape, T) != 0;
  const int small = T >= 1 && (int64_t)T * a->top_k <= 32;
  c->gu_slots = small && c->w2pf_mb == 0 && opgraft__tune_value("moe.gate_up.slot_routing", arch, gpu, shape, T) != 0;
  c->down_warp = small && opgraft__tune_value("moe.down.warp_routing", arch, gpu, shape, T) != 0;
  while (c->w1 > 1 && c->w1 * c->nt > 32) c->w1 /= 2; /* 1 KB of reduction buffer per warp-tile */
  while (c->w2 > 1 && c->w2 * c->nt > 64) c->w2 /= 2;
  /* 16 warps cap a thread at 128 registers; both kernels need more from two token tiles on. */
  if ((c->gu_nt >= 2 || c->fused) && c->w1 > 8) c->w1 = 8; /* fused: one block of <= 256 threads */
  if (c->nt >= 2 && c->w2 > 8) c->w2 = 8;
  while (c->u1 > 1 && c->u1 * (4 + c->gu_nt) > 24) c->u1--; /* 16-byte operands per k-step group */
  /* One token tile only (more need the registers), and at least 128 registers a thread; with
   * gate_up.nt 1 at up to 16 tokens the second path (two tiles, one k-step) fits in those too. */
  c->gu_min_blocks = c->gu_nt == 1 && c->nt <= 2
                         ? (int)opgraft__tune_value("moe.gate_up.min_blocks", arch, gpu, shape, T)
                         : 0;
  while (c->gu_min_blocks > 1 && c->gu_min_blocks * c->w1 > 16) c->gu_min_blocks--;
  while (c->u2 > 1 && c->u2 * (2 + c->nt) > (c->nt >= 2 ? 20 : 24)) c->u2--;
  /* down's minimum: at least 128 registers a thread (16 warps an SM), up to two token tiles. */
  c->down_min_blocks = c->nt <= 2 ? (int)opgraft__tune_value("moe.down.min_blocks", arch, gpu, shape, T) : 0;
  while (c->down_min_blocks > 1 && c->down_min_blocks * c->w2 > 16) c->down_min_blocks--;
  if (c->down_min_blocks < 2) c->down_min_blocks = 0; /* one block an SM is the default rule's */
  /* moe_stream: bulk copies need sm_90, and the ring is sized for sm_90's 227 KB of shared memory
   * a block (later archs differ: sm_120 has ~100 KB), so sm_90 only; every (token, slot) pair of
   * a tile in one pass of at most 8 MMA tiles; x's T rows, later act's T*k rows (padded by 64
   * bytes) in at most 64 KB. The ring shrinks to what fits. */
  const int64_t xb = (int64_t)T * (2 * a->hidden + 64), ab = (int64_t)T * a->top_k * (2 * a->inter + 64);
  const int64_t opb = ((xb > ab ? xb : ab) + 15) & ~(int64_t)15;
  c->stream = arch == 90 && T >= 1 && c->nt == 1 && (int64_t)T * a->top_k <= 64 && opb <= 64 * 1024 &&
              opgraft__tune_value("moe.stream", arch, gpu, shape, T) != 0;
  c->sw = c->ss = c->spt = c->kc = c->opb = c->stream_blocks = c->stream_ef = 0;
  if (!c->stream) return;
  c->sw = (int)opgraft__tune_value("moe.stream.warps", arch, gpu, shape, T);
  c->ss = (int)opgraft__tune_value("moe.stream.slots", arch, gpu, shape, T);
  c->spt = (int)((T * a->top_k + 7) / 8);
  c->opb = (int)opb;
  const int64_t kc = opgraft__tune_value("moe.stream.kc", arch, gpu, shape, T);
  c->kc = kc >= 2048 ? 2048 : kc >= 1024 ? 1024 : kc >= 512 ? 512 : 256;
  c->stream_blocks = (int)opgraft__tune_value("moe.stream.blocks", arch, gpu, shape, T);
  c->stream_ef = opgraft__tune_value("moe.stream.evict_first", arch, gpu, shape, T) != 0;
  while (c->ss > 2 && stream_smem(c) > OG_STREAM_SMEM_CAP) c->ss--;
  while (c->sw > 1 && stream_smem(c) > OG_STREAM_SMEM_CAP) c->sw--;
}

#define OG_REASON(...) (snprintf(reason, reason_len, __VA_ARGS__), OPGRAFT_EUNSUPPORTED)

/* The checks that look only at the arguments. */
static int32_t check_static(const opgraft_moe_args *a, char *reason, size_t reason_len) {
  if (!a) return OG_REASON("no arguments");
  if (a->struct_size < sizeof(opgraft_moe_args))
    return OG_REASON("opgraft_moe_args.struct_size %u < %zu: caller built against an older ABI",
                     a->struct_size, sizeof(opgraft_moe_args));
  if (a->dtype != OPGRAFT_DTYPE_BF16 && a->dtype != OPGRAFT_DTYPE_FP16)
    return OG_REASON("dtype %s (the kernel takes bf16 and fp16)", dtype_name(a->dtype));
  if (a->activation != OPGRAFT_ACT_SILU) return OG_REASON("activation %d is not SwiGLU (silu)", a->activation);
  if (a->expert_map && (a->expert_map_len < 1 || a->expert_map_len > OG_MAX_EXPERTS))
    return OG_REASON("expert_map of %lld global experts (1..%d supported)", (long long)a->expert_map_len,
                     OG_MAX_EXPERTS);
  if (a->expert_map && ((uintptr_t)a->expert_map & 3u)) return OG_REASON("expert_map misaligned");
  if (a->topk_weights_dtype != OPGRAFT_DTYPE_FP32)
    return OG_REASON("topk_weights dtype %s (fp32 expected)", dtype_name(a->topk_weights_dtype));
  if (a->topk_ids_dtype != OPGRAFT_DTYPE_INT32 && a->topk_ids_dtype != OPGRAFT_DTYPE_INT64)
    return OG_REASON("topk_ids dtype %s (int32 or int64 expected)", dtype_name(a->topk_ids_dtype));
  const int64_t T = a->num_tokens, H = a->hidden, I = a->inter, E = a->num_experts, k = a->top_k;
  if (T < 0) return OG_REASON("negative token count %lld", (long long)T);
  if (H < 32 || H % 32) return OG_REASON("hidden size %lld is not a positive multiple of 32", (long long)H);
  if (I < 32 || I % 32) return OG_REASON("intermediate size %lld is not a positive multiple of 32", (long long)I);
  if (H > (1 << 20) || I > (1 << 20)) return OG_REASON("hidden/intermediate size too large");
  if (E < 1 || E > OG_MAX_EXPERTS) return OG_REASON("%lld experts (1..%d supported)", (long long)E, OG_MAX_EXPERTS);
  if (k < 1 || k > OG_MAX_TOPK) return OG_REASON("top_k %lld (1..%d supported)", (long long)k, OG_MAX_TOPK);
  if (k > E) return OG_REASON("top_k %lld > %lld experts", (long long)k, (long long)E);
  if (a->hidden_states_stride[1] != 1 || a->w13_stride[2] != 1 || a->w2_stride[2] != 1 ||
      a->out_stride[1] != 1 || a->topk_weights_stride[1] != 1 || a->topk_ids_stride[1] != 1)
    return OG_REASON("a tensor's last dimension is not contiguous");
  if (a->w13_stride[1] < H || a->w13_stride[0] < 2 * I * a->w13_stride[1] || a->w2_stride[1] < I ||
      a->w2_stride[0] < H * a->w2_stride[1])
    return OG_REASON("weight strides do not describe plain [E, 2I, H] / [E, H, I] tensors");
  if (a->w13_stride[0] % 8 || a->w13_stride[1] % 8 || a->w2_stride[0] % 8 || a->w2_stride[1] % 8 ||
      a->hidden_states_stride[0] % 8)
    return OG_REASON("row strides are not multiples of 16 bytes");
  if (T > 0 && (a->hidden_states_stride[0] < H || a->out_stride[0] < H ||
                a->topk_weights_stride[0] < k || a->topk_ids_stride[0] < k))
    return OG_REASON("row strides smaller than the rows");
  if (T > 0 && (!a->hidden_states || !a->w13 || !a->w2 || !a->topk_weights || !a->topk_ids || !a->out))
    return OG_REASON("a tensor pointer is NULL");
  if (!aligned16(a->hidden_states) || !aligned16(a->w13) || !aligned16(a->w2))
    return OG_REASON("hidden_states or weights not 16-byte aligned");
  if (((uintptr_t)a->out & 1u) || ((uintptr_t)a->topk_weights & 3u) ||
      ((uintptr_t)a->topk_ids & (a->topk_ids_dtype == OPGRAFT_DTYPE_INT64 ? 7u : 3u)))
    return OG_REASON("out, topk_weights or topk_ids misaligned");

  return OPGRAFT_OK;
}

/* The checks that need the device (arch, name) and the tunables: done once per plan. */
static int32_t check_device(const opgraft_moe_args *a, int32_t *arch_out, char *gpu, size_t gpu_len,
                            char *reason, size_t reason_len) {
  const int64_t T = a->num_tokens;
  int32_t arch = a->arch;
  if (gpu && gpu_len) opgraft__copy(gpu, gpu_len, a->gpu_name);
  if (!arch) {
    const int32_t st = opgraft__current_device(NULL, &arch, gpu, gpu_len);
    if (st) return OG_REASON("no GPU: %s", opgraft_last_error());
  }
  if (arch < OG_MIN_ARCH) return OG_REASON("sm_%d is older than sm_%d", arch, OG_MIN_ARCH);
  if (T > OG_MAX_TOKENS) return OG_REASON("%lld tokens > %d (kernel limit)", (long long)T, OG_MAX_TOKENS);
  char shape[128];
  shape_key(a, shape, sizeof shape);
  const char *g = gpu && *gpu ? gpu : NULL;
  const int64_t max_t = opgraft__tune_value("moe.max_tokens", arch, g, shape, (int32_t)T);
  if (T > max_t) return OG_REASON("%lld tokens > moe.max_tokens %lld", (long long)T, (long long)max_t);
  if (a->expert_map && !opgraft__tune_value("moe.expert_map", arch, g, shape, (int32_t)T))
    return OG_REASON("expert_map is set and moe.expert_map is 0 (expert parallelism is handed back)");
  if (arch_out) *arch_out = arch;
  return OPGRAFT_OK;
}

int32_t opgraft_moe_supports(const opgraft_moe_args *args, char *reason, size_t reason_len) {
  char local[256];
  if (!reason || !reason_len) reason = local, reason_len = sizeof local;
  reason[0] = 0;
  char gpu[256];
  int32_t st = check_static(args, reason, reason_len);
  if (!st) st = check_device(args, NULL, gpu, sizeof gpu, reason, reason_len);
  if (st) opgraft__fail(st, "MoE call not supported: %s", reason);
  return st;
}

static size_t act_bytes(const opgraft_moe_args *a) {
  const size_t n = (size_t)a->num_tokens * (size_t)a->top_k * (size_t)a->inter * 2u;
  return (n + 255u) & ~(size_t)255u;
}

int32_t opgraft_moe_workspace_size(const opgraft_moe_args *a, size_t *bytes) {
  if (!a || !bytes || a->struct_size < sizeof(opgraft_moe_args))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_moe_workspace_size: bad arguments");
  if (a->num_tokens < 0 || a->top_k < 0 || a->inter < 0)
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_moe_workspace_size: negative size");
  /* act: [T*k, I] in the activation dtype, padded to 256 bytes, then 256 bytes for the fused
   * kernel's barrier counter. */
  *bytes = act_bytes(a) + 256u + (trace_on() ? trace_bytes(a) : 0u);
  return OPGRAFT_OK;
}

/* Compile options for one configuration; returns their number, or -1 (an error set) if they would
 * not fit in OG_MAX_OPTS. */
enum { OG_MAX_OPTS = 40 }; /* 29 always, 7 more for moe_stream, 1 for OPGRAFT_TRACE */
static int moe_options(const opgraft_moe_args *a, const og_moe_cfg *c, char buf[][48], const char **opts) {
  int n = 0;
#define OG_OPT(...) (n < OG_MAX_OPTS ? (snprintf(buf[n], 48, __VA_ARGS__), opts[n] = buf[n]) : 0, ++n)
  OG_OPT("-DOG_DTYPE=%d", a->dtype == OPGRAFT_DTYPE_BF16 ? 1 : 2);
  OG_OPT("-DOG_IDS64=%d", a->topk_ids_dtype == OPGRAFT_DTYPE_INT64);
  OG_OPT("-DOG_EMAP=%d", a->expert_map != NULL);
  OG_OPT("-DOG_H=%lld", (long long)a->hidden);
  OG_OPT("-DOG_I=%lld", (long long)a->inter);
  OG_OPT("-DOG_E=%lld", (long long)a->num_experts);
  OG_OPT("-DOG_K=%lld", (long long)a->top_k);
  OG_OPT("-DOG_NT=%d", c->nt);
  OG_OPT("-DOG_GU_NT=%d", c->gu_nt);
  OG_OPT("-DOG_W1=%d", c->w1);
  OG_OPT("-DOG_U1=%d", c->u1);
  OG_OPT("-DOG_W2=%d", c->w2);
  OG_OPT("-DOG_U2=%d", c->u2);
  OG_OPT("-DOG_ON_INPUT=%d", a->apply_router_weight_on_input ? 1 : 0);
  OG_OPT("-DOG_PREFETCH=%d", c->prefetch);
  OG_OPT("-DOG_L2_FETCH=%d", c->l2_fetch);
  OG_OPT("-DOG_W2PF_BYTES=%lldLL", (long long)c->w2pf_mb << 20);
  OG_OPT("-DOG_W2PF_LAST=%d", c->w2pf_last);
  OG_OPT("-DOG_PDL=%d", c->pdl);
  OG_OPT("-DOG_DOWN_EARLY=%d", c->down_early);
  OG_OPT("-DOG_PDL_IN=%d", c->pdl_in);
  OG_OPT("-DOG_GU_ONE=%d", c->gu_one);
  OG_OPT("-DOG_DOWN_ONE=%d", c->down_one);
  OG_OPT("-DOG_GU_SLOTS=%d", c->gu_slots);
  OG_OPT("-DOG_DOWN_WARP=%d", c->down_warp);
  if (c->trace) OG_OPT("-DOG_TRACE=1");
  OG_OPT("-DOG_LOAD=%d", c->load);
  OG_OPT("-DOG_DOWN_LOAD=%d", c->down_load);
  OG_OPT("-DOG_GU_MIN_BLOCKS=%d", c->gu_min_blocks);
  OG_OPT("-DOG_DOWN_MIN_BLOCKS=%d", c->down_min_blocks);
  if (c->stream) {
    OG_OPT("-DOG_STREAM=1");
    OG_OPT("-DOG_SW=%d", c->sw);
    OG_OPT("-DOG_SS=%d", c->ss);
    OG_OPT("-DOG_SPT=%d", c->spt);
    OG_OPT("-DOG_OPB=%d", c->opb);
    OG_OPT("-DOG_KC=%d", c->kc);
    OG_OPT("-DOG_STREAM_EF=%d", c->stream_ef);
  }
#undef OG_OPT
  if (n > OG_MAX_OPTS) {
    opgraft__fail(OPGRAFT_EINVAL, "MoE kernel configuration needs %d compile options (room for %d)", n, OG_MAX_OPTS);
    return -1;
  }
  return n;
}

#define OG_MOE_KERNELS 4 /* moe_stream exists in the module only when OG_STREAM is set */
static void fn_names(const opgraft_moe_args *a, char names[OG_MOE_KERNELS][64]) {
  const char *sfx = a->dtype == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16";
  snprintf(names[0], 64, "moe_gate_up_%s", sfx);
  snprintf(names[1], 64, "moe_down_%s", sfx);
  snprintf(names[2], 64, "moe_fused_%s", sfx);
  snprintf(names[3], 64, "moe_stream_%s", sfx);
}

/* Launch plans by (context, arguments that shape the kernels): repeated calls skip the tunable
 * lookups and the module search. Tunables are read at the first call of each shape. */
typedef struct og_plan {
  og_CUcontext ctx;
  int32_t dtype, ids64, emap, on_input, arch_req, arch;
  uint32_t tune_gen;
  int64_t T, H, I, E, k;
  og_moe_cfg cfg;
  og_CUfunction fn[OG_MOE_KERNELS];
  unsigned fused_grid; /* blocks of moe_fused that fit on the GPU at once (cooperative launch) */
  unsigned stream_grid, stream_smem; /* moe_stream's cooperative grid and dynamic shared memory */
} og_plan;
#define OG_PLANS 128
static og_plan plans[OG_PLANS];
static int nplans, next_evict;
static pthread_mutex_t plan_lock = PTHREAD_MUTEX_INITIALIZER;

static int plan_matches(const og_plan *p, const og_plan *q) {
  return p->ctx == q->ctx && p->tune_gen == q->tune_gen && p->arch_req == q->arch_req && p->dtype == q->dtype && p->ids64 == q->ids64 && p->emap == q->emap && p->on_input == q->on_input &&
         p->T == q->T && p->H == q->H && p->I == q->I && p->E == q->E && p->k == q->k;
}

/* A 1-D launch with one int-valued launch attribute set to 1 (cooperative, programmatic
 * stream serialization). */
static int32_t launch_flagged(const og_cuda_api *cu, og_CUfunction fn, unsigned grid, unsigned threads,
                              unsigned smem, og_CUstream s, int attr_id, void **params, const char *what) {
  og_CUlaunchAttribute attr;
  memset(&attr, 0, sizeof attr);
  attr.id = attr_id;
  attr.value.flag = 1;
  og_CUlaunchConfig lc = {grid, 1, 1, threads, 1, 1, smem, s, &attr, 1};
  return opgraft__cu_check(cu->cuLaunchKernelEx(&lc, fn, params, NULL), what);
}

/* How many blocks of a cooperative kernel can be resident at once: its grid. */
static int32_t fused_capacity(const og_cuda_api *cu, og_CUfunction fn, int threads, size_t smem, unsigned *grid) {
  enum { OG_ATTR_SM_COUNT = 16 }; /* CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT */
  og_CUdevice dev = 0;
  int per_sm = 0, sms = 0;
  int32_t st = opgraft__cu_check(cu->cuCtxGetDevice(&dev), "cuCtxGetDevice");
  if (!st) st = opgraft__cu_check(cu->cuDeviceGetAttribute(&sms, OG_ATTR_SM_COUNT, dev), "cuDeviceGetAttribute");
  if (!st)
    st = opgraft__cu_check(cu->cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, smem),
                           "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  if (st) return st;
  if (per_sm < 1) return opgraft__fail(OPGRAFT_ECUDA, "a cooperative MoE kernel cannot be resident on this GPU");
  *grid = (unsigned)(per_sm * sms);
  return OPGRAFT_OK;
}

int32_t opgraft_moe_run_stages(const opgraft_moe_args *a, void *workspace, size_t workspace_bytes, void *stream,
                               uint32_t stages) {
  char reason[256];
  if (stages == 0 || (stages & ~(uint32_t)OPGRAFT_MOE_STAGE_ALL))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_moe_run_stages: bad stage mask %u", stages);
  const og_cuda_api *cu = opgraft__cuda();
  if (!cu) return OPGRAFT_ENOLIB;
  og_CUcontext ctx = NULL;
  int32_t st = opgraft__cu_check(cu->cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (st) return st;
  if (!ctx) return opgraft__fail(OPGRAFT_ENODEV, "no CUDA context is current on this thread");

  og_plan key;
  memset(&key, 0, sizeof key);
  if (a && a->struct_size >= sizeof *a) {
    key.ctx = ctx, key.dtype = a->dtype, key.ids64 = a->topk_ids_dtype == OPGRAFT_DTYPE_INT64;
    key.emap = a->expert_map != NULL;
    key.on_input = !!a->apply_router_weight_on_input, key.T = a->num_tokens, key.H = a->hidden;
    key.I = a->inter, key.E = a->num_experts, key.k = a->top_k, key.arch_req = a->arch;
    key.tune_gen = opgraft__tune_generation();
  }
  /* The argument checks run on every call (no system calls); the device and tunable checks run
   * once per plan. */
  if ((st = check_static(a, reason, sizeof reason)))
    return opgraft__fail(st, "MoE call not supported: %s", reason);
  size_t need = 0;
  opgraft_moe_workspace_size(a, &need);
  if (a->num_tokens == 0) return OPGRAFT_OK;
  if (!workspace || workspace_bytes < need)
    return opgraft__fail(OPGRAFT_EINVAL, "workspace of %zu bytes given, %zu needed", workspace_bytes, need);
  if ((uintptr_t)workspace & 15u) return opgraft__fail(OPGRAFT_EINVAL, "workspace not 16-byte aligned");

  og_plan plan;
  int found = 0;
  pthread_mutex_lock(&plan_lock);
  for (int i = 0; i < nplans && !found; ++i)
    if (plan_matches(&plans[i], &key)) plan = plans[i], found = 1;
  pthread_mutex_unlock(&plan_lock);
  if (!found) {
    char gpu[256] = "";
    int32_t arch = 0;
    if ((st = check_device(a, &arch, gpu, sizeof gpu, reason, sizeof reason)))
      return opgraft__fail(st, "MoE call not supported: %s", reason);
    plan = key;
    plan.arch = arch;
    moe_config(a, arch, gpu[0] ? gpu : NULL, &plan.cfg);
    char buf[OG_MAX_OPTS][48];
    const char *opts[OG_MAX_OPTS];
    const int nopts = moe_options(a, &plan.cfg, buf, opts);
    if (nopts < 0) return OPGRAFT_EINVAL;
    char names[OG_MOE_KERNELS][64];
    fn_names(a, names);
    const char *np[OG_MOE_KERNELS] = {names[0], names[1], names[2], names[3]};
    if ((st = opgraft__get_functions("moe_decode.cu", opts, nopts, arch, np, plan.cfg.stream ? 4 : 3, plan.fn)))
      return st;
    plan.fused_grid = plan.stream_grid = plan.stream_smem = 0;
    if (plan.cfg.fused && (st = fused_capacity(cu, plan.fn[2], 32 * plan.cfg.w1, 0, &plan.fused_grid))) return st;
    if (plan.cfg.stream) {
      enum { OG_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8 };
      plan.stream_smem = stream_smem(&plan.cfg);
      st = opgraft__cu_check(cu->cuFuncSetAttribute(plan.fn[3], OG_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                    (int)plan.stream_smem),
                             "cuFuncSetAttribute (moe_stream shared memory)");
      if (!st) st = fused_capacity(cu, plan.fn[3], 32 * (plan.cfg.sw + 1), plan.stream_smem, &plan.stream_grid);
      if (st) return st;
      if (plan.cfg.stream_blocks > 0 && (unsigned)plan.cfg.stream_blocks < plan.stream_grid)
        plan.stream_grid = (unsigned)plan.cfg.stream_blocks;
    }
    pthread_mutex_lock(&plan_lock);
    if (nplans < OG_PLANS) {
      plans[nplans++] = plan;
    } else {
      plans[next_evict] = plan;
      next_evict = (next_evict + 1) % OG_PLANS;
    }
    pthread_mutex_unlock(&plan_lock);
  }

  og_moe_params p;
  memset(&p, 0, sizeof p);
  p.x = a->hidden_states, p.w13 = a->w13, p.w2 = a->w2;
  p.topk_w = a->topk_weights, p.topk_ids = a->topk_ids;
  p.act = workspace, p.out = a->out;
  p.x_stride = a->hidden_states_stride[0];
  p.w13_estride = a->w13_stride[0], p.w13_rstride = a->w13_stride[1];
  p.w2_estride = a->w2_stride[0], p.w2_rstride = a->w2_stride[1];
  p.topk_w_stride = a->topk_weights_stride[0], p.topk_ids_stride = a->topk_ids_stride[0];
  p.out_stride = a->out_stride[0];
  p.T = (int)a->num_tokens;
  p.emap = (const int *)a->expert_map, p.emap_len = a->expert_map ? (int)a->expert_map_len : 0;
  if (plan.cfg.trace && workspace_bytes >= act_bytes(a) + 256u + trace_bytes(a)) {
    p.trace = (unsigned long long *)((char *)workspace + act_bytes(a) + 256u);
    p.trace_blocks = (int)trace_blocks(a);
  }
  void *params[] = {&p};

  const int64_t used_max = a->num_tokens * a->top_k < a->num_experts ? a->num_tokens * a->top_k : a->num_experts;
  /* gate_up's blocks: (used expert, tile), or (routing slot, tile) with the slot routing */
  const int64_t gu_rows = plan.cfg.gu_slots ? a->num_tokens * a->top_k : used_max;
  const unsigned grid1 = (unsigned)(gu_rows * (a->inter / 16));
  const unsigned grid2 = (unsigned)(a->hidden / 16);
  og_CUstream s = (og_CUstream)stream;
  if (plan.cfg.stream && stages == OPGRAFT_MOE_STAGE_ALL) {
    /* One cooperative launch (its grid barrier needs every block resident), one block an SM. */
    const unsigned long long counter = (unsigned long long)(uintptr_t)workspace + act_bytes(a);
    p.sync = (unsigned *)(uintptr_t)counter;
    if ((st = opgraft__cu_check(cu->cuMemsetD32Async(counter, 0u, 1, s), "cuMemsetD32Async (moe_stream counter)")))
      return st;
    return launch_flagged(cu, plan.fn[3], plan.stream_grid, 32u * (unsigned)(plan.cfg.sw + 1), plan.stream_smem, s,
                          OG_LAUNCH_ATTRIBUTE_COOPERATIVE, params, "launch moe_stream (cooperative)");
  }
  if (plan.cfg.fused && stages == OPGRAFT_MOE_STAGE_ALL) {
    /* One cooperative launch: every block is resident, so the grid-wide barrier cannot hang. */
    const unsigned long long counter = (unsigned long long)(uintptr_t)workspace + act_bytes(a);
    p.sync = (unsigned *)(uintptr_t)counter;
    const unsigned want = grid1 > grid2 ? grid1 : grid2;
    const unsigned grid = want < plan.fused_grid ? want : plan.fused_grid;
    if ((st = opgraft__cu_check(cu->cuMemsetD32Async(counter, 0u, 1, s), "cuMemsetD32Async (moe_fused counter)")))
      return st;
    return launch_flagged(cu, plan.fn[2], grid, 32u * (unsigned)plan.cfg.w1, 0, s, OG_LAUNCH_ATTRIBUTE_COOPERATIVE,
                          params, "launch moe_fused (cooperative)");
  }
  if (stages & OPGRAFT_MOE_STAGE_GATE_UP) {
    /* With moe.pdl_in gate_up may start while the stream's previous kernel ends; it waits
     * (griddepcontrol.wait) before it reads or writes anything. */
    st = plan.cfg.pdl_in ? launch_flagged(cu, plan.fn[0], grid1, 32u * (unsigned)plan.cfg.w1, 0, s,
                                          OG_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, params,
                                          "launch moe_gate_up (programmatic dependent launch)")
                         : opgraft__cu_check(cu->cuLaunchKernel(plan.fn[0], grid1, 1, 1, 32u * (unsigned)plan.cfg.w1,
                                                                1, 1, 0, s, params, NULL),
                                             "launch moe_gate_up");
    if (st) return st;
  }
  if (!(stages & OPGRAFT_MOE_STAGE_DOWN)) return OPGRAFT_OK;
  if (plan.cfg.pdl && (stages & OPGRAFT_MOE_STAGE_GATE_UP)) {
    /* moe_down may start while moe_gate_up's blocks still run; it waits (griddepcontrol.wait)
     * before it touches what gate_up writes or reads. */
    return launch_flagged(cu, plan.fn[1], grid2, 32u * (unsigned)plan.cfg.w2, 0, s,
                          OG_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, params,
                          "launch moe_down (programmatic dependent launch)");
  }
  return opgraft__cu_check(
      cu->cuLaunchKernel(plan.fn[1], grid2, 1, 1, 32u * (unsigned)plan.cfg.w2, 1, 1, 0, s, params, NULL),
      "launch moe_down");
}

int32_t opgraft_moe_run(const opgraft_moe_args *a, void *workspace, size_t workspace_bytes, void *stream) {
  return opgraft_moe_run_stages(a, workspace, workspace_bytes, stream, OPGRAFT_MOE_STAGE_ALL);
}

int32_t opgraft_moe_compile_report(const opgraft_moe_args *a, int32_t arch, opgraft_kernel_info *out,
                                   int32_t cap, int32_t *count) {
  if (!a || a->struct_size < sizeof *a || !count || (cap > 0 && !out))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_moe_compile_report: bad arguments");
  if (a->dtype != OPGRAFT_DTYPE_BF16 && a->dtype != OPGRAFT_DTYPE_FP16)
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "dtype %s has no kernel", dtype_name(a->dtype));
  if (a->hidden % 32 || a->inter % 32 || a->hidden <= 0 || a->inter <= 0 || a->num_experts < 1 ||
      a->top_k < 1 || a->top_k > OG_MAX_TOPK || a->num_tokens < 1 || a->num_tokens > OG_MAX_TOKENS)
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "shape outside the kernel's limits");
  og_moe_cfg cfg;
  moe_config(a, arch, a->gpu_name, &cfg);
  char buf[OG_MAX_OPTS][48];
  const char *opts[OG_MAX_OPTS];
  const int nopts = moe_options(a, &cfg, buf, opts);
  if (nopts < 0) return OPGRAFT_EINVAL;
  og_cubin cub;
  int32_t st = opgraft__compile("moe_decode.cu", opts, nopts, arch, &cub);
  if (st) return st;
  char names[OG_MOE_KERNELS][64];
  fn_names(a, names);
  /* The fused or stream kernel is reported (third) only when the configuration selects it. */
  if (cfg.stream) memcpy(names[2], names[3], sizeof names[2]);
  const int n = cfg.fused || cfg.stream ? 3 : 2;
  *count = n;
  for (int i = 0; i < n && i < cap && st == OPGRAFT_OK; ++i) st = opgraft__parse_resources(cub.log, names[i], &out[i]);
  opgraft__cubin_free(&cub);
  return st;
}
