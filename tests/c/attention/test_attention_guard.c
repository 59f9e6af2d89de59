/* The decode-attention guard (which calls the kernel takes and why it refuses the others), its
 * configuration, and the split and combine-tree arithmetic the kernel and the launcher share.
 * No GPU and no data: the pointers are fake but aligned, and nothing here reads them. */
#include <math.h>

#include "og_test.h"
#include "attention/attention.h"
#include "../../../kernels/attention/attn_params.h"

static char tmp[512];

static int setup(void **state) {
  og_tmpdir(tmp, sizeof tmp);
  setenv("OPGRAFT_CACHE_DIR", tmp, 1);
  og_unsetenv_prefix("OPGRAFT_TUNE_");
  opgraft_tune_reload();
  return 0;
}

static int teardown(void **state) {
  og_unsetenv_prefix("OPGRAFT_TUNE_");
  opgraft_tune_reload();
  unsetenv("OPGRAFT_CACHE_DIR");
  og_rm_rf(tmp);
  return 0;
}

static int reset_tunables(void **state) {
  og_unsetenv_prefix("OPGRAFT_TUNE_");
  opgraft_tune_reload();
  return 0;
}

/* vLLM 0.26's FlashAttention cache: logical (blocks, kv_heads, block_size, 2*D), physically
 * [block, token, head, K then V]; K and V are views D elements apart. */
static void set_vllm_cache(opgraft_attention_args *a, int64_t blocks, int64_t bs, int64_t Hk, int64_t D) {
  a->num_blocks = blocks, a->block_size = bs, a->num_kv_heads = Hk, a->head_size = D;
  const int64_t st[4] = {bs * Hk * 2 * D, Hk * 2 * D, 2 * D, 1};
  memcpy(a->k_stride, st, sizeof st);
  memcpy(a->v_stride, st, sizeof st);
}

/* Qwen3-30B-A3B's attention (32 query heads, 4 kv heads, head 128), bf16, block 16, batch 8. */
static opgraft_attention_args valid_args(void) {
  opgraft_attention_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = a.kv_dtype = OPGRAFT_DTYPE_BF16;
  a.batch = 8, a.query_len = 1, a.num_heads = 32;
  set_vllm_cache(&a, 4096, 16, 4, 128);
  a.max_blocks = 2560;
  a.scale = 1.0 / sqrt(128.0);
  a.window_left = -1;
  a.q = (const void *)0x100000, a.q_stride[0] = 32 * 128, a.q_stride[1] = 128, a.q_stride[2] = 1;
  a.k_cache = (const void *)0x10000000, a.v_cache = (const void *)(0x10000000 + 256);
  a.block_table = (const void *)0x200000, a.block_table_dtype = OPGRAFT_DTYPE_INT32;
  a.block_table_stride[0] = 2560, a.block_table_stride[1] = 1;
  a.seq_lens = (const void *)0x300000, a.seq_lens_dtype = OPGRAFT_DTYPE_INT32;
  a.out = (void *)0x400000, a.out_stride[0] = 32 * 128, a.out_stride[1] = 128, a.out_stride[2] = 1;
  a.arch = 90;
  return a;
}

static void expect_ok(const opgraft_attention_args *a, const char *what) {
  char reason[256] = "unset";
  const int32_t st = opgraft_attention_supports(a, reason, sizeof reason);
  if (st != OPGRAFT_OK) fail_msg("%s: %s, reason \"%s\"", what, opgraft_status_name(st), reason);
  assert_string_equal(reason, "");
}

static void expect_refusal(const opgraft_attention_args *a, const char *needle, const char *what) {
  char reason[256] = "unset";
  const int32_t st = opgraft_attention_supports(a, reason, sizeof reason);
  if (st != OPGRAFT_EUNSUPPORTED)
    fail_msg("%s: %s, expected OPGRAFT_EUNSUPPORTED (reason \"%s\")", what, opgraft_status_name(st), reason);
  if (!strstr(reason, needle)) fail_msg("%s: reason \"%s\" lacks \"%s\"", what, reason, needle);
  if (!strstr(opgraft_last_error(), reason)) fail_msg("%s: last error \"%s\" lacks the reason", what, opgraft_last_error());
}

/* The call's cache write (Qwen3's qkv output as the new keys and values). */
static void set_update(opgraft_attention_args *a) {
  a->k_new = (const void *)0x600000, a->v_new = (const void *)0x600100, a->slot_mapping = (const void *)0x700000;
  a->k_new_stride[0] = a->v_new_stride[0] = 3 * 4 * 128, a->k_new_stride[1] = a->v_new_stride[1] = 128;
  a->slot_mapping_dtype = OPGRAFT_DTYPE_INT64, a->slot_count = 8;
}

/* Qwen3's q/k RMSNorm and NeoX rotary embedding in the kernel (with the cache write). */
static void set_prologue(opgraft_attention_args *a) {
  set_update(a);
  a->q_norm_weight = (const void *)0x800000, a->k_norm_weight = (const void *)0x800100;
  a->qk_norm_dtype = a->dtype, a->qk_norm_eps = 1e-6;
  a->rope_style = OPGRAFT_ROPE_NEOX, a->cos_sin_cache = (const void *)0x900000, a->cos_sin_dtype = a->dtype;
  a->cos_sin_stride = 128, a->rope_rows = 40960, a->positions = (const void *)0xa00000;
  a->positions_dtype = OPGRAFT_DTYPE_INT64;
}

static void test_max_batch(void **state) {
  /* sm_90 takes up to 32 sequences by the rule (measured: FA3 won at 64 with long contexts and 8
   * warps), 64 for Qwen3-30B-A3B's heads by their row (12 warps won there); other archs any. */
  opgraft_attention_args a = valid_args();
  a.batch = 64;
  expect_ok(&a, "batch 64 on sm_90, Qwen3-30B-A3B heads");
  a.batch = 65;
  expect_refusal(&a, "batch 65 > attention.max_batch 64", "batch 65 on sm_90, Qwen3-30B-A3B heads");
  a.num_heads = 16, a.batch = 33; /* 4 query heads a kv head: no row, the rule */
  expect_refusal(&a, "batch 33 > attention.max_batch 32", "batch 33 on sm_90, GQA 4");
  a.arch = 80;
  expect_ok(&a, "batch 33 on sm_80");
  setenv("OPGRAFT_TUNE_ATTENTION_MAX_BATCH", "64", 1);
  a.arch = 90, a.batch = 64;
  expect_ok(&a, "batch 64 with the threshold raised");
  unsetenv("OPGRAFT_TUNE_ATTENTION_MAX_BATCH");
}

