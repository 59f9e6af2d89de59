/* The linear op's configuration: tunables (rows, rules) -> the kernel's compile-time constants,
 * clamped to what compiles without spills; the compile options; describe and compile report. */
#include <stdio.h>
#include <string.h>

#include "linear.h"

/* The clamps keep one batch of loads (a k-step group's 16-byte operands: x and each tile's W) at
 * 64 registers or fewer, and the launch-bounds minimum at 16 warps an SM or fewer (128 registers
 * a thread; the add + RMSNorm form 12): the compile test checks that every such variant is spill-free on sm_80 and sm_90
 * (FP8: sm_89 and sm_90). */
void opgraft__linear_config(const opgraft_linear_args *a, int32_t arch, const char *gpu, og_linear_cfg *c) {
  char shape[96];
  opgraft__linear_shape_key(a, shape, sizeof shape);
  const int32_t M = (int32_t)a->rows;
  c->warps = (int)opgraft__tune_value("linear.warps", arch, gpu, shape, M);
  c->tiles = (int)opgraft__tune_value("linear.tiles", arch, gpu, shape, M);
  c->unroll = (int)opgraft__tune_value("linear.unroll", arch, gpu, shape, M);
  c->min_blocks = (int)opgraft__tune_value("linear.min_blocks", arch, gpu, shape, M);
  /* Forms 1 and 4 exist (og_common.cuh); any other value reads as 4. */
  c->load = opgraft__tune_value("linear.load", arch, gpu, shape, M) == 1 ? 1 : 4;
  const int64_t f = opgraft__tune_value("linear.l2_fetch", arch, gpu, shape, M);
  c->l2_fetch = f >= 256 ? 256 : f >= 128 ? 128 : 0; /* the hint has two sizes */
  /* 0 off; 1 the first loads before the wait; 2 also the rest of the weights asked of L2 there. */
  const int64_t pdl = arch >= 90 ? opgraft__tune_value("linear.pdl", arch, gpu, shape, M) : 0;
  c->pdl = pdl >= 2 ? 2 : pdl != 0;
  c->trigger = arch >= 90 && opgraft__tune_value("linear.trigger", arch, gpu, shape, M) != 0;
  /* The q/k epilogue: a head's blocks are one cluster of at most 8 (8 * tiles divides head_size),
   * of 4 warps or fewer: a cluster's blocks share a GPC, and Qwen3-30B-A3B's 40 clusters of eight
   * 8-warp blocks (two an SM) did not all fit at once on the H100 (14.4 us against 11.4 with 4
   * warps, 10.1 without the epilogue; bench/NOTES.md v61). */
  if (a->qk_heads) {
    while (c->tiles > 1 && a->head_size % (8 * c->tiles)) c->tiles--;
    while (a->head_size / (8 * c->tiles) > 8) c->tiles *= 2;
    if (c->warps > 4) c->warps = 4;
  }
  if (opgraft__linear_is_fp8(a)) {
    /* A group's operands a lane: (block_k / 64) steps of 16 bytes of 2 rows a tile, and 32 bytes
     * of x (shared by the tiles): at most 64 registers for a batch of groups, 48 for one group
     * (three 16-row tiles spilled at 128 registers); PDL without its L2 prefetch form. */
    const int64_t spg = a->block_k / 64 > 0 ? a->block_k / 64 : 1;
    while (c->tiles > 1 && 4 * spg * (2 * c->tiles + 2) > 48) c->tiles--;
    const int64_t groups = a->block_k > 0 ? a->in_features / a->block_k : 1;
    const int64_t per_warp = (groups + c->warps - 1) / c->warps;
    while (c->unroll > 1 && 4 * spg * (2 * c->tiles + 2) * c->unroll > 64) c->unroll--;
    if (c->unroll > per_warp) c->unroll = per_warp > 0 ? (int)per_warp : 1;
    if (c->pdl > 1) c->pdl = 1;
  } else {
    const int64_t steps = (a->in_features / 8 + 3) / 4;
    const int64_t per_warp = (steps + c->warps - 1) / c->warps;
    while (c->unroll > 1 && c->unroll * (c->tiles + 1) > 16) c->unroll--;
    if (c->unroll > per_warp) c->unroll = per_warp > 0 ? (int)per_warp : 1; /* no loads a warp never issues */
  }
  /* The add + RMSNorm form holds the first weights in flight through its prologue: at most 12
   * warps an SM by launch bounds (170 registers), where 16 spilled a few bytes. */
  const int max_warps = a->residual ? 12 : 16;
  while (c->min_blocks > 1 && c->min_blocks * c->warps > max_warps) c->min_blocks--;
}

