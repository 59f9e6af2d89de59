/* Every decode-attention kernel variant that a shipped or tunable configuration can select
 * compiles with NVRTC for sm_80 and sm_90 without register spills, in each entry point (fan-in 16,
 * and fan-in 32 where the configuration has it: sm_90's rule): each head size and group
 * size, both dtypes, every option's code path (soft cap, window, sinks, the cache write) and each tunable's other
 * values (the block size is a run-time value: it does not change the code). Configurations are
 * resolved first, then compiled as og_compile_jobs.h does. The prologue-alone kernel (OG_QK_ONLY)
 * likewise, in each head size, dtype and norm / rotary combination. */
#include "og_compile_jobs.h"
#include "attention/attention.h"
#include "../../../kernels/attention/attn_params.h"

static const int32_t archs[] = {80, 90};

/* Options of a call: 0 none, else a mask of SOFTCAP 1, WINDOW 2, SINKS32 4, SINKS16 8, UPDATE 16
 * (the call's new keys and values written by the kernel), and with UPDATE QKNORM 32, NEOX 64 and
 * GPTJ 128 (q/k norm, rotary embedding). */
static void add_job(int32_t dtype, int64_t D, int64_t G, int64_t bs, int options, int32_t arch, const char *setting) {
  opgraft_attention_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = a.kv_dtype = dtype;
  a.batch = 1, a.query_len = 1, a.num_kv_heads = 2, a.num_heads = 2 * G, a.head_size = D;
  a.block_size = bs, a.num_blocks = 1024, a.max_blocks = 64;
  a.scale = 0.1, a.softcap = options & 1 ? 30.0 : 0.0, a.window_left = options & 2 ? 255 : -1;
  if (options & 12) a.sinks = (const void *)0x1000, a.sinks_dtype = options & 4 ? OPGRAFT_DTYPE_FP32 : dtype;
  a.block_table_dtype = a.seq_lens_dtype = OPGRAFT_DTYPE_INT32;
  a.q_stride[0] = a.out_stride[0] = 2 * G * D, a.q_stride[1] = a.out_stride[1] = D, a.q_stride[2] = a.out_stride[2] = 1;
  const int64_t st[4] = {bs * 2 * 2 * D, 2 * 2 * D, 2 * D, 1};
  memcpy(a.k_stride, st, sizeof st), memcpy(a.v_stride, st, sizeof st);
  a.block_table_stride[0] = 64, a.block_table_stride[1] = 1;
  if (options & 16) {
    a.k_new = a.v_new = a.slot_mapping = (const void *)0x1000, a.slot_mapping_dtype = OPGRAFT_DTYPE_INT64;
    a.k_new_stride[0] = a.v_new_stride[0] = 2 * D * 3, a.k_new_stride[1] = a.v_new_stride[1] = D;
  }
  if (options & 32)
    a.q_norm_weight = a.k_norm_weight = (const void *)0x1000, a.qk_norm_dtype = dtype, a.qk_norm_eps = 1e-6;
  if (options & 192) {
    a.rope_style = options & 64 ? OPGRAFT_ROPE_NEOX : OPGRAFT_ROPE_GPTJ;
    a.cos_sin_cache = a.positions = (const void *)0x1000, a.cos_sin_dtype = dtype, a.cos_sin_stride = D;
    a.rope_rows = 4096, a.positions_dtype = OPGRAFT_DTYPE_INT64;
  }
  a.arch = arch;
  og_job *j = og_job_new("%s D=%lld G=%lld bs=%lld options=%d sm_%d%s%s", dtype == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16",
                         (long long)D, (long long)G, (long long)bs, options, arch, setting ? " with " : "",
                         setting ? setting : "");
  j->source = OG_ATTN_SOURCE, j->arch = arch;
  char reason[256];
  if (opgraft__attn_check_static(&a, reason, sizeof reason)) fail_msg("%s: refused: %s", j->what, reason);
  og_attn_cfg cfg;
  opgraft__attn_config(&a, arch, NULL, &cfg);
  if (opgraft__attn_options(&a, &cfg, &j->opts) != OPGRAFT_OK) fail_msg("%s: %s", j->what, opgraft_last_error());
  j->nfn = cfg.fan32 ? 2 : 1; /* fan-in 16's entry point, and fan-in 32's with attention.fan32 */
  for (int f = 0; f < j->nfn; ++f) opgraft__attn_fn_name(dtype, f ? OG_ATTN_FAN_MAX_LOG2 : OG_ATTN_FAN_LOG2, j->fn[f]);
  og_job_done(j);
}

