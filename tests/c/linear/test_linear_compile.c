/* Every linear kernel variant that a shipped or tunable configuration can select compiles with
 * NVRTC, for sm_80 and sm_90 (FP8 weights: sm_89 and sm_90), without register spills. The configurations are resolved first (the
 * rule at the projection shapes of the presets and dense models, then the tuner's candidates over
 * the keys that change registers or code), identical option sets are compiled once, and the
 * compiles run on several threads through the kernel cache ($OPGRAFT_TEST_KERNEL_CACHE keeps the
 * cubins and their resource reports across runs; without it, a fresh directory).
 * $OPGRAFT_TEST_JOBS overrides the thread count. */
#include "og_test.h"
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

typedef struct job {
  char what[200];
  opgraft_linear_args args;
  int32_t dtype, arch;
  og_opts opts;
  int32_t status;
  opgraft_kernel_info info;
  char error[512];
  int dup_of; /* -1, or the job with the same options and arch */
} job;

enum { MAX_JOBS = 4096 };
static job jobs[MAX_JOBS];
static int n_jobs, n_unique;
static int have_nvrtc;
static char nvrtc_error[256];
static _Atomic int next_job;

/* Set while the jobs of the add + RMSNorm form (16-bit weights) are added. */
static int norm_jobs;

static void add_job(const shape *s, int64_t M, int32_t dtype, int fp8, int32_t arch, const char *setting) {
  if (n_jobs >= MAX_JOBS) fail_msg("more than %d compile jobs", MAX_JOBS);
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
  job *j = &jobs[n_jobs];
  memset(j, 0, sizeof *j);
  snprintf(j->what, sizeof j->what, "%s [%lld, %lld] %s%s%s M=%lld sm_%d%s%s", s->name, (long long)s->N,
           (long long)s->K, fp8 ? "fp8 x " : "", norm_jobs ? "add+RMSNorm " : "",
           dtype == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16", (long long)M, arch, setting ? " with " : "",
           setting ? setting : "");
  j->args = a, j->dtype = dtype, j->arch = arch, j->dup_of = -1;
  og_linear_cfg cfg;
  opgraft__linear_config(&a, arch, NULL, &cfg);
  if (opgraft__linear_options(&a, &cfg, &j->opts) != OPGRAFT_OK) fail_msg("%s: %s", j->what, opgraft_last_error());
  for (int i = 0; i < n_jobs && j->dup_of < 0; ++i) {
    const job *o = &jobs[i];
    if (o->dup_of >= 0 || o->arch != arch || o->opts.n != j->opts.n || opgraft__linear_is_fp8(&o->args) != fp8 ||
        !o->args.residual != !a.residual)
      continue;
    int same = 1;
    for (int k = 0; k < o->opts.n && same; ++k) same = strcmp(o->opts.ptr[k], j->opts.ptr[k]) == 0;
    if (same) j->dup_of = i;
  }
  n_unique += j->dup_of < 0;
  ++n_jobs;
}

/* The jobs of one setting (NULL: the shipped rule) over the given shapes (of fp8_shapes with FP8
 * weights), both archs. */
