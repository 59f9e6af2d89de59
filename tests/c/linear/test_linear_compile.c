/* Every linear kernel variant that a shipped or tunable configuration can select compiles with
 * NVRTC, for sm_80 and sm_90 (FP8 weights: sm_89 and sm_90; the q/k epilogue: sm_90), without register spills. The
 * configurations are resolved first (the rule at the projection shapes of the presets and dense
 * models, then the tuner's candidates over the keys that change registers or code), then compiled
 * as og_compile_jobs.h does. */
#include "og_compile_jobs.h"
#include "linear/linear.h"

typedef struct shape {
  const char *name;
  int64_t N, K;
} shape;

/* [out_features, in_features] of the projections vLLM's unquantized linear layers run (merged
 * qkv, o, router gate, lm_head, dense gate_up and down), from each model's config.json. */
static const shape shapes[] = {
    {"Qwen3-30B-A3B qkv", 5120, 2048},     {"Qwen3-30B-A3B o", 2048, 4096},
    {"Qwen3-30B-A3B gate", 128, 2048},     {"Qwen3-30B-A3B lm_head", 151936, 2048},
    {"Qwen3-235B-A22B qkv", 9216, 4096},   {"Qwen3-235B-A22B o", 4096, 8192},
    {"Qwen3-235B-A22B gate", 128, 4096},   {"Mixtral-8x7B qkv", 6144, 4096},
    {"Mixtral-8x7B gate", 8, 4096},        {"Mixtral-8x7B lm_head", 32000, 4096},
    {"Llama-3-8B gate_up", 28672, 4096},   {"Llama-3-8B down", 4096, 14336},
    {"Llama-3-70B/tp8 qkv", 1280, 8192},   {"Llama-3-70B/tp8 o", 8192, 1024},
    {"Llama-3-70B/tp8 gate_up", 7168, 8192}, {"Llama-3-70B/tp8 down", 8192, 3584},
    {"odd N=1 K=8", 1, 8},                 {"odd N=7 K=72", 7, 72},
    {"odd N=129 K=2056", 129, 2056},       {"odd N=5 K=14336", 5, 14336},
    {"heads 64 [6 x 64, 72]", 384, 72},    {"heads 256 [6 x 256, 2048]", 1536, 2048},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof *shapes))
static const int32_t archs[] = {80, 90}, fp8_archs[] = {89, 90};

/* The block-FP8 projections (128x128 blocks) of Qwen3-30B-A3B-FP8, Qwen3-235B-A22B-FP8 and
 * DeepSeek-V3 (its dense q_a, kv_a, q_b and o projections), from each model's config.json. */
static const shape fp8_shapes[] = {
    {"Qwen3-30B-A3B-FP8 qkv", 5120, 2048},  {"Qwen3-30B-A3B-FP8 o", 2048, 4096},
    {"Qwen3-30B-A3B-FP8 gate", 128, 2048},  {"Qwen3-235B-A22B-FP8 qkv", 9216, 4096},
    {"DeepSeek-V3 q_a", 1536, 7168},        {"DeepSeek-V3 kv_a", 576, 7168},
    {"DeepSeek-V3 q_b", 24576, 1536},       {"DeepSeek-V3 o", 7168, 16384},
    {"odd N=129 K=256", 129, 256},
};
#define N_FP8_SHAPES ((int)(sizeof fp8_shapes / sizeof *fp8_shapes))

/* Set while the jobs of the add + RMSNorm form (16-bit weights) are added. */
static int norm_jobs;

/* The q/k epilogue's heads (a qkv projection's): set while its jobs are added. */
typedef struct qk_heads {
  int32_t D, q_heads, qk_heads, norm, rope;
} qk_heads;
static const qk_heads *qk_job;

