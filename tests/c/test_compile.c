/* Every kernel variant of the model presets compiles with NVRTC without register spills, and the
 * ptxas resource report is parsed correctly. Compiles run on several threads (NVRTC is
 * thread-safe for distinct programs); $OPGRAFT_TEST_JOBS overrides the thread count. */
#include "og_test.h"

typedef struct shape {
  const char *name;
  int64_t E, H, I, k;
  int64_t global_experts; /* > 0: expert parallelism, the kernels with an expert_map */
} shape;

static const shape shapes[] = {
    {"Qwen3-30B-A3B", 128, 2048, 768, 8, 0},  {"Qwen3-235B-A22B", 128, 4096, 1536, 8, 0},
    {"Mixtral-8x7B", 8, 4096, 14336, 2, 0},   {"DeepSeek-V3", 256, 7168, 2048, 8, 0},
    {"Kimi-K2", 384, 7168, 2048, 8, 0},       {"odd", 7, 96, 160, 3, 0},
    {"Qwen3-30B-A3B/ep2", 64, 2048, 768, 8, 128},
};
static const int32_t token_counts[] = {1, 8, 9, 16, 17, 32, 33, 64};
static const int32_t archs[] = {80, 90};
static const int32_t dtypes[] = {OPGRAFT_DTYPE_BF16, OPGRAFT_DTYPE_FP16};

#define N_SHAPES (sizeof shapes / sizeof *shapes)
#define N_TOKENS (sizeof token_counts / sizeof *token_counts)
#define N_JOBS (N_SHAPES * N_TOKENS * 2 * 2)

typedef struct job {
  const shape *s;
  int32_t dtype, arch, T;
  int32_t status, count;
  opgraft_kernel_info info[3]; /* gate_up, down, and fused or stream when the configuration selects one */
  char error[512];
} job;

static job jobs[N_JOBS];
static int n_jobs;
static int have_nvrtc;
static char nvrtc_error[256];
static _Atomic int next_job;

