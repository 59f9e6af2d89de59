/* The MoE op's tunable keys and its baked per-arch rows, and its descriptor for the core's
 * registry. `opgraft tune --inject` rewrites the rows between the markers; each row says why it
 * holds. Rows match like tune-file entries (src/core/tune.c); where none matches, the rule in
 * heuristics.c decides from the shape. Rows exist only where a measurement beat that rule. */
#include "moe.h"

/* Ranges are what the kernels accept; the fallback applies only where neither a row nor the rule
 * gives a value; the last field is what `opgraft tune` tries (the kernels clamp what would not
 * fit). moe.max_tokens (a hand-back threshold from end-to-end runs), moe.expert_map, moe.route, moe.fp8 and
 * moe.fp8_quantize (switches) are not speed choices the tuner makes. */
static const og_tunable tunables[] = {
    {"moe.max_tokens", 0, 64, 1, NULL},
    {"moe.gate_up.warps", 1, 16, 8, "1 2 4 8 16"},
    {"moe.gate_up.unroll", 1, 8, 4, "1 2 4"},
    {"moe.gate_up.min_blocks", 0, 4, 0, "0 1 2 4"},
    {"moe.gate_up.nt", 0, 8, 0, "0 1"},
    {"moe.gate_up.one_token", 0, 1, 0, "0 1"},
    {"moe.gate_up.slot_routing", 0, 1, 0, "0 1"},
    {"moe.down.warps", 1, 16, 8, "2 4 8 16"},
    {"moe.down.unroll", 1, 8, 4, "1 2 3 4 8"},
    {"moe.down.min_blocks", 0, 4, 0, "0 2 4"},
    {"moe.down.early", 0, 1, 0, "0 1"},
    {"moe.down.one_token", 0, 1, 0, "0 1"},
    {"moe.down.warp_routing", 0, 1, 0, "0 1"},
    {"moe.fused", 0, 1, 0, "0 1"},
    {"moe.l2_fetch", 0, 256, 0, "0 128 256"},
    {"moe.expert_map", 0, 1, 1, NULL},
    {"moe.route", 0, 1, 1, NULL},
    {"moe.pdl", 0, 1, 0, "0 1"},
    {"moe.pdl_in", 0, 1, 0, "0 1"},
    {"moe.trigger", 0, 1, 0, NULL}, /* its effect is on the next kernel: not an op-level tune */
    {"moe.load", 1, 4, 4, "4 1"},
    {"moe.down_load", 1, 4, 1, "1 4"},
    /* FP8 weights: the k of a k-step (64: 16-byte weight loads, where the shape allows). */
    {"moe.fp8_kstep", 32, 64, 64, "64 32"},
    /* FP8 weights: rows of I a gate_up tile (16: twice the blocks of 32). */
    {"moe.gate_up.fp8_rows", 16, 32, 16, "16 32"},
    /* FP8 weights taken (1) or handed back (0); also OPGRAFT_MOE_FP8=0. A switch, not tuned. */
    {"moe.fp8", 0, 1, 0, NULL},
    /* FP8 weights: 16-bit hidden states quantized by gate_up (1), or refused so that the caller
     * quantizes them (vLLM's kernel) and passes e4m3 (0). A switch, not tuned. */
    {"moe.fp8_quantize", 0, 1, 0, NULL},
};

