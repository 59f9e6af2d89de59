/* The MoE op's configuration: tunables (rows, rules) -> the kernels' compile-time constants,
 * clamped to what compiles without spills; the compile options; describe and compile report. */
#include <stdio.h>
#include <string.h>

#include "moe.h"

/* The keys both weight types read the same way (the FP8 ones under the FP8 shape key). */
static void config_shared(const opgraft_moe_args *a, int32_t arch, const char *gpu, const char *shape,
                          og_moe_cfg *c) {
  const int32_t T = (int32_t)a->num_tokens;
  c->nt = T <= 0 ? 1 : (T + 7) / 8;
  c->w1 = (int)opgraft__tune_value("moe.gate_up.warps", arch, gpu, shape, T);
  c->u1 = (int)opgraft__tune_value("moe.gate_up.unroll", arch, gpu, shape, T);
  c->w2 = (int)opgraft__tune_value("moe.down.warps", arch, gpu, shape, T);
  c->u2 = (int)opgraft__tune_value("moe.down.unroll", arch, gpu, shape, T);
  const int64_t f = opgraft__tune_value("moe.l2_fetch", arch, gpu, shape, T);
  c->l2_fetch = f >= 256 ? 256 : f >= 128 ? 128 : 0; /* the hint has two sizes */
  c->pdl = arch >= 90 ? (int)opgraft__tune_value("moe.pdl", arch, gpu, shape, T) : 0;
  c->down_early = c->pdl && opgraft__tune_value("moe.down.early", arch, gpu, shape, T) != 0;
  c->pdl_in = arch >= 90 && opgraft__tune_value("moe.pdl_in", arch, gpu, shape, T) != 0;
  c->trigger = arch >= 90 && opgraft__tune_value("moe.trigger", arch, gpu, shape, T) != 0;
  c->trace = opgraft__moe_trace_on();
  /* Forms 1 and 4 exist (og_common.cuh); any other value reads as 4. */
  c->load = opgraft__tune_value("moe.load", arch, gpu, shape, T) == 1 ? 1 : 4;
  /* sm_90 only: on sm_80 form 4 makes Mixtral-8x7B's down spill (test_compile), so down keeps
   * form 1 there. */
  c->down_load = arch >= 90 && opgraft__tune_value("moe.down_load", arch, gpu, shape, T) == 4 ? 4 : 1;
  const int small = T >= 1 && (int64_t)T * a->top_k <= 32;
  c->gu_slots = small && opgraft__tune_value("moe.gate_up.slot_routing", arch, gpu, shape, T) != 0;
  c->down_warp = small && opgraft__tune_value("moe.down.warp_routing", arch, gpu, shape, T) != 0;
}

/* FP8 weights (moe/moe_fp8.cu): the same keys, resolved under the FP8 shape key
 * ("moe:fp8block:..." / "moe:fp8tensor:..."), for the paths the FP8 kernels have: two kernels
 * (no cooperative one), routing by slot for calls of up to 32 routing slots (one token included),
 * else the general routing. gate_up's tiles are 16 or 32 rows of I, a half (16 rows) a pass over H,
 * its k-steps 4 weight loads of 16 bytes a lane (8 where 64-k steps do not fit); down's k-steps
 * 2 weight loads of 16 bytes and 32 bytes of act (f16) a token tile (8 and 16). */