static void add_setting_w(const char *const *env, const int *ids, int nids, int64_t M, int32_t dtype, int fp8) {
  char setting[200] = "";
  for (int e = 0; env && env[e]; e += 2) {
    setenv(env[e], env[e + 1], 1);
    snprintf(setting + strlen(setting), sizeof setting - strlen(setting), "%s%s=%s", e ? " " : "", env[e], env[e + 1]);
  }
  opgraft_tune_reload();
  for (int s = 0; s < nids; ++s)
    for (int a = 0; a < 2; ++a)
      add_job(fp8 ? &fp8_shapes[ids ? ids[s] : s] : &shapes[ids ? ids[s] : s], M, dtype, fp8,
              fp8 ? fp8_archs[a] : archs[a], env ? setting : NULL);
  for (int e = 0; env && env[e]; e += 2) unsetenv(env[e]);
  opgraft_tune_reload();
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

static void run_job(job *j) {
  og_cubin c;
  j->status = opgraft__cubin_cached(opgraft__linear_source(&j->args), j->opts.ptr, j->opts.n, j->arch, &c);
  if (j->status) {
    opgraft__copy(j->error, sizeof j->error, opgraft_last_error());
    return;
  }
  char name[64];
  opgraft__linear_fn_name(&j->args, name);
  j->status = opgraft__parse_resources(c.log, name, &j->info);
  if (j->status) opgraft__copy(j->error, sizeof j->error, opgraft_last_error());
  opgraft__cubin_free(&c);
}

static void *worker(void *arg) {
  for (int i; (i = next_job++) < n_jobs;)
    if (jobs[i].dup_of < 0) run_job(&jobs[i]);
  return arg;
}

static char tmp[512];

static int setup(void **state) {
  const char *keep = getenv("OPGRAFT_TEST_KERNEL_CACHE");
  tmp[0] = 0;
  if (keep && *keep) {
    setenv("OPGRAFT_CACHE_DIR", keep, 1);
  } else {
    og_tmpdir(tmp, sizeof tmp);
    setenv("OPGRAFT_CACHE_DIR", tmp, 1);
  }
  og_unsetenv_prefix("OPGRAFT_TUNE_"); /* the shipped tunables decide the configurations */
  opgraft_tune_reload();
  opgraft_runtime_info info;
  assert_int_equal(opgraft_runtime_query(&info), OPGRAFT_OK);
  have_nvrtc = info.nvrtc_version > 0;
  opgraft__copy(nvrtc_error, sizeof nvrtc_error, info.nvrtc_error);
  if (!have_nvrtc) return 0;

  n_jobs = n_unique = 0;
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
  norm_jobs = 0;
  /* FP8 weights: every shape as shipped at one and eight rows (bf16 x; fp16 at one row), then the
   * tuner's candidates at 16 warps an SM for qkv and the odd shape, and the other keys on qkv. */
  add_setting_w(NULL, NULL, N_FP8_SHAPES, 1, OPGRAFT_DTYPE_BF16, 1);
  add_setting_w(NULL, NULL, N_FP8_SHAPES, 8, OPGRAFT_DTYPE_BF16, 1);
  add_setting_w(NULL, NULL, N_FP8_SHAPES, 1, OPGRAFT_DTYPE_FP16, 1);
  static const int fp8_two[] = {0, 8};
  add_candidates(fp8_two, 8, 1);
  for (size_t i = 0; i < sizeof others / sizeof *others; ++i) add_setting_w(others[i], fp8_two, 1, 1, OPGRAFT_DTYPE_BF16, 1);
  long threads = sysconf(_SC_NPROCESSORS_ONLN);
  const char *env = getenv("OPGRAFT_TEST_JOBS");
  if (env && atoi(env) > 0) threads = atoi(env);
  if (threads < 1) threads = 1;
  if (threads > 16) threads = 16;
  pthread_t th[16];
  next_job = 0;
  for (long i = 0; i < threads; ++i) assert_int_equal(pthread_create(&th[i], NULL, worker, NULL), 0);
  for (long i = 0; i < threads; ++i) assert_int_equal(pthread_join(th[i], NULL), 0);
  print_message("%d linear configurations, %d distinct compiles\n", n_jobs, n_unique);
  return 0;
}

static int teardown(void **state) {
  if (tmp[0]) og_rm_rf(tmp);
  unsetenv("OPGRAFT_CACHE_DIR");
  return 0;
}

static void need_nvrtc(void) {
  if (have_nvrtc) return;
  if (og_allow_no_nvrtc()) {
    print_message("skipping: NVRTC cannot be loaded (%s) and OPGRAFT_TEST_ALLOW_NO_NVRTC=1\n", nvrtc_error);
    skip();
  }
  fail_msg("NVRTC cannot be loaded: %s (set OPGRAFT_TEST_ALLOW_NO_NVRTC=1 to skip the compile tests)", nvrtc_error);
}

static const job *result_of(const job *j) { return j->dup_of >= 0 ? &jobs[j->dup_of] : j; }

static void test_every_variant_compiles(void **state) {
  need_nvrtc();
  assert_true(n_unique > 40 && n_unique <= n_jobs);
  int bad = 0;
  for (int i = 0; i < n_jobs; ++i) {
    const job *r = result_of(&jobs[i]);
    char name[64];
    opgraft__linear_fn_name(&jobs[i].args, name);
    if (r->status != OPGRAFT_OK) {
      print_error("%s: %s: %.400s\n", jobs[i].what, opgraft_status_name(r->status), r->error);
      ++bad;
    } else if (strcmp(r->info.name, name) != 0 || r->info.registers <= 0) {
      print_error("%s: kernel \"%s\" with %d registers, expected %s\n", jobs[i].what, r->info.name, r->info.registers,
                  name);
      ++bad;
    }
  }
  if (bad) fail_msg("%d problems over %d kernel variants", bad, n_jobs);
}

static void test_no_spills(void **state) {
  need_nvrtc();
  int bad = 0;
  for (int i = 0; i < n_jobs; ++i) {
    const job *r = result_of(&jobs[i]);
    if (r->status != OPGRAFT_OK) continue; /* reported by test_every_variant_compiles */
    const opgraft_kernel_info *ki = &r->info;
    if (ki->spill_store_bytes > 0 || ki->spill_load_bytes > 0 || ki->stack_bytes > 0) {
      print_error("%s: spills: %d bytes stored, %d bytes loaded, %d registers, %d bytes stack\n", jobs[i].what,
                  ki->spill_store_bytes, ki->spill_load_bytes, ki->registers, ki->stack_bytes);
      ++bad;
    }
  }
  if (bad) fail_msg("%d kernels spill registers", bad);
}

static void test_shipped_registers(void **state) {
  /* The shipped configurations stay within the 128 registers a thread that 16 warps an SM allow,
   * and use no more shared memory than the block's reduction buffer. */
  need_nvrtc();
  for (int i = 0; i < n_jobs && strstr(jobs[i].what, " with ") == NULL; ++i) {
    const job *r = result_of(&jobs[i]);
    if (r->status != OPGRAFT_OK) continue;
    if (r->info.registers > 128) fail_msg("%s: %d registers", jobs[i].what, r->info.registers);
    if (r->info.shared_bytes > 16 * 4 * 2 * 32 * 4) fail_msg("%s: %d bytes of shared memory", jobs[i].what, r->info.shared_bytes);
  }
}

static void test_report_matches_the_jobs(void **state) {
  /* opgraft_linear_compile_report (the public entry point) agrees with the job list's compile. */
  need_nvrtc();
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
  const job *r = result_of(&jobs[1]); /* Qwen3-30B-A3B qkv bf16 M=1 sm_90 */
  assert_non_null(strstr(jobs[1].what, "Qwen3-30B-A3B qkv ["));
  assert_non_null(strstr(jobs[1].what, "M=1 sm_90"));
  assert_string_equal(ki.name, r->info.name);
  assert_int_equal(ki.registers, r->info.registers);
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
  return cmocka_run_group_tests(tests, setup, teardown);
}
