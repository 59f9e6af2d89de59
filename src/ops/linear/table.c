/* The linear op's tunable keys and its baked per-arch rows, and its descriptor for the core's
 * registry. Rows match like tune-file entries (src/core/tune.c); where none matches, the rule in
 * heuristics.c decides from the shape. Rows exist only where a measurement beat that rule. */
#include "linear.h"

/* Ranges are what the kernel accepts; the fallback applies only where neither a row nor the rule
 * gives a value; the last field is what `opgraft tune` tries (config.c clamps what would not fit).
 * linear.max_rows is a hand-back threshold, not a speed choice the tuner makes; linear.norm_rows
 * (the most rows at which vLLM's graph gets the add + RMSNorm form, opgraft/vllm/norm_seam.py)
 * and linear.qk_epilogue (1: vLLM's graph gives the qkv projection of this shape the q/k norm and
 * rotary embedding, opgraft/vllm/rope_seam.py; OPGRAFT_QK_EPILOGUE overrides it either way) are
 * read when the graph is compiled, not by the kernel. */
static const og_tunable tunables[] = {
    {"linear.max_rows", 0, OG_LINEAR_MAX_ROWS, 1, NULL},
    {"linear.warps", 1, 16, 8, "2 4 8 16"},
    {"linear.tiles", 1, 4, 1, "1 2 3 4"},
    {"linear.unroll", 1, 8, 4, "2 4 8"},
    {"linear.min_blocks", 0, 16, 0, "0 1 2 4"},
    {"linear.load", 1, 4, 4, "4 1"},
    {"linear.l2_fetch", 0, 256, 0, "0 128 256"},
    {"linear.pdl", 0, 2, 0, "0 1 2"},
    {"linear.trigger", 0, 1, 0, NULL}, /* its effect is on the next kernel: not an op-level tune */
    {"linear.norm_rows", 0, OG_LINEAR_MAX_ROWS, 0, NULL},
    {"linear.qk_epilogue", 0, 1, 0, NULL},
};