static void test_valid(void **state) {
  opgraft_attention_args a = valid_args();
  expect_ok(&a, "Qwen3-30B-A3B heads");
  assert_int_equal(opgraft_attention_supports(&a, NULL, 0), OPGRAFT_OK);
  a.dtype = a.kv_dtype = OPGRAFT_DTYPE_FP16;
  expect_ok(&a, "fp16");
  a = valid_args();
  a.window_left = 4095, a.softcap = 50.0;
  a.sinks = (const void *)0x500000, a.sinks_dtype = OPGRAFT_DTYPE_FP32;
  expect_ok(&a, "window, soft cap, fp32 sinks");
  a.sinks_dtype = OPGRAFT_DTYPE_BF16;
  expect_ok(&a, "sinks in the query's dtype");
  a = valid_args();
  set_update(&a);
  expect_ok(&a, "the cache write in the kernel");
  a.slot_count = 0, a.slot_mapping = NULL;
  expect_ok(&a, "the cache write with no slots this call");
  a = valid_args();
  set_prologue(&a);
  expect_ok(&a, "q/k norm and NeoX rotary embedding");
  a.rope_style = OPGRAFT_ROPE_GPTJ;
  expect_ok(&a, "q/k norm and GPT-J rotary embedding");
  a.rope_style = OPGRAFT_ROPE_NONE, a.cos_sin_cache = a.positions = NULL;
  expect_ok(&a, "q/k norm alone");
  set_prologue(&a);
  a.q_norm_weight = a.k_norm_weight = NULL;
  expect_ok(&a, "rotary embedding alone");
  a.batch = 0, a.cos_sin_cache = a.positions = NULL;
  a.q = a.k_cache = a.v_cache = a.block_table = a.seq_lens = NULL, a.out = NULL;
  expect_ok(&a, "rotary embedding, an empty batch with NULL pointers");
  static const int64_t heads[][3] = {{32, 32, 64}, {32, 8, 128}, {64, 4, 128}, {16, 2, 256}, {8, 8, 256}, {7, 1, 64}};
  for (int i = 0; i < 6; ++i) {
    a = valid_args();
    a.num_heads = heads[i][0];
    set_vllm_cache(&a, 4096, 16, heads[i][1], heads[i][2]);
    a.q_stride[0] = a.out_stride[0] = heads[i][0] * heads[i][2], a.q_stride[1] = a.out_stride[1] = heads[i][2];
    char what[64];
    snprintf(what, sizeof what, "%lld/%lld heads, head %lld", (long long)heads[i][0], (long long)heads[i][1],
             (long long)heads[i][2]);
    expect_ok(&a, what);
  }
  a = valid_args();
  set_vllm_cache(&a, 4096, 48, 4, 128);
  expect_ok(&a, "block size 48 (a multiple of 16, not a power of two)");
  a = valid_args();
  a.q_stride[0] = (32 + 2 * 4) * 128; /* q a view of a fused qkv projection */
  expect_ok(&a, "q rows of the qkv projection");
  a = valid_args();
  a.k_stride[2] = a.v_stride[2] = 0; /* one kv head: its stride does not matter */
  expect_ok(&a, "a zero stride on a kv-head dimension");
  a = valid_args();
  a.arch = 80;
  expect_ok(&a, "sm_80");
  a = valid_args();
  a.batch = 0;
  a.q = a.k_cache = a.v_cache = a.block_table = a.seq_lens = NULL;
  a.out = NULL;
  expect_ok(&a, "an empty batch with NULL pointers");
}

typedef struct refusal {
  void (*mutate)(opgraft_attention_args *a);
  const char *needle;
} refusal;

static void m_struct_size(opgraft_attention_args *a) { a->struct_size = (uint32_t)sizeof *a - 8; }
static void m_mla(opgraft_attention_args *a) { a->flags = OPGRAFT_ATTN_MLA; }
static void m_encoder(opgraft_attention_args *a) { a->flags = OPGRAFT_ATTN_ENCODER; }
static void m_alibi(opgraft_attention_args *a) { a->flags = OPGRAFT_ATTN_ALIBI; }
static void m_non_causal(opgraft_attention_args *a) { a->flags = OPGRAFT_ATTN_NON_CAUSAL; }
static void m_flags(opgraft_attention_args *a) { a->flags = 64; }
static void m_fp32(opgraft_attention_args *a) { a->dtype = a->kv_dtype = OPGRAFT_DTYPE_FP32; }
static void m_fp8_kv(opgraft_attention_args *a) { a->kv_dtype = OPGRAFT_DTYPE_FP8_E4M3; }
static void m_uint8_kv(opgraft_attention_args *a) { a->kv_dtype = OPGRAFT_DTYPE_UINT8; }
static void m_kv_fp16(opgraft_attention_args *a) { a->kv_dtype = OPGRAFT_DTYPE_FP16; }
static void m_query_len(opgraft_attention_args *a) { a->query_len = 2; }
static void m_batch(opgraft_attention_args *a) { a->batch = 70000; }
static void m_head_96(opgraft_attention_args *a) { a->head_size = 96; }
static void m_head_512(opgraft_attention_args *a) { a->head_size = 512; }
static void m_heads_ratio(opgraft_attention_args *a) { a->num_heads = 30; }
static void m_group_32(opgraft_attention_args *a) { a->num_heads = 128; }
static void m_group_16_d256(opgraft_attention_args *a) {
  a->num_heads = 64;
  set_vllm_cache(a, 4096, 16, 4, 256);
}
static void m_block_8(opgraft_attention_args *a) { a->block_size = 8; }
static void m_block_24(opgraft_attention_args *a) { a->block_size = 24; }
static void m_block_8192(opgraft_attention_args *a) { a->block_size = 8192; }
static void m_blocks_0(opgraft_attention_args *a) { a->num_blocks = 0; }
static void m_scale_0(opgraft_attention_args *a) { a->scale = 0; }
static void m_scale_nan(opgraft_attention_args *a) { a->scale = NAN; }
static void m_softcap_neg(opgraft_attention_args *a) { a->softcap = -1; }
static void m_window(opgraft_attention_args *a) { a->window_left = -2; }
static void m_bt_int64(opgraft_attention_args *a) { a->block_table_dtype = OPGRAFT_DTYPE_INT64; }
static void m_lens_int64(opgraft_attention_args *a) { a->seq_lens_dtype = OPGRAFT_DTYPE_INT64; }
static void m_sinks_fp16(opgraft_attention_args *a) {
  a->sinks = (const void *)0x500000;
  a->sinks_dtype = OPGRAFT_DTYPE_FP16;
}
static void m_q_dim(opgraft_attention_args *a) { a->q_stride[2] = 2; }
static void m_k_dim(opgraft_attention_args *a) { a->k_stride[3] = 2; }
static void m_bt_cols(opgraft_attention_args *a) { a->block_table_stride[1] = 2; }
static void m_q_rows(opgraft_attention_args *a) { a->q_stride[0] = 32 * 128 + 4; }
static void m_out_heads(opgraft_attention_args *a) { a->out_stride[1] = 132; }
static void m_k_tokens(opgraft_attention_args *a) { a->k_stride[1] = 4 * 2 * 128 + 4; }
static void m_v_blocks(opgraft_attention_args *a) { a->v_stride[0] = 12; }
static void m_q_misaligned(opgraft_attention_args *a) { a->q = (const void *)0x100008; }
static void m_v_misaligned(opgraft_attention_args *a) { a->v_cache = (const void *)0x10000008; }
static void m_lens_misaligned(opgraft_attention_args *a) { a->seq_lens = (const void *)0x300002; }
static void m_null_bt(opgraft_attention_args *a) { a->block_table = NULL; }
static void m_max_seq_len(opgraft_attention_args *a) { a->max_seq_len = -1; }
static void m_arch_75(opgraft_attention_args *a) { a->arch = 75; }
static void m_slots_int32(opgraft_attention_args *a) { set_update(a), a->slot_mapping_dtype = OPGRAFT_DTYPE_INT32; }
static void m_slot_count(opgraft_attention_args *a) { set_update(a), a->slot_count = -1; }
static void m_new_stride(opgraft_attention_args *a) { set_update(a), a->v_new_stride[0] = 3 * 4 * 128 + 2; }
static void m_no_new_values(opgraft_attention_args *a) { set_update(a), a->v_new = NULL; }
static void m_no_slots(opgraft_attention_args *a) { set_update(a), a->slot_mapping = NULL; }
static void m_new_misaligned(opgraft_attention_args *a) { set_update(a), a->k_new = (const void *)0x600008; }
static void m_slots_misaligned(opgraft_attention_args *a) { set_update(a), a->slot_mapping = (const void *)0x700004; }
static void m_pro_no_update(opgraft_attention_args *a) { set_prologue(a), a->k_new = NULL; }
static void m_rope_style(opgraft_attention_args *a) { set_prologue(a), a->rope_style = 3; }
static void m_one_norm_weight(opgraft_attention_args *a) { set_prologue(a), a->k_norm_weight = NULL; }
static void m_norm_dtype(opgraft_attention_args *a) { set_prologue(a), a->qk_norm_dtype = OPGRAFT_DTYPE_FP32; }
static void m_norm_eps(opgraft_attention_args *a) { set_prologue(a), a->qk_norm_eps = NAN; }
static void m_cos_sin_dtype(opgraft_attention_args *a) { set_prologue(a), a->cos_sin_dtype = OPGRAFT_DTYPE_FP32; }
static void m_rope_rows(opgraft_attention_args *a) { set_prologue(a), a->rope_rows = 0; }
static void m_cos_sin_stride(opgraft_attention_args *a) { set_prologue(a), a->cos_sin_stride = 132; }
static void m_cos_sin_short(opgraft_attention_args *a) { set_prologue(a), a->cos_sin_stride = 64; }
static void m_positions_int32(opgraft_attention_args *a) { set_prologue(a), a->positions_dtype = OPGRAFT_DTYPE_INT32; }
static void m_no_positions(opgraft_attention_args *a) { set_prologue(a), a->positions = NULL; }
static void m_cos_sin_misaligned(opgraft_attention_args *a) { set_prologue(a), a->cos_sin_cache = (const void *)0x900008; }
static void m_norm_misaligned(opgraft_attention_args *a) { set_prologue(a), a->q_norm_weight = (const void *)0x800002; }

