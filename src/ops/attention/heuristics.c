/* The decode-attention op's rules: tunable values derived from the shape and the GPU, used where
 * no baked row (table.c) matches. attention.max_batch, attention.warps and attention.fan32 on sm_90
 * are measured here; the other values are argued from the kernel's structure (the rows override
 * them where measured: 8 warps for Qwen3-30B-A3B's heads at one sequence, v22):
 * - attention.max_batch 32 on sm_90: against vLLM 0.26's FA3 in the same run (H200, 2026-12-01,
 *   bench/results/2026-12-01-h200-v20-vllm/) ours won at batch 1 and 8 at every context
 *   (1.02-1.40x) and at batch 64 with 1K tokens (1.22x), and lost at batch 64 with 8K and 32K
 *   (0.97x, 0.92x: FA3 reads the cache at ~96% of the ceiling there). The batch is what a plan
 *   knows (the lengths live on the device), so batches above 32 stay FA3's (64 for the heads
 *   where 12 warps won at batch 64: their row, table.c). Unmeasured archs take every batch.
 * - attention.warps 12 on sm_90 for head 128 with 2..8 query heads a kv head (measured): one block
 *   of 12 warps an SM (3 a scheduler x 168 registers fill its 16K) keeps 1.5x the loads of 8 in
 *   flight, and beat 8 warps and 3 blocks of 4 (v37). H200, 64 MiB between calls, µs at batch 1
 *   and 8 (bench/results/2026-12-03-h200-v37-attention-warps/, -v38-attention-rule/):
 *   Qwen3-30B-A3B bf16 (32 / 4) batch 8 32K 138.17 (8 warps) -> 127.74, FA3 134.10, batch 2-64 ahead
 *   of FA3 and FlashInfer; fp16 1K 9.57 / 13.20 (4 warps) -> 9.00 / 12.41, 32K 29.46 / 135.08 ->
 *   27.26 / 130.85; Llama-3-8B (32 / 8) batch 8 32K 245.60 -> 242.75; 32 / 16 (G2) 8K 26.43 /
 *   129.96 -> 24.02 / 127.30; 40 / 8 (G5) 8K 19.66 / 70.90 -> 16.18 / 70.10 (1K at batch 8 a tie,
 *   15.87 -> 15.89; v38's 12-warp rows ran a variant of the kernel, since reverted, that was within
 *   0.4 us of this one on Qwen3-30B-A3B's heads). One query head a kv head keeps 4: 12 warps lost
 *   4-6% at 1K there (11.43 / 37.38 -> 11.84 / 39.46) and won 1-5% at 8K. Elsewhere 4: a block of
 *   4 warps at the kernel's ~160 registers (head size 128) lets 3 blocks share an SM, 12 warps
 *   each with one 16-token tile (8 KB) of K/V in flight: about 96 KB an SM, above the ~40 KB the
 *   H200's bandwidth needs at its ~1 us load latency under load.
 * - attention.min_chunk 128 tokens: a short context splits into few blocks (1K tokens: 8 splits a
 *   kv head, one combine level), each warp pipelining two tiles; a long one into up to
 *   attention.max_splits splits so that batch x kv heads x splits fills one wave of blocks. A span
 *   of at most one 16-token tile a warp stays one split whatever min_chunk says (the kernel's
 *   rule): with 12 warps, 129-192 tokens. H100, Qwen3-30B-A3B in the engine at batch 8 (12 warps),
 *   129-144 tokens: 8.82 -> 7.82 us a layer, the o projection after it -0.96; at batch 1 (8 warps)
 *   one split of such a span lost 0.82 us, a second tile round for some warps costing more than
 *   the combine's chain (bench/results/2026-12-06-h100-v55-hold-fp8/).
 * - attention.max_splits 128: two combine levels at most (fan-in 16); batch 1 with 4 kv heads
 *   fills the H200's 396 block slots with 99 splits.
 * - attention.load 4 (plain read-only loads), attention.pdl 0: the forms the MoE op measured as
 *   safe defaults; both are tuner candidates (pdl 1 gained nothing before the o projection, v26).
 *   pdl 2 (the first round's K and V before the wait, with the cache write) only acts where the
 *   kernel before it lets it start early (linear.trigger on the qkv projection, which precedes
 *   attention only with the prologue): with it -4.5 us a layer at batch 1 (H100, qkv + attention
 *   + o, v59). Without the prologue Inductor's rotary kernel comes between and pdl 2 gained
 *   nothing in the engine (v59), so calls with the prologue, or after the q/k epilogue (the
 *   OPGRAFT_ATTN_AFTER_QKV hint), have their own key, attention.pdl_pro (-1 by the rule:
 *   attention.pdl's value). Its H100 row (table.c) with the
 *   qkv projection's trigger row: batch-1 ITL 3.206 -> 2.905 and 3.129 -> 3.010 ms against the
 *   prologue alone, in both orders (v60); not timed on the H200.
 * - attention.trigger 1 on sm_90: the output projection launched as a programmatic dependent
 *   (linear.pdl) then streams its weights while attention runs. H200, Qwen3-30B-A3B, attention
 *   then o [2048, 4096] timed as one span (tools.attn_o, v26): batch 1 at 256 / 1K / 8K tokens
 *   15.53 / 16.17 / 22.28 us without PDL -> 14.31 / 14.77 / 20.86 with it; batch 8 -0.9 to -2.0
 *   us. A next kernel launched without the attribute is not affected.
 * - attention.vpf 0: the V prefetch (a tile's V with its K, a tile ahead). H100, Qwen3-30B-A3B's
 *   heads, in one call (bench/results/2026-12-06-h100-v56-ring-vpf/): alone, batch 1 192 / 1K / 8K
 *   tokens 7.90 / 8.23 / 13.78 -> 8.11 / 8.46 / 14.30 us, 32K and batch 8 level; with the cache
 *   write and the o projection (tools.attn_o) batch 1 144 / 1K 15.53 / 17.00 -> 14.78 / 15.83, batch
 *   8 within 0.3. Off until the engine decides between the two.
 * - attention.round 1 (one tile a round) by the rule; 2 by the row of Qwen3-30B-A3B's heads at one
 *   sequence on sm_90 (table.c): a warp's two tiles' K and V in flight together, so a span of up to
 *   two tiles a warp (256 tokens at 8 warps) is one split and one round trip. H100, in one call
 *   (bench/results/2026-12-06-h100-v57-round/): batch 1 at 192 / 256 tokens 7.9 / 7.9 -> 6.2 / 6.7
 *   us, 512-2K level, 8K 13.9 -> 14.3, 32K 31.3 -> 31.5; at 8 warps from two sequences (12 warps'
 *   168 registers do not hold a second tile) ahead up to 1K, behind from 8K. Not with the V prefetch.
 * - attention.cluster 1 (no clusters): on the H200 at batch 1 with Qwen3-30B-A3B's heads, clusters
 *   of 8 merged contexts up to 1K tokens on chip 11-13% faster, but only 15 clusters of 8 are
 *   resident at one block an SM, so a launch keeps 24 of 33 splits and contexts from 4K tokens
 *   took 8-12% longer (v25); the lengths live on the device, so the choice is the tuner's. The
 *   kernel of v67 on an H100 (v68): clusters of 8 at batch 1 1K 8.1 -> 7.2 us, 2K level, 8K 14.2
 *   -> 15.0; batch 2 +0.2 to +0.5 at 1K-8K; clusters of 4 nowhere ahead.
 * - attention.fan32 1 on sm_90: a launch of 17..36 splits a sequence merges them in one 32-wide
 *   combine (33..36 lowered to 32) instead of two levels of 16; every other launch keeps fan-in
 *   16, where 32 leaves the number of levels as it is and a node's block reads twice the bytes.
 *   H200, from v39's fan-in-32 run (fan-in 32 on every launch against 16, in one call:
 *   bench/results/2026-12-03-h200-v39-fp8-tensor-combine/call-d/), µs at batch 1: Qwen3-30B-A3B's
 *   heads (32 / 4, head 128: 33 splits, 32 kept) 4K 10.97 -> 9.92, 8K 13.64 -> 12.66, 16K 18.31
 *   -> 17.19, 32K 27.09 -> 26.12, 2K 8.51 -> 8.38 (batch 2, 8 and 64 within 0.5%); with 64..128
 *   splits, two levels either way, it lost 4-15%: 16 / 2 head 64 at 8K 10.38 -> 11.97, 8 / 1 head
 *   128 (Llama-3-70B/tp8) at 32K 13.59 -> 14.35, 8 / 4 head 256 at 8K 17.20 -> 17.85; those
 *   launches keep 16. Per launch, each fan-in its own entry point (v40, call-f3/, against the
 *   kernel before it in one call): 4K 10.89 -> 9.81, 8K 13.66 -> 12.51, 32K 27.24 -> 26.04; the
 *   launches that keep 16 within 0.1 µs (Llama-3-8B at 1K +0.08, the head-64 shape at 8K +0.08). */