/* A placeholder row keeps the array non-empty for the compiler; nrows below excludes it. */
static const og_tune_entry rows[] = {
    /* BEGIN TUNED ROWS */
    /* Shapes where torch's cuBLAS call won in the same run (H200 2026-12-01, span timing, 64 MiB
     * between calls, bench/results/2026-12-01-h200-v20-vllm/linear_bench_span.json): handed back. */
    {90, NULL, "linear:bf16:N8192:K3584", 0, 0, "linear.max_rows", 0, "H200 2026-12-01: Llama-3-70B/tp8 down, ours 17.86 / 17.88 / 17.99 us at M=1/4/8 against cuBLAS 17.64 / 17.52 / 17.50; tuned (v25) 17.66 / 17.57 at M=1/8 against 17.79 / 17.64, a tie"},
    /* Llama-3-70B/tp8's lm_head: 1% ahead at one row, 1-2% behind from two (v25, three runs): ours at one row. */
    {90, NULL, "linear:bf16:N16032:K8192", 0, 0, "linear.max_rows", 1, "H200 2026-12-02: Llama-3-70B/tp8 lm_head, ours 64.9 / 64.2 / 62.6 us at M=1 against cuBLAS 65.4 / 64.9 / 63.0; M=2 63.95 against 63.44, M=8 65.9 / 66.2 / 64.9 against 65.5 / 64.8 / 64.1"},
    /* Llama-3-70B/tp8 qkv, o and gate_up: `opgraft tune linear` (v25); o, handed back before, now wins
     * (three 8-row tiles a block): 6.94 / 6.95 / 7.08 us at M=1/2/8 against cuBLAS 7.40 / 7.31 / 7.33. */
    {90, NULL, "linear:bf16:N1280:K8192", 1, 8, "linear.load", 1, "H200 2026-12-02 opgraft tune (64 MiB between calls): Llama-3-70B/tp8 qkv [1280, 8192] M=1 8.99 -> 8.63 us, M=8 10.01 -> 9.88"},
    {90, NULL, "linear:bf16:N8192:K1024", 1, 8, "linear.tiles", 3, "H200 2026-12-02 opgraft tune (64 MiB between calls): Llama-3-70B/tp8 o [8192, 1024] M=1 8.12 -> 7.03 us, M=8 8.12 -> 7.20"},
    {90, NULL, "linear:bf16:N7168:K8192", 1, 8, "linear.tiles", 2, "H200 2026-12-02 opgraft tune (64 MiB between calls): Llama-3-70B/tp8 gate_up [7168, 8192] M=1 33.40 -> 30.88 us, M=8 34.16 -> 31.42 (with load 1)"},
    {90, NULL, "linear:bf16:N7168:K8192", 1, 8, "linear.load", 1, "H200 2026-12-02 opgraft tune: Llama-3-70B/tp8 gate_up, with tiles 2"},
    {90, NULL, "linear:bf16:N7168:K8192", 1, 2, "linear.min_blocks", 1, "H200 2026-12-02 opgraft tune: Llama-3-70B/tp8 gate_up M=1, with tiles 2 and load 1"},
    /* Llama-3-70B/tp8 o and qkv: programmatic dependent launch (the rule's linear.pdl 1) lost here
     * (v41, two runs each); qkv won at one row (8.86 -> 8.62 us) and is unmeasured from 2 to 7. */
    {90, NULL, "linear:bf16:N8192:K1024", 1, 8, "linear.pdl", 0, "H200 2026-12-04 bench linear (span, 64 MiB between calls): Llama-3-70B/tp8 o [8192, 1024] pdl 0 -> 1 M=1 7.05 -> 8.80 us, M=8 7.20 -> 9.12"},
    {90, NULL, "linear:bf16:N1280:K8192", 2, 8, "linear.pdl", 0, "H200 2026-12-04 bench linear (span, 64 MiB between calls): Llama-3-70B/tp8 qkv [1280, 8192] pdl 0 -> 1 M=8 9.79 -> 10.08 us"},
    /* Qwen3-30B-A3B o: after attention, which lets it start early (attention.trigger), its weights
     * loaded and asked of L2 before the wait (tools.attn_o, attention + o as one span, v26). */
    {90, NULL, "linear:bf16:N2048:K4096", 1, 8, "linear.pdl", 2, "H200 2026-12-02 tools.attn_o (64 MiB between calls): Qwen3-30B-A3B attention + o, batch 1 at 256 / 1K / 8K tokens 15.53 / 16.17 / 22.28 us with pdl 0 -> 14.31 / 14.77 / 20.86 with pdl 2 and attention.trigger; batch 8 16.72 / 20.07 / 49.83 -> 15.73 / 18.81 / 47.84"},
    /* Llama-3-70B/tp8 gate_up: its tiles row makes 448 blocks, past the rule's two an SM (v42). */
    {90, NULL, "linear:bf16:N7168:K8192", 1, 8, "linear.norm_rows", 0, "H200 2026-12-04 bench linear --norm (span, 64 MiB between calls): Llama-3-70B/tp8 gate_up [7168, 8192] M=1 compiled norm + ours 35.32 us, add + RMSNorm form 38.02"},
    /* Qwen3-30B-A3B's qkv lets decode attention launch as it starts; acts only where attention
     * directly follows (with the q/k prologue) and launches as a dependent (attention.pdl_pro). */
    {90, "NVIDIA H100 80GB HBM3", "linear:bf16:N5120:K2048", 1, 8, "linear.trigger", 1, "H100 2026-12-06 engine, vLLM 0.26, Qwen3-30B-A3B bf16 with the prologue: with attention.pdl_pro 2, batch-1 ITL 3.206 -> 2.905 and 3.129 -> 3.010 ms against the prologue alone (both orders); op level qkv + attention + o at batch 1 144 / 8K tokens 24.43 / 32.30 -> 19.80 / 28.46 us; alone it changes nothing (24.19 / 32.33)"},
    /* Qwen3-30B-A3B's qkv with the q/k norm and rotary in its epilogue (rope_seam.py), with its early
     * start by the two rows around it (linear.trigger above, attention.pdl_pro). */
    {90, "NVIDIA H100 80GB HBM3", "linear:bf16:N5120:K2048", 0, 0, "linear.qk_epilogue", 1, "H100 2026-12-07 engine, vLLM 0.26, Qwen3-30B-A3B bf16, 128 in / 64 out, 30 reps in both orders against opgraft without it: batch-1 ITL 3.145 -> 2.957 and 3.121 -> 2.963 ms, one-token run (median) 14.6 -> 12.7 and 13.3 -> 13.0 ms, prefill GPU time x0.992 / x0.998, tokens identical; batch 8 11.197 -> 10.744 (2026-12-06)"},
    /* END TUNED ROWS */
    {0, NULL, NULL, 0, 0, NULL, 0, NULL},
};