static const refusal refusals[] = {
    {m_struct_size, "struct_size"},
    {m_mla, "MLA"},
    {m_encoder, "encoder or cross attention"},
    {m_alibi, "ALiBi"},
    {m_non_causal, "non-causal"},
    {m_flags, "unknown flags"},
    {m_fp32, "dtype fp32"},
    {m_fp8_kv, "FP8 KV cache"},
    {m_uint8_kv, "FP8 KV cache"},
    {m_kv_fp16, "KV cache dtype fp16 differs"},
    {m_query_len, "2 query tokens per sequence"},
    {m_batch, "batch 70000"},
    {m_head_96, "head size 96"},
    {m_head_512, "head size 512"},
    {m_heads_ratio, "30 query heads over 4 kv heads"},
    {m_group_32, "32 query heads per kv head"},
    {m_group_16_d256, "head size 256"},
    {m_block_8, "block size 8"},
    {m_block_24, "block size 24"},
    {m_block_8192, "block size 8192"},
    {m_blocks_0, "cache of 0 blocks"},
    {m_scale_0, "softmax scale"},
    {m_scale_nan, "softmax scale"},
    {m_softcap_neg, "soft cap"},
    {m_window, "window -2"},
    {m_bt_int64, "block table dtype int64"},
    {m_lens_int64, "seq_lens dtype int64"},
    {m_sinks_fp16, "sinks dtype fp16"},
    {m_q_dim, "dims are not contiguous"},
    {m_k_dim, "dims are not contiguous"},
    {m_bt_cols, "block table rows"},
    {m_q_rows, "multiples of 16 bytes"},
    {m_out_heads, "multiples of 16 bytes"},
    {m_k_tokens, "KV cache strides"},
    {m_v_blocks, "KV cache strides"},
    {m_q_misaligned, "16-byte aligned"},
    {m_v_misaligned, "16-byte aligned"},
    {m_lens_misaligned, "misaligned"},
    {m_null_bt, "NULL"},
    {m_max_seq_len, "max_seq_len"},
    {m_arch_75, "sm_75 is older than sm_80"},
    {m_slots_int32, "slot mapping dtype int32"},
    {m_slot_count, "negative slot count"},
    {m_new_stride, "new key or value strides"},
    {m_no_new_values, "without new values"},
    {m_no_slots, "without new values or a slot mapping"},
    {m_new_misaligned, "slot mapping misaligned"},
    {m_slots_misaligned, "slot mapping misaligned"},
    {m_pro_no_update, "without the call's new keys"},
    {m_rope_style, "unknown rotary embedding style 3"},
    {m_one_norm_weight, "a q norm weight without a k norm weight"},
    {m_norm_dtype, "q/k norm weight dtype fp32"},
    {m_norm_eps, "q/k norm epsilon"},
    {m_cos_sin_dtype, "cos/sin cache dtype fp32"},
    {m_rope_rows, "cos/sin cache of 0 rows"},
    {m_cos_sin_stride, "cos/sin cache row stride 132"},
    {m_cos_sin_short, "cos/sin cache row stride 64"},
    {m_positions_int32, "positions dtype int32"},
    {m_no_positions, "without a cos/sin cache or positions"},
    {m_cos_sin_misaligned, "cos/sin cache or positions misaligned"},
    {m_norm_misaligned, "cos/sin cache or positions misaligned"},
};

static void test_refusals(void **state) {
  for (size_t i = 0; i < sizeof refusals / sizeof *refusals; ++i) {
    opgraft_attention_args a = valid_args();
    refusals[i].mutate(&a);
    expect_refusal(&a, refusals[i].needle, refusals[i].needle);
  }
  char reason[64] = "";
  assert_int_equal(opgraft_attention_supports(NULL, reason, sizeof reason), OPGRAFT_EUNSUPPORTED);
  assert_true(reason[0] != 0);
}

static void test_registered_with_its_tunables(void **state) {
  int found = 0;
  for (const char *const *n = opgraft_op_names(); *n; ++n) found |= strcmp(*n, "attention") == 0;
  assert_true(found);
  int64_t lo, hi;
  assert_int_equal(opgraft_tune_range("attention.warps", &lo, &hi), OPGRAFT_OK);
  assert_true(lo == 1 && hi == 16);
  assert_string_equal(opgraft_tune_space("attention.min_chunk"), "64 128 256 512 1024");
  assert_non_null(strstr(opgraft_abi_layout(), "\"opgraft_attention_args\""));
  /* The rule decides every key (there are no baked rows yet). */
  const char *keys[] = {"attention.warps", "attention.min_blocks", "attention.min_chunk", "attention.max_splits",
                        "attention.load", "attention.pdl", "attention.trigger", "attention.cluster", "attention.fan32",
                        "attention.vpf", "attention.round", "attention.pdl_pro"};
  for (size_t i = 0; i < sizeof keys / sizeof *keys; ++i) {
    const opgraft_tune_query q = {keys[i], 90, "NVIDIA H200", "attention:bf16:D128:G8:bs16", 0};
    int64_t v;
    char src[64];
    assert_int_equal(opgraft_tune_get(&q, &v, src, sizeof src), OPGRAFT_OK);
    assert_string_equal(src, "rule");
  }
  og_attn_shape s;
  assert_true(opgraft__attn_parse_shape("attention:bf16:D128:G8:bs16", &s));
  assert_true(s.D == 128 && s.G == 8 && s.bs == 16);
  assert_false(opgraft__attn_parse_shape("moe:bf16:E1:H1:I1:k1", &s));
  char key[128];
  opgraft_attention_args a = valid_args();
  opgraft__attn_shape_key(&a, key, sizeof key);
  assert_string_equal(key, "attention:bf16:D128:G8:bs16");
}

