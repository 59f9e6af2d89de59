/* The decode-attention op's configuration: tunables (rows, rules) -> the kernel's compile-time
 * constants, clamped to what compiles without spills; the compile options; the workspace size;
 * describe and compile report. */
#include <stdio.h>
#include <string.h>

#include "../../../kernels/attention/attn_params.h"
#include "attention.h"

/* Registers a thread needs without spills (NVRTC 13.0, sm_80 and sm_90, every option; the compile
 * test checks each variant): the launch-bounds minimum never squeezes a thread below this. The V
 * prefetch holds a tile's V rows twice: ptxas fits head 128 with up to 8 query heads a kv head in
 * the same registers (sm_90, 12 warps, with the cache write: 160 of the 168 the launch bounds
 * allow, 148 without it); elsewhere it takes D/4 more. */
static int regs_needed(int64_t D, int64_t G, int update_cluster, int vpf) {
  if (D == 64) return (G <= 8 ? 128 : 136) + (vpf ? 16 : 0);
  if (D == 128) /* the cache write and the cluster merge */
    return G <= 8 ? (update_cluster ? 176 : 168) : 208 + (vpf ? 32 : 0);
  return 256 + (vpf ? 64 : 0);
}

/* The registers a thread may take with mb blocks of W warps on an SM: each of the SM's 4
 * schedulers holds its warps' registers in its own 16K, allocated 8 registers a thread at a time. */
static int regs_cap(int W, int mb) {
  const int per_scheduler = (W * mb + 3) / 4;
  return 16384 / (per_scheduler * 32) / 8 * 8;
}

/* Whether a block of W warps still fits at a register need, within a thread's 255. */
static int fits(int W, int need) { return need <= 255 && regs_cap(W, 1) >= need; }

void opgraft__attn_config(const opgraft_attention_args *a, int32_t arch, const char *gpu, og_attn_cfg *c) {
  char shape[128];
  opgraft__attn_shape_key(a, shape, sizeof shape);
  /* The batch is the query's token count (one query token a sequence), so rows can hold for a
   * batch range; the lengths live on the device and cannot key a row. */
  const int32_t B = a->batch > INT32_MAX ? INT32_MAX : (int32_t)a->batch;
  const int64_t G = a->num_kv_heads > 0 ? a->num_heads / a->num_kv_heads : 1;
  c->warps = (int)opgraft__tune_value("attention.warps", arch, gpu, shape, B);
  if (c->warps < 1) c->warps = 1;
  /* Up to 64 KB of warp partials in shared memory (the dynamic limit set at launch is far above). */
  while (c->warps > 1 && (int64_t)c->warps * G * a->head_size * 4 > (64 << 10)) c->warps /= 2;
  /* Portable cluster sizes, powers of two (the grid's split count is rounded to a multiple). */
  const int64_t cl = arch >= 90 ? opgraft__tune_value("attention.cluster", arch, gpu, shape, B) : 1;
  c->cluster = cl >= 8 ? 8 : cl >= 4 ? 4 : cl >= 2 ? 2 : 1;
  /* A block must fit the register file at the register need (else ptxas would spill). */
  const int uc = a->k_new != NULL && c->cluster > 1;
  const int base = regs_needed(a->head_size, G, uc, 0);
  int need = base;
  while (c->warps > 1 && regs_cap(c->warps, 1) < need) c->warps /= 2;
  /* The V prefetch only where the warps still fit. */
  const int vneed = regs_needed(a->head_size, G, uc, 1);
  c->vpf = opgraft__tune_value("attention.vpf", arch, gpu, shape, B) != 0 && fits(c->warps, vneed);
  if (c->vpf) need = vneed;
  /* Two tiles a round hold a second tile's K and V rows, D/2 registers more: only where the warps
   * still fit, and not with the V prefetch. */
  const int rneed = base + (int)(a->head_size / 2);
  c->round =
      !c->vpf && opgraft__tune_value("attention.round", arch, gpu, shape, B) == 2 && fits(c->warps, rneed) ? 2 : 1;
  if (c->round == 2) need = rneed;
  /* 0: as many blocks an SM as the register need allows; a value is clamped down to that. */
  int fit = 16;
  while (fit > 1 && regs_cap(c->warps, fit) < need) --fit;
  const int64_t mb = opgraft__tune_value("attention.min_blocks", arch, gpu, shape, B);
  c->min_blocks = mb == 0 || mb > fit ? fit : (int)mb;
  if (c->min_blocks < 1) c->min_blocks = 1;
  const int64_t chunk = opgraft__tune_value("attention.min_chunk", arch, gpu, shape, B);
  c->min_chunk = (int)((chunk + 15) / 16 * 16);
  c->max_splits = (int)opgraft__tune_value("attention.max_splits", arch, gpu, shape, B);
  /* Forms 1 and 4 exist (og_common.cuh); any other value reads as 4. */
  c->load = opgraft__tune_value("attention.load", arch, gpu, shape, B) == 1 ? 1 : 4;
  /* 2 loads the first round before the wait: rows the kernel reads must not be the previous
   * kernel's, so only where the kernel writes the step's key itself (and without a window). */
  int64_t pdl = arch >= 90 ? opgraft__tune_value("attention.pdl", arch, gpu, shape, B) : 0;
  /* A call with the q/k prologue, or after the q/k epilogue, directly follows the qkv projection,
   * whose trigger lets it start. */
  if (arch >= 90 && (a->q_norm_weight != NULL || a->rope_style != OPGRAFT_ROPE_NONE ||
                     (a->flags & OPGRAFT_ATTN_AFTER_QKV))) {
    const int64_t pro = opgraft__tune_value("attention.pdl_pro", arch, gpu, shape, B);
    if (pro >= 0) pdl = pro;
  }
  c->pdl = pdl >= 2 && a->k_new != NULL && a->window_left < 0 ? 2 : pdl != 0;
  c->trigger = arch >= 90 && opgraft__tune_value("attention.trigger", arch, gpu, shape, B) != 0;
  /* Only where a launch can take 17 splits or more (the fan-in 32 entry point is compiled then). */
  c->fan32 = opgraft__tune_value("attention.fan32", arch, gpu, shape, B) != 0 && c->max_splits > OG_ATTN_FAN;
  c->softcap = a->softcap > 0;
  c->window = a->window_left >= 0;
  c->sinks = !a->sinks ? 0 : a->sinks_dtype == OPGRAFT_DTYPE_FP32 ? 2 : 1;
  c->update = a->k_new != NULL;
  c->qknorm = a->q_norm_weight != NULL;
  c->rope = a->rope_style;
}

