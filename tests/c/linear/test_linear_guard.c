/* The linear op's guard (which calls the kernel takes and why it refuses the others), its rule
 * and its configuration. No GPU and no data are needed: the pointers are fake but aligned, and
 * neither the guard nor the configuration reads them. */
#include <math.h>

#include "og_test.h"
#include "linear/linear.h"

static char tmp[512];

static int setup(void **state) {
  og_tmpdir(tmp, sizeof tmp);
  setenv("OPGRAFT_CACHE_DIR", tmp, 1); /* nothing here should write a cache file */
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

static void set_shape(opgraft_linear_args *a, int64_t M, int64_t N, int64_t K) {
  a->rows = M, a->out_features = N, a->in_features = K;
  a->x_stride[0] = K, a->x_stride[1] = 1;
  a->weight_stride[0] = K, a->weight_stride[1] = 1;
  a->out_stride[0] = N, a->out_stride[1] = 1;
}

/* bf16, M=1, Qwen3-30B-A3B's qkv projection [5120, 2048] with a bias, on sm_90. */
static opgraft_linear_args valid_args(void) {
  opgraft_linear_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = a.weight_dtype = a.bias_dtype = a.out_dtype = OPGRAFT_DTYPE_BF16;
  set_shape(&a, 1, 5120, 2048);
  a.x = (const void *)0x10000;
  a.weight = (const void *)0x100000;
  a.bias = (const void *)0x200000;
  a.out = (void *)0x300000;
  a.arch = 90;
  return a;
}

/* The same projection with block-FP8 weights (vLLM's Fp8LinearMethod, 128x128 blocks). */
static opgraft_linear_args fp8_args(void) {
  opgraft_linear_args a = valid_args();
  a.weight_dtype = OPGRAFT_DTYPE_FP8_E4M3, a.scale_dtype = OPGRAFT_DTYPE_FP32, a.block_n = a.block_k = 128;
  a.weight_scale = (const void *)0x400000;
  a.weight_scale_stride[0] = 16, a.weight_scale_stride[1] = 1;
  return a;
}

static void expect_ok(const opgraft_linear_args *a, const char *what) {
  char reason[256] = "unset";
  const int32_t st = opgraft_linear_supports(a, reason, sizeof reason);
  if (st != OPGRAFT_OK) fail_msg("%s: %s, reason \"%s\"", what, opgraft_status_name(st), reason);
  assert_string_equal(reason, "");
}

static void expect_refusal(const opgraft_linear_args *a, const char *needle, const char *what) {
  char reason[256] = "unset";
  const int32_t st = opgraft_linear_supports(a, reason, sizeof reason);
  if (st != OPGRAFT_EUNSUPPORTED)
    fail_msg("%s: %s, expected OPGRAFT_EUNSUPPORTED (reason \"%s\")", what, opgraft_status_name(st), reason);
  if (!strstr(reason, needle)) fail_msg("%s: reason \"%s\" lacks \"%s\"", what, reason, needle);
  if (!strstr(opgraft_last_error(), reason))
    fail_msg("%s: last error \"%s\" lacks the reason", what, opgraft_last_error());
}

static void test_valid(void **state) {
  opgraft_linear_args a = valid_args();
  expect_ok(&a, "qkv M=1 with bias");
  a.bias = NULL, a.bias_dtype = 0; /* no bias: its dtype is not looked at */
  expect_ok(&a, "qkv M=1 without bias");
  for (int64_t M = 1; M <= 8; ++M) {
    set_shape(&a, M, 5120, 2048);
    expect_ok(&a, "M 1..8 on sm_90");
  }
  a.dtype = a.weight_dtype = a.out_dtype = OPGRAFT_DTYPE_FP16;
  expect_ok(&a, "fp16");
  /* Odd N and the smallest K; padded rows; a one-row x with any row stride. */
  set_shape(&a, 3, 7, 8);
  expect_ok(&a, "N=7 K=8");
  set_shape(&a, 2, 129, 72);
  a.x_stride[0] = 80, a.weight_stride[0] = 136, a.out_stride[0] = 200;
  expect_ok(&a, "padded rows");
  set_shape(&a, 1, 151936, 2048);
  a.x_stride[0] = 3;
  expect_ok(&a, "one row: its row stride is never used");
}

static void test_zero_rows(void **state) {
  opgraft_linear_args a = valid_args();
  a.rows = 0;
  expect_ok(&a, "M=0");
  a.x = a.weight = a.bias = NULL;
  a.out = NULL;
  expect_ok(&a, "M=0 with NULL pointers");
}

/* ---- one refusal per case ---- */

typedef struct refusal {
  void (*mutate)(opgraft_linear_args *a);
  const char *needle;
} refusal;

/* Qwen3-30B-A3B's qkv with its q/k RMSNorm and NeoX rotary embedding in the epilogue. */
static opgraft_linear_args qk_args(void) {
  opgraft_linear_args a = valid_args();
  a.bias = NULL, a.bias_dtype = 0;
  a.head_size = 128, a.q_heads = 32, a.qk_heads = 36, a.rope_style = OPGRAFT_ROPE_NEOX, a.qk_norm_eps = 1e-6f;
  a.q_norm_weight = (const void *)0x500000, a.k_norm_weight = (const void *)0x500100;
  a.cos_sin_cache = (const void *)0x600000, a.cos_sin_stride = 128, a.rope_rows = 40960;
  a.positions = (const void *)0x700000;
  return a;
}

static void m_qk_d96(opgraft_linear_args *a) { *a = qk_args(), a->head_size = 96; }
static void m_qk_n(opgraft_linear_args *a) { *a = qk_args(), set_shape(a, 1, 5120 + 64, 2048); }
static void m_qk_heads(opgraft_linear_args *a) { *a = qk_args(), a->qk_heads = 41; }
static void m_qk_q_over(opgraft_linear_args *a) { *a = qk_args(), a->q_heads = 37; }
static void m_qk_one_norm(opgraft_linear_args *a) { *a = qk_args(), a->k_norm_weight = NULL; }
static void m_qk_eps(opgraft_linear_args *a) { *a = qk_args(), a->qk_norm_eps = -1.f; }
static void m_qk_style(opgraft_linear_args *a) { *a = qk_args(), a->rope_style = 3; }
static void m_qk_nothing(opgraft_linear_args *a) {
  *a = qk_args(), a->q_norm_weight = a->k_norm_weight = NULL, a->rope_style = OPGRAFT_ROPE_NONE;
}
static void m_qk_cs_stride(opgraft_linear_args *a) { *a = qk_args(), a->cos_sin_stride = 100; }
static void m_qk_fp8(opgraft_linear_args *a) {
  *a = qk_args();
  a->weight_dtype = OPGRAFT_DTYPE_FP8_E4M3, a->scale_dtype = OPGRAFT_DTYPE_FP32, a->block_n = a->block_k = 128;
  a->weight_scale = (const void *)0x400000, a->weight_scale_stride[0] = 16, a->weight_scale_stride[1] = 1;
}
static void m_qk_no_heads(opgraft_linear_args *a) { *a = qk_args(), a->qk_heads = 0; }
static void m_qk_no_positions(opgraft_linear_args *a) { *a = qk_args(), a->positions = NULL; }
static void m_qk_sm80(opgraft_linear_args *a) { *a = qk_args(), a->arch = 80; }
static void m_qk_positions(opgraft_linear_args *a) { *a = qk_args(), a->positions = (const void *)0x700004; }

static void test_qk_epilogue(void **state) {
  opgraft_linear_args a = qk_args();
  for (int64_t M = 1; M <= 8; M += 7) {
    set_shape(&a, M, 5120, 2048);
    expect_ok(&a, "Qwen3-30B-A3B qkv with the q/k epilogue");
  }
  a = qk_args(), a.rope_style = OPGRAFT_ROPE_NONE, a.cos_sin_cache = a.positions = NULL;
  expect_ok(&a, "the norm alone");
  a = qk_args(), a.q_norm_weight = a.k_norm_weight = NULL, a.rope_style = OPGRAFT_ROPE_GPTJ;
  expect_ok(&a, "GPT-J rotation alone");
  const refusal qk_refusals[] = {
      {m_qk_d96, "head_size 96"},
      {m_qk_n, "not a multiple of head_size"},
      {m_qk_heads, "qk_heads 41"},
      {m_qk_q_over, "q_heads 37"},
      {m_qk_one_norm, "one of q_norm_weight and k_norm_weight"},
      {m_qk_eps, "qk_norm_eps"},
      {m_qk_style, "rotary embedding style 3"},
      {m_qk_nothing, "no norm and no rotation"},
      {m_qk_cs_stride, "rotary cache"},
      {m_qk_fp8, "FP8 weights"},
      {m_qk_no_heads, "qk_heads 0"},
      {m_qk_no_positions, "positions is NULL"},
      {m_qk_sm80, "thread-block clusters"},
      {m_qk_positions, "misaligned"},
  };
  for (size_t i = 0; i < sizeof qk_refusals / sizeof *qk_refusals; ++i) {
    qk_refusals[i].mutate(&a);
    expect_refusal(&a, qk_refusals[i].needle, qk_refusals[i].needle);
  }
  /* A head's blocks are one cluster of at most 8: three 8-row tiles (24 rows) become two for heads
   * of 128 and 64, and four for heads of 256; one tile becomes two for heads of 128. */
  a = qk_args();
  og_linear_cfg c;
  opgraft__linear_config(&a, 90, NULL, &c);
  assert_int_equal(128 % (8 * c.tiles), 0);
  assert_true(c.warps <= 4); /* the clusters resident at once */
  setenv("OPGRAFT_TUNE_LINEAR_TILES", "3", 1);
  opgraft_tune_reload();
  opgraft__linear_config(&a, 90, NULL, &c);
  assert_int_equal(c.tiles, 2);
  a.head_size = 64, a.q_heads = 64, a.qk_heads = 72;
  opgraft__linear_config(&a, 90, NULL, &c);
  assert_int_equal(c.tiles, 2);
  a.head_size = 256, a.q_heads = 16, a.qk_heads = 18;
  opgraft__linear_config(&a, 90, NULL, &c);
  assert_int_equal(c.tiles, 4);
  setenv("OPGRAFT_TUNE_LINEAR_TILES", "1", 1);
  opgraft_tune_reload();
  a = qk_args();
  opgraft__linear_config(&a, 90, NULL, &c);
  assert_int_equal(c.tiles, 2);
  unsetenv("OPGRAFT_TUNE_LINEAR_TILES");
  opgraft_tune_reload();
  a = qk_args();
  opgraft__linear_config(&a, 90, NULL, &c);
  og_opts o;
  assert_int_equal(opgraft__linear_options(&a, &c, &o), OPGRAFT_OK);
  int found = 0;
  for (int i = 0; i < o.n; ++i)
    found += strcmp(o.ptr[i], "-DOG_QKPRO=1") == 0 || strcmp(o.ptr[i], "-DOG_QK_D=128") == 0 ||
             strcmp(o.ptr[i], "-DOG_QKNORM=1") == 0 || strcmp(o.ptr[i], "-DOG_ROPE=1") == 0;
  assert_int_equal(found, 4);
  char name[64];
  opgraft__linear_fn_name(&a, name);
  assert_string_equal(name, "linear_gemv_qk_bf16");
  a.residual = (const void *)0x900000;
  opgraft__linear_fn_name(&a, name);
  assert_string_equal(name, "linear_norm_gemv_qk_bf16");
}

static void m_struct_size(opgraft_linear_args *a) { a->struct_size = (uint32_t)sizeof *a - 8; }
static void m_dtype_fp32(opgraft_linear_args *a) { a->dtype = a->weight_dtype = a->bias_dtype = a->out_dtype = OPGRAFT_DTYPE_FP32; }
static void m_weight_fp16(opgraft_linear_args *a) { a->weight_dtype = OPGRAFT_DTYPE_FP16; }
static void m_bias_fp32(opgraft_linear_args *a) { a->bias_dtype = OPGRAFT_DTYPE_FP32; }
static void m_out_fp32(opgraft_linear_args *a) { a->out_dtype = OPGRAFT_DTYPE_FP32; }
static void m_rows_9(opgraft_linear_args *a) { set_shape(a, 9, 5120, 2048); }
static void m_rows_neg(opgraft_linear_args *a) { a->rows = -1; }
static void m_k_12(opgraft_linear_args *a) { set_shape(a, 1, 5120, 12); }
static void m_k_0(opgraft_linear_args *a) { set_shape(a, 1, 5120, 0); }
static void m_k_huge(opgraft_linear_args *a) { set_shape(a, 1, 16, (1 << 20) + 8); }
static void m_n_0(opgraft_linear_args *a) { set_shape(a, 1, 0, 2048); }
static void m_x_col_stride(opgraft_linear_args *a) { a->x_stride[1] = 2; }
static void m_w_col_stride(opgraft_linear_args *a) { a->weight_stride[1] = 2; }
static void m_out_col_stride(opgraft_linear_args *a) { a->out_stride[1] = 2; }
static void m_w_rows_short(opgraft_linear_args *a) { a->weight_stride[0] = 2040; }
static void m_w_row_stride(opgraft_linear_args *a) { a->weight_stride[0] = 2052; }
static void m_x_rows_short(opgraft_linear_args *a) {
  set_shape(a, 2, 5120, 2048);
  a->x_stride[0] = 2040;
}
static void m_x_row_stride(opgraft_linear_args *a) {
  set_shape(a, 2, 5120, 2048);
  a->x_stride[0] = 2052;
}
static void m_out_rows_short(opgraft_linear_args *a) {
  set_shape(a, 2, 5120, 2048);
  a->out_stride[0] = 5119;
}
static void m_x_misaligned(opgraft_linear_args *a) { a->x = (const void *)0x10008; }
static void m_w_misaligned(opgraft_linear_args *a) { a->weight = (const void *)0x100004; }
static void m_out_odd(opgraft_linear_args *a) { a->out = (void *)0x300001; }
static void m_bias_odd(opgraft_linear_args *a) { a->bias = (const void *)0x200001; }
static void m_null_x(opgraft_linear_args *a) { a->x = NULL; }
static void m_null_out(opgraft_linear_args *a) { a->out = NULL; }
static void m_arch_75(opgraft_linear_args *a) { a->arch = 75; }
static void m_scale_on_bf16(opgraft_linear_args *a) { a->weight_scale = (const void *)0x400000; }
/* FP8 weights (from fp8_args) */
static void f_arch_80(opgraft_linear_args *a) { a->arch = 80; }
static void f_scale_bf16(opgraft_linear_args *a) { a->scale_dtype = OPGRAFT_DTYPE_BF16; }
static void f_block_n_8(opgraft_linear_args *a) { a->block_n = 8; }
static void f_block_k_32(opgraft_linear_args *a) { a->block_k = 32; }
static void f_k_not_blocks(opgraft_linear_args *a) {
  set_shape(a, 1, 5120, 2112); /* 16.5 blocks of 128 */
}
static void f_w_row_stride(opgraft_linear_args *a) { a->weight_stride[0] = 2056; }
static void f_scale_stride_neg(opgraft_linear_args *a) { a->weight_scale_stride[1] = -1; }
static void f_scale_null(opgraft_linear_args *a) { a->weight_scale = NULL; }
static void f_scale_misaligned(opgraft_linear_args *a) { a->weight_scale = (const void *)0x400002; }
static void f_out_fp8(opgraft_linear_args *a) { a->out_dtype = OPGRAFT_DTYPE_FP8_E4M3; }

static const refusal r_struct_size = {m_struct_size, "struct_size"};
static const refusal r_dtype_fp32 = {m_dtype_fp32, "dtype fp32 (the kernel takes bf16 and fp16)"};
static const refusal r_weight_fp16 = {m_weight_fp16, "dtype mismatch: x bf16, weight fp16, bias bf16, out bf16"};
static const refusal r_bias_fp32 = {m_bias_fp32, "dtype mismatch: x bf16, weight bf16, bias fp32"};
static const refusal r_out_fp32 = {m_out_fp32, "out fp32"};
static const refusal r_rows_9 = {m_rows_9, "rows 9 > 8 (kernel limit)"};
static const refusal r_rows_neg = {m_rows_neg, "negative row count"};
static const refusal r_k_12 = {m_k_12, "in_features 12 is not a positive multiple of 8"};
static const refusal r_k_0 = {m_k_0, "in_features 0 is not a positive multiple of 8"};
static const refusal r_k_huge = {m_k_huge, "in_features 1048584 >"};
static const refusal r_n_0 = {m_n_0, "out_features 0 outside"};
static const refusal r_x_col_stride = {m_x_col_stride, "not contiguous"};
static const refusal r_w_col_stride = {m_w_col_stride, "not contiguous"};
static const refusal r_out_col_stride = {m_out_col_stride, "not contiguous"};
static const refusal r_w_rows_short = {m_w_rows_short, "weight row stride 2040 < in_features 2048"};
static const refusal r_w_row_stride = {m_w_row_stride, "weight row stride 2052 is not a multiple of 16 bytes"};
static const refusal r_x_rows_short = {m_x_rows_short, "x row stride 2040 < in_features"};
static const refusal r_x_row_stride = {m_x_row_stride, "x row stride 2052 is not a multiple of 8 elements"};
static const refusal r_out_rows_short = {m_out_rows_short, "out row stride 5119 < out_features 5120"};
static const refusal r_x_misaligned = {m_x_misaligned, "16-byte aligned"};
static const refusal r_w_misaligned = {m_w_misaligned, "16-byte aligned"};
static const refusal r_out_odd = {m_out_odd, "misaligned"};
static const refusal r_bias_odd = {m_bias_odd, "misaligned"};
static const refusal r_null_x = {m_null_x, "NULL"};
static const refusal r_null_out = {m_null_out, "NULL"};
static const refusal r_arch_75 = {m_arch_75, "sm_75 is older than sm_80"};

static const refusal r_scale_on_bf16 = {m_scale_on_bf16, "weight scales or blocks given with bf16 weights"};
static const refusal f_arch_80_r = {f_arch_80, "FP8 weights on sm_80: the kernel needs sm_89"};
static const refusal f_scale_bf16_r = {f_scale_bf16, "FP8 weight scales of dtype bf16 (fp32 expected)"};
static const refusal f_block_n_8_r = {f_block_n_8, "FP8 weight blocks 8x128"};
static const refusal f_block_k_32_r = {f_block_k_32, "FP8 weight blocks 128x32"};
static const refusal f_k_not_blocks_r = {f_k_not_blocks, "with in_features 2112"};
static const refusal f_w_row_stride_r = {f_w_row_stride, "weight row stride 2056 is not a multiple of 16 bytes"};
static const refusal f_scale_stride_neg_r = {f_scale_stride_neg, "negative FP8 scale strides"};
static const refusal f_scale_null_r = {f_scale_null, "FP8 weight scales NULL or misaligned"};
static const refusal f_scale_misaligned_r = {f_scale_misaligned, "FP8 weight scales NULL or misaligned"};
static const refusal f_out_fp8_r = {f_out_fp8, "out fp8_e4m3"};

static void test_fp8_refusal(void **state) {
  const refusal *r = *state;
  opgraft_linear_args a = fp8_args();
  expect_ok(&a, "FP8 base case");
  r->mutate(&a);
  expect_refusal(&a, r->needle, r->needle);
}

static void test_fp8_valid(void **state) {
  opgraft_linear_args a = fp8_args();
  expect_ok(&a, "Qwen3-30B-A3B-FP8 qkv M=1");
  set_shape(&a, 8, 5120, 2048);
  expect_ok(&a, "M=8");
  a.arch = 89;
  set_shape(&a, 1, 5120, 2048);
  expect_refusal(&a, "rows 1 > linear.max_rows 0", "FP8 on sm_89: handed back (nothing measured there)");
  a.arch = 90;
  set_shape(&a, 1, 24576, 1536);
  expect_refusal(&a, "rows 1 > linear.max_rows 0", "DeepSeek-V3 q_b (37.7 MB): over 16 MiB, handed back");
  set_shape(&a, 8, 7168, 2048);
  expect_ok(&a, "DeepSeek-V3/tp8 o (14.7 MB) M=8");
  a = fp8_args();
  a.dtype = a.bias_dtype = a.out_dtype = OPGRAFT_DTYPE_FP16;
  expect_ok(&a, "fp16 x with FP8 weights");
  a = fp8_args();
  a.weight_scale_stride[0] = 1, a.weight_scale_stride[1] = 40; /* DeepGEMM-style transposed scales */
  a.block_n = 16, a.block_k = 64;
  expect_ok(&a, "transposed scales, 16x64 blocks");
  char key[96];
  opgraft__linear_shape_key(&a, key, sizeof key);
  assert_string_equal(key, "linear:fp8:N5120:K2048");
  og_linear_shape sh;
  assert_true(opgraft__linear_parse_shape(key, &sh));
  assert_true(sh.fp8);
  char buf[512];
  a = fp8_args();
  assert_int_equal(opgraft_linear_describe(&a, 90, buf, sizeof buf), OPGRAFT_OK);
  assert_string_equal(buf, "-DOG_DTYPE=1 -DOG_K=2048 -DOG_BN=128 -DOG_BK=128 -DOG_WARPS=8 -DOG_TILES=2 -DOG_U=1 "
                           "-DOG_MINB=2 -DOG_LOAD=4 -DOG_L2_FETCH=128 -DOG_PDL=0 grid=160 threads=256");
  /* The router gate [128, 2048]: 8 tiles of 16 rows < 132 SMs, 16 warps of one group each. */
  set_shape(&a, 1, 128, 2048);
  assert_int_equal(opgraft_linear_describe(&a, 90, buf, sizeof buf), OPGRAFT_OK);
  assert_non_null(strstr(buf, "-DOG_WARPS=16 -DOG_TILES=1 -DOG_U=1 -DOG_MINB=1 "));
  assert_non_null(strstr(buf, "grid=8 "));
  /* Clamps: three 16-row tiles spill, PDL has no L2 prefetch form here. */
  setenv("OPGRAFT_TUNE_LINEAR_TILES", "4", 1);
  setenv("OPGRAFT_TUNE_LINEAR_UNROLL", "8", 1);
  setenv("OPGRAFT_TUNE_LINEAR_PDL", "2", 1);
  opgraft_tune_reload();
  og_linear_cfg c;
  a = fp8_args();
  opgraft__linear_config(&a, 90, NULL, &c);
  assert_int_equal(c.tiles, 2);
  assert_int_equal(c.unroll, 1);
  assert_int_equal(c.pdl, 1);
  /* An FP8 plan runs only through its own entry point (and the reverse); checked before any GPU use. */
  assert_int_equal(opgraft_linear_plan_run_fp8(NULL, NULL, NULL, NULL, NULL, NULL, NULL), OPGRAFT_EINVAL);
}

static void test_refusal(void **state) {
  const refusal *r = *state;
  opgraft_linear_args a = valid_args();
  r->mutate(&a);
  expect_refusal(&a, r->needle, r->needle);
}

static void test_null_args(void **state) {
  char reason[128] = "";
  assert_int_equal(opgraft_linear_supports(NULL, reason, sizeof reason), OPGRAFT_EUNSUPPORTED);
  assert_true(reason[0] != 0);
}

static void test_max_rows_rule_and_tunable(void **state) {
  /* The rule: up to 8 rows on sm_90, one row on other GPUs (unmeasured there). */
  opgraft_linear_args a = valid_args();
  set_shape(&a, 8, 5120, 2048);
  expect_ok(&a, "M=8 on sm_90");
  a.arch = 80;
  set_shape(&a, 1, 5120, 2048);
  expect_ok(&a, "M=1 on sm_80");
  set_shape(&a, 2, 5120, 2048);
  expect_refusal(&a, "rows 2 > linear.max_rows 1", "M=2 on sm_80");
  /* The tunable moves the threshold; the kernel's own limit stays. */
  a.arch = 90;
  setenv("OPGRAFT_TUNE_LINEAR_MAX_ROWS", "4", 1);
  opgraft_tune_reload();
  set_shape(&a, 4, 5120, 2048);
  expect_ok(&a, "M=4 with linear.max_rows=4");
  set_shape(&a, 5, 5120, 2048);
  expect_refusal(&a, "rows 5 > linear.max_rows 4", "M=5 with linear.max_rows=4");
  setenv("OPGRAFT_TUNE_LINEAR_MAX_ROWS", "0", 1);
  opgraft_tune_reload();
  set_shape(&a, 1, 5120, 2048);
  expect_refusal(&a, "rows 1 > linear.max_rows 0", "linear.max_rows=0 hands every call back");
}

static void test_no_gpu_without_arch(void **state) {
  opgraft_linear_args a = valid_args();
  a.arch = 0;
  expect_refusal(&a, "no GPU", "arch 0 without a current CUDA context");
}

static void test_run_without_gpu(void **state) {
  opgraft_runtime_info info;
  assert_int_equal(opgraft_runtime_query(&info), OPGRAFT_OK);
  opgraft_linear_args a = valid_args();
  const int32_t st = opgraft_linear_run(&a, NULL);
  assert_int_not_equal(st, OPGRAFT_OK);
  if (!info.libcuda_path[0]) assert_int_equal(st, OPGRAFT_ENOLIB);
  else assert_int_equal(st, OPGRAFT_ENODEV);
  opgraft_linear_plan *plan = (opgraft_linear_plan *)0x1;
  char reason[256];
  assert_int_not_equal(opgraft_linear_plan_create(&a, &plan, reason, sizeof reason), OPGRAFT_OK);
  assert_null(plan);
  assert_int_equal(opgraft_linear_plan_create(&a, NULL, reason, sizeof reason), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_linear_plan_run(NULL, NULL, NULL, NULL, NULL, NULL), OPGRAFT_EINVAL);
  opgraft_linear_plan_destroy(NULL);
  /* A refused call is refused before anything is loaded. */
  a.rows = 9;
  assert_int_equal(opgraft_linear_run(&a, NULL), OPGRAFT_EUNSUPPORTED);
  assert_non_null(strstr(opgraft_last_error(), "rows 9 > 8"));
}

/* ---- the rule and the configuration ---- */

static og_linear_cfg config_of(int64_t M, int64_t N, int64_t K, int32_t arch) {
  opgraft_linear_args a = valid_args();
  set_shape(&a, M, N, K);
  og_linear_cfg c;
  opgraft__linear_config(&a, arch, NULL, &c);
  return c;
}

/* The shipped configuration at M=1 on sm_90 (the rule, or a baked row where one exists). */
static void expect_cfg_load(int64_t N, int64_t K, int warps, int tiles, int unroll, int min_blocks, unsigned grid,
                            int pdl, int load) {
  opgraft_linear_args a = valid_args();
  set_shape(&a, 1, N, K);
  og_linear_cfg c;
  opgraft__linear_config(&a, 90, NULL, &c);
  const unsigned g = opgraft__linear_grid(&a, &c);
  if (c.warps != warps || c.tiles != tiles || c.unroll != unroll || c.min_blocks != min_blocks || g != grid)
    fail_msg("[%lld, %lld] on sm_90: warps %d tiles %d unroll %d min blocks %d grid %u, expected %d %d %d %d %u",
             (long long)N, (long long)K, c.warps, c.tiles, c.unroll, c.min_blocks, g, warps, tiles, unroll,
             min_blocks, grid);
  assert_int_equal(c.load, load);
  assert_int_equal(c.l2_fetch, 128);
  assert_int_equal(c.pdl, pdl);
}
static void expect_cfg(int64_t N, int64_t K, int warps, int tiles, int unroll, int min_blocks, unsigned grid,
                       int pdl) {
  expect_cfg_load(N, K, warps, tiles, unroll, min_blocks, grid, pdl, 4);
}

static void test_rule_shapes(void **state) {
  /* Every block resident at once where 4 tiles a block allow it (132 SMs x 16 warps an SM). */
  /* Qwen3-30B-A3B qkv, 640 tiles over 264 blocks (PDL 1, the rule), and o (PDL 2 with the L2
   * prefetch: its tuned row, table.c) */
  expect_cfg(5120, 2048, 8, 3, 4, 2, 214, 1);
  expect_cfg(2048, 4096, 8, 1, 8, 2, 256, 2);
  expect_cfg(128, 2048, 16, 1, 4, 1, 16, 1);     /* Qwen3-30B-A3B router gate: 16 tiles < 132 SMs */
  expect_cfg(151936, 2048, 8, 2, 4, 2, 9496, 1); /* lm_head: many waves of 16-row blocks */
  expect_cfg(6144, 4096, 8, 3, 4, 2, 256, 1);    /* Llama-3-8B qkv */
  expect_cfg_load(1280, 8192, 8, 1, 8, 2, 160, 1, 1); /* Llama-3-70B/tp8 qkv: load form 1 (its tuned row) */
  expect_cfg(8192, 1024, 8, 3, 4, 2, 342, 0);    /* Llama-3-70B/tp8 o: 3 tiles, no PDL (its rows), 1.3 waves */
  expect_cfg(7, 72, 1, 1, 3, 16, 1, 1);          /* tiny: one warp, its 3 k-steps */
  expect_cfg(1, 8, 1, 1, 1, 16, 1, 1);
  /* Llama-3-70B/tp8 qkv from two rows: no PDL (its row). */
  assert_int_equal(config_of(2, 1280, 8192, 90).pdl, 0);
  /* The rule's values are what the tunables give where no row exists. */
  int64_t v = 0;
  char src[64];
  const opgraft_tune_query q = {"linear.tiles", 90, NULL, "linear:bf16:N5120:K2048", 1};
  assert_int_equal(opgraft_tune_get(&q, &v, src, sizeof src), OPGRAFT_OK);
  assert_int_equal(v, 3);
  assert_string_equal(src, "rule");
  /* Without a shape the fallbacks apply. */
  const opgraft_tune_query nos = {"linear.warps", 90, NULL, NULL, 1};
  assert_int_equal(opgraft_tune_get(&nos, &v, src, sizeof src), OPGRAFT_OK);
  assert_int_equal(v, 8);
  assert_string_equal(src, "default");
}

static void test_config_clamps(void **state) {
  /* Tunables set past what compiles without spills are clamped; values are those of config.c. */
  setenv("OPGRAFT_TUNE_LINEAR_TILES", "4", 1);
  setenv("OPGRAFT_TUNE_LINEAR_UNROLL", "8", 1);
  setenv("OPGRAFT_TUNE_LINEAR_WARPS", "16", 1);
  setenv("OPGRAFT_TUNE_LINEAR_MIN_BLOCKS", "4", 1);
  setenv("OPGRAFT_TUNE_LINEAR_L2_FETCH", "200", 1);
  setenv("OPGRAFT_TUNE_LINEAR_LOAD", "2", 1);
  setenv("OPGRAFT_TUNE_LINEAR_PDL", "1", 1);
  opgraft_tune_reload();
  og_linear_cfg c = config_of(1, 5120, 2048, 90);
  assert_int_equal(c.tiles, 4);
  assert_int_equal(c.unroll, 3);     /* (4 tiles + x) x 3 steps = 15 operands of 16 bytes */
  assert_int_equal(c.warps, 16);
  assert_int_equal(c.min_blocks, 1); /* 16 warps an SM */
  assert_int_equal(c.l2_fetch, 128);
  assert_int_equal(c.load, 4);
  assert_int_equal(c.pdl, 1);
  assert_int_equal(c.trigger, 0); /* off unless asked for */
  c = config_of(1, 5120, 2048, 80);
  assert_int_equal(c.pdl, 0); /* programmatic dependent launch needs sm_90 */
  setenv("OPGRAFT_TUNE_LINEAR_TRIGGER", "1", 1);
  opgraft_tune_reload();
  assert_int_equal(config_of(1, 5120, 2048, 80).trigger, 0);
  c = config_of(1, 5120, 2048, 90);
  assert_int_equal(c.trigger, 1);
  og_opts o;
  opgraft_linear_args a = valid_args();
  set_shape(&a, 1, 5120, 2048);
  assert_int_equal(opgraft__linear_options(&a, &c, &o), OPGRAFT_OK);
  int found = 0;
  for (int i = 0; i < o.n; ++i) found |= strcmp(o.ptr[i], "-DOG_TRIGGER=1") == 0;
  assert_true(found);
  unsetenv("OPGRAFT_TUNE_LINEAR_TRIGGER");
  opgraft_tune_reload();
  /* Qwen3-30B-A3B's qkv triggers by its H100 row (the early start with the prologue, v60), at 1..8
   * rows, and only there: not on the H200 or another shape. */
  {
    opgraft_linear_args q = valid_args();
    og_linear_cfg h;
    const char *h100 = "NVIDIA H100 80GB HBM3";
    for (int64_t M = 1; M <= 8; M += 7) {
      set_shape(&q, M, 5120, 2048);
      opgraft__linear_config(&q, 90, h100, &h);
      assert_int_equal(h.trigger, 1);
      opgraft__linear_config(&q, 90, "NVIDIA H200", &h);
      assert_int_equal(h.trigger, 0);
    }
    set_shape(&q, 1, 2048, 4096);
    opgraft__linear_config(&q, 90, h100, &h);
    assert_int_equal(h.trigger, 0);
  }
  /* linear.qk_epilogue (read when vLLM's graph is traced): 1 by the H100's row for Qwen3-30B-A3B's
   * qkv, at any row count; 0 where no row says otherwise; the environment sets it, within 0..1. */
  {
    int64_t v = -1;
    char src[64];
    opgraft_tune_query h = {"linear.qk_epilogue", 90, "NVIDIA H100 80GB HBM3", "linear:bf16:N5120:K2048", 1};
    assert_int_equal(opgraft_tune_get(&h, &v, src, sizeof src), OPGRAFT_OK);
    assert_int_equal(v, 1);
    h.tokens = 512;
    assert_int_equal(opgraft_tune_get(&h, &v, src, sizeof src), OPGRAFT_OK);
    assert_int_equal(v, 1);
    h.shape = "linear:fp16:N5120:K2048";
    assert_int_equal(opgraft_tune_get(&h, &v, src, sizeof src), OPGRAFT_OK);
    assert_int_equal(v, 0);
    opgraft_tune_query k = {"linear.qk_epilogue", 90, "NVIDIA H200", "linear:bf16:N5120:K2048", 1};
    assert_int_equal(opgraft_tune_get(&k, &v, src, sizeof src), OPGRAFT_OK);
    assert_int_equal(v, 0);
    setenv("OPGRAFT_TUNE_LINEAR_QK_EPILOGUE", "1", 1);
    opgraft_tune_reload();
    assert_int_equal(opgraft_tune_get(&k, &v, src, sizeof src), OPGRAFT_OK);
    assert_int_equal(v, 1);
    setenv("OPGRAFT_TUNE_LINEAR_QK_EPILOGUE", "2", 1); /* out of range: ignored */
    opgraft_tune_reload();
    assert_int_equal(opgraft_tune_get(&k, &v, src, sizeof src), OPGRAFT_OK);
    assert_int_equal(v, 0);
    unsetenv("OPGRAFT_TUNE_LINEAR_QK_EPILOGUE");
    opgraft_tune_reload();
  }
  /* A warp never gets more steps in flight than it has: K=64 is 2 k-steps, 16 warps. */
  c = config_of(1, 5120, 64, 90);
  assert_int_equal(c.unroll, 1);
  setenv("OPGRAFT_TUNE_LINEAR_LOAD", "1", 1);
  setenv("OPGRAFT_TUNE_LINEAR_L2_FETCH", "256", 1);
  opgraft_tune_reload();
  c = config_of(1, 5120, 2048, 90);
  assert_int_equal(c.load, 1);
  assert_int_equal(c.l2_fetch, 256);
}

static void test_describe(void **state) {
  opgraft_linear_args a = valid_args();
  char buf[512];
  assert_int_equal(opgraft_linear_describe(&a, 90, buf, sizeof buf), OPGRAFT_OK);
  assert_string_equal(buf, "-DOG_DTYPE=1 -DOG_K=2048 -DOG_WARPS=8 -DOG_TILES=3 -DOG_U=4 -DOG_MINB=2 -DOG_LOAD=4 "
                           "-DOG_L2_FETCH=128 -DOG_PDL=1 grid=214 threads=256");
  char small[40];
  assert_int_equal(opgraft_linear_describe(&a, 90, small, sizeof small), OPGRAFT_ERANGE);
  assert_int_equal(opgraft_linear_describe(NULL, 90, buf, sizeof buf), OPGRAFT_EINVAL);
  a.in_features = 12;
  assert_int_equal(opgraft_linear_describe(&a, 90, buf, sizeof buf), OPGRAFT_EUNSUPPORTED);
  assert_non_null(strstr(opgraft_last_error(), "multiple of 8"));
  /* fp16, and sm_80 (108 SMs: 640 tiles over 216 resident blocks, 3 tiles a block). */
  a = valid_args();
  a.dtype = a.weight_dtype = a.bias_dtype = a.out_dtype = OPGRAFT_DTYPE_FP16;
  assert_int_equal(opgraft_linear_describe(&a, 80, buf, sizeof buf), OPGRAFT_OK);
  assert_non_null(strstr(buf, "-DOG_DTYPE=2 "));
  assert_non_null(strstr(buf, "-DOG_TILES=3 "));
  assert_non_null(strstr(buf, "grid=214 "));
}

static void test_shape_key(void **state) {
  opgraft_linear_args a = valid_args();
  char key[96];
  opgraft__linear_shape_key(&a, key, sizeof key);
  assert_string_equal(key, "linear:bf16:N5120:K2048");
  og_linear_shape s;
  assert_true(opgraft__linear_parse_shape(key, &s));
  assert_int_equal(s.N, 5120);
  assert_int_equal(s.K, 2048);
  assert_false(opgraft__linear_parse_shape("moe:bf16:E128:H2048:I768:k8", &s));
  assert_false(opgraft__linear_parse_shape("linear:bf16:N0:K2048", &s));
  assert_false(opgraft__linear_parse_shape(NULL, &s));
}

/* ---- the add + RMSNorm form ---- */

static opgraft_linear_args norm_args(void) {
  opgraft_linear_args a = valid_args();
  a.norm_dtype = OPGRAFT_DTYPE_BF16, a.norm_eps = 1e-6f;
  a.residual = (const void *)0x500000, a.residual_out = (void *)0x600000, a.norm_weight = (const void *)0x700000;
  a.residual_stride[0] = a.residual_out_stride[0] = 2048, a.residual_stride[1] = a.residual_out_stride[1] = 1;
  return a;
}

static void n_fp8(opgraft_linear_args *a) {
  opgraft_linear_args f = fp8_args();
  f.residual = a->residual, f.residual_out = a->residual_out, f.norm_weight = a->norm_weight;
  f.norm_dtype = a->norm_dtype, f.residual_stride[1] = f.residual_out_stride[1] = 1;
  *a = f;
}
static void n_dtype(opgraft_linear_args *a) { a->norm_dtype = OPGRAFT_DTYPE_FP16; }
static void n_eps_nan(opgraft_linear_args *a) { a->norm_eps = NAN; }
static void n_eps_neg(opgraft_linear_args *a) { a->norm_eps = -1e-6f; }
static void n_col_stride(opgraft_linear_args *a) { a->residual_out_stride[1] = 2; }
static void n_row_stride(opgraft_linear_args *a) {
  set_shape(a, 2, 5120, 2048);
  a->residual_stride[0] = 2044;
}
static void n_misaligned(opgraft_linear_args *a) { a->norm_weight = (const void *)0x700008; }
static void n_normed_misaligned(opgraft_linear_args *a) {
  a->normed_out = (void *)0x800008, a->normed_out_stride[0] = 2048, a->normed_out_stride[1] = 1;
}
static void n_normed_stride(opgraft_linear_args *a) {
  set_shape(a, 2, 5120, 2048);
  a->normed_out = (void *)0x800000, a->normed_out_stride[0] = 2044, a->normed_out_stride[1] = 1;
}
static void n_normed_col(opgraft_linear_args *a) {
  a->normed_out = (void *)0x800000, a->normed_out_stride[0] = 2048, a->normed_out_stride[1] = 2;
}
static void n_normed_alone(opgraft_linear_args *a) {
  n_normed_col(a);
  a->normed_out_stride[1] = 1, a->residual = NULL, a->residual_out = NULL, a->norm_weight = NULL;
}
static void n_null_out(opgraft_linear_args *a) { a->residual_out = NULL; }
static void n_without_residual(opgraft_linear_args *a) { a->residual = NULL; }
static void n_smem(opgraft_linear_args *a) {
  set_shape(a, 8, 1280, 8192);
  a->residual_stride[0] = a->residual_out_stride[0] = 8192;
}

static const refusal n_fp8_r = {n_fp8, "add + RMSNorm with FP8 weights"};
static const refusal n_dtype_r = {n_dtype, "dtype mismatch: x bf16, norm fp16"};
static const refusal n_eps_nan_r = {n_eps_nan, "norm_eps nan outside 0..1"};
static const refusal n_eps_neg_r = {n_eps_neg, "outside 0..1"};
static const refusal n_col_stride_r = {n_col_stride, "residual's last dimension is not contiguous"};
static const refusal n_row_stride_r = {n_row_stride, "residual row strides 2044 / 2048"};
static const refusal n_misaligned_r = {n_misaligned, "residual, residual_out, norm_weight or normed_out not 16-byte aligned"};
static const refusal n_normed_misaligned_r = {n_normed_misaligned, "or normed_out not 16-byte aligned"};
static const refusal n_normed_stride_r = {n_normed_stride, "normed_out strides [2044, 1]"};
static const refusal n_normed_col_r = {n_normed_col, "normed_out strides [2048, 2]"};
static const refusal n_normed_alone_r = {n_normed_alone, "residual_out, norm_weight or normed_out given without a residual"};
static const refusal n_null_out_r = {n_null_out, "residual_out or norm_weight is NULL"};
static const refusal n_without_residual_r = {n_without_residual, "given without a residual"};
static const refusal n_smem_r = {n_smem, "add + RMSNorm of 8 rows of 8192: 131584 bytes of shared memory > 98304"};

static void test_norm_refusal(void **state) {
  const refusal *r = *state;
  opgraft_linear_args a = norm_args();
  expect_ok(&a, "add + RMSNorm base case");
  r->mutate(&a);
  expect_refusal(&a, r->needle, r->needle);
}

static void test_norm_valid(void **state) {
  opgraft_linear_args a = norm_args();
  for (int64_t M = 1; M <= 8; ++M) {
    set_shape(&a, M, 5120, 2048);
    expect_ok(&a, "add + RMSNorm M 1..8");
  }
  a.residual_stride[0] = 4096; /* a residual view of a wider buffer */
  expect_ok(&a, "padded residual rows");
  a = norm_args();
  a.norm_eps = 0.f;
  expect_ok(&a, "eps 0");
  a.normed_out = (void *)0x800000, a.normed_out_stride[0] = 4096, a.normed_out_stride[1] = 1;
  expect_ok(&a, "normed rows into a wider buffer");
  /* Its own kernel (name and option), the same tunables as the plain form. */
  char plain[512], fused[512];
  opgraft_linear_args p = valid_args();
  assert_int_equal(opgraft_linear_describe(&p, 90, plain, sizeof plain), OPGRAFT_OK);
  assert_int_equal(opgraft_linear_describe(&a, 90, fused, sizeof fused), OPGRAFT_OK);
  assert_null(strstr(plain, "-DOG_NORM"));
  assert_non_null(strstr(fused, "-DOG_NORM=1"));
  char name[64];
  opgraft__linear_fn_name(&a, name);
  assert_string_equal(name, "linear_norm_gemv_bf16");
  char k1[96], k2[96];
  opgraft__linear_shape_key(&a, k1, sizeof k1);
  opgraft__linear_shape_key(&p, k2, sizeof k2);
  assert_string_equal(k1, k2);
}

#define NORM_REFUSAL(r) {"refuse_norm_" #r, test_norm_refusal, NULL, reset_tunables, (void *)&n_##r##_r}
#define REFUSAL(r) {"refuse_" #r, test_refusal, NULL, reset_tunables, (void *)&r_##r}
#define FP8_REFUSAL(r) {"refuse_fp8_" #r, test_fp8_refusal, NULL, reset_tunables, (void *)&f_##r##_r}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_valid, reset_tunables),
      cmocka_unit_test_teardown(test_zero_rows, reset_tunables),
      REFUSAL(struct_size),
      REFUSAL(dtype_fp32),
      REFUSAL(weight_fp16),
      REFUSAL(bias_fp32),
      REFUSAL(out_fp32),
      REFUSAL(rows_9),
      REFUSAL(rows_neg),
      REFUSAL(k_12),
      REFUSAL(k_0),
      REFUSAL(k_huge),
      REFUSAL(n_0),
      REFUSAL(x_col_stride),
      REFUSAL(w_col_stride),
      REFUSAL(out_col_stride),
      REFUSAL(w_rows_short),
      REFUSAL(w_row_stride),
      REFUSAL(x_rows_short),
      REFUSAL(x_row_stride),
      REFUSAL(out_rows_short),
      REFUSAL(x_misaligned),
      REFUSAL(w_misaligned),
      REFUSAL(out_odd),
      REFUSAL(bias_odd),
      REFUSAL(null_x),
      REFUSAL(null_out),
      REFUSAL(arch_75),
      REFUSAL(scale_on_bf16),
      cmocka_unit_test_teardown(test_fp8_valid, reset_tunables),
      FP8_REFUSAL(arch_80),
      FP8_REFUSAL(scale_bf16),
      FP8_REFUSAL(block_n_8),
      FP8_REFUSAL(block_k_32),
      FP8_REFUSAL(k_not_blocks),
      FP8_REFUSAL(w_row_stride),
      FP8_REFUSAL(scale_stride_neg),
      FP8_REFUSAL(scale_null),
      FP8_REFUSAL(scale_misaligned),
      FP8_REFUSAL(out_fp8),
      cmocka_unit_test_teardown(test_norm_valid, reset_tunables),
      NORM_REFUSAL(fp8),
      NORM_REFUSAL(dtype),
      NORM_REFUSAL(eps_nan),
      NORM_REFUSAL(eps_neg),
      NORM_REFUSAL(col_stride),
      NORM_REFUSAL(row_stride),
      NORM_REFUSAL(misaligned),
      NORM_REFUSAL(normed_misaligned),
      NORM_REFUSAL(normed_stride),
      NORM_REFUSAL(normed_col),
      NORM_REFUSAL(normed_alone),
      NORM_REFUSAL(null_out),
      NORM_REFUSAL(without_residual),
      NORM_REFUSAL(smem),
      cmocka_unit_test(test_null_args),
      cmocka_unit_test_teardown(test_max_rows_rule_and_tunable, reset_tunables),
      cmocka_unit_test(test_no_gpu_without_arch),
      cmocka_unit_test(test_run_without_gpu),
      cmocka_unit_test_teardown(test_rule_shapes, reset_tunables),
      cmocka_unit_test_teardown(test_config_clamps, reset_tunables),
      cmocka_unit_test_teardown(test_describe, reset_tunables),
      cmocka_unit_test(test_shape_key),
      cmocka_unit_test_teardown(test_qk_epilogue, reset_tunables),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