static int has_opt(const og_opts *o, const char *opt) {
  for (int i = 0; i < o->n; ++i)
    if (strcmp(o->ptr[i], opt) == 0) return 1;
  return 0;
}

/* cfg.fan32 of a's plan on arch with the tunable env var set to value (unset after). */
static int fan32_with(const opgraft_attention_args *a, const char *env, const char *value, int32_t arch) {
  og_attn_cfg c;
  setenv(env, value, 1);
  opgraft_tune_reload();
  opgraft__attn_config(a, arch, NULL, &c);
  unsetenv(env);
  opgraft_tune_reload();
  return c.fan32;
}

static void test_config(void **state) {
  opgraft_attention_args a = valid_args();
  og_attn_cfg c;
  og_opts o;
  /* The rule (sm_80: no baked rows); on sm_90 this shape has a tuned row of 8 warps at one
   * sequence, and the rule's 12 from two. */
  opgraft__attn_config(&a, 80, NULL, &c);
  assert_int_equal(c.warps, 4);
  assert_int_equal(c.min_blocks, 3); /* 3 warps a scheduler x 168 registers fill its 16K */
  assert_int_equal(c.min_chunk, 128);
  assert_int_equal(c.pdl, 0);
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.warps, 12);
  assert_int_equal(c.min_blocks, 1);
  a.batch = 1;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.warps, 8);
  a.batch = 8;
  set_update(&a); /* 12 warps with the cache write: 168 registers, one block an SM */
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.warps, 12);
  /* The sm_90 rule: 12 warps for head 128 with 2..8 query heads a kv head, whatever the dtype
   * (no row matches fp16); 4 elsewhere and on other archs. */
  a = valid_args();
  a.dtype = a.kv_dtype = OPGRAFT_DTYPE_FP16, a.batch = 1;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.warps, 12);
  opgraft__attn_config(&a, 80, NULL, &c);
  assert_int_equal(c.warps, 4);
  a.num_heads = 5 * a.num_kv_heads;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.warps, 12);
  a.num_heads = 16 * a.num_kv_heads;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.warps, 4);
  a.num_heads = a.num_kv_heads;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.warps, 4);
  a = valid_args();
  a.num_heads = 4 * a.num_kv_heads, a.batch = 1; /* Llama-3-8B's group size: the rule at one sequence too */
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.warps, 12);
  a = valid_args();
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(opgraft__attn_options(&a, &c, &o), OPGRAFT_OK);
  assert_true(has_opt(&o, "-DOG_D=128") && has_opt(&o, "-DOG_G=8"));
  assert_true(has_opt(&o, "-DOG_SOFTCAP=0") && has_opt(&o, "-DOG_WINDOW=0") && has_opt(&o, "-DOG_SINKS=0"));
  char buf[1024];
  assert_int_equal(opgraft_attention_describe(&a, 80, buf, sizeof buf), OPGRAFT_OK);
  assert_non_null(strstr(buf, "-DOG_W=4"));
  /* The options' code paths follow the call. */
  a.softcap = 30, a.window_left = 127, a.sinks = (const void *)0x500000, a.sinks_dtype = OPGRAFT_DTYPE_FP32;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_true(c.softcap == 1 && c.window == 1 && c.sinks == 2);
  a.sinks_dtype = OPGRAFT_DTYPE_BF16;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.sinks, 1);
  assert_int_equal(opgraft__attn_options(&a, &c, &o), OPGRAFT_OK);
  assert_true(has_opt(&o, "-DOG_UPDATE=0"));
  set_update(&a); /* the cache write is a code path of its own */
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.update, 1);
  assert_int_equal(opgraft__attn_options(&a, &c, &o), OPGRAFT_OK);
  assert_true(has_opt(&o, "-DOG_UPDATE=1"));
  /* PDL only from sm_90; warps and the launch-bounds minimum clamped to what fits. */
  setenv("OPGRAFT_TUNE_ATTENTION_PDL", "1", 1);
  setenv("OPGRAFT_TUNE_ATTENTION_WARPS", "16", 1);
  setenv("OPGRAFT_TUNE_ATTENTION_MIN_BLOCKS", "4", 1);
  setenv("OPGRAFT_TUNE_ATTENTION_MIN_CHUNK", "100", 1);
  opgraft_tune_reload();
  a = valid_args();
  opgraft__attn_config(&a, 80, NULL, &c);
  assert_int_equal(c.pdl, 0);
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.pdl, 1);
  assert_int_equal(c.warps, 8); /* 16 warps x 168 registers do not fit one SM */
  assert_int_equal(c.min_blocks, 1);
  assert_int_equal(c.min_chunk, 112);
  a.num_heads = 64; /* 16 query heads a kv head */
  set_vllm_cache(&a, 4096, 16, 4, 128);
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.warps, 8); /* 8 x 16 x 128 floats = 64 KB of warp partials */
  set_vllm_cache(&a, 4096, 16, 8, 256);
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.warps, 8);
  assert_true(og_attn_smem_bytes(256, 8, 8, 0) <= (64u << 10) + 8u * 288u * 2u + 512u);
  /* The cluster merge adds the block's result (G x D floats and G pairs) at a 16-byte boundary. */
  assert_int_equal(og_attn_smem_bytes(256, 8, 8, 1), og_attn_smem_bytes(256, 8, 8, 0) + 8u * 256u * 4u + 8u * 8u);
  assert_int_equal(OG_ATTN_RES_OFF(64, 5, 1) % 4, 0);
  assert_true(OG_ATTN_RES_OFF(64, 5, 1) >= 5 * 64 + 5 * 2);
  /* Cluster sizes: powers of two up to 8, sm_90 only. */
  a.num_heads = 32;
  set_vllm_cache(&a, 4096, 16, 4, 128);
  const char *sizes[][2] = {{"1", "1"}, {"3", "2"}, {"4", "4"}, {"8", "8"}};
  for (int i = 0; i < 4; ++i) {
    setenv("OPGRAFT_TUNE_ATTENTION_CLUSTER", sizes[i][0], 1);
    opgraft_tune_reload();
    opgraft__attn_config(&a, 90, NULL, &c);
    assert_int_equal(c.cluster, atoi(sizes[i][1]));
    opgraft__attn_config(&a, 80, NULL, &c);
    assert_int_equal(c.cluster, 1);
  }
  unsetenv("OPGRAFT_TUNE_ATTENTION_CLUSTER");
  opgraft_tune_reload();
  /* The combine's fan-in 32: on by the sm_90 rule, off elsewhere; the variable overrides both.
   * With it the module has the fan-in 32 entry point too (OG_FAN32). */
  a = valid_args();
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.fan32, 1);
  assert_int_equal(opgraft__attn_options(&a, &c, &o), OPGRAFT_OK);
  assert_true(has_opt(&o, "-DOG_FAN32=1"));
  opgraft__attn_config(&a, 80, NULL, &c);
  assert_int_equal(c.fan32, 0);
  assert_int_equal(opgraft__attn_options(&a, &c, &o), OPGRAFT_OK);
  assert_true(has_opt(&o, "-DOG_FAN32=0"));
  /* Never more than 16 splits: no fan-in 32 (nor its entry point). */
  assert_int_equal(fan32_with(&a, "OPGRAFT_TUNE_ATTENTION_MAX_SPLITS", "16", 90), 0);
  assert_int_equal(fan32_with(&a, "OPGRAFT_TUNE_ATTENTION_MAX_SPLITS", "17", 90), 1);
  /* The entry points' names. */
  char fname[64];
  opgraft__attn_fn_name(OPGRAFT_DTYPE_BF16, OG_ATTN_FAN_LOG2, fname);
  assert_string_equal(fname, "attention_decode_bf16");
  opgraft__attn_fn_name(OPGRAFT_DTYPE_FP16, OG_ATTN_FAN_MAX_LOG2, fname);
  assert_string_equal(fname, "attention_decode_fan32_fp16");
  assert_int_equal(fan32_with(&a, "OPGRAFT_TUNE_ATTENTION_FAN32", "0", 90), 0);
  assert_int_equal(fan32_with(&a, "OPGRAFT_TUNE_ATTENTION_FAN32", "1", 80), 1);
  /* The V prefetch: off by the rule; asked for, on where its registers leave the warps as they
   * are: head 128 with up to 8 query heads a kv head at 8 and 12 warps, not head 256 (a thread's
   * 255 taken). */
  og_unsetenv_prefix("OPGRAFT_TUNE_");
  opgraft_tune_reload();
  a = valid_args();
  a.batch = 1;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.vpf, 0);
  assert_int_equal(opgraft__attn_options(&a, &c, &o), OPGRAFT_OK);
  assert_true(has_opt(&o, "-DOG_VPF=0"));
  setenv("OPGRAFT_TUNE_ATTENTION_VPF", "1", 1);
  opgraft_tune_reload();
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_true(c.warps == 8 && c.vpf == 1 && c.min_blocks == 1);
  assert_int_equal(opgraft__attn_options(&a, &c, &o), OPGRAFT_OK);
  assert_true(has_opt(&o, "-DOG_VPF=1"));
  a.batch = 8;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_true(c.warps == 12 && c.vpf == 1);
  a.num_heads = 64; /* 16 query heads a kv head: 208 registers, and 64 KB of warp partials at 8 */
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_true(c.warps == 4 && c.vpf == 1);
  a.num_heads = 32;
  a.batch = 1;
  set_vllm_cache(&a, 4096, 16, 4, 256);
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.vpf, 0);
  unsetenv("OPGRAFT_TUNE_ATTENTION_VPF");
  opgraft_tune_reload();
  /* Two tiles a round: one by the rule, two by this shape's row at one sequence on sm_90; asked for,
   * two where the second tile's registers leave the warps as they are (8 warps at one sequence, head
   * 64 at 4), not at 12 warps (168 registers) or head 256, and never with the V prefetch. */
  a = valid_args();
  a.batch = 1;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_true(c.warps == 8 && c.round == 2 && c.min_blocks == 1);
  assert_int_equal(opgraft__attn_options(&a, &c, &o), OPGRAFT_OK);
  assert_true(has_opt(&o, "-DOG_ROUND=2"));
  opgraft__attn_config(&a, 80, NULL, &c);
  assert_int_equal(c.round, 1);
  setenv("OPGRAFT_TUNE_ATTENTION_ROUND", "1", 1);
  opgraft_tune_reload();
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.round, 1);
  assert_int_equal(opgraft__attn_options(&a, &c, &o), OPGRAFT_OK);
  assert_true(has_opt(&o, "-DOG_ROUND=1"));
  setenv("OPGRAFT_TUNE_ATTENTION_ROUND", "2", 1);
  opgraft_tune_reload();
  a.batch = 8;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_true(c.warps == 12 && c.round == 1);
  a.num_heads = 16, a.num_kv_heads = 2; /* head 64, G 8: 4 warps, 3 blocks an SM still */
  set_vllm_cache(&a, 4096, 16, 2, 64);
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_true(c.warps == 4 && c.round == 2 && c.min_blocks == 3);
  a = valid_args();
  a.batch = 1;
  set_vllm_cache(&a, 4096, 16, 4, 256);
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.round, 1);
  a = valid_args();
  a.batch = 1;
  setenv("OPGRAFT_TUNE_ATTENTION_VPF", "1", 1);
  opgraft_tune_reload();
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_true(c.vpf == 1 && c.round == 1);
  unsetenv("OPGRAFT_TUNE_ATTENTION_VPF");
  unsetenv("OPGRAFT_TUNE_ATTENTION_ROUND");
  opgraft_tune_reload();
  /* The first round before the wait (PDL 2): only with the kernel's cache write and without a
   * window (PDL 1 otherwise), only on sm_90; the trigger then follows the wait (kernel side). */
  setenv("OPGRAFT_TUNE_ATTENTION_PDL", "2", 1);
  opgraft_tune_reload();
  a = valid_args();
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.pdl, 1);
  set_update(&a);
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.pdl, 2);
  assert_int_equal(opgraft__attn_options(&a, &c, &o), OPGRAFT_OK);
  assert_true(has_opt(&o, "-DOG_PDL=2") && has_opt(&o, "-DOG_UPDATE=1"));
  opgraft__attn_config(&a, 80, NULL, &c);
  assert_int_equal(c.pdl, 0);
  a.window_left = 127;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.pdl, 1);
  setenv("OPGRAFT_TUNE_ATTENTION_PDL", "3", 1); /* out of range: ignored, the rule gives 0 */
  opgraft_tune_reload();
  a.window_left = -1;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.pdl, 0);
  unsetenv("OPGRAFT_TUNE_ATTENTION_PDL");
  opgraft_tune_reload();
  /* Calls with the q/k prologue take attention.pdl_pro where it is set (-1 by the rule: attention.pdl's
   * value): 2 by Qwen3-30B-A3B's heads' H100 row (v60), not on the H200, not without the prologue. */
  {
    const char *h100 = "NVIDIA H100 80GB HBM3";
    opgraft_attention_args p = valid_args();
    set_prologue(&p);
    for (int B = 1; B <= 32; B += 31) {
      p.batch = B;
      opgraft__attn_config(&p, 90, h100, &c);
      assert_int_equal(c.pdl, 2);
      opgraft__attn_config(&p, 90, "NVIDIA H200", &c);
      assert_int_equal(c.pdl, 0);
    }
    opgraft__attn_config(&p, 80, h100, &c);
    assert_int_equal(c.pdl, 0);
    p.window_left = 127; /* pdl 2's own conditions still hold */
    opgraft__attn_config(&p, 90, h100, &c);
    assert_int_equal(c.pdl, 1);
    p.window_left = -1;
    opgraft_attention_args u = valid_args();
    set_update(&u);
    opgraft__attn_config(&u, 90, h100, &c);
    assert_int_equal(c.pdl, 0);
    setenv("OPGRAFT_TUNE_ATTENTION_PDL", "1", 1);
    setenv("OPGRAFT_TUNE_ATTENTION_PDL_PRO", "-1", 1);
    opgraft_tune_reload();
    opgraft__attn_config(&p, 90, h100, &c);
    assert_int_equal(c.pdl, 1);
    setenv("OPGRAFT_TUNE_ATTENTION_PDL_PRO", "0", 1);
    opgraft_tune_reload();
    opgraft__attn_config(&p, 90, h100, &c);
    assert_int_equal(c.pdl, 0);
    opgraft__attn_config(&u, 90, h100, &c);
    assert_int_equal(c.pdl, 1);
    unsetenv("OPGRAFT_TUNE_ATTENTION_PDL");
    unsetenv("OPGRAFT_TUNE_ATTENTION_PDL_PRO");
    opgraft_tune_reload();
  }
  /* A call after the q/k epilogue (the hint, no prologue) takes the same key; the guard and the
   * oracle take the hint, not an unknown bit beside it. */
  {
    const char *h100 = "NVIDIA H100 80GB HBM3";
    opgraft_attention_args u = valid_args();
    set_update(&u);
    u.flags = OPGRAFT_ATTN_AFTER_QKV;
    opgraft__attn_config(&u, 90, h100, &c);
    assert_int_equal(c.pdl, 2);
    opgraft__attn_config(&u, 90, "NVIDIA H200", &c);
    assert_int_equal(c.pdl, 0);
    opgraft__attn_config(&u, 80, h100, &c);
    assert_int_equal(c.pdl, 0);
    char why[160];
    assert_int_equal(opgraft_attention_supports(&u, why, sizeof why), OPGRAFT_OK);
    u.flags = OPGRAFT_ATTN_AFTER_QKV | 32;
    assert_int_equal(opgraft_attention_supports(&u, why, sizeof why), OPGRAFT_EUNSUPPORTED);
    assert_non_null(strstr(why, "unknown flags"));
  }
  /* A combine's maxima and sums (32 partials x G pairs) fit the room of the warps' partials. */
  for (int D = 64; D <= 256; D *= 2)
    for (int G = 1; G <= 16; ++G)
      for (int W = 1; W <= 16; ++W)
        for (int cl = 0; cl < 2; ++cl) {
          const unsigned sq = (unsigned)((G + 7) / 8) * 8u * (unsigned)OG_ATTN_QROW(D) * 2u;
          if (og_attn_smem_bytes(D, G, W, cl) < sq + (unsigned)(OG_ATTN_FAN_MAX * G) * 8u)
            fail_msg("D=%d G=%d W=%d cluster=%d: no room for the combine's maxima and sums", D, G, W, cl);
        }
}