static void add_job(const shape *s, int64_t M, int32_t dtype, int fp8, int32_t arch, const char *setting) {
  if (qk_job && arch < 90) return; /* the q/k epilogue's clusters: sm_90 (the guard refuses older) */
  opgraft_linear_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = a.weight_dtype = a.bias_dtype = a.out_dtype = dtype;
  if (fp8) {
    a.weight_dtype = OPGRAFT_DTYPE_FP8_E4M3, a.scale_dtype = OPGRAFT_DTYPE_FP32, a.block_n = a.block_k = 128;
    a.weight_scale_stride[0] = (s->K + 127) / 128, a.weight_scale_stride[1] = 1;
  }
  a.rows = M, a.out_features = s->N, a.in_features = s->K;
  a.x_stride[0] = s->K, a.x_stride[1] = 1, a.weight_stride[0] = s->K, a.weight_stride[1] = 1;
  a.out_stride[0] = s->N, a.out_stride[1] = 1;
  a.arch = arch;
  if (norm_jobs) {
    a.residual = a.norm_weight = (const void *)16, a.residual_out = (void *)16;
    a.norm_dtype = dtype, a.norm_eps = 1e-6f;
    a.residual_stride[0] = a.residual_out_stride[0] = s->K, a.residual_stride[1] = a.residual_out_stride[1] = 1;
  }
  if (qk_job) {
    a.head_size = qk_job->D, a.q_heads = qk_job->q_heads, a.qk_heads = qk_job->qk_heads, a.rope_style = qk_job->rope;
    if (qk_job->norm) a.q_norm_weight = a.k_norm_weight = (const void *)16, a.qk_norm_eps = 1e-6f;
    if (qk_job->rope) a.cos_sin_stride = qk_job->D, a.rope_rows = 40960;
  }
  og_job *j = og_job_new("%s [%lld, %lld] %s%s%s%s M=%lld sm_%d%s%s", s->name, (long long)s->N, (long long)s->K,
                         fp8 ? "fp8 x " : "", norm_jobs ? "add+RMSNorm " : "", qk_job ? "q/k epilogue " : "",
                         dtype == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16", (long long)M, arch, setting ? " with " : "",
                         setting ? setting : "");
  j->source = opgraft__linear_source(&a), j->arch = arch, j->nfn = 1;
  opgraft__linear_fn_name(&a, j->fn[0]);
  og_linear_cfg cfg;
  opgraft__linear_config(&a, arch, NULL, &cfg);
  if (opgraft__linear_options(&a, &cfg, &j->opts) != OPGRAFT_OK) fail_msg("%s: %s", j->what, opgraft_last_error());
  og_job_done(j);
}

/* The jobs of one setting (NULL: the shipped rule) over the given shapes (of fp8_shapes with FP8
 * weights), both archs. */
static void add_setting_w(const char *const *env, const int *ids, int nids, int64_t M, int32_t dtype, int fp8) {
  char setting[200];
  og_setting_apply(env, setting, sizeof setting);
  for (int s = 0; s < nids; ++s)
    for (int a = 0; a < 2; ++a)
      add_job(fp8 ? &fp8_shapes[ids ? ids[s] : s] : &shapes[ids ? ids[s] : s], M, dtype, fp8,
              fp8 ? fp8_archs[a] : archs[a], env ? setting : NULL);
  og_setting_clear(env);
}

static void add_setting(const char *const *env, const int *ids, int nids, int64_t M, int32_t dtype) {
  add_setting_w(env, ids, nids, M, dtype, 0);
}

/* The tuner's candidates where they change registers, on two shapes (ids) at M rows: every tile
 * count and unroll at 16 warps an SM (128 registers a thread, the tightest budget the configuration
 * allows). */
static void add_candidates(const int ids[2], int64_t M, int fp8) {
  static const char *const tiles[] = {"1", "2", "3", "4"}, *const unrolls[] = {"2", "4", "8"};
  static const char *const warps[] = {"2", "4", "8", "16"};
  for (int t = 0; t < 4; ++t)
    for (int u = 0; u < 3; ++u)
      for (int w = 0; w < 4; ++w) {
        char mb[8];
        snprintf(mb, sizeof mb, "%d", 16 / atoi(warps[w]));
        add_setting_w((const char *[]){"OPGRAFT_TUNE_LINEAR_TILES", tiles[t], "OPGRAFT_TUNE_LINEAR_UNROLL", unrolls[u],
                                       "OPGRAFT_TUNE_LINEAR_WARPS", warps[w], "OPGRAFT_TUNE_LINEAR_MIN_BLOCKS", mb, NULL},
                      ids, 2, M, OPGRAFT_DTYPE_BF16, fp8);
      }
}

