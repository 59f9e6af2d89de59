/* The linear op's rules: tunable values derived from the shape and the GPU, used wherever no baked
 * row (table.c) matches. linear.max_rows is measured (H200 2026-12-01: ours won at every
 * Qwen3-30B-A3B projection, 1.06-1.86x cuBLAS, and lost on two Llama-3-70B/tp8 shapes, which rows
 * hand back); the tile and warp values follow from the kernel's structure and the MoE kernels'
 * measurements (bench/NOTES.md), not from a sweep.
 *
 * - linear.max_rows (hand-back threshold): 8 on sm_90, where the kernel was measured to win
 *   (weights streamed once: 1.06-1.9x cuBLAS at one row on the H200's presets, within 8% of that
 *   at eight rows; bench/NOTES.md); rows hand back the shapes where it lost. Conservative
 *   elsewhere: one row on other sm_80+ GPUs, where nothing was measured.
 * - linear.warps: 8 warps split K; 16 when the call has fewer 8-row tiles than the GPU has SMs
 *   (router gates: [128, 2048] gives 16 blocks), so that more loads are in flight; halved while a
 *   warp would get fewer than 4 k-steps of 32.
 * - linear.tiles: as few 8-row tiles a block as let every block be resident at once (the GPU's SMs
 *   x 16 warps an SM at 128 registers a thread): the blocks then stream side by side and end
 *   together, with no partial last wave. Qwen3-30B-A3B's qkv [5120, 2048]: 640 tiles, 264 resident
 *   blocks of 8 warps -> 3 tiles, 214 blocks. Where even 4 tiles need several waves (lm_head,
 *   dense MLPs) blocks of 2 tiles stream wave after wave.
 * - linear.unroll: 8 k-steps in flight a warp at one tile, 4 from two (4 KB or more of weights in
 *   flight a warp), never more than a warp's k-steps.
 * - linear.min_blocks: 16 warps an SM (MoE v13: without a minimum ptxas trades the loads issued
 *   together for fewer registers).
 * - linear.l2_fetch 128 (the MoE kernels' largest single gain, NOTES v2), linear.load 4 (the form
 *   that kept its speed after other kernels had filled L2, NOTES v9).
 * - linear.pdl 1 on sm_90 for 16-bit weights: launched as a programmatic dependent of a previous
 *   kernel that does not let it start early (vLLM's norm before qkv and the router, the bench's
 *   64 MiB read), the call starts as that kernel's blocks exit and has its first weights in flight
 *   when the wait ends. H200, span timing, two runs each, pdl 0 -> 1 (bench/NOTES.md v41): Qwen3-30B-A3B
 *   router 3.17 -> 3.00 us, qkv 8.02 -> 7.82, lm_head 137.6 -> 137.4; Llama-3-8B qkv 14.95 -> 14.67,
 *   o 10.85 -> 10.63, down 31.15 -> 30.75 (M=1), gate_up 57.8 -> 56.9 (M=8); Llama-3-70B/tp8 down,
 *   gate_up, qkv (M=1), lm_head -0.1..-0.8. Rows keep 0 where it lost (Llama-3-70B/tp8's o, +1.8 us,
 *   and its qkv at 8 rows) and 2 for Qwen3-30B-A3B's o after attention. FP8 weights 0: no gain
 *   there (Qwen3-30B-A3B-FP8 qkv -0.05, o +0.2..+0.3, router +0.05 us).
 * - FP8 weights ("linear:fp8:..."): linear.max_rows 8 on sm_90 for weights of at most 16 MiB, 0
 *   elsewhere: against vLLM's own FP8 kernel in the same run (NOTES v33) ours is 1.27-4.3x on
 *   Qwen3-30B-A3B-FP8's projections (up to 10.5 MB) but 0.80-1.05x on DeepSeek-V3's q_b
 *   (38 MB) and o (117 MB), where this GEMV reads 40-60% of the ceiling;
 *   warps as above over 128-column groups (one group a warp at least); one 16-row tile a block
 *   where every block of 8 warps is then resident (two blocks an SM), else two (Qwen3-30B-A3B's
 *   qkv [5120, 2048]: 320 blocks in 1.2 waves 7.77 µs, 160 in one 6.77); one group a warp in
 *   flight (o [2048, 4096] 6.40 -> 5.79 µs against two; qkv and router the same or better).
 *   H200 sweep, bench/NOTES.md v32.
 * - linear.norm_rows (the add + RMSNorm form, read by the graph pass, not the kernel): every block
 *   normalizes the rows itself, a cost that grows with rows x K and with the blocks an SM runs in
 *   turn, against the norm kernel and the boundary it saves (~2.5 us). H200, span timing, against
 *   the compiled norm then the plain kernel (bench/NOTES.md v42): Qwen3-30B-A3B qkv [5120, 2048]
 *   (214 blocks) 10.49 -> 9.00 us at one row, 10.58 -> 9.82 at two, +0.4 at four; Llama-3-70B/tp8
 *   qkv [1280, 8192] 12.96 -> 12.27 at one, +2.4 at two; Llama-3-8B qkv [6144, 4096] (256 blocks)
 *   17.58 -> 17.40 at one, +0.9 at two; gate_up of Llama-3-8B (1792 blocks) and Llama-3-70B/tp8
 *   (448) +4.8 / +2.7 at one. So 2 rows where K <= 2048, else 1, where the blocks are at most two
 *   an SM; 0 past that, for FP8 weights and off sm_90 (not measured). */