/* The fan-in a launch takes: 32 (log2 5) for 17..36 splits with attention.fan32, 33..36 lowered
 * to 32 (one 32-wide combine, where 16 takes two levels); else 16 and the split count as it was. */
static void test_fan_of(void **state) {
  for (int fan32 = 0; fan32 < 2; ++fan32)
    for (int S0 = 1; S0 <= 1024; ++S0) {
      int S = S0;
      const int lg = opgraft__attn_fan_of(fan32, &S);
      const int wide = fan32 && S0 > 16 && S0 <= 36;
      if (lg != (wide ? 5 : 4) || S != (wide && S0 > 32 ? 32 : S0))
        fail_msg("fan32 %d, %d splits: fan-in log2 %d and %d splits", fan32, S0, lg, S);
      /* A launch at fan-in 32 is one level: its S slots and the root's counter. */
      int sp, sc;
      og_attn_tree(S, lg, &sp, &sc);
      if (wide && (sc != 1 || sp != S)) fail_msg("%d splits at fan-in 32: %d slots, %d counters", S, sp, sc);
    }
  static const int cases[][4] = {
      /* fan32, S in, fan-in log2, S out */
      {1, 33, 5, 32}, /* batch 1 with 4 kv heads on an H200: 33 -> 3 -> 1 becomes 32 -> 1 */
      {1, 36, 5, 32}, {1, 32, 5, 32}, {1, 17, 5, 17}, {1, 16, 4, 16}, {1, 37, 4, 37},
      {1, 64, 4, 64}, {1, 128, 4, 128}, {1, 2, 4, 2}, {1, 1, 4, 1},  {0, 33, 4, 33}, {0, 17, 4, 17},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
    int S = cases[i][1];
    const int lg = opgraft__attn_fan_of(cases[i][0], &S);
    if (lg != cases[i][2] || S != cases[i][3])
      fail_msg("fan32 %d S %d: log2 %d S %d, expected %d and %d", cases[i][0], cases[i][1], lg, S, cases[i][2],
               cases[i][3]);
  }
  /* After the clusters' rounding (a multiple of 4 or 8), the lowered count stays a multiple. */
  for (int S0 = 4; S0 <= 64; S0 += 4) {
    int S = S0;
    opgraft__attn_fan_of(1, &S);
    assert_int_equal(S % 4, 0);
  }
}