/* The prologue alone (OG_QK_ONLY, opgraft_attention_prologue_run): every head size, dtype and
 * combination of the q/k norm and the rotary embedding's styles. */
static void add_prologue_jobs(void) {
  for (int D = 64; D <= 256; D *= 2)
    for (int dt = 0; dt < 2; ++dt)
      for (int norm = 0; norm < 2; ++norm)
        for (int rope = OPGRAFT_ROPE_NONE; rope <= OPGRAFT_ROPE_GPTJ; ++rope)
          for (int ar = 0; ar < 2 && (norm || rope); ++ar) {
            const int32_t dtype = dt ? OPGRAFT_DTYPE_FP16 : OPGRAFT_DTYPE_BF16;
            opgraft_attention_args a;
            memset(&a, 0, sizeof a);
            a.struct_size = sizeof a;
            a.dtype = dtype, a.batch = 128, a.num_heads = 32, a.num_kv_heads = 4, a.head_size = D;
            a.q_stride[0] = a.out_stride[0] = 40 * D, a.q_stride[1] = a.out_stride[1] = D;
            a.q_stride[2] = a.out_stride[2] = 1;
            a.k_new = (const void *)0x1000, a.k_new_stride[0] = 40 * D, a.k_new_stride[1] = D;
            if (norm) a.q_norm_weight = a.k_norm_weight = (const void *)0x1000, a.qk_norm_dtype = dtype, a.qk_norm_eps = 1e-6;
            if (rope) {
              a.rope_style = rope, a.cos_sin_cache = a.positions = (const void *)0x1000, a.cos_sin_dtype = dtype;
              a.cos_sin_stride = D, a.rope_rows = 4096, a.positions_dtype = OPGRAFT_DTYPE_INT64;
            }
            const int64_t ko[2] = {4 * D, D};
            og_job *j = og_job_new("prologue alone %s D=%d norm=%d rope=%d sm_%d", dt ? "fp16" : "bf16", D, norm, rope,
                                   archs[ar]);
            j->source = OG_ATTN_SOURCE, j->arch = archs[ar];
            char reason[256];
            if (opgraft__attn_check_prologue_alone(&a, ko, reason, sizeof reason))
              fail_msg("%s: refused: %s", j->what, reason);
            if (opgraft__attn_prologue_options(&a, &j->opts) != OPGRAFT_OK) fail_msg("%s: %s", j->what, opgraft_last_error());
            j->nfn = 1;
            opgraft__attn_prologue_fn_name(dtype, j->fn[0]);
            og_job_done(j);
          }
}

typedef struct variant {
  int32_t dtype;
  int64_t D, G, bs;
  int options;
} variant;

/* The jobs of one setting (NULL: the shipped tables) over variants x both archs. */
static void add_setting(const char *const *env, const variant *v, int nv) {
  char setting[200];
  og_setting_apply(env, setting, sizeof setting);
  for (int i = 0; i < nv; ++i)
    for (int a = 0; a < 2; ++a) add_job(v[i].dtype, v[i].D, v[i].G, v[i].bs, v[i].options, archs[a], env ? setting : NULL);
  og_setting_clear(env);
}

#define BF OPGRAFT_DTYPE_BF16
#define FP OPGRAFT_DTYPE_FP16