static const og_tune_entry rows[] = {
    /* BEGIN TUNED ROWS */
    /* Kimi-K2 takes more tokens than the rule's 8: op level against vLLM's own kernel in the same
     * run (64 MiB of other reads between calls); it loses from 14 tokens on. */
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 0, 0, "moe.max_tokens", 12, "H200 2026-11-30 op level vs vLLM 0.26's kernel, Kimi-K2: T=1/2/4/8 1.11/1.06/1.05/1.10x (164.8 vs 183.0 us at T=1, 1118.8 vs 1232.9 at T=8), T=10/12 1.05/1.06x, T=14/16 0.94x"},
    /* gate_up's loads with L2's evict_first hint, measured at one shape and token count. */
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 1, 1, "moe.load", 1, "H200 2026-11-30 descent from the shipped rows (gate_up 4 warps, min blocks 4), 64 MiB between calls: Qwen3-30B-A3B T=1 24.0 -> 23.6 us with load form 1 instead of 4"},
    /* Per-rank shapes under tensor parallelism 8: one cooperative kernel wins where calls are small. */
    {90, NULL, "moe:bf16:E384:H7168:I256:k8", 0, 0, "moe.fused", 1, "H200 2026-11-29, fused vs two kernels in one run: Kimi-K2/tp8 T=1 38.2 -> 29.9 us, T=8 171.1 -> 155.9 us"},
    {90, NULL, "moe:bf16:E8:H4096:I1792:k2", 0, 0, "moe.fused", 1, "H200 2026-11-29, fused vs two kernels in one run: Mixtral-8x7B/tp8 T=1 31.0 -> 28.5 us, T=8 85.0 -> 80.0 us"},
    {90, NULL, "moe:bf16:E128:H2048:I96:k8", 1, 4, "moe.fused", 1, "H200 2026-11-29, fused vs two kernels in one run: Qwen3-30B-A3B/tp8 T=1 12.8 -> 11.2 us, T=4 18.0 -> 17.2 us (T=8 loses: 24.6 -> 27.1)"},
    /* 9..16 tokens (measured at 16, v15; the rule hands these calls back on sm_90 anyway). */
    {90, NULL, "moe:bf16:E8:H4096:I14336:k2", 9, 16, "moe.gate_up.warps", 1, "H200 2026-11-30 descent: Mixtral-8x7B T=16 675.8 -> 666.1 us with gate_up 1 warp (4 warps ties) and down unroll 2"},
    {90, NULL, "moe:bf16:E8:H4096:I14336:k2", 9, 16, "moe.down.unroll", 2, "H200 2026-11-30 descent: Mixtral-8x7B T=16 down unroll 4 -> 2: 675.7 -> 665.8 us"},
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 9, 16, "moe.gate_up.warps", 4, "H200 2026-11-30 descents: Kimi-K2 T=16 2599.2 -> 2352.7 us with gate_up 1 warp and down 2 warps; then, from that row, 2401.7 -> 2373.2 us with 4 warps (2: 2386.0)"},
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 9, 16, "moe.down.min_blocks", 4, "H200 2026-11-30 (v15): with down 4 warps and unroll 3, 112 registers, all 448 blocks resident (see moe.down.warps)"},
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 9, 16, "moe.down.unroll", 3, "H200 2026-11-30 (v15): Kimi-K2 T=16 down unroll 3 853.9 us, 2 882.1, 4 1015.7 (4 warps, min blocks 4; unroll 4 spills at 128 registers)"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 9, 16, "moe.gate_up.nt", 1, "H200 2026-11-30 (v15), 64 MiB between calls: Qwen3-235B-A22B T=16 gate_up 619.8 -> 461.6 us (2 warps), all 918.9 -> 763.0; then down 8 warps, min blocks 2, unroll 2: 736.3 (0.732 -> 0.913 of the ceiling)"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 9, 16, "moe.gate_up.warps", 2, "H200 2026-11-30 (v15) with gate_up.nt 1: Qwen3-235B-A22B T=16 2 warps 763.0 us, 4 764.8, 1 769.1, 8 793.5, 16 862.4"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 9, 16, "moe.down.min_blocks", 2, "H200 2026-11-30 (v15): Qwen3-235B-A22B T=16 down 302.8 -> 276.1 us with 8 warps, min blocks 2, unroll 2 (4 warps, min blocks 4: 424.6)"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 9, 16, "moe.down.unroll", 2, "H200 2026-11-30 (v15): see moe.down.min_blocks"},
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 9, 16, "moe.gate_up.nt", 1, "H200 2026-11-30 (v15), 64 MiB between calls: Qwen3-30B-A3B T=16 216.1 -> 207.8 us with 2 warps (218.0 -> 210.3 in an earlier lease; 4 warps 209.0; down 8 warps min blocks 2: 244.4)"},
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 9, 16, "moe.gate_up.warps", 2, "H200 2026-11-30 (v15): see moe.gate_up.nt"},
    /* Programmatic dependent launch of the down stage (sm_90), on and off in one run: a win where
     * calls are small, a loss on Mixtral's large experts (5%). */
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 1, 2, "moe.pdl", 1, "H200 2026-11-29 pdl 0 -> 1: Qwen3-30B-A3B T=1 25.1 -> 23.8 us, T=2 45.0 -> 43.9 us (T=8 126.5 -> 125.9)"},
    {90, NULL, "moe:bf16:E128:H2048:I384:k8", 1, 1, "moe.pdl", 1, "H200 2026-11-29 pdl 0 -> 1: Qwen3-30B-A3B/tp2 T=1 17.9 -> 16.8 us (T=8 76.0 -> 75.7)"},
    {90, NULL, "moe:bf16:E128:H2048:I192:k8", 1, 1, "moe.pdl", 1, "H200 2026-11-29 pdl 0 -> 1: Qwen3-30B-A3B/tp4 T=1 14.6 -> 13.2 us (T=8 loses: 46.7 -> 47.6)"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 1, 1, "moe.pdl", 1, "H200 2026-11-29 pdl 0 -> 1: Qwen3-235B-A22B T=1 81.8 -> 80.4 us (T=8 466.6 -> 465.3)"},
    /* gate_up as a programmatic dependent of the previous kernel (v18), with the one-token paths at
     * T=1, on and off twice in one lease: it loses on Mixtral-8x7B and Kimi-K2 T=1 (167.8 -> 168.3,
     * 166.5 -> 167.2 us) and Qwen3-235B-A22B T=2 (143.7 -> 144.1 / 144.3). */
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 1, 2, "moe.pdl_in", 1, "H200 2026-11-30 (v18): Qwen3-30B-A3B T=1 22.1 -> 22.1 and 22.3 -> 22.0 us, T=2 41.0 -> 40.7 and 41.1 -> 40.6 (T=4/8 lose: 73.0 -> 73.7, 121.9 -> 122.6)"},
    {90, NULL, "moe:bf16:E128:H2048:I384:k8", 1, 1, "moe.pdl_in", 1, "H200 2026-11-30 (v18): Qwen3-30B-A3B/tp2 T=1 14.7 -> 14.5 us (twice)"},
    {90, NULL, "moe:bf16:E128:H2048:I192:k8", 1, 1, "moe.pdl_in", 1, "H200 2026-11-30 (v18): Qwen3-30B-A3B/tp4 T=1 9.9 -> 9.7 us (twice)"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 1, 1, "moe.pdl_in", 1, "H200 2026-11-30 (v18): Qwen3-235B-A22B T=1 74.8 -> 74.5 and 74.8 -> 74.6 us"},
    /* down's first weight loads before its wait for gate_up (v16), where moe.pdl is 1; 64 MiB of
     * other reads between calls, the same lease for on and off. */
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 1, 2, "moe.down.early", 1, "H200 2026-11-30 (v16): Qwen3-30B-A3B T=1 23.5 -> 23.0 us (two runs), T=2 41.3 -> 40.5"},
    {90, NULL, "moe:bf16:E128:H2048:I384:k8", 1, 1, "moe.down.early", 1, "H200 2026-11-30 (v16): Qwen3-30B-A3B/tp2 T=1 16.1 -> 15.6 us"},
    {90, NULL, "moe:bf16:E128:H2048:I192:k8", 1, 1, "moe.down.early", 1, "H200 2026-11-30 (v16): Qwen3-30B-A3B/tp4 T=1 11.6 -> 11.1 us; with down unroll 6 10.3"},
    {90, NULL, "moe:bf16:E128:H2048:I192:k8", 1, 1, "moe.down.unroll", 6, "H200 2026-11-30 (v16) with moe.down.early 1: Qwen3-30B-A3B/tp4 T=1 11.1 -> 10.3 us (8: 10.4; 2: 11.3)"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 1, 1, "moe.down.early", 1, "H200 2026-11-30 (v16): Qwen3-235B-A22B T=1 76.1 -> 75.1 us"},
    /* down lets the next layer's qkv projection (a programmatic dependent, linear.pdl 1) launch as it
     * starts, so qkv streams its first weights while down runs: an engine measurement, since the
     * effect is on the next kernel (down itself is 1.2 us slower beside it). */
    {90, "NVIDIA H100 80GB HBM3", "moe:bf16:E128:H2048:I768:k8", 1, 1, "moe.trigger", 1, "H100 2026-12-06 engine, vLLM 0.26, Qwen3-30B-A3B bf16, 128 in / 64 out: batch-1 ITL 3.206 -> 3.117 and 3.207 -> 3.124 ms (x0.972, x0.974, reps apart, both orders); batch 8 x0.987 / x0.972 inside the spread, not taken"},
    /* FP8 block scales, Qwen3-30B-A3B: `opgraft tune moe --dtype fp8-block` on the v23 kernels
     * (64-k steps, 16-row gate_up tiles), activations quantized beforehand; each range's rows are
     * its whole tuned configuration beyond the rules. */
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 1, 1, "moe.gate_up.warps", 4, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): Qwen3-30B-A3B fp8-block T=1 21.12 -> 17.91 us"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 1, 1, "moe.pdl", 1, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): Qwen3-30B-A3B fp8-block T=1 21.12 -> 17.91 us"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 1, 1, "moe.pdl_in", 1, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): Qwen3-30B-A3B fp8-block T=1 21.12 -> 17.91 us"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 2, 2, "moe.gate_up.warps", 2, "H200 2026-12-01 opgraft tune, v23 kernels: T=2 29.67 -> 26.72 us (with v22's pdl 1)"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 2, 2, "moe.pdl", 1, "H200 2026-12-01 opgraft tune, v23 kernels: T=2 29.67 -> 26.72 us (with v22's pdl 1)"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 2, 2, "moe.down.early", 1, "H200 2026-12-01 opgraft tune, v23 kernels: T=2 29.67 -> 26.72 us (with v22's pdl 1)"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 2, 2, "moe.load", 1, "H200 2026-12-01 opgraft tune, v23 kernels: T=2 29.67 -> 26.72 us (with v22's pdl 1)"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 3, 5, "moe.gate_up.warps", 2, "H200 2026-12-01 opgraft tune, v23 kernels: T=4 49.30 -> 45.24 us (with v22's pdl 1)"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 3, 5, "moe.pdl", 1, "H200 2026-12-01 opgraft tune, v23 kernels: T=4 49.30 -> 45.24 us (with v22's pdl 1)"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 3, 5, "moe.load", 1, "H200 2026-12-01 opgraft tune, v23 kernels: T=4 49.30 -> 45.24 us (with v22's pdl 1)"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 6, 64, "moe.gate_up.warps", 2, "H200 2026-12-01 opgraft tune, v23 kernels: T=8 80.62 -> 76.39 us (with v22's pdl 1)"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 6, 64, "moe.pdl", 1, "H200 2026-12-01 opgraft tune, v23 kernels: T=8 80.62 -> 76.39 us (with v22's pdl 1)"},
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 6, 64, "moe.load", 1, "H200 2026-12-01 opgraft tune, v23 kernels: T=8 80.62 -> 76.39 us (with v22's pdl 1)"},
    /* FP8 block scales, DeepSeek-V3 under tensor parallelism 8 (one rank's experts: E256, H7168,
     * I256), likewise (v24). */
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 1, 1, "moe.gate_up.warps", 8, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): DeepSeek-V3/tp8 fp8-block T=1 22.19 -> 19.71 us"},
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 1, 1, "moe.pdl", 1, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): DeepSeek-V3/tp8 fp8-block T=1 22.19 -> 19.71 us"},
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 1, 1, "moe.pdl_in", 1, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): DeepSeek-V3/tp8 fp8-block T=1 22.19 -> 19.71 us"},
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 2, 2, "moe.gate_up.warps", 8, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): DeepSeek-V3/tp8 fp8-block T=2 36.69 -> 28.40 us"},
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 2, 2, "moe.pdl", 1, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): DeepSeek-V3/tp8 fp8-block T=2 36.69 -> 28.40 us"},
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 2, 2, "moe.load", 1, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): DeepSeek-V3/tp8 fp8-block T=2 36.69 -> 28.40 us"},
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 3, 5, "moe.gate_up.warps", 4, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): DeepSeek-V3/tp8 fp8-block T=4 62.39 -> 48.58 us"},
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 3, 5, "moe.pdl", 1, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): DeepSeek-V3/tp8 fp8-block T=4 62.39 -> 48.58 us"},
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 3, 5, "moe.load", 1, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): DeepSeek-V3/tp8 fp8-block T=4 62.39 -> 48.58 us"},
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 6, 64, "moe.gate_up.warps", 1, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): DeepSeek-V3/tp8 fp8-block T=8 116.03 -> 90.29 us"},
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 6, 64, "moe.pdl", 1, "H200 2026-12-01 opgraft tune, v23 kernels (64 MiB between calls): DeepSeek-V3/tp8 fp8-block T=8 116.03 -> 90.29 us"},
    /* FP8 block scales, Qwen3-235B-A22B (E128, H4096, I1536), likewise (v36). Past two tokens
     * ours with vLLM's quantization 144.7 against 165.2 us at T=4 (1.14x) and 244.6 against 247.7
     * at T=8 (1.01x, inside the run-to-run spread: left to vLLM); at two tokens gate_up's own
     * quantization loses on this shape (86.9 against 81.7 us with vLLM's kernel before ours). */
    {90, NULL, "moe:fp8block:E128:H4096:I1536:k8", 1, 64, "moe.gate_up.warps", 2, "H200 2026-12-03 opgraft tune (one round, 64 MiB between calls): Qwen3-235B-A22B fp8-block 2 warps won at T=1 (54.73 -> 43.64 us), T=2 (94.98 -> 78.17) and T=4 (163.75 -> 142.56)"},
    {90, NULL, "moe:fp8block:E128:H4096:I1536:k8", 1, 2, "moe.pdl", 1, "H200 2026-12-03 opgraft tune (one round, 64 MiB between calls): Qwen3-235B-A22B fp8-block T=1 54.73 -> 43.64 us, T=2 94.98 -> 78.17"},
    {90, NULL, "moe:fp8block:E128:H4096:I1536:k8", 1, 2, "moe.load", 1, "H200 2026-12-03 opgraft tune (one round, 64 MiB between calls): Qwen3-235B-A22B fp8-block T=1 54.73 -> 43.64 us, T=2 94.98 -> 78.17"},
    {90, NULL, "moe:fp8block:E128:H4096:I1536:k8", 1, 2, "moe.down.early", 1, "H200 2026-12-03 opgraft tune (one round, 64 MiB between calls): Qwen3-235B-A22B fp8-block T=1 54.73 -> 43.64 us, T=2 94.98 -> 78.17"},
    {90, NULL, "moe:fp8block:E128:H4096:I1536:k8", 3, 5, "moe.fp8", 1, "H200 2026-12-03 tuned kernels vs vLLM 0.26 TritonExperts: Qwen3-235B-A22B T=4 1.14x (T=8 1.01x: not taken)"},
    {90, NULL, "moe:fp8block:E128:H4096:I1536:k8", 2, 2, "moe.fp8_quantize", 0, "H200 2026-12-03: Qwen3-235B-A22B T=2 in-kernel quantization 86.87 us against 81.66 with vLLM's quantization kernel and ours"},
    /* FP8 block scales, Kimi-K2 under tensor parallelism 8 (E384, H7168, I256): DeepSeek-V3/tp8's
     * values (the same per-rank H and I), neighbouring token ranges of one value as one row, measured
     * on this shape (v36); past two tokens ours with vLLM's quantization 51.8 against 72.9 us at T=4,
     * 93.9 against 110.3 at T=8. */
    {90, NULL, "moe:fp8block:E384:H7168:I256:k8", 1, 2, "moe.gate_up.warps", 8, "H200 2026-12-03 DeepSeek-V3/tp8's rows on Kimi-K2/tp8: T=1/2/4/8 19.78/28.63/49.24/90.76 us (the rule's values, an earlier lease: 22.04/36.78/62.71/116.03)"},
    {90, NULL, "moe:fp8block:E384:H7168:I256:k8", 3, 5, "moe.gate_up.warps", 4, "H200 2026-12-03 DeepSeek-V3/tp8's rows on Kimi-K2/tp8: T=1/2/4/8 19.78/28.63/49.24/90.76 us (the rule's values, an earlier lease: 22.04/36.78/62.71/116.03)"},
    {90, NULL, "moe:fp8block:E384:H7168:I256:k8", 6, 64, "moe.gate_up.warps", 1, "H200 2026-12-03 DeepSeek-V3/tp8's rows on Kimi-K2/tp8: T=1/2/4/8 19.78/28.63/49.24/90.76 us (the rule's values, an earlier lease: 22.04/36.78/62.71/116.03)"},
    {90, NULL, "moe:fp8block:E384:H7168:I256:k8", 1, 64, "moe.pdl", 1, "H200 2026-12-03 DeepSeek-V3/tp8's rows on Kimi-K2/tp8: T=1/2/4/8 19.78/28.63/49.24/90.76 us (the rule's values, an earlier lease: 22.04/36.78/62.71/116.03)"},
    {90, NULL, "moe:fp8block:E384:H7168:I256:k8", 1, 1, "moe.pdl_in", 1, "H200 2026-12-03 DeepSeek-V3/tp8's rows on Kimi-K2/tp8: T=1/2/4/8 19.78/28.63/49.24/90.76 us (the rule's values, an earlier lease: 22.04/36.78/62.71/116.03)"},
    {90, NULL, "moe:fp8block:E384:H7168:I256:k8", 2, 5, "moe.load", 1, "H200 2026-12-03 DeepSeek-V3/tp8's rows on Kimi-K2/tp8: T=1/2/4/8 19.78/28.63/49.24/90.76 us (the rule's values, an earlier lease: 22.04/36.78/62.71/116.03)"},
    {90, NULL, "moe:fp8block:E384:H7168:I256:k8", 3, 8, "moe.fp8", 1, "H200 2026-12-03 vs vLLM 0.26 TritonExperts: Kimi-K2/tp8 T=4 1.41x, T=8 1.18x"},
    /* Qwen3-30B-A3B block FP8 past the rule's two tokens: against vLLM's FP8 path in the same run,
     * ours with its quantization 47.2 against 55.5 us at T=4, 78.8 against 86.7 at T=8 (3, 5..7
     * lie between measured wins; a later run: 44.7 and 75.3 us alone). */
    {90, NULL, "moe:fp8block:E128:H2048:I768:k8", 3, 8, "moe.fp8", 1, "H200 2026-12-01 v23 kernels vs vLLM 0.26 TritonExperts: Qwen3-30B-A3B T=4 1.18x, T=8 1.10x"},
    /* DeepSeek-V3/tp8 block FP8 past two tokens with the rows above: ours with vLLM's quantization
     * 52.0 against 70.1 us at T=4, 92.5 against 106.9 at T=8 in the same run (v24). */
    {90, NULL, "moe:fp8block:E256:H7168:I256:k8", 3, 8, "moe.fp8", 1, "H200 2026-12-01 tuned v23 kernels vs vLLM 0.26 TritonExperts: DeepSeek-V3/tp8 T=4 1.35x, T=8 1.16x"},
    /* FP8 per-tensor scales, Mixtral-8x7B (E8, H4096, I14336, top-2), tuned (v39): the rule's 16
     * gate_up warps keep too few bytes in flight a warp on these long rows. Tuned, ours alone
     * reads at 83-86% of the ceiling at 1-8 tokens (rule: 66-70%); with vLLM's quantization in
     * front 107.5 / 181.4 / 249.1 / 328.2 us against vLLM's FP8 path's 147.0 / 210.3 / 272.0 /
     * 355.7 at 1 / 2 / 4 / 8 tokens in the same run (1.37 / 1.16 / 1.09 / 1.08x). */
    {90, NULL, "moe:fp8tensor:E8:H4096:I14336:k2", 1, 1, "moe.gate_up.warps", 4, "H200 2026-12-03 opgraft tune (one round, 64 MiB between calls): Mixtral-8x7B fp8-tensor T=1 118.64 -> 92.95 us"},
    {90, NULL, "moe:fp8tensor:E8:H4096:I14336:k2", 1, 1, "moe.gate_up.unroll", 1, "H200 2026-12-03 opgraft tune (one round, 64 MiB between calls): Mixtral-8x7B fp8-tensor T=1 118.64 -> 92.95 us"},
    {90, NULL, "moe:fp8tensor:E8:H4096:I14336:k2", 1, 1, "moe.pdl", 1, "H200 2026-12-03 opgraft tune (one round, 64 MiB between calls): Mixtral-8x7B fp8-tensor T=1 118.64 -> 92.95 us"},
    {90, NULL, "moe:fp8tensor:E8:H4096:I14336:k2", 1, 1, "moe.down.early", 1, "H200 2026-12-03 opgraft tune (one round, 64 MiB between calls): Mixtral-8x7B fp8-tensor T=1 118.64 -> 92.95 us"},
    /* 32-row gate_up tiles at one token: the same 93.0 us on e4m3 hidden states, 98.2 -> 96.8 where
     * gate_up quantizes the bf16 ones (v40). */
    {90, NULL, "moe:fp8tensor:E8:H4096:I14336:k2", 1, 1, "moe.gate_up.fp8_rows", 32, "H200 2026-12-03 bench: Mixtral-8x7B fp8-tensor T=1 bf16 hidden states 98.2 -> 96.8 us, e4m3 93.0 -> 93.0"},
    {90, NULL, "moe:fp8tensor:E8:H4096:I14336:k2", 2, 2, "moe.gate_up.warps", 2, "H200 2026-12-03 opgraft tune (one round, 64 MiB between calls): Mixtral-8x7B fp8-tensor T=2 202.10 -> 168.67 us"},
    {90, NULL, "moe:fp8tensor:E8:H4096:I14336:k2", 3, 64, "moe.gate_up.warps", 1, "H200 2026-12-03 opgraft tune (one round, 64 MiB between calls): Mixtral-8x7B fp8-tensor T=4 292.01 -> 241.17 us, T=8 411.89 -> 323.05"},
    {90, NULL, "moe:fp8tensor:E8:H4096:I14336:k2", 1, 64, "moe.load", 1, "H200 2026-12-03 opgraft tune (one round, 64 MiB between calls): Mixtral-8x7B fp8-tensor load form 1 won at T=1, 2, 4 and 8"},
    {90, NULL, "moe:fp8tensor:E8:H4096:I14336:k2", 2, 8, "moe.fp8", 1, "H200 2026-12-03 tuned kernels vs vLLM 0.26 TritonExperts: Mixtral-8x7B fp8-tensor T=2 1.16x, T=4 1.09x, T=8 1.08x"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H2048:I768:k8", 1, 1, "moe.down.early", 1, "H100 2026-12-06 opgraft tune (one round, 64 MiB between calls): Qwen3-30B-A3B fp8-block T=1 20.91 -> 20.42 us"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H2048:I768:k8", 1, 1, "moe.load", 1, "H100 2026-12-06 opgraft tune (one round, 64 MiB between calls): Qwen3-30B-A3B fp8-block T=1 20.91 -> 20.42 us"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H2048:I768:k8", 2, 2, "moe.pdl_in", 1, "H100 2026-12-06 opgraft tune (one round, 64 MiB between calls): Qwen3-30B-A3B fp8-block T=2 32.05 -> 31.69 us"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H2048:I768:k8", 3, 5, "moe.gate_up.warps", 4, "H100 2026-12-06 opgraft tune (one round, 64 MiB between calls): Qwen3-30B-A3B fp8-block T=4 56.10 -> 55.06 us"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H2048:I768:k8", 6, 64, "moe.down.early", 1, "H100 2026-12-06 opgraft tune (one round, 64 MiB between calls): Qwen3-30B-A3B fp8-block T=8 92.88 -> 91.43 us"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H2048:I768:k8", 1, 1, "moe.down.unroll", 3, "H100 2026-12-07 bench, alternating rounds: Qwen3-30B-A3B fp8-block T=1 19.8-19.9 -> 19.4 us with down unroll 3 (32 items of 3 k-steps, two a warp); T=2/4/8 lose 0.2-0.5"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E384:H7168:I256:k8", 1, 1, "moe.load", 1, "H100 2026-12-07 opgraft tune (one round): Kimi-K2/tp8 fp8-block T=1 22.75 -> 22.05 us; bench 23.0 -> 22.2 (T=2 36.2 either way)"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H4096:I384:k8", 1, 1, "moe.gate_up.warps", 8, "H100 2026-12-07 opgraft tune (one round), then the bench in two alternating rounds: Qwen3-235B-A22B/tp4 fp8-block T=1/2/4/8 23.6/36.8/59.5/105.5 -> 19.4/32.0/53.5/89.5 us"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H4096:I384:k8", 2, 2, "moe.gate_up.warps", 4, "H100 2026-12-07 opgraft tune (one round), then the bench in two alternating rounds: Qwen3-235B-A22B/tp4 fp8-block T=1/2/4/8 23.6/36.8/59.5/105.5 -> 19.4/32.0/53.5/89.5 us"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H4096:I384:k8", 3, 64, "moe.gate_up.warps", 2, "H100 2026-12-07 opgraft tune (one round), then the bench in two alternating rounds: Qwen3-235B-A22B/tp4 fp8-block T=1/2/4/8 23.6/36.8/59.5/105.5 -> 19.4/32.0/53.5/89.5 us"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H4096:I384:k8", 1, 64, "moe.pdl", 1, "H100 2026-12-07 opgraft tune (one round), then the bench in two alternating rounds: Qwen3-235B-A22B/tp4 fp8-block T=1/2/4/8 23.6/36.8/59.5/105.5 -> 19.4/32.0/53.5/89.5 us"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H4096:I384:k8", 1, 1, "moe.pdl_in", 1, "H100 2026-12-07 opgraft tune (one round), then the bench in two alternating rounds: Qwen3-235B-A22B/tp4 fp8-block T=1/2/4/8 23.6/36.8/59.5/105.5 -> 19.4/32.0/53.5/89.5 us"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H4096:I384:k8", 1, 64, "moe.load", 1, "H100 2026-12-07 opgraft tune (one round), then the bench in two alternating rounds: Qwen3-235B-A22B/tp4 fp8-block T=1/2/4/8 23.6/36.8/59.5/105.5 -> 19.4/32.0/53.5/89.5 us"},
    {90, "NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H4096:I384:k8", 3, 8, "moe.fp8", 1, "H100 2026-12-07 tuned rows vs vLLM 0.26 TritonExperts in the same runs: Qwen3-235B-A22B/tp4 T=4 1.38x, T=8 1.23x"},
    /* END TUNED ROWS */
};