/* The cluster size and the split count a launch rounds to. */
static void test_cluster_of(void **state) {
  const int resident[4] = {132, 66, 30, 15}; /* an H200 at one block an SM */
  static const int cases[][5] = {
      /* cluster, groups, S in, size out, S out */
      {8, 4, 33, 8, 24},   /* 16 clusters of 8 > 15 resident: 3 a group, 27% fewer splits */
      {8, 5, 26, 8, 24},   /* 15 clusters of 8 */
      {8, 4, 40, 4, 28},   /* 3 of 8 a group would lose 40%: 7 of 4 */
      {8, 8, 4, 4, 4},     /* 8 clusters of 4 */
      {8, 1, 13, 4, 12},   /* 8 of 13 would lose 38% */
      {8, 20, 6, 1, 6},    /* 4 of 6 would lose 33% */
      {8, 32, 4, 1, 4},    /* 32 clusters of 4 > 30 resident; of 2, the tree is as fast */
      {8, 4, 64, 1, 64},
      {8, 1, 3, 1, 3},
      {1, 4, 33, 1, 33},   /* off */
      {8, 4, 1, 1, 1},     /* no split */
      {16, 1, 100, 8, 96}, /* 8 at most */
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
    int S = cases[i][2];
    const int c = opgraft__attn_cluster_of(cases[i][0], resident, cases[i][1], &S);
    if (c != cases[i][3] || S != cases[i][4])
      fail_msg("cluster %d groups %d S %d: size %d S %d, expected %d and %d", cases[i][0], cases[i][1], cases[i][2], c, S,
               cases[i][3], cases[i][4]);
  }
}

/* A tuned row holds for a batch range: the query's token count is the batch. */
static void test_rows_match_by_batch(void **state) {
  char dir[256], path[512];
  og_tmpdir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/tune.json", dir);
  og_write_file(path, "{\"version\": 1, \"entries\": [{\"arch\": 90, \"shape\": \"attention:bf16:D128:G8:bs16\", "
                      "\"tokens\": [1, 2], \"values\": {\"attention.min_chunk\": 512}, \"why\": \"test\"}]}");
  setenv("OPGRAFT_TUNE_FILE", path, 1);
  opgraft_tune_reload();
  opgraft_attention_args a = valid_args();
  og_attn_cfg c;
  a.batch = 2;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.min_chunk, 512);
  a.batch = 3;
  opgraft__attn_config(&a, 90, NULL, &c);
  assert_int_equal(c.min_chunk, 128); /* the rule's */
  unsetenv("OPGRAFT_TUNE_FILE");
  og_rm_rf(dir);
}