#include <stdio.h>
#include <string.h>

#include "linear.h"

#define OG_LINEAR_FP8_MAX_BYTES (16LL << 20)

int opgraft__linear_parse_shape(const char *shape, og_linear_shape *s) {
  char dt[8];
  long long N, K;
  if (!shape || sscanf(shape, "linear:%7[a-z0-9]:N%lld:K%lld", dt, &N, &K) != 3) return 0;
  if (N < 1 || K < 8) return 0;
  s->N = N, s->K = K, s->fp8 = strcmp(dt, "fp8") == 0;
  return 1;
}

/* SMs of the usual GPU of an arch (the rule cannot see the device): H100/H200 SXM 132, A100 108. */
static int64_t sms_of(int32_t arch) { return arch == 90 ? 132 : arch >= 100 ? 148 : 108; }

/* FP8: the units a warp splits are 128-column groups (vLLM's blocks; the rule cannot see
 * block_k), a tile is 16 rows. */
static int64_t rule_warps(const og_linear_shape *s, int32_t arch) {
  const int64_t units = s->fp8 ? s->K / 128 : (s->K / 8 + 3) / 4, tiles = (s->N + (s->fp8 ? 15 : 7)) / (s->fp8 ? 16 : 8);
  int64_t w = tiles < sms_of(arch) ? 16 : 8;
  while (w > 1 && units < (s->fp8 ? 1 : 4) * w) w /= 2;
  return w;
}

static int64_t rule_tiles(const og_linear_shape *s, int32_t arch) {
  if (s->fp8) return (s->N + 15) / 16 > 2 * sms_of(arch) ? 2 : 1;
  const int64_t tiles8 = (s->N + 7) / 8;
  const int64_t resident = sms_of(arch) * (16 / rule_warps(s, arch));
  const int64_t t = (tiles8 + resident - 1) / resident;
  return t < 1 ? 1 : t > 4 ? 2 : t;
}

int opgraft__linear_rule(const opgraft_tune_query *q, int64_t *value) {
  const char *key = q->key;
  og_linear_shape s;
  const int parsed = opgraft__linear_parse_shape(q->shape, &s);
  if (strcmp(key, "linear.max_rows") == 0 && parsed && s.fp8)
    return *value = q->arch == 90 && s.N * s.K <= OG_LINEAR_FP8_MAX_BYTES ? 8 : 0, 1;
  if (strcmp(key, "linear.max_rows") == 0) return *value = q->arch == 90 ? 8 : 1, 1;
  if (strcmp(key, "linear.load") == 0) return *value = 4, 1;
  if (strcmp(key, "linear.l2_fetch") == 0) return *value = 128, 1;
  if (!parsed) return 0;
  if (strcmp(key, "linear.pdl") == 0) return *value = q->arch == 90 && !s.fp8, 1;
  if (strcmp(key, "linear.norm_rows") == 0) {
    const int64_t blocks = ((s.N + 7) / 8 + rule_tiles(&s, q->arch) - 1) / rule_tiles(&s, q->arch);
    return *value = q->arch != 90 || s.fp8 || blocks > 2 * sms_of(q->arch) ? 0 : s.K <= 2048 ? 2 : 1, 1;
  }
  if (strcmp(key, "linear.warps") == 0) return *value = rule_warps(&s, q->arch), 1;
  if (strcmp(key, "linear.tiles") == 0) return *value = rule_tiles(&s, q->arch), 1;
  if (strcmp(key, "linear.min_blocks") == 0) return *value = 16 / rule_warps(&s, q->arch), 1;
  if (strcmp(key, "linear.unroll") == 0 && s.fp8) return *value = 1, 1;
  if (strcmp(key, "linear.unroll") == 0) {
    const int64_t steps = (s.K / 8 + 3) / 4, w = rule_warps(&s, q->arch);
    const int64_t per_warp = (steps + w - 1) / w;
    const int64_t u = rule_tiles(&s, q->arch) == 1 ? 8 : 4;
    return *value = u < per_warp ? u : per_warp, 1;
  }
  return 0;
}