int32_t opgraft__linear_options(const opgraft_linear_args *a, const og_linear_cfg *c, og_opts *o) {
  memset(o, 0, sizeof *o);
#define OG_OPT(...) opgraft__opt(o, __VA_ARGS__)
  OG_OPT("-DOG_DTYPE=%d", a->dtype == OPGRAFT_DTYPE_BF16 ? 1 : 2);
  OG_OPT("-DOG_K=%lld", (long long)a->in_features);
  if (opgraft__linear_is_fp8(a)) {
    OG_OPT("-DOG_BN=%d", a->block_n);
    OG_OPT("-DOG_BK=%d", a->block_k);
  }
  OG_OPT("-DOG_WARPS=%d", c->warps);
  OG_OPT("-DOG_TILES=%d", c->tiles);
  OG_OPT("-DOG_U=%d", c->unroll);
  OG_OPT("-DOG_MINB=%d", c->min_blocks);
  OG_OPT("-DOG_LOAD=%d", c->load);
  OG_OPT("-DOG_L2_FETCH=%d", c->l2_fetch);
  OG_OPT("-DOG_PDL=%d", c->pdl);
  if (c->trigger) OG_OPT("-DOG_TRIGGER=1"); /* only where on, as OG_NORM */
  if (a->residual) OG_OPT("-DOG_NORM=1");
  if (a->qk_heads) {
    OG_OPT("-DOG_QKPRO=1");
    OG_OPT("-DOG_QK_D=%d", a->head_size);
    OG_OPT("-DOG_QKNORM=%d", a->q_norm_weight != NULL);
    OG_OPT("-DOG_ROPE=%d", a->rope_style);
  }
#undef OG_OPT
  return opgraft__opts_check(o, "linear");
}

unsigned opgraft__linear_grid(const opgraft_linear_args *a, const og_linear_cfg *c) {
  const int64_t rows = (opgraft__linear_is_fp8(a) ? 16 : 8) * (int64_t)c->tiles;
  return (unsigned)((a->out_features + rows - 1) / rows);
}

void opgraft__linear_fn_name(const opgraft_linear_args *a, char name[64]) {
  snprintf(name, 64, "linear_%sgemv%s%s_%s", a->residual ? "norm_" : "", opgraft__linear_is_fp8(a) ? "_fp8" : "",
           a->qk_heads ? "_qk" : "", a->dtype == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16");
}

const char *opgraft__linear_source(const opgraft_linear_args *a) {
  return opgraft__linear_is_fp8(a) ? "linear/linear_fp8.cu" : "linear/linear.cu";
}

/* The checks a compile-only call needs (no device, no pointers). */
static int32_t compile_check(const opgraft_linear_args *a, const char *what) {
  char reason[256];
  if (!a || a->struct_size < sizeof *a) return opgraft__fail(OPGRAFT_EINVAL, "%s: bad arguments", what);
  if (!opgraft__op_ok(&opgraft__linear_op))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "the linear op is not registered");
  const int32_t st = opgraft__linear_check_static(a, reason, sizeof reason);
  if (st) return opgraft__fail(st, "%s: %s", what, reason);
  return OPGRAFT_OK;
}

int32_t opgraft_linear_describe(const opgraft_linear_args *a, int32_t arch, char *buf, size_t buf_len) {
  int32_t st = compile_check(a, "opgraft_linear_describe");
  if (st) return st;
  if (!buf || !buf_len) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_describe: no buffer");
  og_linear_cfg cfg;
  opgraft__linear_config(a, arch, a->gpu_name, &cfg);
  og_opts o;
  if ((st = opgraft__linear_options(a, &cfg, &o))) return st;
  if ((st = opgraft__opts_join(&o, buf, buf_len))) return st;
  const size_t used = strlen(buf);
  const int w = snprintf(buf + used, buf_len - used, " grid=%u threads=%d", opgraft__linear_grid(a, &cfg),
                         32 * cfg.warps);
  if (w < 0 || (size_t)w >= buf_len - used) return opgraft__fail(OPGRAFT_ERANGE, "opgraft_linear_describe: buffer too small");
  return OPGRAFT_OK;
}

int32_t opgraft_linear_compile_report(const opgraft_linear_args *a, int32_t arch, opgraft_kernel_info *out,
                                      int32_t cap, int32_t *count) {
  if (!count || (cap > 0 && !out))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_compile_report: bad arguments");
  int32_t st = compile_check(a, "opgraft_linear_compile_report");
  if (st) return st;
  og_linear_cfg cfg;
  opgraft__linear_config(a, arch, a->gpu_name, &cfg);
  og_opts o;
  if ((st = opgraft__linear_options(a, &cfg, &o))) return st;
  /* Through the cache: the compiler log is kept with the cubin, so a report needs no recompile. */
  og_cubin cub;
  if ((st = opgraft__cubin_cached(opgraft__linear_source(a), o.ptr, o.n, arch, &cub))) return st;
  char name[64];
  opgraft__linear_fn_name(a, name);
  *count = 1;
  if (cap > 0) st = opgraft__parse_resources(cub.log, name, &out[0]);
  opgraft__cubin_free(&cub);
  return st;
}