static void test_workspace(void **state) {
  opgraft_attention_args a = valid_args();
  size_t bytes = 0;
  assert_int_equal(opgraft_attention_workspace_size(&a, &bytes), OPGRAFT_OK);
  /* counters, maxima/sums and outputs for up to OG_ATTN_MAX_SLOTS blocks of 8 heads x 128 dims */
  assert_true(bytes >= (size_t)OG_ATTN_MAX_SLOTS * 8 * 130 * 4 && bytes % 256 == 0);
  size_t ml, part;
  opgraft__attn_workspace_offsets(&a, 396, 128, &ml, &part);
  assert_true(ml > 0 && ml % 256 == 0 && part > ml && part % 256 == 0);
  assert_true(opgraft__attn_workspace_bytes(&a, 396, 128) > part);
  assert_int_equal(opgraft__attn_workspace_bytes(&a, 396, 1), 0); /* never split: no workspace */
  /* Every launch's tree fits the regions, at the fan-in it takes with attention.fan32 on or off:
   * S splits over up to slots / S groups (batch x kv heads), then the fan-in's choice. */
  static const int64_t slot_counts[] = {132, 396, 528, OG_ATTN_MAX_SLOTS};
  static const int splits[] = {1, 16, 17, 32, 36, 64, 128, 1024};
  const int64_t G = a.num_heads / a.num_kv_heads, D = a.head_size;
  for (int si = 0; si < 4; ++si)
    for (int mi = 0; mi < 8; ++mi) {
      const int64_t slots = slot_counts[si];
      const int max_splits = splits[mi];
      const size_t total = opgraft__attn_workspace_bytes(&a, slots, max_splits);
      opgraft__attn_workspace_offsets(&a, slots, max_splits, &ml, &part);
      for (int64_t groups = 1; groups <= slots; ++groups)
        for (int fan32 = 0; fan32 < 2; ++fan32) {
          int64_t S0 = slots / groups;
          if (S0 > max_splits) S0 = max_splits;
          if (S0 < 2) continue;
          int S = (int)S0, sp, sc;
          const int lg = opgraft__attn_fan_of(fan32, &S);
          og_attn_tree(S, lg, &sp, &sc);
          if ((size_t)(groups * sc) * 4u > ml || (size_t)(groups * sp * G) * 8u > part - ml ||
              (size_t)(groups * sp * G * D) * 4u > total - part)
            fail_msg("slots %lld max_splits %d groups %lld: %d splits at fan-in log2 %d outgrow the workspace",
                     (long long)slots, max_splits, (long long)groups, S, lg);
        }
    }
  a.dtype = OPGRAFT_DTYPE_FP32;
  assert_int_equal(opgraft_attention_workspace_size(&a, &bytes), OPGRAFT_EUNSUPPORTED);
}

/* The split arithmetic: the non-empty splits tile [start rounded down to 16, L) exactly; a span
 * of at most `one` tokens is one split, and `one` changes nothing else. */
static void test_splits_partition_the_keys(void **state) {
  static const int mins[] = {16, 64, 128, 1024}, ones[] = {0, 64, 128, 192};
  for (int L = 1; L <= 700; L += (L < 80 ? 1 : 13))
    for (int start = 0; start < L; start += (L / 7) + 1)
      for (int S = 1; S <= 150; S += (S < 20 ? 1 : 29))
        for (int mi = 0; mi < 4; ++mi)
          for (int oi = 0; oi < 4; ++oi) {
            int a0, chunk, a0_, chunk_;
            const int n = og_attn_split(L, start, S, mins[mi], ones[oi], &a0, &chunk);
            const int n0 = og_attn_split(L, start, S, mins[mi], 0, &a0_, &chunk_);
            const int span = L - (start & ~15);
            if (n < 1 || n > S || chunk % 16 || chunk < mins[mi] || a0 % 16 || a0 > start || start - a0 > 15)
              fail_msg("L=%d start=%d S=%d min=%d: n=%d chunk=%d a0=%d", L, start, S, mins[mi], n, chunk, a0);
            if (span <= ones[oi] ? n != 1 : n != n0 || chunk != chunk_)
              fail_msg("L=%d start=%d S=%d min=%d one=%d: n=%d chunk=%d, without one n=%d chunk=%d", L, start, S,
                       mins[mi], ones[oi], n, chunk, n0, chunk_);
            int next = a0;
            for (int s = 0; s < n; ++s) {
              const int r0 = a0 + s * chunk, r1 = r0 + chunk < L ? r0 + chunk : L;
              if (r0 != next || r1 <= r0) fail_msg("L=%d S=%d: split %d is [%d, %d)", L, S, s, r0, r1);
              next = r1;
            }
            if (next != L) fail_msg("L=%d start=%d S=%d: the splits end at %d", L, start, S, next);
          }
}

/* The combine tree at either fan-in, simulated with random arrival orders: every counter ends at
 * 0, every node merges children that have all been written (no more than the fan-in), slots and
 * counters stay inside og_attn_tree's sizes, the root is written exactly once, by the block that
 * climbed ceil(log_fan n) levels (one at fan-in 32 for up to 32 splits). */
static void test_combine_tree(void **state) {
  unsigned seed = 12345;
  for (int lg = OG_ATTN_FAN_LOG2; lg <= OG_ATTN_FAN_MAX_LOG2; ++lg)
    for (int S = 2; S <= 600; S += (S < 40 ? 1 : 37))
      for (int n = 2; n <= S; n += (n < 34 ? 1 : 61)) {
        int sp, sc, levels = 0;
        og_attn_tree(S, lg, &sp, &sc);
        for (int c = n; c > 1; c = (c + (1 << lg) - 1) >> lg) ++levels;
        int *written = calloc((size_t)sp, sizeof(int)), *counters = calloc((size_t)(sc + 1), sizeof(int));
        int *order = malloc(sizeof(int) * (size_t)n), roots = 0;
        for (int i = 0; i < n; ++i) order[i] = i;
        for (int i = n - 1; i > 0; --i) { /* a random arrival order */
          seed = seed * 1103515245u + 12345u;
          const int j = (int)((seed >> 8) % (unsigned)(i + 1)), t = order[i];
          order[i] = order[j], order[j] = t;
        }
        for (int k = 0; k < n; ++k) {
          og_attn_node node = {order[k], n, S, 0, 0};
          assert_true(node.idx < sp);
          written[node.idx] = 1;
          for (int level = 1;; ++level) {
            const int ci = node.coff + og_attn_parent(&node, lg), members = og_attn_members(&node, lg);
            if (ci >= sc) fail_msg("lg=%d S=%d n=%d: counter %d of %d", lg, S, n, ci, sc);
            if (members < 1 || members > 1 << lg) fail_msg("lg=%d S=%d n=%d: %d members", lg, S, n, members);
            if (++counters[ci] != members) break;
            counters[ci] = 0;
            const int first = node.off + (og_attn_parent(&node, lg) << lg);
            for (int c = 0; c < members; ++c)
              if (!written[first + c])
                fail_msg("lg=%d S=%d n=%d: slot %d merged before it was written", lg, S, n, first + c);
            if (og_attn_parent_is_root(&node, lg)) {
              if (level != levels) fail_msg("lg=%d S=%d n=%d: the root at level %d of %d", lg, S, n, level, levels);
              ++roots;
              break;
            }
            const int dst = og_attn_parent_slot(&node, lg);
            if (dst >= sp || written[dst])
              fail_msg("lg=%d S=%d n=%d: parent slot %d (of %d) twice or outside", lg, S, n, dst, sp);
            written[dst] = 1;
            og_attn_up(&node, lg);
          }
        }
        assert_int_equal(roots, 1);
        if (lg == OG_ATTN_FAN_MAX_LOG2 && n <= 32) assert_int_equal(levels, 1);
        for (int i = 0; i < sc; ++i)
          if (counters[i]) fail_msg("lg=%d S=%d n=%d: counter %d left at %d", lg, S, n, i, counters[i]);
        free(written), free(counters), free(order);
      }
}