static const char *dtype_str(int32_t d) { return d == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16"; }

static void describe(const job *j, char *buf, size_t len) {
  snprintf(buf, len, "%s (E=%lld H=%lld I=%lld k=%lld) %s T=%d sm_%d", j->s->name, (long long)j->s->E,
           (long long)j->s->H, (long long)j->s->I, (long long)j->s->k, dtype_str(j->dtype), j->T, j->arch);
}

static void run_job(job *j) {
  opgraft_moe_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = j->dtype;
  a.activation = OPGRAFT_ACT_SILU;
  a.num_tokens = j->T, a.hidden = j->s->H, a.inter = j->s->I, a.num_experts = j->s->E, a.top_k = j->s->k;
  a.topk_weights_dtype = OPGRAFT_DTYPE_FP32;
  a.topk_ids_dtype = OPGRAFT_DTYPE_INT32;
  a.arch = j->arch;
  if (j->s->global_experts) /* the compile looks at whether there is a map, never at its data */
    a.expert_map = (const void *)0x1000, a.expert_map_len = j->s->global_experts;
  j->count = -1;
  j->status = opgraft_moe_compile_report(&a, j->arch, j->info, 3, &j->count);
  opgraft__copy(j->error, sizeof j->error, j->status ? opgraft_last_error() : "");
}

static void *worker(void *arg) {
  for (int i; (i = next_job++) < n_jobs;) run_job(&jobs[i]);
  return arg;
}

static int setup(void **state) {
  static char tmp[512];
  og_tmpdir(tmp, sizeof tmp);
  setenv("OPGRAFT_CACHE_DIR", tmp, 1); /* nothing should be cached, but never in $HOME */
  og_unsetenv_prefix("OPGRAFT_TUNE_");  /* the shipped tunables decide the configurations */
  opgraft_tune_reload();
  *state = tmp;

  opgraft_runtime_info info;
  assert_int_equal(opgraft_runtime_query(&info), OPGRAFT_OK);
  have_nvrtc = info.nvrtc_version > 0;
  opgraft__copy(nvrtc_error, sizeof nvrtc_error, info.nvrtc_error);
  if (!have_nvrtc) return 0;

  n_jobs = 0;
  for (size_t d = 0; d < 2; ++d)
    for (size_t a = 0; a < 2; ++a)
      for (size_t s = 0; s < N_SHAPES; ++s)
        for (size_t t = 0; t < N_TOKENS; ++t) {
          job *j = &jobs[n_jobs++];
          memset(j, 0, sizeof *j);
          j->s = &shapes[s], j->dtype = dtypes[d], j->arch = archs[a], j->T = token_counts[t];
        }
  long threads = sysconf(_SC_NPROCESSORS_ONLN);
  const char *env = getenv("OPGRAFT_TEST_JOBS");
  if (env && atoi(env) > 0) threads = atoi(env);
  if (threads < 1) threads = 1;
  if (threads > 16) threads = 16;
  pthread_t th[16];
  next_job = 0;
  for (long i = 0; i < threads; ++i) assert_int_equal(pthread_create(&th[i], NULL, worker, NULL), 0);
  for (long i = 0; i < threads; ++i) assert_int_equal(pthread_join(th[i], NULL), 0);
  return 0;
}

static int teardown(void **state) {
  og_rm_rf(*state);
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

static void test_every_variant_compiles(void **state) {
  need_nvrtc();
  assert_int_equal(n_jobs, (int)N_JOBS);
  int bad = 0;
  for (int i = 0; i < n_jobs; ++i) {
    const job *j = &jobs[i];
    char what[160], names[3][64];
    describe(j, what, sizeof what);
    snprintf(names[0], sizeof names[0], "moe_gate_up_%s", dtype_str(j->dtype));
    snprintf(names[1], sizeof names[1], "moe_down_%s", dtype_str(j->dtype));
    snprintf(names[2], sizeof names[2], "moe_fused_%s", dtype_str(j->dtype));
    if (j->status != OPGRAFT_OK) {
      print_error("%s: %s: %.400s\n", what, opgraft_status_name(j->status), j->error);
      ++bad;
      continue;
    }
    if (j->count != 2 && j->count != 3) {
      print_error("%s: %d kernels reported, expected 2 (3 with moe.fused)\n", what, j->count);
      ++bad;
      continue;
    }
    for (int k = 0; k < j->count; ++k)
      if (strcmp(j->info[k].name, names[k]) != 0 || j->info[k].registers <= 0) {
        print_error("%s: kernel %d is \"%s\" with %d registers, expected %s with some\n", what, k, j->info[k].name,
                    j->info[k].registers, names[k]);
        ++bad;
      }
  }
  if (bad) fail_msg("%d problems over %d kernel variants", bad, n_jobs);
}

static void test_no_spills(void **state) {
  need_nvrtc();
  int bad = 0;
  for (int i = 0; i < n_jobs; ++i) {
    const job *j = &jobs[i];
    if (j->status != OPGRAFT_OK) continue; /* reported by test_every_variant_compiles */
    for (int k = 0; k < j->count && k < 3; ++k) {
      const opgraft_kernel_info *ki = &j->info[k];
      if (ki->spill_store_bytes > 0 || ki->spill_load_bytes > 0) {
        char what[160];
        describe(j, what, sizeof what);
        print_error("%s: %s spills: %d bytes stored, %d bytes loaded, %d registers, %d bytes stack\n", what,
                    ki->name, ki->spill_store_bytes, ki->spill_load_bytes, ki->registers, ki->stack_bytes);
        ++bad;
      }
    }
  }
  if (bad) fail_msg("%d kernels spill registers", bad);
}

/* Compiles shapes[shape_ids] at the token counts tokens[0..ntokens) for both archs with one tunable
 * set through its env var; returns the number of failed or spilling kernels. */
static int variants_compile_at(const char *env, const char *value, const int *shape_ids, int nshapes,
                               const int32_t *tokens, int ntokens) {
  setenv(env, value, 1);
  opgraft_tune_reload();
  int bad = 0;
  for (int s = 0; s < nshapes; ++s)
    for (int t = 0; t < ntokens; ++t)
      for (int ar = 0; ar < 2; ++ar) {
        job j;
        memset(&j, 0, sizeof j);
        j.s = &shapes[shape_ids[s]], j.dtype = OPGRAFT_DTYPE_BF16, j.arch = archs[ar], j.T = tokens[t];
        run_job(&j);
        char what[160];
        describe(&j, what, sizeof what);
        if (j.status != OPGRAFT_OK || j.count < 2 || j.count > 3) {
          print_error("%s with %s=%s: %s %.300s\n", what, env, value, opgraft_status_name(j.status), j.error);
          ++bad;
          continue;
        }
        for (int k = 0; k < j.count; ++k)
          if (j.info[k].spill_store_bytes > 0 || j.info[k].spill_load_bytes > 0) {
            print_error("%s with %s=%s: %s spills\n", what, env, value, j.info[k].name);
            ++bad;
          }
      }
  unsetenv(env);
  opgraft_tune_reload();
  return bad;
}

/* The same at T=1 and 8. */
static const int32_t tokens_1_8[] = {1, 8};
static int variants_compile(const char *env, const char *value, const int *shape_ids, int nshapes) {
  return variants_compile_at(env, value, shape_ids, nshapes, tokens_1_8, 2);
}

/* variants_compile_at with a second variable (extra=extra_value) set while it runs. */
static int variants_compile_also(const char *extra, const char *extra_value, const char *env, const char *value,
                                 const int *shape_ids, int nshapes, const int32_t *tokens, int ntokens) {
  setenv(extra, extra_value, 1);
  const int bad = variants_compile_at(env, value, shape_ids, nshapes, tokens, ntokens);
  unsetenv(extra);
  opgraft_tune_reload();
  return bad;
}

static void test_pdl_variants_compile(void **state) {
  /* moe.pdl=1 (programmatic dependent launch), Qwen3-30B-A3B and its ep2 shape: sm_90 spill-free; sm_80 has no
   * griddepcontrol and gets the plain kernels whatever the setting. */
  need_nvrtc();
  const int ids[] = {0, 6};
  int bad = variants_compile("OPGRAFT_TUNE_MOE_PDL", "1", ids, 2);
  /* down's first loads before its wait */
  bad += variants_compile_also("OPGRAFT_TUNE_MOE_DOWN_EARLY", "1", "OPGRAFT_TUNE_MOE_PDL", "1", ids, 2, tokens_1_8, 2);
  if (bad) fail_msg("%d problems with moe.pdl=1 (and moe.down.early=1)", bad);
}

static void test_one_token_variants_compile(void **state) {
  /* moe.gate_up.one_token and moe.down.one_token (one-token routing paths) with moe.pdl_in (gate_up
   * a programmatic dependent of the previous kernel) and down's early loads, Qwen3-30B-A3B and its ep2 shape, sm_80
   * and sm_90: spill-free. */
  need_nvrtc();
  const int ids[] = {0, 6};
  static const int32_t one[] = {1};
  setenv("OPGRAFT_TUNE_MOE_PDL", "1", 1);
  setenv("OPGRAFT_TUNE_MOE_DOWN_EARLY", "1", 1);
  setenv("OPGRAFT_TUNE_MOE_DOWN_ONE_TOKEN", "1", 1);
  const int bad = variants_compile_also("OPGRAFT_TUNE_MOE_PDL_IN", "1", "OPGRAFT_TUNE_MOE_GATE_UP_ONE_TOKEN", "1",
                                        ids, 2, one, 1);
  unsetenv("OPGRAFT_TUNE_MOE_PDL");
  unsetenv("OPGRAFT_TUNE_MOE_DOWN_EARLY");
  unsetenv("OPGRAFT_TUNE_MOE_DOWN_ONE_TOKEN");
  opgraft_tune_reload();
  if (bad) fail_msg("%d problems with moe.gate_up.one_token and moe.pdl_in", bad);
}

static void test_slot_routing_variants_compile(void **state) {
  /* moe.gate_up.slot_routing and moe.down.warp_routing at 32 routing slots (Qwen3-30B-A3B T=4,
   * Mixtral-8x7B T=16 with two token tiles), sm_80 and sm_90: spill-free. */
  need_nvrtc();
  int bad = 0;
  static const int32_t four[] = {4}, sixteen[] = {16};
  const int q30[] = {0}, mixtral[] = {2};
  bad += variants_compile_also("OPGRAFT_TUNE_MOE_DOWN_WARP_ROUTING", "1", "OPGRAFT_TUNE_MOE_GATE_UP_SLOT_ROUTING", "1",
                               q30, 1, four, 1);
  bad += variants_compile_also("OPGRAFT_TUNE_MOE_DOWN_WARP_ROUTING", "1", "OPGRAFT_TUNE_MOE_GATE_UP_SLOT_ROUTING", "1",
                               mixtral, 1, sixteen, 1);
  if (bad) fail_msg("%d problems with moe.gate_up.slot_routing and moe.down.warp_routing", bad);
}

static void test_fused_variants_compile(void **state) {
  /* moe.fused 1 (one cooperative kernel) on Qwen3-30B-A3B, Mixtral-8x7B, Kimi-K2, the odd shape
   * and the ep2 shape, at T=1 and 8 for sm_80 and sm_90: all three kernels compile spill-free. */
  need_nvrtc();
  const int ids[] = {0, 2, 4, 5, 6};
  const int bad = variants_compile("OPGRAFT_TUNE_MOE_FUSED", "1", ids, 5);
  if (bad) fail_msg("%d problems with moe.fused", bad);
}

static void test_gate_up_min_blocks_compile(void **state) {
  /* moe.gate_up.min_blocks 1, 2 and 4 (gate_up's launch bounds; clamped to 128 registers a thread):
   * Qwen3-30B-A3B, Qwen3-235B-A22B, Mixtral-8x7B, Kimi-K2 and the odd shape compile spill-free. */
  need_nvrtc();
  const int ids[] = {0, 1, 2, 4, 5};
  int bad = variants_compile("OPGRAFT_TUNE_MOE_GATE_UP_MIN_BLOCKS", "1", ids, 5);
  bad += variants_compile("OPGRAFT_TUNE_MOE_GATE_UP_MIN_BLOCKS", "2", ids, 5);
  bad += variants_compile("OPGRAFT_TUNE_MOE_GATE_UP_MIN_BLOCKS", "4", ids, 5);
  if (bad) fail_msg("%d problems with moe.gate_up.min_blocks", bad);
}

static void test_gate_up_nt_compile(void **state) {
  /* moe.gate_up.nt 1 (gate_up's one-pass path with one 8-pair tile, the second path with all of
   * them) at 16 and 33 tokens, with the shipped warps and with 16 (allowed at 16 tokens: one
   * tile's registers), on Qwen3-30B-A3B, Qwen3-235B-A22B, Mixtral-8x7B, Kimi-K2 and the odd
   * shape: spill-free. */
  need_nvrtc();
  const int ids[] = {0, 1, 2, 4, 5};
  static const int32_t tokens[] = {16, 33};
  int bad = variants_compile_at("OPGRAFT_TUNE_MOE_GATE_UP_NT", "1", ids, 5, tokens, 2);
  bad += variants_compile_also("OPGRAFT_TUNE_MOE_GATE_UP_WARPS", "16", "OPGRAFT_TUNE_MOE_GATE_UP_NT", "1", ids, 5,
                               tokens, 2);
  if (bad) fail_msg("%d problems with moe.gate_up.nt", bad);
}

static void test_trace_variants_compile(void **state) {
  /* OPGRAFT_TRACE=1 (per-block phase times, a diagnostic): the two kernels and the cooperative one
   * compile spill-free with the timer stores, on Qwen3-30B-A3B, Kimi-K2 and the odd shape. */
  need_nvrtc();
  const int ids[] = {0, 4, 5};
  int bad = variants_compile("OPGRAFT_TRACE", "1", ids, 3);
  bad += variants_compile_also("OPGRAFT_TUNE_MOE_FUSED", "1", "OPGRAFT_TRACE", "1", ids, 3, tokens_1_8, 2);
  if (bad) fail_msg("%d problems with OPGRAFT_TRACE=1", bad);
}

static void test_stream_variants_compile(void **state) {
  /* moe.stream 1 (moe_stream: bulk copies into a shared-memory ring, sm_90): at T=1 and 2 on sm_90
   * the configuration reports moe_stream as its third kernel, spill-free, for every preset (and
   * with the ring's other chunk sizes, warp counts and the copies' L2 policy on Qwen3-30B-A3B and
   * the odd shape); on sm_80, and where x's or act's rows would need more than 64 KB
   * (Qwen3-30B-A3B T=8), the two kernels stay. */
  need_nvrtc();
  static const char *const settings[][2] = {{NULL, NULL},
                                            {"OPGRAFT_TUNE_MOE_STREAM_KC", "256"},
                                            {"OPGRAFT_TUNE_MOE_STREAM_KC", "2048"},
                                            {"OPGRAFT_TUNE_MOE_STREAM_WARPS", "8"},
                                            {"OPGRAFT_TUNE_MOE_STREAM_EVICT_FIRST", "1"}};
  int bad = 0;
  setenv("OPGRAFT_TUNE_MOE_STREAM", "1", 1);
  for (size_t v = 0; v < sizeof settings / sizeof *settings; ++v) {
    if (settings[v][0]) setenv(settings[v][0], settings[v][1], 1);
    opgraft_tune_reload();
    for (size_t si = 0; si < N_SHAPES; ++si) {
      if (v > 0 && si != 0 && si != 5) continue; /* other chunks and warps: Qwen3-30B-A3B, odd */
      for (int32_t T = 1; T <= 8; T = T == 2 ? 8 : T + 1)
        for (int ar = 0; ar < 2; ++ar) {
          job j;
          memset(&j, 0, sizeof j);
          j.s = &shapes[si], j.dtype = OPGRAFT_DTYPE_BF16, j.arch = archs[ar], j.T = T;
          run_job(&j);
          char what[160];
          describe(&j, what, sizeof what);
          const int opb_fits = (long long)T * j.s->k * (2 * j.s->I + 64) <= 64 * 1024 &&
                               (long long)T * (2 * j.s->H + 64) <= 64 * 1024;
          const int want = j.arch == 90 && opb_fits ? 3 : 2;
          if (j.status != OPGRAFT_OK || j.count != want) {
            print_error("%s, moe.stream 1 %s=%s: %s, %d kernels (expected %d) %.300s\n", what,
                        settings[v][0] ? settings[v][0] : "", settings[v][1] ? settings[v][1] : "",
                        opgraft_status_name(j.status), j.count, want, j.error);
            ++bad;
            continue;
          }
          if (want == 3 && strcmp(j.info[2].name, "moe_stream_bf16") != 0) {
            print_error("%s: third kernel %s, expected moe_stream_bf16\n", what, j.info[2].name);
            ++bad;
          }
          for (int k = 0; k < j.count; ++k)
            if (j.info[k].spill_store_bytes > 0 || j.info[k].spill_load_bytes > 0) {
              print_error("%s, moe.stream 1: %s spills\n", what, j.info[k].name);
              ++bad;
            }
        }
    }
    if (settings[v][0]) unsetenv(settings[v][0]);
  }
  unsetenv("OPGRAFT_TUNE_MOE_STREAM");
  opgraft_tune_reload();
  if (bad) fail_msg("%d problems with moe.stream", bad);
}

static void test_load_forms_compile(void **state) {
  /* Every form of gate_up's and down's weight loads (moe.load, moe.down_load) compiles spill-free,
   * on Qwen3-30B-A3B and Mixtral-8x7B. */
  need_nvrtc();
  const int ids[] = {0, 2};
  int bad = 0;
  for (const char *const *v = (const char *const[]){"0", "1", "2", "3", NULL}; *v; ++v)
    bad += variants_compile("OPGRAFT_TUNE_MOE_LOAD", *v, ids, 2);
  /* down's loads (moe.down_load, sm_90 only; 1, the default, is in test_no_spills) */
  for (const char *const *v = (const char *const[]){"0", "2", "3", "4", NULL}; *v; ++v)
    bad += variants_compile("OPGRAFT_TUNE_MOE_DOWN_LOAD", *v, ids, 2);
  if (bad) fail_msg("%d problems with the moe.load / moe.down_load forms", bad);
}

static void test_real_log_parses(void **state) {
  /* The resource report of an actual compile parses. */
  need_nvrtc();
  og_cubin c;
  const int32_t st = opgraft__compile("stream_read.cu", NULL, 0, 90, &c);
  if (st != OPGRAFT_OK) fail_msg("compiling stream_read.cu: %s", opgraft_last_error());
  assert_non_null(c.log);
  opgraft_kernel_info ki;
  assert_int_equal(opgraft__parse_resources(c.log, "stream_read_u128", &ki), OPGRAFT_OK);
  assert_string_equal(ki.name, "stream_read_u128");
  assert_true(ki.registers > 0 && ki.registers <= 255);
  assert_int_equal(ki.spill_store_bytes, 0);
  assert_int_equal(ki.spill_load_bytes, 0);
  opgraft__cubin_free(&c);
}

/* A verbose ptxas log in the shape NVRTC gives it: the first entry in the older report format,
 * the second in the newer one, with spills. */
static const char canned_log[] =
    "ptxas info    : 0 bytes gmem\n"
    "ptxas info    : Compiling entry function 'moe_gate_up_bf16' for 'sm_90'\n"
    "ptxas info    : Function properties for moe_gate_up_bf16\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 176 registers, 36920 bytes smem, 400 bytes cmem[0]\n"
    "ptxas info    : Compile time = 93.120 ms\n"
    "ptxas info    : Compiling entry function 'moe_down_bf16' for 'sm_90'\n"
    "ptxas info    : Function properties for moe_down_bf16\n"
    "ptxas         .     24 bytes stack frame, 40 bytes spill stores, 64 bytes spill loads\n"
    "ptxas info    : Used 128 registers, used 1 barriers, 24 bytes cumulative stack size, 12600 bytes smem\n"
    "ptxas info    : Compile time = 89.320 ms\n";

static void test_parse_canned_log(void **state) {
  opgraft_kernel_info ki;
  assert_int_equal(opgraft__parse_resources(canned_log, "moe_gate_up_bf16", &ki), OPGRAFT_OK);
  assert_string_equal(ki.name, "moe_gate_up_bf16");
  assert_int_equal(ki.registers, 176);
  assert_int_equal(ki.spill_store_bytes, 0);
  assert_int_equal(ki.spill_load_bytes, 0);
  assert_int_equal(ki.stack_bytes, 0);
  assert_int_equal(ki.shared_bytes, 36920);

  assert_int_equal(opgraft__parse_resources(canned_log, "moe_down_bf16", &ki), OPGRAFT_OK);
  assert_string_equal(ki.name, "moe_down_bf16");
  assert_int_equal(ki.registers, 128);
  assert_int_equal(ki.spill_store_bytes, 40);
  assert_int_equal(ki.spill_load_bytes, 64);
  assert_int_equal(ki.stack_bytes, 24);
  assert_int_equal(ki.shared_bytes, 12600);
}

static void test_parse_rejects_garbage(void **state) {
  opgraft_kernel_info ki;
  assert_int_not_equal(opgraft__parse_resources("garbage", "moe_down_bf16", &ki), OPGRAFT_OK);
  assert_int_not_equal(opgraft__parse_resources("", "moe_down_bf16", &ki), OPGRAFT_OK);
  assert_int_not_equal(opgraft__parse_resources(NULL, "moe_down_bf16", &ki), OPGRAFT_OK);
  /* A name that is only a prefix of a reported one is not found. */
  assert_int_equal(opgraft__parse_resources(canned_log, "moe_down", &ki), OPGRAFT_ENOTFOUND);
  /* The entry is there but its numbers are not. */
  const char *no_numbers =
      "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
      "ptxas         .     many bytes stack frame, some bytes spill stores, few bytes spill loads\n"
      "ptxas info    : Used lots of registers\n";
  assert_int_equal(opgraft__parse_resources(no_numbers, "k", &ki), OPGRAFT_EPARSE);
  const char *no_registers =
      "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used lots of registers\n";
  assert_int_equal(opgraft__parse_resources(no_registers, "k", &ki), OPGRAFT_EPARSE);
  /* The report lines belong to the next entry, not to this one. */
  const char *borrowed =
      "ptxas info    : Compiling entry function 'a' for 'sm_90'\n"
      "ptxas info    : Compiling entry function 'b' for 'sm_90'\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 32 registers\n";
  assert_int_equal(opgraft__parse_resources(borrowed, "a", &ki), OPGRAFT_EPARSE);
  const char *no_spill_line =
      "ptxas info    : Compiling entry function 'a' for 'sm_90'\n"
      "ptxas info    : Used 10 registers\n"
      "ptxas info    : Compiling entry function 'b' for 'sm_90'\n"
      "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
      "ptxas info    : Used 32 registers\n";
  assert_int_equal(opgraft__parse_resources(no_spill_line, "a", &ki), OPGRAFT_EPARSE);
  assert_int_equal(opgraft__parse_resources(borrowed, "b", &ki), OPGRAFT_OK);
  assert_int_equal(ki.registers, 32);
}

static void test_compile_report_arguments(void **state) {
  opgraft_moe_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = OPGRAFT_DTYPE_BF16;
  a.activation = OPGRAFT_ACT_SILU;
  a.num_tokens = 1, a.hidden = 64, a.inter = 64, a.num_experts = 4, a.top_k = 2;
  a.topk_weights_dtype = OPGRAFT_DTYPE_FP32;
  a.topk_ids_dtype = OPGRAFT_DTYPE_INT32;
  opgraft_kernel_info ki[2];
  int32_t count = 0;
  assert_int_equal(opgraft_moe_compile_report(NULL, 90, ki, 2, &count), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_moe_compile_report(&a, 90, ki, 2, NULL), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_moe_compile_report(&a, 90, NULL, 2, &count), OPGRAFT_EINVAL);
  a.dtype = OPGRAFT_DTYPE_FP32;
  assert_int_equal(opgraft_moe_compile_report(&a, 90, ki, 2, &count), OPGRAFT_EUNSUPPORTED);
  a.dtype = OPGRAFT_DTYPE_BF16;
  a.num_tokens = 65;
  assert_int_equal(opgraft_moe_compile_report(&a, 90, ki, 2, &count), OPGRAFT_EUNSUPPORTED);
  a.num_tokens = 1;
  a.hidden = 48;
  assert_int_equal(opgraft_moe_compile_report(&a, 90, ki, 2, &count), OPGRAFT_EUNSUPPORTED);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse_canned_log),
      cmocka_unit_test(test_parse_rejects_garbage),
      cmocka_unit_test(test_compile_report_arguments),
      cmocka_unit_test(test_real_log_parses),
      cmocka_unit_test(test_every_variant_compiles),
      cmocka_unit_test(test_no_spills),
      cmocka_unit_test(test_pdl_variants_compile),
      cmocka_unit_test(test_one_token_variants_compile),
      cmocka_unit_test(test_slot_routing_variants_compile),
      cmocka_unit_test(test_fused_variants_compile),
      cmocka_unit_test(test_gate_up_min_blocks_compile),
      cmocka_unit_test(test_gate_up_nt_compile),
      cmocka_unit_test(test_trace_variants_compile),
      cmocka_unit_test(test_load_forms_compile),
      cmocka_unit_test(test_stream_variants_compile),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