static void config_fp8(const opgraft_moe_args *a, int32_t arch, const char *gpu, const char *shape,
                       og_moe_cfg *c) {
  const int32_t T = (int32_t)a->num_tokens;
  c->gu_nt = c->nt;
  /* 64-k steps (16-byte weight loads) where the k dimension and the weight blocks' k divide by 64
   * (the activations' 1 x block_k groups then hold whole steps too). */
  const int ks = (int)opgraft__tune_value("moe.fp8_kstep", arch, gpu, shape, T) == 32 ? 32 : 64;
  const int bk_ok = a->scale_layout != OPGRAFT_MOE_SCALE_BLOCK || a->block_k % 64 == 0;
  c->gu_ks = ks == 64 && bk_ok && a->hidden % 64 == 0 ? 64 : 32;
  c->down_ks = ks == 64 && bk_ok && a->inter % 64 == 0 ? 64 : 32;
  c->gu_rows = opgraft__tune_value("moe.gate_up.fp8_rows", arch, gpu, shape, T) == 32 ? 32 : 16;
  while (c->w1 > 1 && c->w1 * c->nt > 16) c->w1 /= 2; /* 2 KB of reduction buffer per warp-tile */
  while (c->w2 > 1 && c->w2 * c->nt > 64) c->w2 /= 2;
  if (c->nt >= 2 && c->w1 > 8) c->w1 = 8; /* 16 warps cap a thread at 128 registers */
  if (c->nt >= 2 && c->w2 > 8) c->w2 = 8;
  /* gate_up's launch-bounds minimum is at least one block: without one ptxas aims 16-warp blocks
   * at 64 registers and spills. */
  c->gu_min_blocks = c->nt == 1 ? (int)opgraft__tune_value("moe.gate_up.min_blocks", arch, gpu, shape, T) : 0;
  while (c->gu_min_blocks > 1 && c->gu_min_blocks * c->w1 > 16) c->gu_min_blocks--;
  if (c->gu_min_blocks < 1) c->gu_min_blocks = 1;
  /* Accumulators plus the operands of the k-steps in flight, in registers a thread; where the
   * minimum caps a thread at 128 registers, at most 6 k-steps (8 reach 128 and spill on some
   * shapes). */
  const int q1 = c->gu_ks / 32, q2 = c->down_ks / 32; /* a k-step's registers, in 32-k steps' */
  c->xq = opgraft__moe_quantizes_x(a);
  const int xb = c->xq ? 4 : 2; /* x's registers a token tile and 32-k step: 16-bit, or e4m3 */
  while (c->u1 > 1 && 8 * c->nt + c->u1 * q1 * (8 + xb * c->nt) > 96) c->u1--;
  if (c->gu_min_blocks * c->w1 >= 16 && c->u1 * q1 > 6) c->u1 = 6 / q1;
  /* An unroll that splits H's k-steps evenly over the warps needs no bounds checks (fewer
   * registers) and gives every warp the same steps. */
  for (int u = c->u1; u * 2 > c->u1; --u)
    if ((a->hidden / c->gu_ks) % (c->w1 * u) == 0) {
      c->u1 = u;
      break;
    }
  /* Quantizing x: a warp's k-steps a round hold whole 1 x block_k groups (each group's absmax
   * from the values in its registers), so the unroll is a multiple of the steps of a group. */
  if (c->xq) {
    const int spg = (int)opgraft__moe_x_group(a) / c->gu_ks;
    c->u1 = c->u1 < spg ? spg : c->u1 - c->u1 % spg;
  }
  while (c->u2 > 1 && 4 * c->nt + c->u2 * q2 * (4 + 4 * c->nt) > 72) c->u2--; /* act: 16 bytes a 32-k step */
  for (int u = c->u2; u * 2 > c->u2; --u) /* chunks of whole k-steps over I, likewise */
    if ((a->inter / c->down_ks) % u == 0) {
      c->u2 = u;
      break;
    }
  c->down_min_blocks = c->nt <= 2 ? (int)opgraft__tune_value("moe.down.min_blocks", arch, gpu, shape, T) : 0;
  while (c->down_min_blocks > 1 && c->down_min_blocks * c->w2 > 16) c->down_min_blocks--;
  if (c->down_min_blocks < 2) c->down_min_blocks = 0;
  /* With no minimum ptxas compiled down's 64-k steps at an unroll of 2, or in blocks of 1-2 warps,
   * to 64-96 registers and spilled; a minimum of 1 there. The measured configurations (unroll 4,
   * 8-16 warps) keep none, as they ran. */
  if (c->down_min_blocks == 0 && c->down_ks == 64 && (c->u2 <= 2 || c->w2 <= 2)) c->down_min_blocks = 1;
}

/* Resolves the kernel configuration; clamps keep the static shared memory under 48 KB and the
 * operand registers of one k-step group under what compiles without spills (checked by the
 * compile tests for every token tile count). */