/* The prologue alone (opgraft_attention_prologue_run) on a prefill of Qwen3's qkv output: 1000
 * token rows, q and k views of the [rows, (32 + 2 * 4) * 128] projection, out and k_out contiguous;
 * the cache fields are left zero (ignored). */
static opgraft_attention_args prologue_args(void) {
  opgraft_attention_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = OPGRAFT_DTYPE_BF16;
  a.batch = 1000, a.num_heads = 32, a.num_kv_heads = 4, a.head_size = 128;
  a.q = (const void *)0x100000, a.q_stride[0] = 40 * 128, a.q_stride[1] = 128, a.q_stride[2] = 1;
  a.out = (void *)0x400000, a.out_stride[0] = 32 * 128, a.out_stride[1] = 128, a.out_stride[2] = 1;
  set_prologue(&a);
  a.k_new_stride[0] = 40 * 128;
  return a;
}

static void expect_prologue_refusal(const opgraft_attention_args *a, const int64_t *ko, const char *needle) {
  char reason[256] = "";
  assert_int_equal(opgraft__attn_check_prologue_alone(a, ko, reason, sizeof reason), OPGRAFT_EUNSUPPORTED);
  if (!strstr(reason, needle)) fail_msg("reason \"%s\" lacks \"%s\"", reason, needle);
  assert_int_equal(opgraft_attention_prologue_run(a, (void *)0xb00000, ko, NULL), OPGRAFT_EUNSUPPORTED);
  if (!strstr(opgraft_last_error(), needle)) fail_msg("last error \"%s\" lacks \"%s\"", opgraft_last_error(), needle);
}

static void test_prologue_alone(void **state) {
  const int64_t ko[2] = {4 * 128, 128}, ko_odd[2] = {4 * 128 + 4, 128};
  char reason[256] = "unset";
  opgraft_attention_args a = prologue_args();
  assert_int_equal(opgraft__attn_check_prologue_alone(&a, ko, reason, sizeof reason), OPGRAFT_OK);
  a.q_norm_weight = a.k_norm_weight = NULL; /* the rotary embedding alone, GPT-J, fp16, head 64 */
  a.rope_style = OPGRAFT_ROPE_GPTJ, a.dtype = a.cos_sin_dtype = OPGRAFT_DTYPE_FP16, a.head_size = 64;
  assert_int_equal(opgraft__attn_check_prologue_alone(&a, ko, reason, sizeof reason), OPGRAFT_OK);
  a = prologue_args(), a.rope_style = OPGRAFT_ROPE_NONE; /* the norm alone */
  assert_int_equal(opgraft__attn_check_prologue_alone(&a, ko, reason, sizeof reason), OPGRAFT_OK);
  a.batch = 0; /* nothing to run: no GPU needed */
  assert_int_equal(opgraft_attention_prologue_run(&a, (void *)0xb00000, ko, NULL), OPGRAFT_OK);

  a = prologue_args(), a.struct_size -= 8;
  expect_prologue_refusal(&a, ko, "older ABI");
  a = prologue_args(), a.dtype = OPGRAFT_DTYPE_FP32;
  expect_prologue_refusal(&a, ko, "dtype fp32");
  a = prologue_args(), a.head_size = 96;
  expect_prologue_refusal(&a, ko, "head size 96");
  a = prologue_args(), a.num_kv_heads = 0;
  expect_prologue_refusal(&a, ko, "kv heads");
  a = prologue_args(), a.batch = -1;
  expect_prologue_refusal(&a, ko, "rows");
  a = prologue_args(), a.q_norm_weight = a.k_norm_weight = NULL, a.rope_style = OPGRAFT_ROPE_NONE;
  expect_prologue_refusal(&a, ko, "nothing to do");
  a = prologue_args(), a.k_norm_weight = NULL;
  expect_prologue_refusal(&a, ko, "a q norm weight without a k norm weight");
  a = prologue_args();
  expect_prologue_refusal(&a, NULL, "no output key strides");
  expect_prologue_refusal(&a, ko_odd, "not multiples of 16 bytes");
  a.q_stride[2] = 2;
  expect_prologue_refusal(&a, ko, "not contiguous");
  a = prologue_args(), a.k_new = NULL;
  expect_prologue_refusal(&a, ko, "without the call's new keys");
  a = prologue_args(), a.qk_norm_dtype = OPGRAFT_DTYPE_FP16;
  expect_prologue_refusal(&a, ko, "q/k norm weight dtype fp16");
  a = prologue_args(), a.positions_dtype = OPGRAFT_DTYPE_INT32;
  expect_prologue_refusal(&a, ko, "positions dtype int32");
  a = prologue_args(), a.cos_sin_stride = 64;
  expect_prologue_refusal(&a, ko, "cos/sin cache row stride 64");
  /* Pointers the guard does not look at: a NULL or misaligned one is a bad call, not a refusal. */
  a = prologue_args(), a.q = NULL;
  assert_int_equal(opgraft_attention_prologue_run(&a, (void *)0xb00000, ko, NULL), OPGRAFT_EINVAL);
  a = prologue_args(), a.positions = (const void *)0xa00004;
  assert_int_equal(opgraft_attention_prologue_run(&a, (void *)0xb00000, ko, NULL), OPGRAFT_EINVAL);
  a = prologue_args();
  assert_int_equal(opgraft_attention_prologue_run(&a, NULL, ko, NULL), OPGRAFT_EINVAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_valid, reset_tunables),
      cmocka_unit_test_teardown(test_max_batch, reset_tunables),
      cmocka_unit_test_teardown(test_refusals, reset_tunables),
      cmocka_unit_test_teardown(test_registered_with_its_tunables, reset_tunables),
      cmocka_unit_test_teardown(test_config, reset_tunables),
      cmocka_unit_test_teardown(test_rows_match_by_batch, reset_tunables),
      cmocka_unit_test_teardown(test_workspace, reset_tunables),
      cmocka_unit_test(test_splits_partition_the_keys),
      cmocka_unit_test(test_combine_tree),
      cmocka_unit_test(test_fan_of),
      cmocka_unit_test(test_cluster_of),
      cmocka_unit_test(test_prologue_alone),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