static int setup(void **state) {
  if (!og_jobs_setup()) return 0;
  /* The shipped configuration: every head size and group size in bf16, block 16. */
  static const variant shipped[] = {
      {BF, 64, 1, 16, 0},  {BF, 64, 2, 16, 0},  {BF, 64, 4, 16, 0},  {BF, 64, 8, 16, 0},  {BF, 64, 16, 16, 0},
      {BF, 128, 1, 16, 0}, {BF, 128, 2, 16, 0}, {BF, 128, 4, 16, 0}, {BF, 128, 8, 16, 0}, {BF, 128, 16, 16, 0},
      {BF, 256, 1, 16, 0}, {BF, 256, 2, 16, 0}, {BF, 256, 4, 16, 0}, {BF, 256, 8, 16, 0}, {BF, 128, 5, 16, 0},
      {BF, 128, 12, 16, 0},
      /* fp16 (the same code but for its conversions) */
      {FP, 64, 8, 16, 0},  {FP, 128, 1, 16, 0}, {FP, 128, 8, 16, 0}, {FP, 128, 16, 16, 0}, {FP, 256, 8, 16, 0},
      /* the options' code paths, and other block sizes */
      {BF, 64, 8, 16, 3},  {BF, 128, 8, 16, 7}, {BF, 128, 16, 16, 7}, {BF, 256, 8, 16, 7}, {BF, 64, 16, 16, 15 & ~4},
      {FP, 128, 8, 16, 11}, {BF, 128, 1, 16, 8}, {BF, 256, 1, 16, 3}, {FP, 64, 4, 16, 2},
  };
  add_setting(NULL, shipped, (int)(sizeof shipped / sizeof *shipped));
  /* The cache write in the kernel, over every shipped variant and with the settings it may run with. */
  variant written[sizeof shipped / sizeof *shipped];
  const int nwritten = (int)(sizeof shipped / sizeof *shipped);
  for (int i = 0; i < nwritten; ++i) written[i] = shipped[i], written[i].options |= 16;
  add_setting(NULL, written, nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_PDL", "1", NULL}, written, nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_CLUSTER", "8", NULL}, written, nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_WARPS", "12", NULL}, written, nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_WARPS", "16", NULL}, written, nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_WARPS", "1", NULL}, written, nwritten);
  /* q/k norm and NeoX rotary embedding (Qwen3's) over every shipped variant with the settings the
   * cache write takes; GPT-J, and each alone, over some. */
  variant prologue[sizeof shipped / sizeof *shipped];
  for (int i = 0; i < nwritten; ++i) prologue[i] = written[i], prologue[i].options |= 32 | 64;
  add_setting(NULL, prologue, nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_PDL", "1", NULL}, prologue, nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_CLUSTER", "8", NULL}, prologue, nwritten);
  static const variant pro_some[] = {{BF, 64, 8, 16, 16 | 32 | 128}, {BF, 128, 8, 16, 16 | 32 | 128},
                                     {FP, 256, 4, 16, 16 | 32 | 128}, {BF, 128, 4, 16, 16 | 64},
                                     {BF, 64, 16, 16, 16 | 128 | 3},  {BF, 128, 16, 16, 16 | 32 | 7},
                                     {BF, 256, 1, 16, 16 | 32},       {FP, 128, 8, 16, 16 | 64 | 11}};
  const int npro = (int)(sizeof pro_some / sizeof *pro_some);
  add_setting(NULL, pro_some, npro);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_WARPS", "16", NULL}, pro_some, npro);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_WARPS", "1", NULL}, pro_some, npro);
  /* Each tunable's other values, where they change the code. */
  static const variant some[] = {{BF, 64, 8, 16, 0},   {BF, 128, 8, 16, 0}, {BF, 128, 16, 16, 7},
                                 {BF, 256, 8, 16, 0},  {BF, 128, 1, 16, 0}, {FP, 256, 4, 16, 3}};
  const int nsome = (int)(sizeof some / sizeof *some);
  for (const char *const *w = (const char *const[]){"1", "2", "8", "12", "16", NULL}; *w; ++w)
    add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_WARPS", *w, NULL}, some, nsome);
  for (const char *const *m = (const char *const[]){"1", "2", NULL}; *m; ++m)
    add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_MIN_BLOCKS", *m, NULL}, some, nsome);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_WARPS", "2", "OPGRAFT_TUNE_ATTENTION_MIN_BLOCKS", "8", NULL}, some,
              nsome);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_LOAD", "1", NULL}, some, nsome);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_PDL", "1", NULL}, some, nsome);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_TRIGGER", "1", NULL}, shipped,
              (int)(sizeof shipped / sizeof *shipped));
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_PDL", "1", "OPGRAFT_TUNE_ATTENTION_TRIGGER", "1", NULL}, some,
              nsome);
  /* The cluster merge (sm_90; on sm_80 the setting compiles the shipped code) over every shipped
   * variant, and with the warps and PDL it may be tuned with. */
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_CLUSTER", "8", NULL}, shipped,
              (int)(sizeof shipped / sizeof *shipped));
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_CLUSTER", "4", "OPGRAFT_TUNE_ATTENTION_WARPS", "8", NULL}, some,
              nsome);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_CLUSTER", "8", "OPGRAFT_TUNE_ATTENTION_PDL", "1", NULL}, some,
              nsome);
  /* The V prefetch over every shipped variant with the cache write, at the shipped warps (sm_90's
   * 12 for head 128, where ptxas must fit it in 168 registers) and at 8, with the prologue, and
   * with the cluster merge. */
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_VPF", "1", NULL}, written, nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_VPF", "1", "OPGRAFT_TUNE_ATTENTION_WARPS", "8", NULL}, written,
              nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_VPF", "1", NULL}, prologue, nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_VPF", "1", "OPGRAFT_TUNE_ATTENTION_WARPS", "8", NULL}, prologue,
              nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_VPF", "1", NULL}, some, nsome);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_VPF", "1", "OPGRAFT_TUNE_ATTENTION_WARPS", "8",
                               "OPGRAFT_TUNE_ATTENTION_CLUSTER", "8", NULL},
              some, nsome);
  /* Two tiles a round over every shipped variant with the cache write, at the shipped warps (where
   * the registers allow it; else one) and at 8, with the prologue, and with the cluster merge. */
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_ROUND", "2", NULL}, written, nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_ROUND", "2", "OPGRAFT_TUNE_ATTENTION_WARPS", "8", NULL}, written,
              nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_ROUND", "2", "OPGRAFT_TUNE_ATTENTION_WARPS", "8", NULL}, prologue,
              nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_ROUND", "2", NULL}, some, nsome);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_ROUND", "2", "OPGRAFT_TUNE_ATTENTION_WARPS", "8",
                               "OPGRAFT_TUNE_ATTENTION_CLUSTER", "8", NULL},
              some, nsome);
  /* The first round before the wait (PDL 2, with the cache write only) over every shipped variant
   * with it, with the trigger, with two tiles a round at 8 warps, the V prefetch and the prologue. */
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_PDL", "2", "OPGRAFT_TUNE_ATTENTION_TRIGGER", "1", NULL}, written,
              nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_PDL", "2", "OPGRAFT_TUNE_ATTENTION_ROUND", "2",
                               "OPGRAFT_TUNE_ATTENTION_WARPS", "8", NULL},
              written, nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_PDL", "2", "OPGRAFT_TUNE_ATTENTION_VPF", "1", NULL}, written,
              nwritten);
  add_setting((const char *[]){"OPGRAFT_TUNE_ATTENTION_PDL", "2", NULL}, prologue, nwritten);
  add_prologue_jobs();
  og_jobs_compile("attention");
  return 0;
}