void opgraft__moe_config(const opgraft_moe_args *a, int32_t arch, const char *gpu, og_moe_cfg *c) {
  char shape[128];
  opgraft__moe_shape_key(a, shape, sizeof shape);
  memset(c, 0, sizeof *c);
  config_shared(a, arch, gpu, shape, c);
  if (opgraft__moe_is_fp8(a)) {
    config_fp8(a, arch, gpu, shape, c);
    return;
  }
  const int32_t T = (int32_t)a->num_tokens;
  c->fused = opgraft__tune_value("moe.fused", arch, gpu, shape, T) != 0;
  /* gate_up's one-pass token tiles: fewer than the call's only for the two kernels (the fused
   * kernel's stages share one reduction buffer and one register budget). */
  const int64_t gnt = opgraft__tune_value("moe.gate_up.nt", arch, gpu, shape, T);
  c->gu_nt = !c->fused && gnt >= 1 && gnt < c->nt ? (int)gnt : c->nt;
  c->gu_one = T == 1 && opgraft__tune_value("moe.gate_up.one_token", arch, gpu, shape, T) != 0;
  c->down_one = T == 1 && opgraft__tune_value("moe.down.one_token", arch, gpu, shape, T) != 0;
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
}

/* Compile options for one configuration. */
int32_t opgraft__moe_options(const opgraft_moe_args *a, const og_moe_cfg *c, og_opts *o) {
  memset(o, 0, sizeof *o);
#define OG_OPT(...) opgraft__opt(o, __VA_ARGS__)
  OG_OPT("-DOG_DTYPE=%d", a->dtype == OPGRAFT_DTYPE_BF16 ? 1 : 2);
  OG_OPT("-DOG_IDS64=%d", a->topk_ids_dtype == OPGRAFT_DTYPE_INT64);
  OG_OPT("-DOG_EMAP=%d", a->expert_map != NULL);
  OG_OPT("-DOG_ROUTE=%d", (int)a->routing);
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
  OG_OPT("-DOG_L2_FETCH=%d", c->l2_fetch);
  OG_OPT("-DOG_PDL=%d", c->pdl);
  OG_OPT("-DOG_DOWN_EARLY=%d", c->down_early);
  OG_OPT("-DOG_PDL_IN=%d", c->pdl_in);
  OG_OPT("-DOG_DOWN_TRIGGER=%d", c->trigger);
  OG_OPT("-DOG_GU_ONE=%d", c->gu_one);
  OG_OPT("-DOG_DOWN_ONE=%d", c->down_one);
  OG_OPT("-DOG_GU_SLOTS=%d", c->gu_slots);
  OG_OPT("-DOG_DOWN_WARP=%d", c->down_warp);
  if (c->trace) OG_OPT("-DOG_TRACE=1");
  OG_OPT("-DOG_LOAD=%d", c->load);
  OG_OPT("-DOG_DOWN_LOAD=%d", c->down_load);
  OG_OPT("-DOG_GU_MIN_BLOCKS=%d", c->gu_min_blocks);
  OG_OPT("-DOG_DOWN_MIN_BLOCKS=%d", c->down_min_blocks);
  if (opgraft__moe_is_fp8(a)) { /* the FP8 kernels' scaling (moe/moe_fp8_config.cuh) */
    const int block = a->scale_layout == OPGRAFT_MOE_SCALE_BLOCK;
    OG_OPT("-DOG_SCALE=%d", block ? 1 : 2);
    OG_OPT("-DOG_BN=%d", block ? a->block_n : 0);
    OG_OPT("-DOG_BK=%d", block ? a->block_k : 0);
    OG_OPT("-DOG_GU_KS=%d", c->gu_ks);
    OG_OPT("-DOG_DOWN_KS=%d", c->down_ks);
    OG_OPT("-DOG_GU_ROWS=%d", c->gu_rows);
    OG_OPT("-DOG_XQ=%d", c->xq);
    OG_OPT("-DOG_XG=%d", c->xq ? (int)opgraft__moe_x_group(a) : 0);
  }
#undef OG_OPT
  return opgraft__opts_check(o, "MoE");
}

void opgraft__moe_fn_names(const opgraft_moe_args *a, char names[OG_MOE_KERNELS][64]) {
  const char *sfx = a->dtype == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16";
  if (opgraft__moe_is_fp8(a)) {
    snprintf(names[0], 64, "moe_gate_up_fp8_%s", sfx);
    snprintf(names[1], 64, "moe_down_fp8_%s", sfx);
    names[2][0] = 0;
    return;
  }
  snprintf(names[0], 64, "moe_gate_up_%s", sfx);
  snprintf(names[1], 64, "moe_down_%s", sfx);
  snprintf(names[2], 64, "moe_fused_%s", sfx);
}

