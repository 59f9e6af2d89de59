/* The MoE dispatch guard: which calls the kernel takes and why it refuses the others. No GPU and
 * no data are needed: the pointers are fake but aligned, and the guard never reads them. */
#include "og_test.h"
#include "moe/moe.h"

static char tmp[512];

static int setup(void **state) {
  og_tmpdir(tmp, sizeof tmp);
  /* Nothing here should write a cache file; if something does, it lands in tmp. */
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

/* A tunable's value from the environment (NULL: unset), read again. */
static void tune(const char *name, const char *value) {
  if (value) setenv(name, value, 1);
  else unsetenv(name);
  opgraft_tune_reload();
}

/* After each test: tunables back to their defaults. */
static int reset_tunables(void **state) {
  og_unsetenv_prefix("OPGRAFT_TUNE_");
  opgraft_tune_reload();
  return 0;
}

/* Contiguous strides for the given sizes. */
static void set_shape(opgraft_moe_args *a, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k) {
  a->num_tokens = T, a->hidden = H, a->inter = I, a->num_experts = E, a->top_k = k;
  a->hidden_states_stride[0] = H, a->hidden_states_stride[1] = 1;
  a->w13_stride[0] = 2 * I * H, a->w13_stride[1] = H, a->w13_stride[2] = 1;
  a->w2_stride[0] = H * I, a->w2_stride[1] = I, a->w2_stride[2] = 1;
  a->topk_weights_stride[0] = k, a->topk_weights_stride[1] = 1;
  a->topk_ids_stride[0] = k, a->topk_ids_stride[1] = 1;
  a->out_stride[0] = H, a->out_stride[1] = 1;
}

/* bf16, T=1, H=2048, I=768, E=128, k=8 (Qwen3-30B-A3B) on sm_90. */
static opgraft_moe_args valid_args(void) {
  opgraft_moe_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = OPGRAFT_DTYPE_BF16;
  a.activation = OPGRAFT_ACT_SILU;
  set_shape(&a, 1, 2048, 768, 128, 8);
  a.hidden_states = (const void *)0x10000;
  a.w13 = (const void *)0x100000;
  a.w2 = (const void *)0x200000;
  a.topk_weights = (const void *)0x300000;
  a.topk_weights_dtype = OPGRAFT_DTYPE_FP32;
  a.topk_ids = (const void *)0x310000;
  a.topk_ids_dtype = OPGRAFT_DTYPE_INT32;
  a.out = (void *)0x320000;
  a.arch = 90;
  return a;
}

static void expect_ok(const opgraft_moe_args *a, const char *what) {
  char reason[256] = "unset";
  const int32_t st = opgraft_moe_supports(a, reason, sizeof reason);
  if (st != OPGRAFT_OK) fail_msg("%s: %s, reason \"%s\"", what, opgraft_status_name(st), reason);
  assert_string_equal(reason, "");
}

static void expect_refusal(const opgraft_moe_args *a, const char *needle, const char *what) {
  char reason[256] = "unset";
  const int32_t st = opgraft_moe_supports(a, reason, sizeof reason);
  if (st != OPGRAFT_EUNSUPPORTED)
    fail_msg("%s: %s, expected OPGRAFT_EUNSUPPORTED (reason \"%s\")", what, opgraft_status_name(st), reason);
  if (!strstr(reason, needle)) fail_msg("%s: reason \"%s\" lacks \"%s\"", what, reason, needle);
  if (!strstr(opgraft_last_error(), reason))
    fail_msg("%s: last error \"%s\" lacks the reason", what, opgraft_last_error());
}

static void test_valid(void **state) {
  opgraft_moe_args a = valid_args();
  expect_ok(&a, "the valid call");
  /* A NULL reason buffer is allowed. */
  assert_int_equal(opgraft_moe_supports(&a, NULL, 0), OPGRAFT_OK);
  a.dtype = OPGRAFT_DTYPE_FP16;
  a.topk_ids_dtype = OPGRAFT_DTYPE_INT64;
  a.apply_router_weight_on_input = 1;
  expect_ok(&a, "fp16 with int64 ids and the weight on the input");
  a = valid_args();
  a.arch = 80;
  a.gpu_name = "NVIDIA A100-SXM4-80GB";
  expect_ok(&a, "sm_80");
  a = valid_args();
  a.hidden_states_stride[0] = 2048 + 64; /* rows of a larger buffer */
  expect_ok(&a, "a padded hidden row stride");
}

static void test_zero_tokens(void **state) {
  opgraft_moe_args a = valid_args();
  a.num_tokens = 0;
  expect_ok(&a, "T=0");
  a.hidden_states = a.w13 = a.w2 = a.topk_weights = a.topk_ids = NULL;
  a.out = NULL;
  expect_ok(&a, "T=0 with NULL pointers");
}

/* ---- one refusal per case ---- */

typedef struct refusal {
  void (*mutate)(opgraft_moe_args *a);
  const char *needle;
} refusal;

static void m_struct_size(opgraft_moe_args *a) { a->struct_size = (uint32_t)sizeof *a - 8; }
static void m_dtype_fp32(opgraft_moe_args *a) { a->dtype = OPGRAFT_DTYPE_FP32; }
static void m_gelu(opgraft_moe_args *a) { a->activation = OPGRAFT_ACT_GELU; }
static void m_expert_map(opgraft_moe_args *a) { a->expert_map = (const void *)0x400000; }
static void m_weights_bf16(opgraft_moe_args *a) { a->topk_weights_dtype = OPGRAFT_DTYPE_BF16; }
static void m_ids_fp16(opgraft_moe_args *a) { a->topk_ids_dtype = OPGRAFT_DTYPE_FP16; }
static void m_hidden_2064(opgraft_moe_args *a) { set_shape(a, 1, 2064, 768, 128, 8); }
static void m_inter_784(opgraft_moe_args *a) { set_shape(a, 1, 2048, 784, 128, 8); }
static void m_experts_0(opgraft_moe_args *a) { set_shape(a, 1, 2048, 768, 0, 8); }
static void m_topk_0(opgraft_moe_args *a) { set_shape(a, 1, 2048, 768, 128, 0); }
static void m_topk_17(opgraft_moe_args *a) { set_shape(a, 1, 2048, 768, 128, 17); }
static void m_topk_over_e(opgraft_moe_args *a) { set_shape(a, 1, 2048, 768, 4, 8); }
static void m_negative_t(opgraft_moe_args *a) { a->num_tokens = -1; }
static void m_hidden_stride2(opgraft_moe_args *a) { a->hidden_states_stride[1] = 2; }
static void m_w13_rows_short(opgraft_moe_args *a) { a->w13_stride[1] = 2048 - 32; }
static void m_w2_experts_short(opgraft_moe_args *a) { a->w2_stride[0] = 2048 * 768 - 8; }
/* 2 * I * stride wraps around in int64 to a small expert stride (found by fuzzing the guard). */
static void m_w13_stride_wraps(opgraft_moe_args *a) { a->w13_stride[1] = (int64_t)1 << 62; }
static void m_w2_stride_wraps(opgraft_moe_args *a) { a->w2_stride[1] = (int64_t)1 << 62; }
static void m_hidden_row_stride(opgraft_moe_args *a) { a->hidden_states_stride[0] = 2048 + 4; }
static void m_w13_row_stride(opgraft_moe_args *a) {
  a->w13_stride[1] = 2048 + 4;
  a->w13_stride[0] = 2 * 768 * a->w13_stride[1];
}
static void m_out_rows_short(opgraft_moe_args *a) { a->out_stride[0] = 2048 - 8; }
static void m_hidden_misaligned(opgraft_moe_args *a) { a->hidden_states = (const void *)0x10008; }
static void m_w2_misaligned(opgraft_moe_args *a) { a->w2 = (const void *)0x200004; }
static void m_out_odd(opgraft_moe_args *a) { a->out = (void *)0x320001; }
static void m_null_ids(opgraft_moe_args *a) { a->topk_ids = NULL; }
static void m_null_hidden(opgraft_moe_args *a) { a->hidden_states = NULL; }
static void m_arch_75(opgraft_moe_args *a) { a->arch = 75; }

static const refusal r_struct_size = {m_struct_size, "struct_size"};
static const refusal r_dtype_fp32 = {m_dtype_fp32, "dtype fp32"};
static const refusal r_gelu = {m_gelu, "activation 2"};
static const refusal r_expert_map = {m_expert_map, "expert_map"};
static const refusal r_weights_bf16 = {m_weights_bf16, "topk_weights dtype bf16"};
static const refusal r_ids_fp16 = {m_ids_fp16, "topk_ids dtype fp16"};
static const refusal r_hidden_2064 = {m_hidden_2064, "hidden size 2064"};
static const refusal r_inter_784 = {m_inter_784, "intermediate size 784"};
static const refusal r_experts_0 = {m_experts_0, "0 experts"};
static const refusal r_topk_0 = {m_topk_0, "top_k 0"};
static const refusal r_topk_17 = {m_topk_17, "top_k 17"};
static const refusal r_topk_over_e = {m_topk_over_e, "top_k 8 > 4 experts"};
static const refusal r_negative_t = {m_negative_t, "negative token count"};
static const refusal r_hidden_stride2 = {m_hidden_stride2, "not contiguous"};
static const refusal r_w13_rows_short = {m_w13_rows_short, "weight strides"};
static const refusal r_w2_experts_short = {m_w2_experts_short, "weight strides"};
static const refusal r_w13_stride_wraps = {m_w13_stride_wraps, "weight strides"};
static const refusal r_w2_stride_wraps = {m_w2_stride_wraps, "weight strides"};
static const refusal r_hidden_row_stride = {m_hidden_row_stride, "multiples of 16 bytes"};
static const refusal r_w13_row_stride = {m_w13_row_stride, "multiples of 16 bytes"};
static const refusal r_out_rows_short = {m_out_rows_short, "smaller than the rows"};
static const refusal r_hidden_misaligned = {m_hidden_misaligned, "16-byte aligned"};
static const refusal r_w2_misaligned = {m_w2_misaligned, "16-byte aligned"};
static const refusal r_out_odd = {m_out_odd, "misaligned"};
static const refusal r_null_ids = {m_null_ids, "NULL"};
static const refusal r_null_hidden = {m_null_hidden, "NULL"};
static const refusal r_arch_75 = {m_arch_75, "sm_75"};

static void test_refusal(void **state) {
  const refusal *r = *state;
  opgraft_moe_args a = valid_args();
  r->mutate(&a);
  expect_refusal(&a, r->needle, r->needle);
}

static void test_noncontiguous_last_dim_each_tensor(void **state) {
  for (int i = 0; i < 6; ++i) {
    opgraft_moe_args a = valid_args();
    int64_t *dims[6] = {&a.hidden_states_stride[1], &a.w13_stride[2], &a.w2_stride[2],
                        &a.topk_weights_stride[1], &a.topk_ids_stride[1], &a.out_stride[1]};
    *dims[i] = 2;
    char what[64];
    snprintf(what, sizeof what, "tensor %d with last stride 2", i);
    expect_refusal(&a, "not contiguous", what);
  }
}

static void test_null_args(void **state) {
  char reason[128] = "";
  assert_int_equal(opgraft_moe_supports(NULL, reason, sizeof reason), OPGRAFT_EUNSUPPORTED);
  assert_true(reason[0] != 0);
}

static void test_kernel_token_limit(void **state) {
  /* With moe.max_tokens at its maximum, T=64 passes and T=65 hits the kernel's own limit. */
  setenv("OPGRAFT_TUNE_MOE_MAX_TOKENS", "64", 1);
  opgraft_moe_args a = valid_args();
  a.num_tokens = 64;
  expect_ok(&a, "T=64 with moe.max_tokens=64");
  a.num_tokens = 65;
  expect_refusal(&a, "65 tokens > 64 (kernel limit)", "T=65");
}

static void test_max_tokens_tunable(void **state) {
  tune("OPGRAFT_TUNE_MOE_MAX_TOKENS", "4");
  opgraft_moe_args a = valid_args();
  a.num_tokens = 4;
  expect_ok(&a, "T=4 with moe.max_tokens=4");
  a.num_tokens = 5;
  expect_refusal(&a, "5 tokens > moe.max_tokens 4", "T=5 with moe.max_tokens=4");

  /* Unset again: the limit is whatever the tunable now resolves to for this call. */
  tune("OPGRAFT_TUNE_MOE_MAX_TOKENS", NULL);
  const opgraft_tune_query q = {"moe.max_tokens", 90, NULL, "moe:bf16:E128:H2048:I768:k8", 5};
  int64_t max_t = 0;
  assert_int_equal(opgraft_tune_get(&q, &max_t, NULL, 0), OPGRAFT_OK);
  assert_true(max_t != 4);
  if (max_t >= 5) expect_ok(&a, "T=5 with the default moe.max_tokens");
  else expect_refusal(&a, "moe.max_tokens", "T=5 with the default moe.max_tokens");
}

static void test_expert_map(void **state) {
  opgraft_moe_args a = valid_args(); /* this rank: 128 of 256 global experts */
  a.expert_map = (const void *)0x400000, a.expert_map_len = 256;
  expect_ok(&a, "expert_map with the shipped tunables");
  tune("OPGRAFT_TUNE_MOE_EXPERT_MAP", "0");
  expect_refusal(&a, "moe.expert_map is 0", "expert_map with moe.expert_map=0");
  tune("OPGRAFT_TUNE_MOE_EXPERT_MAP", "1");
  a.expert_map_len = 0;
  expect_refusal(&a, "expert_map of 0 global experts", "expert_map without a length");
  a.expert_map_len = 5000;
  expect_refusal(&a, "expert_map of 5000 global experts", "expert_map too long");
  a.expert_map_len = 256, a.expert_map = (const void *)0x400002;
  expect_refusal(&a, "expert_map misaligned", "expert_map misaligned");
}

static void test_no_gpu_without_arch(void **state) {
  /* arch 0 means the current device; there is no CUDA context in this process. */
  opgraft_moe_args a = valid_args();
  a.arch = 0;
  expect_refusal(&a, "no GPU", "arch 0 without a current CUDA context");
}

static void test_workspace_size(void **state) {
  opgraft_moe_args a = valid_args();
  size_t bytes = 1;
  assert_int_equal(opgraft_moe_workspace_size(&a, &bytes), OPGRAFT_OK);
  /* The activations [T*k, I] padded to 256 bytes, then 256 bytes for the fused kernel's grid
   * barrier counter. */
  assert_int_equal(bytes, 1 * 8 * 768 * 2 + 256); /* already a multiple of 256 */
  const int64_t cases[][3] = {{0, 8, 768}, {3, 3, 32}, {5, 2, 1536}, {64, 16, 2048}, {1, 1, 32}, {7, 3, 160}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
    set_shape(&a, cases[i][0], 2048, cases[i][2], 128, cases[i][1]);
    assert_int_equal(opgraft_moe_workspace_size(&a, &bytes), OPGRAFT_OK);
    const size_t raw = (size_t)(cases[i][0] * cases[i][1] * cases[i][2] * 2);
    const size_t want = (raw + 255) / 256 * 256 + 256;
    if (bytes != want) fail_msg("T=%lld k=%lld I=%lld: %zu bytes, expected %zu", (long long)cases[i][0],
                                (long long)cases[i][1], (long long)cases[i][2], bytes, want);
    assert_int_equal(bytes % 256, 0);
    assert_true(bytes >= raw + 256 && bytes < raw + 512);
  }
  /* OPGRAFT_TRACE=1: the per-block phase times after that, [3][blocks][8] u64 with blocks the
   * larger stage grid but at least 4096 (here T=7 k=3 I=160, H=2048: 4096). "0" is off. */
  setenv("OPGRAFT_TRACE", "1", 1);
  assert_int_equal(opgraft_moe_workspace_size(&a, &bytes), OPGRAFT_OK);
  assert_int_equal(bytes, (7 * 3 * 160 * 2 + 255) / 256 * 256 + 256 + 3 * 4096 * 64);
  set_shape(&a, 8, 2048, 768, 128, 8); /* 64 experts x 48 tiles = 3072 < 4096; Kimi-like below */
  assert_int_equal(opgraft_moe_workspace_size(&a, &bytes), OPGRAFT_OK);
  assert_int_equal(bytes, 8 * 8 * 768 * 2 + 256 + 3 * 4096 * 64);
  set_shape(&a, 16, 7168, 2048, 384, 8); /* 128 experts x 128 tiles */
  assert_int_equal(opgraft_moe_workspace_size(&a, &bytes), OPGRAFT_OK);
  assert_int_equal(bytes, 16 * 8 * 2048 * 2 + 256 + 3 * 16384 * 64);
  setenv("OPGRAFT_TRACE", "0", 1);
  assert_int_equal(opgraft_moe_workspace_size(&a, &bytes), OPGRAFT_OK);
  assert_int_equal(bytes, 16 * 8 * 2048 * 2 + 256);
  unsetenv("OPGRAFT_TRACE");
  assert_int_equal(opgraft_moe_workspace_size(NULL, &bytes), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_moe_workspace_size(&a, NULL), OPGRAFT_EINVAL);
  a.struct_size = 16;
  assert_int_equal(opgraft_moe_workspace_size(&a, &bytes), OPGRAFT_EINVAL);
}

static void test_run_without_gpu(void **state) {
  opgraft_runtime_info info;
  assert_int_equal(opgraft_runtime_query(&info), OPGRAFT_OK);
  opgraft_moe_args a = valid_args();
  opgraft__fail(OPGRAFT_OK, "%s", "");
  const int32_t st = opgraft_moe_run(&a, (void *)0x500000, 1 << 20, NULL);
  assert_int_not_equal(st, OPGRAFT_OK);
  assert_true(opgraft_last_error()[0] != 0);
  /* Without libcuda nothing else can be reached; with it, there is still no context here. */
  if (!info.libcuda_path[0]) assert_int_equal(st, OPGRAFT_ENOLIB);
  else assert_int_equal(st, OPGRAFT_ENODEV);

  /* Bad stage masks are refused before anything is loaded. */
  assert_int_equal(opgraft_moe_run_stages(&a, (void *)0x500000, 1 << 20, NULL, 0), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_moe_run_stages(&a, (void *)0x500000, 1 << 20, NULL, 4), OPGRAFT_EINVAL);
}

/* ---- FP8 weights ---- */

/* Qwen3-30B-A3B's FP8 checkpoint as vLLM hands it to TritonExperts.apply: e4m3 weights and
 * activations, 128x128 block scales, per-token activation groups of 128 (contiguous scales). */
static opgraft_moe_args fp8_args(int32_t layout) {
  opgraft_moe_args a = valid_args();
  a.weight_dtype = OPGRAFT_DTYPE_FP8_E4M3, a.scale_layout = layout, a.scale_dtype = OPGRAFT_DTYPE_FP32;
  a.hidden_scale = (const void *)0x330000, a.w13_scale = (const void *)0x340000, a.w2_scale = (const void *)0x350000;
  if (layout == OPGRAFT_MOE_SCALE_BLOCK) {
    a.block_n = a.block_k = 128;
    a.hidden_scale_stride[0] = 2048 / 128, a.hidden_scale_stride[1] = 1;
    a.w13_scale_stride[0] = 12 * 16, a.w13_scale_stride[1] = 16, a.w13_scale_stride[2] = 1;
    a.w2_scale_stride[0] = 16 * 6, a.w2_scale_stride[1] = 6, a.w2_scale_stride[2] = 1;
  } else { /* one scale per expert: [E] */
    a.w13_scale_stride[0] = 1, a.w2_scale_stride[0] = 1;
  }
  return a;
}

/* The rule takes FP8 at one token on sm_90 only (measured as a win there); the guard's other
 * checks are tested with moe.fp8 set to 1. */
static void fp8_on(void) {
  tune("OPGRAFT_TUNE_MOE_FP8", "1");
}

static void test_fp8_valid(void **state) {
  fp8_on();
  opgraft_moe_args a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  expect_ok(&a, "fp8 block scales");
  a.dtype = OPGRAFT_DTYPE_FP16;
  expect_ok(&a, "fp8 block scales, fp16 out");
  a = fp8_args(OPGRAFT_MOE_SCALE_TENSOR);
  expect_ok(&a, "fp8 per-tensor scales");
  a.w13_scale_stride[0] = 2, a.w13_scale_stride[1] = 1; /* [E, 2]: a scale per half */
  expect_ok(&a, "fp8 per-tensor scales per half");
  a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  a.block_n = a.block_k = 64; /* vLLM 0.33's refined blocks */
  expect_ok(&a, "fp8 64x64 blocks");
  a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  a.w13_scale_stride[1] = 1, a.w13_scale_stride[2] = 12; /* DeepGEMM-style transposed scales */
  a.hidden_scale_stride[0] = 1, a.hidden_scale_stride[1] = 1;
  expect_ok(&a, "fp8 transposed scales");
  a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  set_shape(&a, 1, 2048, 768, 128, 8);
  a.hidden_states_stride[0] = 2048 + 16;
  expect_ok(&a, "fp8 with a padded hidden row");
  a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  a.num_tokens = 0, a.hidden_scale = a.w13_scale = a.w2_scale = NULL;
  expect_ok(&a, "fp8 T=0 without scales");
}

static void test_fp8_archs_and_switches(void **state) {
  opgraft_moe_args a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  a.arch = 80;
  expect_refusal(&a, "the FP8 kernels need sm_89", "fp8 on sm_80");
  a.arch = 89; /* compiled and tested on CPU, never measured: handed back by the rule */
  expect_refusal(&a, "moe.fp8 is 0 on sm_89 at T=1", "fp8 on sm_89");
  tune("OPGRAFT_TUNE_MOE_FP8", "1");
  expect_ok(&a, "fp8 on sm_89 with moe.fp8=1");
  a.arch = 90;
  tune("OPGRAFT_TUNE_MOE_FP8", "0");
  expect_refusal(&a, "moe.fp8 is 0 on sm_90", "fp8 with moe.fp8=0");
  tune("OPGRAFT_TUNE_MOE_FP8", NULL);
  expect_ok(&a, "fp8 on sm_90 at one token by the rule");
  set_shape(&a, 2, 2048, 768, 128, 8);
  expect_ok(&a, "fp8 block scales on sm_90 at two tokens by the rule");
  set_shape(&a, 4, 2048, 768, 128, 8);
  expect_ok(&a, "fp8 block scales on sm_90 at four tokens by Qwen3-30B-A3B's row");
  set_shape(&a, 3, 2048, 384, 128, 8); /* a shape without table rows */
  expect_refusal(&a, "moe.fp8 is 0 on sm_90 at T=3", "fp8 on sm_90 at three tokens by the rule");
  fp8_on();
  expect_ok(&a, "fp8 on sm_90 with moe.fp8=1");
  setenv("OPGRAFT_MOE_FP8", " Off ", 1); /* read as the Python layer reads a switch */
  expect_refusal(&a, "OPGRAFT_MOE_FP8 is off", "fp8 with OPGRAFT_MOE_FP8=' Off '");
  setenv("OPGRAFT_MOE_FP8", "false", 1);
  expect_refusal(&a, "OPGRAFT_MOE_FP8 is off", "fp8 with OPGRAFT_MOE_FP8=false");
  setenv("OPGRAFT_MOE_FP8", "0", 1);
  expect_refusal(&a, "OPGRAFT_MOE_FP8 is off", "fp8 with OPGRAFT_MOE_FP8=0");
  opgraft_moe_args b = valid_args(); /* bf16 calls do not look at the FP8 switches */
  expect_ok(&b, "bf16 with OPGRAFT_MOE_FP8=0");
  setenv("OPGRAFT_MOE_FP8", "1", 1);
  expect_ok(&a, "fp8 with OPGRAFT_MOE_FP8=1");
  unsetenv("OPGRAFT_MOE_FP8");
}

static void test_fp8_refusals(void **state) {
  fp8_on();
  static const struct {
    int field;
    const char *needle;
  } cases[] = {
      {0, "weights dtype uint8"},        /* packed 4-bit weights (MXFP4, NVFP4, INT4) */
      {1, "weights dtype int32"},        /* GPTQ/AWQ-style packed weights */
      {2, "scale layout 3"},             /* an unknown layout */
      {3, "scales of dtype bf16"},       /* scales in another dtype */
      {4, "apply_router_weight_on_input"},
      {5, "FP8 weight blocks 128x16"},   /* blocks finer than the kernels' k-step */
      {6, "FP8 weight blocks 100x128"},
      {7, "negative FP8 scale strides"},
      {8, "FP8 row strides"},            /* rows not of whole 16-byte chunks */
      {9, "an FP8 scale pointer is NULL"},
      {10, "FP8 scales misaligned"},
      {11, "scale layout 1 with unquantized weights"},
      {12, "activation 2"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
    opgraft_moe_args a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
    switch (cases[i].field) {
    case 0: a.weight_dtype = OPGRAFT_DTYPE_UINT8; break;
    case 1: a.weight_dtype = OPGRAFT_DTYPE_INT32; break;
    case 2: a.scale_layout = 3; break;
    case 3: a.scale_dtype = OPGRAFT_DTYPE_BF16; break;
    case 4: a.apply_router_weight_on_input = 1; break;
    case 5: a.block_k = 16; break;
    case 6: a.block_n = 100; break;
    case 7: a.w2_scale_stride[2] = -1; break;
    case 8: a.hidden_states_stride[0] = 2048 + 8; break;
    case 9: a.w13_scale = NULL; break;
    case 10: a.hidden_scale = (const void *)0x330002; break;
    case 11: a.weight_dtype = 0; break;
    case 12: a.activation = OPGRAFT_ACT_GELU; break;
    }
    expect_refusal(&a, cases[i].needle, cases[i].needle);
  }
}

/* FP8 weights with 16-bit hidden states (ABI 9): gate_up quantizes them; block scales only. */
static void test_fp8_hidden_states_quantized_in_the_kernel(void **state) {
  fp8_on();
  opgraft_moe_args a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  a.hidden_dtype = a.dtype, a.hidden_scale = NULL;
  memset(a.hidden_scale_stride, 0, sizeof a.hidden_scale_stride);
  expect_ok(&a, "the rule: on at one token on sm_90");
  set_shape(&a, 4, 2048, 768, 128, 8);
  expect_refusal(&a, "moe.fp8_quantize is 0 on sm_90 at T=4", "the rule: up to two tokens (the routing seam's calls)");
  set_shape(&a, 1, 2048, 768, 128, 8);
  a.arch = 89;
  expect_refusal(&a, "moe.fp8_quantize is 0 on sm_89 at T=1", "the rule: sm_90 only (measured there)");
  a.arch = 90;
  tune("OPGRAFT_TUNE_MOE_FP8_QUANTIZE", "1");
  expect_ok(&a, "bf16 hidden states, no hidden_scale");
  a.hidden_states_stride[0] = 2048 + 8; /* 16-byte rows of bf16 */
  expect_ok(&a, "bf16 hidden states with a padded row");
  a.hidden_dtype = OPGRAFT_DTYPE_FP16;
  expect_refusal(&a, "hidden states of dtype fp16", "hidden states neither e4m3 nor the output's dtype");
  a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  a.hidden_dtype = OPGRAFT_DTYPE_FP8_E4M3;
  expect_ok(&a, "hidden_dtype e4m3 is the default form");
  a.hidden_scale = NULL;
  expect_refusal(&a, "an FP8 scale pointer is NULL", "e4m3 hidden states without hidden_scale");
  a = fp8_args(OPGRAFT_MOE_SCALE_TENSOR);
  a.hidden_dtype = a.dtype, a.hidden_scale = NULL;
  memset(a.hidden_scale_stride, 0, sizeof a.hidden_scale_stride);
  expect_ok(&a, "per-tensor scales, bf16 hidden states (1 x 128 groups)");
  set_shape(&a, 1, 2048 + 64, 768, 128, 8);
  expect_refusal(&a, "H 2112 not a multiple of the quantization group 128", "per-tensor, H % 128");
  a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  a.hidden_dtype = a.dtype, a.hidden_scale = NULL, a.block_k = 256;
  expect_refusal(&a, "block_k 256 (at most 128)", "block_k 256");
  a.block_k = 96; /* 2048 is not a multiple of 96 */
  expect_refusal(&a, "H 2048 not a multiple of block_k 96", "H % block_k");
  a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  a.hidden_dtype = a.dtype, a.hidden_scale = NULL;
  tune("OPGRAFT_TUNE_MOE_FP8_QUANTIZE", "0");
  expect_refusal(&a, "moe.fp8_quantize is 0", "the switch");
  tune("OPGRAFT_TUNE_MOE_FP8_QUANTIZE", "1");
  a.arch = 89;
  expect_ok(&a, "sm_89 with the switch on");
  a.arch = 90, a.routing = OPGRAFT_MOE_ROUTING_SOFTMAX_RENORM, a.router_logits = (const void *)0x600000;
  a.router_logits_stride[0] = 128, a.router_logits_stride[1] = 1;
  expect_ok(&a, "routed, bf16 hidden states");
  a.scale_dtype = OPGRAFT_DTYPE_BF16; /* a routed call runs the FP8 checks too */
  expect_refusal(&a, "scales of dtype bf16", "routed FP8 with bf16 scales");
}

static void test_fp8_tokens_and_expert_map(void **state) {
  fp8_on();
  opgraft_moe_args a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  a.num_tokens = 8;
  expect_ok(&a, "fp8 T=8");
  a.num_tokens = 9; /* the rule's moe.max_tokens 8 on sm_90 holds for the FP8 shape key too */
  expect_refusal(&a, "9 tokens > moe.max_tokens 8", "fp8 T=9");
  tune("OPGRAFT_TUNE_MOE_MAX_TOKENS", "64");
  a.num_tokens = 64;
  expect_ok(&a, "fp8 T=64 with moe.max_tokens=64");
  /* DeepSeek-V3 at EP 64: 4 local experts, top-8, an expert_map of 256 global experts */
  a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  set_shape(&a, 2, 7168, 2048, 4, 8);
  a.hidden_scale_stride[0] = 56, a.hidden_scale_stride[1] = 1;
  a.w13_scale_stride[0] = 32 * 56, a.w13_scale_stride[1] = 56, a.w13_scale_stride[2] = 1;
  a.w2_scale_stride[0] = 56 * 16, a.w2_scale_stride[1] = 16, a.w2_scale_stride[2] = 1;
  expect_refusal(&a, "top_k 8 > 4 experts", "fp8 k > E without a map");
  a.expert_map = (const void *)0x400000, a.expert_map_len = 256;
  expect_ok(&a, "fp8 k > E with an expert_map");
  opgraft_moe_args b = valid_args();
  set_shape(&b, 2, 7168, 2048, 4, 8);
  b.expert_map = (const void *)0x400000, b.expert_map_len = 256;
  expect_ok(&b, "bf16 k > E with an expert_map");
}

/* The value a tunable query resolves to (rows, then the op's rule), against what is expected. */
static void expect_tunable(const opgraft_tune_query *q, int64_t want) {
  int64_t v = -1;
  char src[64];
  assert_int_equal(opgraft_tune_get(q, &v, src, sizeof src), OPGRAFT_OK);
  if (v != want)
    fail_msg("%s for %s sm_%d%s%s T=%d: %lld (%s), expected %lld", q->key, q->shape, q->arch, q->gpu ? " on " : "",
             q->gpu ? q->gpu : "", q->tokens, (long long)v, src, (long long)want);
}

static void test_fp8_shape_key_rules_workspace(void **state) {
  opgraft_moe_args a = fp8_args(OPGRAFT_MOE_SCALE_BLOCK);
  char key[128];
  opgraft__moe_shape_key(&a, key, sizeof key);
  assert_string_equal(key, "moe:fp8block:E128:H2048:I768:k8");
  a = fp8_args(OPGRAFT_MOE_SCALE_TENSOR);
  opgraft__moe_shape_key(&a, key, sizeof key);
  assert_string_equal(key, "moe:fp8tensor:E128:H2048:I768:k8");
  og_moe_shape sh;
  assert_true(opgraft__moe_parse_shape(key, &sh) && sh.fp8 && sh.E == 128 && sh.k == 8);
  assert_true(opgraft__moe_parse_shape("moe:bf16:E8:H4096:I14336:k2", &sh) && !sh.fp8);
  /* The rule: FP8 at one token on sm_90, two with block scales (measured as wins there), the rows
   * of Qwen3-30B-A3B, Kimi-K2/tp8 (3..8) and Qwen3-235B-A22B (3..5); gate_up's warps twice bf16's;
   * routing by slot up to 32 slots. */
  const struct {
    const char *key, *shape;
    int32_t arch, tokens;
    int64_t want;
  } rules[] = {
      {"moe.fp8", "moe:fp8block:E128:H2048:I768:k8", 90, 1, 1},
      {"moe.fp8", "moe:fp8block:E128:H2048:I768:k8", 90, 2, 1},
      {"moe.fp8", "moe:fp8block:E128:H2048:I768:k8", 90, 3, 1},
      {"moe.fp8", "moe:fp8block:E128:H2048:I768:k8", 90, 8, 1},  /* Qwen3-30B-A3B's row, table.c */
      {"moe.fp8", "moe:fp8block:E128:H2048:I768:k8", 90, 9, 0},
      {"moe.fp8", "moe:fp8block:E256:H7168:I256:k8", 90, 8, 1},  /* DeepSeek-V3/tp8's row */
      {"moe.fp8", "moe:fp8block:E256:H7168:I256:k8", 90, 9, 0},
      {"moe.fp8", "moe:fp8block:E384:H7168:I256:k8", 90, 2, 1},  /* Kimi-K2/tp8: the rule, */
      {"moe.fp8", "moe:fp8block:E384:H7168:I256:k8", 90, 3, 1},  /* then its row */
      {"moe.fp8", "moe:fp8block:E384:H7168:I256:k8", 90, 9, 0},
      {"moe.fp8", "moe:fp8block:E128:H4096:I1536:k8", 90, 5, 1},  /* Qwen3-235B-A22B's row: 3..5 */
      {"moe.fp8", "moe:fp8block:E128:H4096:I1536:k8", 90, 6, 0},
      {"moe.fp8_quantize", "moe:fp8block:E128:H4096:I1536:k8", 90, 1, 1},
      {"moe.fp8_quantize", "moe:fp8block:E128:H4096:I1536:k8", 90, 2, 0},  /* its row: loses there */
      {"moe.fp8_quantize", "moe:fp8block:E128:H2048:I768:k8", 90, 2, 1},
      {"moe.gate_up.warps", "moe:fp8block:E128:H4096:I1536:k8", 90, 4, 2},
      {"moe.fp8", "moe:fp8tensor:E8:H4096:I6400:k2", 90, 2, 1},  /* per-tensor: the rule, */
      {"moe.fp8", "moe:fp8tensor:E8:H4096:I6400:k2", 90, 3, 0},
      {"moe.fp8_quantize", "moe:fp8tensor:E8:H4096:I6400:k2", 90, 2, 1},
      {"moe.fp8_quantize", "moe:fp8tensor:E8:H4096:I14336:k2", 90, 3, 0},
      {"moe.fp8_quantize", "moe:fp8tensor:E8:H4096:I14336:k2", 89, 1, 0},
      {"moe.fp8", "moe:fp8block:E128:H2048:I768:k8", 89, 1, 0},
      {"moe.fp8", "moe:fp8tensor:E8:H4096:I6400:k2", 90, 1, 1},
      {"moe.fp8", "moe:fp8tensor:E8:H4096:I6400:k2", 90, 4, 0},
      {"moe.fp8", "moe:fp8tensor:E8:H4096:I14336:k2", 90, 2, 1},  /* then Mixtral-8x7B's rows */
      {"moe.fp8", "moe:fp8tensor:E8:H4096:I14336:k2", 90, 8, 1},
      {"moe.fp8", "moe:fp8tensor:E8:H4096:I14336:k2", 90, 9, 0},
      {"moe.gate_up.warps", "moe:fp8tensor:E8:H4096:I14336:k2", 90, 1, 4},
      {"moe.gate_up.fp8_rows", "moe:fp8tensor:E8:H4096:I14336:k2", 90, 1, 32},
      {"moe.gate_up.fp8_rows", "moe:fp8tensor:E8:H4096:I14336:k2", 90, 2, 16},
      {"moe.gate_up.warps", "moe:fp8tensor:E8:H4096:I14336:k2", 90, 8, 1},
      {"moe.gate_up.warps", "moe:fp8tensor:E8:H4096:I6400:k2", 90, 8, 2},
      {"moe.gate_up.warps", "moe:fp8tensor:E8:H4096:I6400:k2", 90, 2, 4},
      {"moe.pdl", "moe:fp8tensor:E8:H4096:I6400:k2", 90, 2, 1},
      {"moe.pdl", "moe:fp8tensor:E8:H4096:I6400:k2", 90, 3, 0},
      {"moe.pdl", "moe:fp8tensor:E8:H4096:I6400:k2", 80, 1, 0},
      {"moe.load", "moe:fp8block:E384:H7168:I2048:k8", 90, 1, 4},
      {"moe.load", "moe:fp8block:E384:H7168:I2048:k8", 90, 2, 1},
      {"moe.gate_up.warps", "moe:fp8block:E128:H2048:I384:k8", 90, 1, 4},
      {"moe.gate_up.warps", "moe:bf16:E128:H2048:I768:k8", 90, 1, 4},
      {"moe.gate_up.warps", "moe:fp8block:E384:H7168:I2048:k8", 90, 1, 8},
      {"moe.gate_up.unroll", "moe:fp8block:E384:H7168:I2048:k8", 90, 1, 8},
      {"moe.down.unroll", "moe:fp8tensor:E8:H4096:I14336:k2", 90, 1, 8},
      {"moe.gate_up.slot_routing", "moe:fp8block:E128:H2048:I768:k8", 90, 1, 1},
      {"moe.gate_up.slot_routing", "moe:fp8block:E128:H2048:I768:k8", 90, 5, 0},
      {"moe.down.warp_routing", "moe:fp8tensor:E8:H4096:I14336:k2", 90, 16, 1},
      {"moe.max_tokens", "moe:fp8block:E128:H2048:I768:k8", 90, 9, 8},
      {"moe.route", "moe:fp8block:E128:H2048:I768:k8", 90, 2, 1},
      {"moe.route", "moe:fp8block:E128:H2048:I768:k8", 90, 3, 0},
      {"moe.route", "moe:bf16:E128:H2048:I768:k8", 90, 4, 1},
  };
  for (size_t i = 0; i < sizeof rules / sizeof *rules; ++i) {
    const opgraft_tune_query q = {rules[i].key, rules[i].arch, NULL, rules[i].shape, rules[i].tokens};
    expect_tunable(&q, rules[i].want);
  }
  /* On an H100 the rule takes block scales up to eight tokens; per-tensor and other GPUs as above. */
  const struct {
    const char *gpu, *shape;
    int32_t tokens;
    int64_t want;
  } h100[] = {
      {"NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H4096:I768:k8", 3, 1},
      {"NVIDIA H100 PCIe", "moe:fp8block:E128:H4096:I768:k8", 8, 1},
      {"NVIDIA H100 80GB HBM3", "moe:fp8block:E128:H4096:I768:k8", 9, 0},
      {"NVIDIA H100 80GB HBM3", "moe:fp8tensor:E8:H4096:I6400:k2", 3, 0},
      {"NVIDIA H200", "moe:fp8block:E128:H4096:I768:k8", 3, 0},
      {"NVIDIA H20", "moe:fp8block:E128:H4096:I768:k8", 3, 0},
  };
  for (size_t i = 0; i < sizeof h100 / sizeof *h100; ++i) {
    const opgraft_tune_query q = {"moe.fp8", 90, h100[i].gpu, h100[i].shape, h100[i].tokens};
    expect_tunable(&q, h100[i].want);
  }
  /* Workspace: act [T*k, I] in f16, padded, then a scale per slot and 16 rows, padded, then the
   * counter's 256 bytes. */
  const int64_t cases[][3] = {{1, 8, 768}, {3, 3, 160}, {64, 8, 2048}, {5, 2, 96}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
    set_shape(&a, cases[i][0], 2048, cases[i][2], 128, cases[i][1]);
    size_t bytes = 0;
    assert_int_equal(opgraft_moe_workspace_size(&a, &bytes), OPGRAFT_OK);
    const size_t slots = (size_t)(cases[i][0] * cases[i][1]);
    const size_t want = (slots * (size_t)cases[i][2] * 2 + 255) / 256 * 256 +
                        (slots * (size_t)(cases[i][2] / 16) * 4 + 255) / 256 * 256 + 256;
    if (bytes != want) fail_msg("fp8 workspace T=%lld k=%lld I=%lld: %zu, expected %zu", (long long)cases[i][0],
                                (long long)cases[i][1], (long long)cases[i][2], bytes, want);
  }
}

#define REFUSAL(r) {"refuse_" #r, test_refusal, NULL, reset_tunables, (void *)&r_##r}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_valid, reset_tunables),
      cmocka_unit_test_teardown(test_zero_tokens, reset_tunables),
      REFUSAL(struct_size),
      REFUSAL(dtype_fp32),
      REFUSAL(gelu),
      REFUSAL(expert_map),
      REFUSAL(weights_bf16),
      REFUSAL(ids_fp16),
      REFUSAL(hidden_2064),
      REFUSAL(inter_784),
      REFUSAL(experts_0),
      REFUSAL(topk_0),
      REFUSAL(topk_17),
      REFUSAL(topk_over_e),
      REFUSAL(negative_t),
      REFUSAL(hidden_stride2),
      REFUSAL(w13_rows_short),
      REFUSAL(w2_experts_short),
      REFUSAL(w13_stride_wraps),
      REFUSAL(w2_stride_wraps),
      REFUSAL(hidden_row_stride),
      REFUSAL(w13_row_stride),
      REFUSAL(out_rows_short),
      REFUSAL(hidden_misaligned),
      REFUSAL(w2_misaligned),
      REFUSAL(out_odd),
      REFUSAL(null_ids),
      REFUSAL(null_hidden),
      REFUSAL(arch_75),
      cmocka_unit_test_teardown(test_noncontiguous_last_dim_each_tensor, reset_tunables),
      cmocka_unit_test(test_null_args),
      cmocka_unit_test_teardown(test_kernel_token_limit, reset_tunables),
      cmocka_unit_test_teardown(test_max_tokens_tunable, reset_tunables),
      cmocka_unit_test_teardown(test_expert_map, reset_tunables),
      cmocka_unit_test(test_no_gpu_without_arch),
      cmocka_unit_test(test_workspace_size),
      cmocka_unit_test(test_run_without_gpu),
      cmocka_unit_test_teardown(test_fp8_valid, reset_tunables),
      cmocka_unit_test_teardown(test_fp8_archs_and_switches, reset_tunables),
      cmocka_unit_test_teardown(test_fp8_refusals, reset_tunables),
      cmocka_unit_test_teardown(test_fp8_hidden_states_quantized_in_the_kernel, reset_tunables),
      cmocka_unit_test_teardown(test_fp8_tokens_and_expert_map, reset_tunables),
      cmocka_unit_test_teardown(test_fp8_shape_key_rules_workspace, reset_tunables),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