static void test_every_variant_compiles(void **state) {
  og_need_nvrtc();
  assert_true(og_nunique > 60 && og_nunique <= og_njobs);
  og_jobs_check_compiled();
  int fan32 = 0;
  for (int i = 0; i < og_njobs; ++i) {
    fan32 += og_jobs[i].nfn == 2;
    const int decode = strncmp(og_jobs[i].fn[0], "attention_decode", 16) == 0; /* not the prologue alone */
    if (decode && og_jobs[i].arch == 90 && og_jobs[i].nfn != 2) /* sm_90's rule has fan-in 32 everywhere the jobs go */
      fail_msg("%s: no fan-in 32 entry point", og_jobs[i].what);
  }
  assert_true(fan32 > 0 && fan32 < og_njobs);
}

static void test_no_spills(void **state) { og_jobs_check_no_spills(); }

static void test_report_matches_the_jobs(void **state) {
  /* opgraft_attention_compile_report (the public entry point) agrees with the job list's compile:
   * og_jobs[1] is bf16 D=64 G=1 block 16 on sm_90. */
  og_need_nvrtc();
  opgraft_attention_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = a.kv_dtype = BF;
  a.batch = 1, a.query_len = 1, a.num_kv_heads = 2, a.num_heads = 2, a.head_size = 64;
  a.block_size = 16, a.num_blocks = 1024, a.max_blocks = 64, a.scale = 0.1, a.window_left = -1;
  a.block_table_dtype = a.seq_lens_dtype = OPGRAFT_DTYPE_INT32;
  a.q_stride[2] = a.out_stride[2] = a.k_stride[3] = a.v_stride[3] = a.block_table_stride[1] = 1;
  opgraft_kernel_info ki[2];
  int32_t count = 0;
  assert_int_equal(opgraft_attention_compile_report(&a, 90, ki, 2, &count), OPGRAFT_OK);
  assert_int_equal(count, 2); /* fan-in 16's kernel, then fan-in 32's */
  assert_non_null(strstr(og_jobs[1].what, "bf16 D=64 G=1 bs=16 options=0 sm_90"));
  assert_string_equal(ki[0].name, "attention_decode_bf16");
  assert_string_equal(ki[1].name, "attention_decode_fan32_bf16");
  for (int f = 0; f < 2; ++f) assert_int_equal(ki[f].registers, og_job_result(1)->info[f].registers);
  assert_int_equal(opgraft_attention_compile_report(&a, 90, ki, 1, &count), OPGRAFT_OK); /* room for one */
  assert_int_equal(count, 2);
  assert_string_equal(ki[0].name, "attention_decode_bf16");
  assert_int_equal(opgraft_attention_compile_report(&a, 80, ki, 2, &count), OPGRAFT_OK);
  assert_int_equal(count, 1); /* no fan-in 32 on sm_80 */
  assert_string_equal(ki[0].name, "attention_decode_bf16");
  /* The main variants' resources, for the record (and the Qwen3-30B-A3B D128 G8, D64 G8 and D128
   * G4 variants' at both fan-ins). */
  for (int i = 0; i < og_njobs; ++i) {
    const og_job *r = og_job_result(i);
    const char *what = og_jobs[i].what;
    if ((strstr(what, "G=8 bs=16 options=0") || strstr(what, "bf16 D=128 G=4 bs=16 options=0")) && !strstr(what, " with "))
      for (int f = 0; f < r->nfn; ++f)
        print_message("  %s, %s: %d registers, %d bytes static shared\n", what, r->info[f].name,
                      r->info[f].registers, r->info[f].shared_bytes);
  }
}

static void test_compile_report_arguments(void **state) {
  opgraft_kernel_info ki;
  int32_t count = 0;
  assert_int_equal(opgraft_attention_compile_report(NULL, 90, &ki, 1, &count), OPGRAFT_EINVAL);
  opgraft_attention_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  assert_int_equal(opgraft_attention_compile_report(&a, 90, &ki, 1, NULL), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_attention_compile_report(&a, 90, NULL, 1, &count), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_attention_compile_report(&a, 90, &ki, 1, &count), OPGRAFT_EUNSUPPORTED);
  char buf[64];
  assert_int_equal(opgraft_attention_describe(&a, 90, buf, sizeof buf), OPGRAFT_EUNSUPPORTED);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_compile_report_arguments),
      cmocka_unit_test(test_every_variant_compiles),
      cmocka_unit_test(test_no_spills),
      cmocka_unit_test(test_report_matches_the_jobs),
  };
  return cmocka_run_group_tests(tests, setup, og_jobs_teardown);
}
