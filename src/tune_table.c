/* Baked tunables per arch. `opgraft tune --inject` rewrites the rows between the markers; each
 * row says why it holds. Rows match like tune-file entries (see tune.c); arch 0 matches any GPU. */
#include "internal.h"

const og_tune_entry opgraft__baked_table[] = {
    /* BEGIN TUNED ROWS */
    /* Any arch: the sm_90 winners below, unmeasured elsewhere. */
    {0, NULL, NULL, 0, 0, "moe.max_tokens", 1, "vLLM 0.26 end to end on H200, Qwen3-30B-A3B 2026-11-29 (before moe.load 4): ITL at batch 1 -1.1..-1.9%, at batch 2/4/8 +10..+14%; shapes measured since with moe.load 4 have their own rows below; the others hand T >= 2 to vLLM until measured"},
    {0, NULL, NULL, 0, 0, "moe.load", 4, "H200 2026-11-29: gate_up after 64 MiB of other reads (as in a decode step): Qwen3-30B-A3B T=8 112 -> 85 us, T=1 20.2 -> 16.4 us with form 4 instead of 1; back to back alike (bench/NOTES.md v9)"},
    {0, NULL, NULL, 0, 0, "moe.gate_up.warps", 8, "H200 coordinate descent 2026-11-29: 8 or 16 won on 3 of 4 presets"},
    {0, NULL, NULL, 0, 0, "moe.gate_up.unroll", 4, "H200 coordinate descent 2026-11-29: 4 won on every preset once L2 fetch was 128 B"},
    {0, NULL, NULL, 0, 0, "moe.down.warps", 8, "H200 coordinate descent 2026-11-29: 8 won on Mixtral, Qwen3-235B, Kimi T=1"},
    {0, NULL, NULL, 0, 0, "moe.down.unroll", 4, "H200 coordinate descent 2026-11-29: 4 won on every preset"},
    {0, NULL, NULL, 0, 0, "moe.l2_fetch", 128, "H200 coordinate descent 2026-11-29: 128 B fetch: Kimi T=8 1590 -> 1223 us, Mixtral T=1 234 -> 175 us"},
    {0, NULL, NULL, 0, 0, "moe.prefetch", 0, "H200 coordinate descent 2026-11-29: explicit L2 prefetch never beat the fetch-size hint"},
    {0, NULL, NULL, 0, 0, "moe.fused", 0, "two kernels until the cooperative one is measured"},
    {0, NULL, NULL, 0, 0, "moe.gate_up.min_blocks", 4, "H200 2026-11-30 (v13): gate_up's launch-bounds minimum, clamped to 16 warps an SM (8 warps: 2, 4 warps: 4); never lost at T <= 8 on 7 shapes: Kimi-K2 T=8 1236.0 -> 1167.8 us, Qwen3-235B-A22B T=4 282.5 -> 260.2, Qwen3-30B-A3B/tp4 T=1 14.4 -> 11.7"},
    {0, NULL, NULL, 1, 1, "moe.gate_up.one_token", 1, "H200 2026-11-30 (v18), 64 MiB between calls, with moe.down.one_token, same lease: Qwen3-30B-A3B T=1 23.3 -> 22.1 us, Qwen3-235B-A22B 76.0 -> 74.8, Mixtral-8x7B 169.0 -> 167.8, Kimi-K2 167.8 -> 166.5, Qwen3-30B-A3B/tp2 15.6 -> 14.7, /tp4 10.4 -> 9.9 (gate_up alone: Qwen3-30B-A3B 23.2 -> 22.5)"},
    {0, NULL, NULL, 1, 1, "moe.down.one_token", 1, "H200 2026-11-30 (v18): see moe.gate_up.one_token (down alone: Qwen3-30B-A3B T=1 23.3 -> 23.0 us)"},
    {0, NULL, NULL, 2, 4, "moe.gate_up.slot_routing", 1, "H200 2026-11-30 (v19), 64 MiB between calls, with moe.down.warp_routing, same lease, twice: Qwen3-30B-A3B T=2 40.4 -> 39.6 us, T=4 72.0 -> 70.7, /tp2 T=2 27.7 -> 26.3, Qwen3-235B-A22B T=2 141.4 -> 139.5, T=4 255.6 -> 254.1, Mixtral-8x7B T=2 293.4 -> 291.9, T=4 428.4 -> 423.7, Kimi-K2 T=2 312.4 -> 310.6, T=4 599.5 -> 598.5 (Mixtral-8x7B T=8 / 16 lose: 571.2 -> 576.3, 653.0 -> 655.4; at T=1 the one-token paths win: 21.7-21.8 against 22.1-22.2)"},
    {0, NULL, NULL, 2, 4, "moe.down.warp_routing", 1, "H200 2026-11-30 (v19): see moe.gate_up.slot_routing"},
    /* Per-model rows (bf16, H200). */
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 0, 0, "moe.max_tokens", 8, "vLLM 0.26 end to end on H200 2026-11-29 with moe.load 4, Qwen3-30B-A3B: ITL batch 1 4.115 -> 3.723 ms, batch 2 4.883 -> 4.844 (floor 4.954 -> 4.808), batch 8 floor 9.112 -> 8.904"},
    {90, NULL, "moe:bf16:E128:H2048:I384:k8", 0, 0, "moe.max_tokens", 8, "vLLM 0.26 end to end on 2 H200 2026-11-29 with moe.load 4, Qwen3-30B-A3B tensor_parallel_size 2 (this is one rank's shape): ITL batch 1 3.963 -> 3.530 ms, batch 2 4.231 -> 4.122, batch 8 6.476 -> 6.407"},
    {90, NULL, "moe:bf16:E64:H2048:I768:k8", 0, 0, "moe.max_tokens", 8, "vLLM 0.26 end to end on 2 H200 2026-11-29 with moe.load 4, Qwen3-30B-A3B tensor_parallel_size 2 + expert parallel (one rank's 64 experts): ITL batch 1 4.336 -> 3.680 ms, batch 2 5.303 -> 4.275, batch 8 7.117 -> 6.724"},
    {90, NULL, "moe:bf16:E8:H4096:I14336:k2", 0, 0, "moe.max_tokens", 8, "vLLM 0.26 end to end on H200 2026-11-30 with the v16 rows, Mixtral-8x7B: ITL batch 1 7.860 -> 7.427 ms, batch 2 11.828 -> 11.142, batch 4 16.580 -> 16.126, batch 8 20.745 -> 20.469 (2026-11-29, before v12-v16: batch 8 lost, 21.105 -> 21.468); op level vs vLLM's kernel 1.02-1.10x at T <= 8, 0.97x at T=16"},
    /* Too large for one H200 end to end: op level against vLLM's own kernel in the same run (64 MiB
     * of other reads between calls, which is how the Mixtral-8x7B op-level figures carried to its
     * end-to-end ITL above); both lose to it at T=16. Mixtral-8x7B and Qwen3-30B-A3B lose at
     * T=10/12/14 too (0.95-0.97x). */
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 0, 0, "moe.max_tokens", 12, "H200 2026-11-30 op level vs vLLM 0.26's kernel, Kimi-K2: T=1/2/4/8 1.11/1.06/1.05/1.10x (164.8 vs 183.0 us at T=1, 1118.8 vs 1232.9 at T=8), T=10/12 1.05/1.06x, T=14/16 0.94x"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 0, 0, "moe.max_tokens", 8, "H200 2026-11-30 op level vs vLLM 0.26's kernel, Qwen3-235B-A22B: T=1/2/4/8 1.15/1.11/1.14/1.03x (74.9 vs 86.2 us at T=1, 439.5 vs 451.4 at T=8), T=10/12/14/16 0.95-0.96x"},
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 1, 4, "moe.gate_up.warps", 4, "H200 2026-11-30 with gate_up min blocks 4: Qwen3-30B-A3B T=1 25.0 -> 24.1 us, T=2 45.6 -> 42.1 (8 warps, min blocks 2: 25.0, 43.0)"},
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 5, 64, "moe.gate_up.warps", 4, "H200 coordinate descent 2026-11-29: Qwen3-30B-A3B T=8 124.8 us"},
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 1, 1, "moe.load", 1, "H200 2026-11-30 descent from the shipped rows (gate_up 4 warps, min blocks 4), 64 MiB between calls: Qwen3-30B-A3B T=1 24.0 -> 23.6 us with load form 1 instead of 4"},
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 0, 0, "moe.down.warps", 16, "H200 coordinate descent 2026-11-29: Qwen3-30B-A3B down 9.3 us (T=1), 41.0 us (T=8)"},
    {90, NULL, "moe:bf16:E8:H4096:I14336:k2", 0, 0, "moe.gate_up.warps", 4, "H200 coordinate descent 2026-11-29: Mixtral-8x7B T=1 175.0 us, T=8 593.8 us"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 1, 4, "moe.gate_up.warps", 8, "H200 2026-11-30 with gate_up min blocks 2: Qwen3-235B-A22B T=1 82.5 -> 77.9 us, T=2 155.9 -> 143.9, T=4 282.5 -> 260.2 (16 warps before)"},
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 0, 0, "moe.gate_up.warps", 16, "H200 coordinate descent 2026-11-29: Kimi-K2 T=1 175.6 us, T=8 1222.7 us"},
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 1, 8, "moe.gate_up.warps", 8, "H200 2026-11-30 with gate_up min blocks 2, after 64 MiB of other reads: Kimi-K2 T=1 176.8 -> 168.8 us, T=2 334.4 -> 319.8, T=4 644.7 -> 611.4, T=8 1236.0 -> 1167.8 (16 warps before; 4 warps min blocks 4 within 1%)"},
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 0, 0, "moe.down.warps", 4, "H200 2026-11-30, after 64 MiB of other reads: Kimi-K2 T=1 down 65.9 -> 57.0 us (all 184.0 -> 174.8), T=8 down 459.1 -> 396.8 us with 4 warps instead of 8"},
    /* Per-rank shapes under tensor parallelism 8: one cooperative kernel wins where calls are small. */
    {90, NULL, "moe:bf16:E384:H7168:I256:k8", 0, 0, "moe.fused", 1, "H200 2026-11-29, fused vs two kernels in one run: Kimi-K2/tp8 T=1 38.2 -> 29.9 us, T=8 171.1 -> 155.9 us"},
    {90, NULL, "moe:bf16:E8:H4096:I1792:k2", 0, 0, "moe.fused", 1, "H200 2026-11-29, fused vs two kernels in one run: Mixtral-8x7B/tp8 T=1 31.0 -> 28.5 us, T=8 85.0 -> 80.0 us"},
    {90, NULL, "moe:bf16:E128:H2048:I96:k8", 1, 4, "moe.fused", 1, "H200 2026-11-29, fused vs two kernels in one run: Qwen3-30B-A3B/tp8 T=1 12.8 -> 11.2 us, T=4 18.0 -> 17.2 us (T=8 loses: 24.6 -> 27.1)"},
    /* Large experts after 64 MiB of other reads (coordinate descent 2026-11-30,
     * bench/results/2026-11-30-h200-v12-tuning/, -v13-min-blocks/). Mixtral-8x7B up to 8 tokens:
     * gate_up 8 warps, two blocks an SM (v13; the cooperative kernel before); at 9..16 tokens 1 warp
     * for gate_up and down unroll 2; Kimi-K2 at 9..16 tokens: gate_up 4 warps (down: v15, below). */
    {90, NULL, "moe:bf16:E8:H4096:I14336:k2", 1, 8, "moe.gate_up.warps", 8, "H200 2026-11-30, two kernels with gate_up 8 warps and min blocks 2 against the cooperative kernel (the v12 row): Mixtral-8x7B T=1 173.0 -> 169.2 us, T=2 302.7 -> 297.3, T=4 435.2 -> 434.4, T=8 584.9 -> 579.5"},
    {90, NULL, "moe:bf16:E8:H4096:I14336:k2", 9, 16, "moe.gate_up.warps", 1, "H200 2026-11-30 descent: Mixtral-8x7B T=16 675.8 -> 666.1 us with gate_up 1 warp (4 warps ties) and down unroll 2"},
    {90, NULL, "moe:bf16:E8:H4096:I14336:k2", 9, 16, "moe.down.unroll", 2, "H200 2026-11-30 descent: Mixtral-8x7B T=16 down unroll 4 -> 2: 675.7 -> 665.8 us"},
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 9, 16, "moe.gate_up.warps", 4, "H200 2026-11-30 descents: Kimi-K2 T=16 2599.2 -> 2352.7 us with gate_up 1 warp and down 2 warps; then, from that row, 2401.7 -> 2373.2 us with 4 warps (2: 2386.0)"},
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 9, 16, "moe.down.warps", 4, "H200 2026-11-30 (v15), 64 MiB between calls: Kimi-K2 T=16 down 927.0 -> 853.9 us, all 2331.4 -> 2256.4 (0.906 -> 0.937 of the ceiling) with 4 warps, min blocks 4, unroll 3 instead of 2 warps (which fit all 448 blocks at ~200 registers)"},
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 9, 16, "moe.down.min_blocks", 4, "H200 2026-11-30 (v15): with down 4 warps and unroll 3, 112 registers, all 448 blocks resident (see moe.down.warps)"},
    {90, NULL, "moe:bf16:E384:H7168:I2048:k8", 9, 16, "moe.down.unroll", 3, "H200 2026-11-30 (v15): Kimi-K2 T=16 down unroll 3 853.9 us, 2 882.1, 4 1015.7 (4 warps, min blocks 4; unroll 4 spills at 128 registers)"},
    /* 9..16 tokens, measured at 16 (v15): gate_up's one-pass path with one 8-pair tile, as at <= 8
     * tokens (an expert of these shapes rarely has more than 8 of a call's pairs). */
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 9, 16, "moe.gate_up.nt", 1, "H200 2026-11-30 (v15), 64 MiB between calls: Qwen3-235B-A22B T=16 gate_up 619.8 -> 461.6 us (2 warps), all 918.9 -> 763.0; then down 8 warps, min blocks 2, unroll 2: 736.3 (0.732 -> 0.913 of the ceiling)"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 9, 16, "moe.gate_up.warps", 2, "H200 2026-11-30 (v15) with gate_up.nt 1: Qwen3-235B-A22B T=16 2 warps 763.0 us, 4 764.8, 1 769.1, 8 793.5, 16 862.4"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 9, 16, "moe.down.min_blocks", 2, "H200 2026-11-30 (v15): Qwen3-235B-A22B T=16 down 302.8 -> 276.1 us with 8 warps, min blocks 2, unroll 2 (4 warps, min blocks 4: 424.6)"},
    {90, NULL, "moe:bf16:E128:H4096:I1536:k8", 9, 16, "moe.down.unroll", 2, "H200 2026-11-30 (v15): see moe.down.min_blocks"},
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 9, 16, "moe.gate_up.nt", 1, "H200 2026-11-30 (v15), 64 MiB between calls: Qwen3-30B-A3B T=16 216.1 -> 207.8 us with 2 warps (218.0 -> 210.3 in an earlier lease; 4 warps 209.0; down 8 warps min blocks 2: 244.4)"},
    {90, NULL, "moe:bf16:E128:H2048:I768:k8", 9, 16, "moe.gate_up.warps", 2, "H200 2026-11-30 (v15): see moe.gate_up.nt"},
    /* Programmatic dependent launch of the down stage (sm_90), bench with rotating weight copies,
     * same run for on and off: a win where calls are small, a loss on Mixtral's large experts. */
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
    /* END TUNED ROWS */
};
const int opgraft__baked_table_len = (int)(sizeof opgraft__baked_table / sizeof *opgraft__baked_table);