#include <stdio.h>
#include <string.h>

#include "attention.h"

int opgraft__attn_parse_shape(const char *shape, og_attn_shape *s) {
  char dt[8];
  long long D, G, bs;
  if (!shape || sscanf(shape, "attention:%7[a-z0-9]:D%lld:G%lld:bs%lld", dt, &D, &G, &bs) != 4) return 0;
  if (D < 1 || G < 1 || bs < 1) return 0;
  s->D = D, s->G = G, s->bs = bs;
  return 1;
}

int opgraft__attn_rule(const opgraft_tune_query *q, int64_t *value) {
  const char *key = q->key;
  if (strcmp(key, "attention.max_batch") == 0) return *value = q->arch == 90 ? 32 : 4096, 1;
  if (strcmp(key, "attention.warps") == 0) {
    og_attn_shape s;
    const int head128 = opgraft__attn_parse_shape(q->shape, &s) && s.D == 128 && s.G >= 2 && s.G <= 8;
    return *value = q->arch == 90 && head128 ? 12 : 4, 1;
  }
  if (strcmp(key, "attention.min_blocks") == 0) return *value = 0, 1;
  if (strcmp(key, "attention.min_chunk") == 0) return *value = 128, 1;
  if (strcmp(key, "attention.max_splits") == 0) return *value = 128, 1;
  if (strcmp(key, "attention.load") == 0) return *value = 4, 1;
  if (strcmp(key, "attention.pdl") == 0) return *value = 0, 1;
  if (strcmp(key, "attention.pdl_pro") == 0) return *value = -1, 1;
  if (strcmp(key, "attention.trigger") == 0) return *value = q->arch >= 90, 1;
  if (strcmp(key, "attention.fan32") == 0) return *value = q->arch == 90, 1;
  if (strcmp(key, "attention.cluster") == 0) return *value = 1, 1;
  if (strcmp(key, "attention.vpf") == 0) return *value = 0, 1;
  if (strcmp(key, "attention.round") == 0) return *value = 1, 1;
  return 0;
}