static int setup(void **state) {
  if (!og_jobs_setup()) return 0;
  /* The shipped configurations: every shape at one and eight rows in bf16, in fp16 at one row. */
  add_setting(NULL, NULL, N_SHAPES, 1, OPGRAFT_DTYPE_BF16);
  add_setting(NULL, NULL, N_SHAPES, 8, OPGRAFT_DTYPE_BF16);
  add_setting(NULL, NULL, N_SHAPES, 1, OPGRAFT_DTYPE_FP16);
  /* The tuner's candidates where they change registers: every tile count and unroll at 16 warps an
   * SM (128 registers a thread, the tightest budget the configuration allows), for a K that fills
   * every step and one with a partial last step. */
  static const int two[] = {0, 18}; /* Qwen3-30B-A3B qkv (K=2048), N=129 K=2056 */
  add_candidates(two, 1, 0);
  /* The other keys one at a time, at the widest tile the rule picks (3) and the largest (4). */
  static const int qkv_o[] = {0, 13}; /* Qwen3-30B-A3B qkv (3 tiles), Llama-3-70B/tp8 o (4 tiles) */
  const char *const *others[] = {
      (const char *[]){"OPGRAFT_TUNE_LINEAR_MIN_BLOCKS", "0", NULL},
      (const char *[]){"OPGRAFT_TUNE_LINEAR_MIN_BLOCKS", "1", NULL},
      (const char *[]){"OPGRAFT_TUNE_LINEAR_LOAD", "1", NULL},
      (const char *[]){"OPGRAFT_TUNE_LINEAR_L2_FETCH", "0", NULL},
      (const char *[]){"OPGRAFT_TUNE_LINEAR_L2_FETCH", "256", NULL},
      (const char *[]){"OPGRAFT_TUNE_LINEAR_PDL", "1", NULL},
      (const char *[]){"OPGRAFT_TUNE_LINEAR_PDL", "1", "OPGRAFT_TUNE_LINEAR_LOAD", "1", NULL},
      (const char *[]){"OPGRAFT_TUNE_LINEAR_PDL", "2", NULL},
      (const char *[]){"OPGRAFT_TUNE_LINEAR_PDL", "1", "OPGRAFT_TUNE_LINEAR_TRIGGER", "1", NULL},
  };
  for (size_t i = 0; i < sizeof others / sizeof *others; ++i) {
    add_setting(others[i], qkv_o, 2, 1, OPGRAFT_DTYPE_BF16);
    add_setting(others[i], qkv_o, 2, 1, OPGRAFT_DTYPE_FP16);
  }
  /* The add + RMSNorm form: every shape as shipped at one and eight rows (fp16 at one), the tile,
   * unroll and warp candidates on qkv and the odd shape, and the other keys on qkv and o. */
  norm_jobs = 1;
  add_setting(NULL, NULL, N_SHAPES, 1, OPGRAFT_DTYPE_BF16);
  add_setting(NULL, NULL, N_SHAPES, 8, OPGRAFT_DTYPE_BF16);
  add_setting(NULL, NULL, N_SHAPES, 1, OPGRAFT_DTYPE_FP16);
  add_candidates(two, 8, 0);
  for (size_t i = 0; i < sizeof others / sizeof *others; ++i) add_setting(others[i], qkv_o, 2, 1, OPGRAFT_DTYPE_BF16);
  /* The q/k epilogue (plain and add + RMSNorm forms): Qwen3-30B-A3B's and Qwen3-235B-A22B's qkv
   * with the norm and NeoX rotation as shipped at one and eight rows, fp16 at one, the tile, unroll
   * and warp candidates and the other keys on the first; head 64 with GPT-J rotation alone and head
   * 256 with the norm alone on shapes of their own. */
  static const qk_heads qwen3 = {128, 32, 36, 1, 1}, qwen3_235b = {128, 64, 68, 1, 1};
  static const int q30[] = {0}, q235[] = {4}, h64[] = {20}, h256[] = {21};
  static const qk_heads gptj64 = {64, 4, 5, 0, 2}, norm256 = {256, 4, 5, 1, 0};
  for (int nj = 1; nj >= 0; --nj) {
    norm_jobs = nj;
    qk_job = &qwen3;
    add_setting(NULL, q30, 1, 1, OPGRAFT_DTYPE_BF16);
    add_setting(NULL, q30, 1, 8, OPGRAFT_DTYPE_BF16);
    add_setting(NULL, q30, 1, 1, OPGRAFT_DTYPE_FP16);
    for (size_t i = 0; i < sizeof others / sizeof *others; ++i) add_setting(others[i], q30, 1, 1, OPGRAFT_DTYPE_BF16);
    qk_job = &qwen3_235b;
    add_setting(NULL, q235, 1, 1, OPGRAFT_DTYPE_BF16);
    qk_job = &gptj64;
    add_setting(NULL, h64, 1, 3, OPGRAFT_DTYPE_FP16);
    qk_job = &norm256;
    add_setting(NULL, h256, 1, 8, OPGRAFT_DTYPE_BF16);
  }
  qk_job = &qwen3;
  static const int q30x2[] = {0, 0};
  add_candidates(q30x2, 8, 0);
  qk_job = NULL;
  norm_jobs = 0;
  /* FP8 weights: every shape as shipped at one and eight rows (bf16 x; fp16 at one row), then the
   * tuner's candidates at 16 warps an SM for qkv and the odd shape, and the other keys on qkv. */
  add_setting_w(NULL, NULL, N_FP8_SHAPES, 1, OPGRAFT_DTYPE_BF16, 1);
  add_setting_w(NULL, NULL, N_FP8_SHAPES, 8, OPGRAFT_DTYPE_BF16, 1);
  add_setting_w(NULL, NULL, N_FP8_SHAPES, 1, OPGRAFT_DTYPE_FP16, 1);
  static const int fp8_two[] = {0, 8};
  add_candidates(fp8_two, 8, 1);
  for (size_t i = 0; i < sizeof others / sizeof *others; ++i) add_setting_w(others[i], fp8_two, 1, 1, OPGRAFT_DTYPE_BF16, 1);
  og_jobs_compile("linear");
  return 0;
}

