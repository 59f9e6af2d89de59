/* The decode-attention op's tunable keys and baked per-arch rows, and its descriptor for the
 * core's registry. Rows match by shape and batch (the query's token count); where none matches,
 * the rule in heuristics.c decides (`opgraft tune attention --inject` adds rows between the
 * markers). */
#include "attention.h"

/* Ranges are what the kernel accepts (the configuration clamps what would not fit); the last
 * field is what `opgraft tune` tries. */
static const og_tunable tunables[] = {
    {"attention.max_batch", 0, 4096, 4096, NULL},
    {"attention.warps", 1, 16, 4, "2 4 8 12"},
    {"attention.min_blocks", 0, 16, 0, "0 1 2"},
    {"attention.min_chunk", 16, 65536, 128, "64 128 256 512 1024"},
    {"attention.max_splits", 1, 1024, 128, "16 32 64 128 256"},
    {"attention.load", 1, 4, 4, "4 1"},
    {"attention.pdl", 0, 2, 0, "0 1"}, /* 2 acts only after a kernel that triggers it: not an op-level tune */
    {"attention.pdl_pro", -1, 2, -1, NULL}, /* calls with the q/k prologue; -1: attention.pdl's value */
    {"attention.trigger", 0, 1, 0, "0 1"},
    {"attention.fan32", 0, 1, 0, "0 1"},
    {"attention.cluster", 1, 8, 1, "1 4 8"},
    {"attention.vpf", 0, 1, 0, "0 1"},
    {"attention.round", 1, 2, 1, "1 2"},
};

static const og_tune_entry rows[] = {
    /* BEGIN TUNED ROWS */
    /* Qwen3-30B-A3B heads (32 query / 4 kv, head 128; also Llama-3-70B/tp8's 8 / 1): 8 warps at one
     * sequence (v22's tune; from two the rule's 12, v37: they lost 0.4-0.9 us to 8 up to 8K tokens at
     * one sequence), and the batch bound 64: 12 warps are ahead of every baseline timed beside them
     * at every measured point up to 64 sequences. */
    {90, NULL, "attention:bf16:D128:G8:bs16", 1, 1, "attention.warps", 8, "H200 2026-12-01 opgraft tune (64 MiB between calls): Qwen3-30B-A3B batch 1 contexts 1024,8192 12.47 -> 10.87 us"},
    /* Two tiles a round at one sequence (8 warps): spans of 129-256 tokens in one split and one round
     * trip, no combine; level from 512 to 2K, 0.2-0.4 us behind from 8K (v57). The key is also
     * Llama-3-70B/tp8's (8 / 1 heads a rank), not timed there. */
    {90, NULL, "attention:bf16:D128:G8:bs16", 1, 1, "attention.round", 2, "H100 2026-12-06 bench attention (64 MiB between calls), Qwen3-30B-A3B batch 1: 192 / 256 tokens 7.9 / 7.9 -> 6.2 / 6.7 us (Triton 7.6), 1K 8.3 -> 8.3, 8K 13.9 -> 14.3; engine 129-192 tokens 8.20 -> 7.02 us a layer"},
    /* The early start with the prologue (the qkv projection's linear.trigger row): engine, both orders. */
    {90, "NVIDIA H100 80GB HBM3", "attention:bf16:D128:G8:bs16", 1, 4096, "attention.pdl_pro", 2, "H100 2026-12-06 engine, vLLM 0.26, Qwen3-30B-A3B bf16 with the prologue, 128 in / 64 out, with linear.trigger on qkv against the prologue alone: batch-1 ITL 3.206 -> 2.905 and 3.129 -> 3.010 ms (both orders), GPU busy a step 3.013 -> 2.856 and 3.011 -> 2.847; batch 8 against opgraft without the prologue 10.886 -> 10.668, busy 9.920 -> 9.769"},
    {90, NULL, "attention:bf16:D128:G8:bs16", 1, 4096, "attention.max_batch", 64, "H200 2026-12-03 bench attention, Qwen3-30B-A3B batch 64 with 12 warps: 1K 40.97 us (FlashInfer 44.74), 8K 251.90 (FA3 256.32), 32K 970.69 (FA3 972.70)"},
    /* END TUNED ROWS */
    {0, NULL, NULL, 0, 0, NULL, 0, NULL}, /* closes the list (C has no empty arrays); not a row */
};