int32_t opgraft__attn_options(const opgraft_attention_args *a, const og_attn_cfg *c, og_opts *o) {
  memset(o, 0, sizeof *o);
#define OG_OPT(...) opgraft__opt(o, __VA_ARGS__)
  OG_OPT("-DOG_DTYPE=%d", a->dtype == OPGRAFT_DTYPE_BF16 ? 1 : 2);
  OG_OPT("-DOG_D=%lld", (long long)a->head_size);
  OG_OPT("-DOG_G=%lld", (long long)(a->num_heads / a->num_kv_heads));
  OG_OPT("-DOG_W=%d", c->warps);
  OG_OPT("-DOG_MIN_BLOCKS=%d", c->min_blocks);
  OG_OPT("-DOG_SOFTCAP=%d", c->softcap);
  OG_OPT("-DOG_WINDOW=%d", c->window);
  OG_OPT("-DOG_SINKS=%d", c->sinks);
  OG_OPT("-DOG_LOAD=%d", c->load);
  OG_OPT("-DOG_PDL=%d", c->pdl);
  OG_OPT("-DOG_TRIGGER=%d", c->trigger);
  OG_OPT("-DOG_CLUSTER=%d", c->cluster > 1);
  OG_OPT("-DOG_UPDATE=%d", c->update);
  OG_OPT("-DOG_FAN32=%d", c->fan32);
  OG_OPT("-DOG_QKNORM=%d", c->qknorm);
  OG_OPT("-DOG_ROPE=%d", c->rope);
  OG_OPT("-DOG_VPF=%d", c->vpf);
  OG_OPT("-DOG_ROUND=%d", c->round);
#undef OG_OPT
  return opgraft__opts_check(o, "attention");
}