static void moe_abi(og_sbuf *b) {
  OG_ABI_STRUCT(b, opgraft_moe_args);
  OG_ABI_FIELD(b, opgraft_moe_args, struct_size);
  OG_ABI_FIELD(b, opgraft_moe_args, dtype);
  OG_ABI_FIELD(b, opgraft_moe_args, activation);
  OG_ABI_FIELD(b, opgraft_moe_args, apply_router_weight_on_input);
  OG_ABI_FIELD(b, opgraft_moe_args, num_tokens);
  OG_ABI_FIELD(b, opgraft_moe_args, hidden);
  OG_ABI_FIELD(b, opgraft_moe_args, inter);
  OG_ABI_FIELD(b, opgraft_moe_args, num_experts);
  OG_ABI_FIELD(b, opgraft_moe_args, top_k);
  OG_ABI_FIELD(b, opgraft_moe_args, hidden_states);
  OG_ABI_FIELD(b, opgraft_moe_args, hidden_states_stride);
  OG_ABI_FIELD(b, opgraft_moe_args, w13);
  OG_ABI_FIELD(b, opgraft_moe_args, w13_stride);
  OG_ABI_FIELD(b, opgraft_moe_args, w2);
  OG_ABI_FIELD(b, opgraft_moe_args, w2_stride);
  OG_ABI_FIELD(b, opgraft_moe_args, topk_weights);
  OG_ABI_FIELD(b, opgraft_moe_args, topk_weights_dtype);
  OG_ABI_FIELD(b, opgraft_moe_args, topk_weights_stride);
  OG_ABI_FIELD(b, opgraft_moe_args, topk_ids);
  OG_ABI_FIELD(b, opgraft_moe_args, topk_ids_dtype);
  OG_ABI_FIELD(b, opgraft_moe_args, topk_ids_stride);
  OG_ABI_FIELD(b, opgraft_moe_args, expert_map);
  OG_ABI_FIELD(b, opgraft_moe_args, out);
  OG_ABI_FIELD(b, opgraft_moe_args, out_stride);
  OG_ABI_FIELD(b, opgraft_moe_args, arch);
  OG_ABI_FIELD(b, opgraft_moe_args, gpu_name);
  OG_ABI_FIELD(b, opgraft_moe_args, expert_map_len);
  OG_ABI_FIELD(b, opgraft_moe_args, weight_dtype);
  OG_ABI_FIELD(b, opgraft_moe_args, scale_layout);
  OG_ABI_FIELD(b, opgraft_moe_args, block_n);
  OG_ABI_FIELD(b, opgraft_moe_args, block_k);
  OG_ABI_FIELD(b, opgraft_moe_args, scale_dtype);
  OG_ABI_FIELD(b, opgraft_moe_args, hidden_scale);
  OG_ABI_FIELD(b, opgraft_moe_args, hidden_scale_stride);
  OG_ABI_FIELD(b, opgraft_moe_args, w13_scale);
  OG_ABI_FIELD(b, opgraft_moe_args, w13_scale_stride);
  OG_ABI_FIELD(b, opgraft_moe_args, w2_scale);
  OG_ABI_FIELD(b, opgraft_moe_args, w2_scale_stride);
  OG_ABI_FIELD(b, opgraft_moe_args, routing);
  OG_ABI_FIELD(b, opgraft_moe_args, router_logits);
  OG_ABI_FIELD(b, opgraft_moe_args, router_logits_stride);
  OG_ABI_FIELD(b, opgraft_moe_args, hidden_dtype);
  opgraft__abi_end(b);
}

const og_op opgraft__moe_op = {
    .name = "moe",
    .kernel_dir = "moe",
    .tunables = tunables,
    .ntunables = (int)(sizeof tunables / sizeof *tunables),
    .rows = rows,
    .nrows = (int)(sizeof rows / sizeof *rows),
    .rule = opgraft__moe_rule,
    .abi = moe_abi,
};