static void linear_abi(og_sbuf *b) {
  OG_ABI_STRUCT(b, opgraft_linear_args);
  OG_ABI_FIELD(b, opgraft_linear_args, struct_size);
  OG_ABI_FIELD(b, opgraft_linear_args, dtype);
  OG_ABI_FIELD(b, opgraft_linear_args, weight_dtype);
  OG_ABI_FIELD(b, opgraft_linear_args, bias_dtype);
  OG_ABI_FIELD(b, opgraft_linear_args, out_dtype);
  OG_ABI_FIELD(b, opgraft_linear_args, rows);
  OG_ABI_FIELD(b, opgraft_linear_args, out_features);
  OG_ABI_FIELD(b, opgraft_linear_args, in_features);
  OG_ABI_FIELD(b, opgraft_linear_args, x);
  OG_ABI_FIELD(b, opgraft_linear_args, x_stride);
  OG_ABI_FIELD(b, opgraft_linear_args, weight);
  OG_ABI_FIELD(b, opgraft_linear_args, weight_stride);
  OG_ABI_FIELD(b, opgraft_linear_args, bias);
  OG_ABI_FIELD(b, opgraft_linear_args, out);
  OG_ABI_FIELD(b, opgraft_linear_args, out_stride);
  OG_ABI_FIELD(b, opgraft_linear_args, arch);
  OG_ABI_FIELD(b, opgraft_linear_args, gpu_name);
  OG_ABI_FIELD(b, opgraft_linear_args, block_n);
  OG_ABI_FIELD(b, opgraft_linear_args, block_k);
  OG_ABI_FIELD(b, opgraft_linear_args, scale_dtype);
  OG_ABI_FIELD(b, opgraft_linear_args, weight_scale);
  OG_ABI_FIELD(b, opgraft_linear_args, weight_scale_stride);
  OG_ABI_FIELD(b, opgraft_linear_args, norm_dtype);
  OG_ABI_FIELD(b, opgraft_linear_args, norm_eps);
  OG_ABI_FIELD(b, opgraft_linear_args, residual);
  OG_ABI_FIELD(b, opgraft_linear_args, residual_stride);
  OG_ABI_FIELD(b, opgraft_linear_args, residual_out);
  OG_ABI_FIELD(b, opgraft_linear_args, residual_out_stride);
  OG_ABI_FIELD(b, opgraft_linear_args, norm_weight);
  OG_ABI_FIELD(b, opgraft_linear_args, normed_out);
  OG_ABI_FIELD(b, opgraft_linear_args, normed_out_stride);
  OG_ABI_FIELD(b, opgraft_linear_args, head_size);
  OG_ABI_FIELD(b, opgraft_linear_args, q_heads);
  OG_ABI_FIELD(b, opgraft_linear_args, qk_heads);
  OG_ABI_FIELD(b, opgraft_linear_args, rope_style);
  OG_ABI_FIELD(b, opgraft_linear_args, qk_norm_eps);
  OG_ABI_FIELD(b, opgraft_linear_args, q_norm_weight);
  OG_ABI_FIELD(b, opgraft_linear_args, k_norm_weight);
  OG_ABI_FIELD(b, opgraft_linear_args, cos_sin_cache);
  OG_ABI_FIELD(b, opgraft_linear_args, cos_sin_stride);
  OG_ABI_FIELD(b, opgraft_linear_args, rope_rows);
  OG_ABI_FIELD(b, opgraft_linear_args, positions);
  opgraft__abi_end(b);
}

const og_op opgraft__linear_op = {
    .name = "linear",
    .kernel_dir = "linear",
    .tunables = tunables,
    .ntunables = (int)(sizeof tunables / sizeof *tunables),
    .rows = rows,
    .nrows = (int)(sizeof rows / sizeof *rows) - 1,
    .rule = opgraft__linear_rule,
    .abi = linear_abi,
};