static void attention_abi(og_sbuf *b) {
  OG_ABI_STRUCT(b, opgraft_attention_args);
  OG_ABI_FIELD(b, opgraft_attention_args, struct_size);
  OG_ABI_FIELD(b, opgraft_attention_args, dtype);
  OG_ABI_FIELD(b, opgraft_attention_args, kv_dtype);
  OG_ABI_FIELD(b, opgraft_attention_args, flags);
  OG_ABI_FIELD(b, opgraft_attention_args, batch);
  OG_ABI_FIELD(b, opgraft_attention_args, query_len);
  OG_ABI_FIELD(b, opgraft_attention_args, num_heads);
  OG_ABI_FIELD(b, opgraft_attention_args, num_kv_heads);
  OG_ABI_FIELD(b, opgraft_attention_args, head_size);
  OG_ABI_FIELD(b, opgraft_attention_args, block_size);
  OG_ABI_FIELD(b, opgraft_attention_args, num_blocks);
  OG_ABI_FIELD(b, opgraft_attention_args, max_blocks);
  OG_ABI_FIELD(b, opgraft_attention_args, scale);
  OG_ABI_FIELD(b, opgraft_attention_args, softcap);
  OG_ABI_FIELD(b, opgraft_attention_args, window_left);
  OG_ABI_FIELD(b, opgraft_attention_args, q);
  OG_ABI_FIELD(b, opgraft_attention_args, q_stride);
  OG_ABI_FIELD(b, opgraft_attention_args, k_cache);
  OG_ABI_FIELD(b, opgraft_attention_args, k_stride);
  OG_ABI_FIELD(b, opgraft_attention_args, v_cache);
  OG_ABI_FIELD(b, opgraft_attention_args, v_stride);
  OG_ABI_FIELD(b, opgraft_attention_args, block_table);
  OG_ABI_FIELD(b, opgraft_attention_args, block_table_dtype);
  OG_ABI_FIELD(b, opgraft_attention_args, block_table_stride);
  OG_ABI_FIELD(b, opgraft_attention_args, seq_lens);
  OG_ABI_FIELD(b, opgraft_attention_args, seq_lens_dtype);
  OG_ABI_FIELD(b, opgraft_attention_args, sinks);
  OG_ABI_FIELD(b, opgraft_attention_args, sinks_dtype);
  OG_ABI_FIELD(b, opgraft_attention_args, out);
  OG_ABI_FIELD(b, opgraft_attention_args, out_stride);
  OG_ABI_FIELD(b, opgraft_attention_args, max_seq_len);
  OG_ABI_FIELD(b, opgraft_attention_args, arch);
  OG_ABI_FIELD(b, opgraft_attention_args, gpu_name);
  OG_ABI_FIELD(b, opgraft_attention_args, k_new);
  OG_ABI_FIELD(b, opgraft_attention_args, k_new_stride);
  OG_ABI_FIELD(b, opgraft_attention_args, v_new);
  OG_ABI_FIELD(b, opgraft_attention_args, v_new_stride);
  OG_ABI_FIELD(b, opgraft_attention_args, slot_mapping);
  OG_ABI_FIELD(b, opgraft_attention_args, slot_mapping_dtype);
  OG_ABI_FIELD(b, opgraft_attention_args, slot_count);
  OG_ABI_FIELD(b, opgraft_attention_args, q_norm_weight);
  OG_ABI_FIELD(b, opgraft_attention_args, k_norm_weight);
  OG_ABI_FIELD(b, opgraft_attention_args, qk_norm_dtype);
  OG_ABI_FIELD(b, opgraft_attention_args, qk_norm_eps);
  OG_ABI_FIELD(b, opgraft_attention_args, rope_style);
  OG_ABI_FIELD(b, opgraft_attention_args, cos_sin_cache);
  OG_ABI_FIELD(b, opgraft_attention_args, cos_sin_dtype);
  OG_ABI_FIELD(b, opgraft_attention_args, cos_sin_stride);
  OG_ABI_FIELD(b, opgraft_attention_args, rope_rows);
  OG_ABI_FIELD(b, opgraft_attention_args, positions);
  OG_ABI_FIELD(b, opgraft_attention_args, positions_dtype);
  opgraft__abi_end(b);
}

const og_op opgraft__attention_op = {
    .name = "attention",
    .kernel_dir = "attention",
    .tunables = tunables,
    .ntunables = (int)(sizeof tunables / sizeof *tunables),
    .rows = rows,
    .nrows = (int)(sizeof rows / sizeof *rows) - 1,
    .rule = opgraft__attn_rule,
    .abi = attention_abi,
};