static void test_every_variant_compiles(void **state) {
  og_need_nvrtc();
  assert_true(og_nunique > 40 && og_nunique <= og_njobs);
  og_jobs_check_compiled();
}

static void test_no_spills(void **state) { og_jobs_check_no_spills(); }

static void test_shipped_registers(void **state) {
  /* The shipped configurations stay within the 128 registers a thread that 16 warps an SM allow,
   * and use no more shared memory than the block's reduction buffer. */
  og_need_nvrtc();
  for (int i = 0; i < og_njobs && strstr(og_jobs[i].what, " with ") == NULL; ++i) {
    const og_job *r = og_job_result(i);
    if (r->status != OPGRAFT_OK) continue;
    if (r->info[0].registers > 128) fail_msg("%s: %d registers", og_jobs[i].what, r->info[0].registers);
    if (r->info[0].shared_bytes > 16 * 4 * 2 * 32 * 4)
      fail_msg("%s: %d bytes of shared memory", og_jobs[i].what, r->info[0].shared_bytes);
  }
}

static void test_report_matches_the_jobs(void **state) {
  /* opgraft_linear_compile_report (the public entry point) agrees with the job list's compile. */
  og_need_nvrtc();
  opgraft_linear_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = a.weight_dtype = a.out_dtype = OPGRAFT_DTYPE_BF16;
  a.rows = 1, a.out_features = 5120, a.in_features = 2048;
  a.x_stride[0] = a.weight_stride[0] = 2048, a.x_stride[1] = a.weight_stride[1] = 1;
  a.out_stride[0] = 5120, a.out_stride[1] = 1;
  opgraft_kernel_info ki;
  int32_t count = 0;
  assert_int_equal(opgraft_linear_compile_report(&a, 90, &ki, 1, &count), OPGRAFT_OK);
  assert_int_equal(count, 1);
  const og_job *r = og_job_result(1); /* Qwen3-30B-A3B qkv bf16 M=1 sm_90 */
  assert_non_null(strstr(og_jobs[1].what, "Qwen3-30B-A3B qkv ["));
  assert_non_null(strstr(og_jobs[1].what, "M=1 sm_90"));
  assert_string_equal(ki.name, r->info[0].name);
  assert_int_equal(ki.registers, r->info[0].registers);
}

static void test_compile_report_arguments(void **state) {
  opgraft_linear_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = a.weight_dtype = a.out_dtype = OPGRAFT_DTYPE_BF16;
  a.rows = 1, a.out_features = 64, a.in_features = 64;
  a.x_stride[0] = a.weight_stride[0] = 64, a.x_stride[1] = a.weight_stride[1] = 1;
  a.out_stride[0] = 64, a.out_stride[1] = 1;
  opgraft_kernel_info ki;
  int32_t count = 0;
  assert_int_equal(opgraft_linear_compile_report(NULL, 90, &ki, 1, &count), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_linear_compile_report(&a, 90, &ki, 1, NULL), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_linear_compile_report(&a, 90, NULL, 1, &count), OPGRAFT_EINVAL);
  a.dtype = OPGRAFT_DTYPE_FP32;
  assert_int_equal(opgraft_linear_compile_report(&a, 90, &ki, 1, &count), OPGRAFT_EUNSUPPORTED);
  a.dtype = OPGRAFT_DTYPE_BF16;
  a.rows = 9;
  assert_int_equal(opgraft_linear_compile_report(&a, 90, &ki, 1, &count), OPGRAFT_EUNSUPPORTED);
  a.rows = 1;
  a.in_features = 60;
  assert_int_equal(opgraft_linear_compile_report(&a, 90, &ki, 1, &count), OPGRAFT_EUNSUPPORTED);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_compile_report_arguments),
      cmocka_unit_test(test_every_variant_compiles),
      cmocka_unit_test(test_no_spills),
      cmocka_unit_test(test_shipped_registers),
      cmocka_unit_test(test_report_matches_the_jobs),
  };
  return cmocka_run_group_tests(tests, setup, og_jobs_teardown);
}