void opgraft__attn_fn_name(int32_t dtype, int fan_log2, char name[64]) {
  snprintf(name, 64, "attention_decode_%s%s", fan_log2 == OG_ATTN_FAN_MAX_LOG2 ? "fan32_" : "",
           dtype == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16");
}

int32_t opgraft__attn_prologue_options(const opgraft_attention_args *a, og_opts *o) {
  memset(o, 0, sizeof *o);
  opgraft__opt(o, "-DOG_QK_ONLY=1");
  opgraft__opt(o, "-DOG_DTYPE=%d", a->dtype == OPGRAFT_DTYPE_BF16 ? 1 : 2);
  opgraft__opt(o, "-DOG_D=%lld", (long long)a->head_size);
  opgraft__opt(o, "-DOG_QKNORM=%d", a->q_norm_weight != NULL);
  opgraft__opt(o, "-DOG_ROPE=%d", a->rope_style);
  return opgraft__opts_check(o, "attention prologue");
}

void opgraft__attn_prologue_fn_name(int32_t dtype, char name[64]) {
  snprintf(name, 64, "attention_qk_prologue_%s", dtype == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16");
}

static size_t round256(size_t n) { return (n + 255u) & ~(size_t)255u; }

/* The workspace: [counters][partial maxima and sums][partial outputs], each region at a fixed
 * offset sized for the largest split call at either fan-in (so the counters, which must stay
 * zero, never move with the batch or the fan-in). */
static void workspace_regions(const opgraft_attention_args *a, int64_t max_slots, int max_splits, size_t *counters,
                              size_t *ml, size_t *part) {
  const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_size;
  int64_t nc = 0, ns = 0;
  for (int S = 2; S <= max_splits && S <= max_slots; ++S)
    for (int lg = OG_ATTN_FAN_LOG2; lg <= OG_ATTN_FAN_MAX_LOG2; ++lg) {
      int sp, sc;
      og_attn_tree(S, lg, &sp, &sc);
      const int64_t groups = max_slots / S;
      if (groups * sc > nc) nc = groups * sc;
      if (groups * sp > ns) ns = groups * sp;
    }
  *counters = round256((size_t)nc * 4u);
  *ml = round256((size_t)(ns * G) * 8u);
  *part = round256((size_t)(ns * G * D) * 4u);
}

size_t opgraft__attn_workspace_bytes(const opgraft_attention_args *a, int64_t max_slots, int max_splits) {
  size_t c, m, p;
  workspace_regions(a, max_slots, max_splits, &c, &m, &p);
  return c + m + p;
}

void opgraft__attn_workspace_offsets(const opgraft_attention_args *a, int64_t max_slots, int max_splits,
                                     size_t *ml_off, size_t *part_off) {
  size_t c, m, p;
  workspace_regions(a, max_slots, max_splits, &c, &m, &p);
  *ml_off = c, *part_off = c + m;
}

int32_t opgraft__attn_compile_check(const opgraft_attention_args *a, const char *what) {
  char reason[256];
  if (!a || a->struct_size < sizeof *a) return opgraft__fail(OPGRAFT_EINVAL, "%s: bad arguments", what);
  const int32_t st = opgraft__attn_check_static(a, reason, sizeof reason);
  if (st) return opgraft__fail(st, "%s: %s", what, reason);
  if (!opgraft__op_ok(&opgraft__attention_op))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "the attention op is not registered");
  return OPGRAFT_OK;
}

int32_t opgraft_attention_describe(const opgraft_attention_args *a, int32_t arch, char *buf, size_t buf_len) {
  int32_t st = opgraft__attn_compile_check(a, "opgraft_attention_describe");
  if (st) return st;
  og_attn_cfg cfg;
  opgraft__attn_config(a, arch, a->gpu_name, &cfg);
  og_opts o;
  if ((st = opgraft__attn_options(a, &cfg, &o))) return st;
  return opgraft__opts_join(&o, buf, buf_len);
}

int32_t opgraft_attention_compile_report(const opgraft_attention_args *a, int32_t arch, opgraft_kernel_info *out,
                                         int32_t cap, int32_t *count) {
  if (!count || (cap > 0 && !out))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_attention_compile_report: bad arguments");
  int32_t st = opgraft__attn_compile_check(a, "opgraft_attention_compile_report");
  if (st) return st;
  og_attn_cfg cfg;
  opgraft__attn_config(a, arch, a->gpu_name, &cfg);
  og_opts o;
  if ((st = opgraft__attn_options(a, &cfg, &o))) return st;
  og_cubin cub;
  if ((st = opgraft__cubin_cached(OG_ATTN_SOURCE, o.ptr, o.n, arch, &cub))) return st;
  /* Fan-in 16's kernel, then fan-in 32's where the plan has it. */
  *count = cfg.fan32 ? 2 : 1;
  for (int i = 0; i < *count && i < cap && !st; ++i) {
    char name[64];
    opgraft__attn_fn_name(a->dtype, i ? OG_ATTN_FAN_MAX_LOG2 : OG_ATTN_FAN_LOG2, name);
    st = opgraft__parse_resources(cub.log, name, &out[i]);
  }
  opgraft__cubin_free(&cub);
  return st;
}