int opgraft__moe_nkernels(const opgraft_moe_args *a, const og_moe_cfg *c) {
  return !opgraft__moe_is_fp8(a) && c->fused ? 3 : 2;
}

const char *opgraft__moe_source(const opgraft_moe_args *a) {
  return opgraft__moe_is_fp8(a) ? OG_MOE_FP8_SOURCE : OG_MOE_SOURCE;
}

/* The shape checks a compile-only call needs (no device). */
static int32_t compile_check(const opgraft_moe_args *a, const char *what) {
  if (!a || a->struct_size < sizeof *a) return opgraft__fail(OPGRAFT_EINVAL, "%s: bad arguments", what);
  if (a->dtype != OPGRAFT_DTYPE_BF16 && a->dtype != OPGRAFT_DTYPE_FP16)
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "dtype %s has no kernel", opgraft__moe_dtype_name(a->dtype));
  if (a->weight_dtype != 0 && a->weight_dtype != a->dtype && !opgraft__moe_is_fp8(a))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "weights dtype %s has no kernel", opgraft__moe_dtype_name(a->weight_dtype));
  if (opgraft__moe_is_fp8(a) &&
      !(a->scale_layout == OPGRAFT_MOE_SCALE_TENSOR ||
        (a->scale_layout == OPGRAFT_MOE_SCALE_BLOCK && a->block_n >= 32 && a->block_n % 32 == 0 &&
         a->block_k >= 32 && a->block_k % 32 == 0)))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "FP8 scale layout %d (blocks %dx%d) has no kernel", a->scale_layout,
                         a->block_n, a->block_k);
  if (a->hidden % 32 || a->inter % 32 || a->hidden <= 0 || a->inter <= 0 || a->hidden > OG_MOE_MAX_DIM ||
      a->inter > OG_MOE_MAX_DIM || a->num_experts < 1 || a->num_experts > OG_MOE_MAX_EXPERTS || a->top_k < 1 ||
      a->top_k > OG_MOE_MAX_TOPK || a->num_tokens < 1 || a->num_tokens > OG_MOE_MAX_TOKENS)
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "shape outside the kernel's limits");
  if (!opgraft__op_ok(&opgraft__moe_op)) return opgraft__fail(OPGRAFT_EUNSUPPORTED, "the MoE op is not registered");
  return OPGRAFT_OK;
}

int32_t opgraft_moe_describe(const opgraft_moe_args *a, int32_t arch, char *buf, size_t buf_len) {
  int32_t st = compile_check(a, "opgraft_moe_describe");
  if (st) return st;
  og_moe_cfg cfg;
  opgraft__moe_config(a, arch, a->gpu_name, &cfg);
  og_opts o;
  if ((st = opgraft__moe_options(a, &cfg, &o))) return st;
  return opgraft__opts_join(&o, buf, buf_len);
}

int32_t opgraft_moe_compile_report(const opgraft_moe_args *a, int32_t arch, opgraft_kernel_info *out,
                                   int32_t cap, int32_t *count) {
  if (!count || (cap > 0 && !out)) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_moe_compile_report: bad arguments");
  int32_t st = compile_check(a, "opgraft_moe_compile_report");
  if (st) return st;
  og_moe_cfg cfg;
  opgraft__moe_config(a, arch, a->gpu_name, &cfg);
  og_opts o;
  if ((st = opgraft__moe_options(a, &cfg, &o))) return st;
  /* Through the cache: the compiler log is kept with the cubin, so a report needs no recompile. */
  og_cubin cub;
  if ((st = opgraft__cubin_cached(opgraft__moe_source(a), o.ptr, o.n, arch, &cub))) return st;
  char names[OG_MOE_KERNELS][64];
  opgraft__moe_fn_names(a, names);
  /* The fused kernel is reported (third) only when the configuration selects it. */
  const int n = opgraft__moe_nkernels(a, &cfg);
  *count = n;
  for (int i = 0; i < n && i < cap && st == OPGRAFT_OK; ++i) st = opgraft__parse_resources(cub.log, names[i], &out[i]);
  opgraft__cubin_free(&cub);
  return st;
}
