/* Every MoE kernel variant that a shipped or tunable configuration can select compiles with NVRTC
 * without register spills. The configurations are resolved first (the shipped tables and rules,
 * then each tunable's other values), then compiled as og_compile_jobs.h does (the kernel cache is
 * keyed by the sources, options, arch and NVRTC version, so a changed kernel is compiled again). */
#include "og_compile_jobs.h"
#include "moe/moe.h"

typedef struct shape {
  const char *name;
  int64_t E, H, I, k;
  int64_t global_experts; /* > 0: expert parallelism, the kernels with an expert_map */
} shape;

static const shape shapes[] = {
    {"Qwen3-30B-A3B", 128, 2048, 768, 8, 0},  {"Qwen3-235B-A22B", 128, 4096, 1536, 8, 0},
    {"Mixtral-8x7B", 8, 4096, 14336, 2, 0},   {"DeepSeek-V3", 256, 7168, 2048, 8, 0},
    {"Kimi-K2", 384, 7168, 2048, 8, 0},       {"odd", 7, 96, 160, 3, 0},
    {"Qwen3-30B-A3B/ep2", 64, 2048, 768, 8, 128}, {"DeepSeek-V3/ep64", 4, 7168, 2048, 8, 256},
    /* per-rank shapes of the FP8 jobs: tensor parallelism 8 (I/8) and 4, expert parallelism 8 */
    {"DeepSeek-V3/tp8", 256, 7168, 256, 8, 0}, {"Kimi-K2/tp8", 384, 7168, 256, 8, 0},
    {"DeepSeek-V3/ep8", 32, 7168, 2048, 8, 256}, {"Kimi-K2/ep8", 48, 7168, 2048, 8, 384},
    {"Qwen3-30B-A3B/tp4", 128, 2048, 192, 8, 0}, {"Qwen3-30B-A3B/tp8", 128, 2048, 96, 8, 0},
    {"Qwen3-235B-A22B/tp4", 128, 4096, 384, 8, 0},
};
enum { Q30, Q235, MIX, DSV3, KIMI, ODD, EP2, EP64, DSV3_TP8, KIMI_TP8, DSV3_EP8, KIMI_EP8, Q30_TP4, Q30_TP8, Q235_TP4 };
/* The shapes of the bf16/fp16 jobs (unchanged since before the FP8 kernels). */
#define N_SHAPES 8
static const int32_t token_counts[] = {1, 2, 4, 8, 9, 16, 17, 32, 33, 64};
#define N_TOKENS ((int)(sizeof token_counts / sizeof *token_counts))
static const int32_t archs[] = {80, 90};
/* FP8 weights need sm_89 (mma.sync e4m3): their jobs compile for sm_89 and sm_90. */
static const int32_t fp8_archs[] = {89, 90};

/* The weights of a job: bf16/fp16 (NONE), or FP8 with block scales of a size, or per-tensor. */
typedef struct quant {
  int32_t layout, block;
} quant;
static const quant Q_NONE = {OPGRAFT_MOE_SCALE_NONE, 0}, Q_B128 = {OPGRAFT_MOE_SCALE_BLOCK, 128},
                   Q_B64 = {OPGRAFT_MOE_SCALE_BLOCK, 64}, Q_B32 = {OPGRAFT_MOE_SCALE_BLOCK, 32},
                   Q_TENSOR = {OPGRAFT_MOE_SCALE_TENSOR, 0};

/* Each job's weight dtype, indexed as og_jobs. */
static int32_t job_weight_dtype[OG_JOB_MAX];
/* The routing of the jobs added (opgraft_moe_routing; routed jobs take no expert map). */
static int32_t job_routing;
/* FP8 jobs added with 16-bit hidden states that gate_up quantizes (hidden_dtype = dtype). */
static int job_hidden16;
/* The GPU name the jobs added resolve their rows under (NULL: the rows of every GPU of the arch). */
static const char *job_gpu;

/* Adds the configuration that the current tunables give (shape s, T tokens, dtype, weights, arch). */
static void add_job(int s, int32_t T, int32_t dtype, quant qz, int32_t arch, const char *setting) {
  opgraft_moe_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = dtype;
  a.activation = OPGRAFT_ACT_SILU;
  a.num_tokens = T, a.hidden = shapes[s].H, a.inter = shapes[s].I, a.num_experts = shapes[s].E, a.top_k = shapes[s].k;
  a.topk_weights_dtype = OPGRAFT_DTYPE_FP32;
  a.topk_ids_dtype = OPGRAFT_DTYPE_INT32;
  a.arch = arch;
  a.routing = job_routing;
  if (job_routing) a.router_logits = (const void *)0x1000, a.router_logits_stride[0] = a.num_experts;
  if (shapes[s].global_experts && !job_routing) /* the compile looks at whether there is a map, never at its data */
    a.expert_map = (const void *)0x1000, a.expert_map_len = shapes[s].global_experts;
  char wq[32] = "";
  if (qz.layout != OPGRAFT_MOE_SCALE_NONE) {
    a.weight_dtype = OPGRAFT_DTYPE_FP8_E4M3, a.scale_layout = qz.layout, a.scale_dtype = OPGRAFT_DTYPE_FP32;
    a.block_n = a.block_k = qz.block;
    if (job_hidden16) a.hidden_dtype = dtype;
    if (qz.layout == OPGRAFT_MOE_SCALE_BLOCK)
      snprintf(wq, sizeof wq, " fp8 %dx%d blocks%s", qz.block, qz.block, job_hidden16 ? ", 16-bit x" : "");
    else
      snprintf(wq, sizeof wq, " fp8 per-tensor%s", job_hidden16 ? ", 16-bit x" : "");
  }
  og_job *j = og_job_new("%s (E=%lld H=%lld I=%lld k=%lld) %s%s T=%d sm_%d%s%s", shapes[s].name,
                         (long long)shapes[s].E, (long long)shapes[s].H, (long long)shapes[s].I, (long long)shapes[s].k,
                         dtype == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16", wq, T, arch, setting ? " with " : "",
                         setting ? setting : "");
  if (job_routing)
    snprintf(j->what + strlen(j->what), sizeof j->what - strlen(j->what), " routed %s",
             job_routing == OPGRAFT_MOE_ROUTING_SOFTMAX ? "softmax" : "softmax-renorm");
  if (job_gpu) snprintf(j->what + strlen(j->what), sizeof j->what - strlen(j->what), " on %s", job_gpu);
  job_weight_dtype[og_njobs] = a.weight_dtype;
  j->source = opgraft__moe_source(&a), j->arch = arch;
  og_moe_cfg cfg;
  opgraft__moe_config(&a, arch, job_gpu, &cfg);
  j->nfn = opgraft__moe_nkernels(&a, &cfg);
  char names[OG_MOE_KERNELS][64];
  opgraft__moe_fn_names(&a, names);
  for (int k = 0; k < j->nfn; ++k) memcpy(j->fn[k], names[k], sizeof j->fn[k]);
  if (opgraft__moe_options(&a, &cfg, &j->opts) != OPGRAFT_OK) fail_msg("%s: %s", j->what, opgraft_last_error());
  og_job_done(j);
}

/* The jobs of one setting (NULL: the shipped tables) over shapes ids[] x tokens[] x both archs
 * (sm_80 and sm_90; FP8 weights: sm_89 and sm_90). */
static void add_setting_q(const char *const *env, const int *ids, int nids, const int32_t *tokens, int ntokens,
                          int32_t dtype, quant qz) {
  char setting[200];
  og_setting_apply(env, setting, sizeof setting);
  const int32_t *ar = qz.layout == OPGRAFT_MOE_SCALE_NONE ? archs : fp8_archs;
  for (int s = 0; s < nids; ++s)
    for (int t = 0; t < ntokens; ++t)
      for (int a = 0; a < 2; ++a) add_job(ids[s], tokens[t], dtype, qz, ar[a], env ? setting : NULL);
  og_setting_clear(env);
}

static void add_setting(const char *const *env, const int *ids, int nids, const int32_t *tokens, int ntokens,
                        int32_t dtype) {
  add_setting_q(env, ids, nids, tokens, ntokens, dtype, Q_NONE);
}

static int setup(void **state) {
  if (!og_jobs_setup()) return 0;
  static const int all[] = {Q30, Q235, MIX, DSV3, KIMI, ODD, EP2, EP64};
  static const int q30_ep2[] = {Q30, EP2}, q30_mix[] = {Q30, MIX}, five[] = {Q30, Q235, MIX, KIMI, ODD};
  static const int32_t t1_8[] = {1, 8}, t1[] = {1}, t4[] = {4}, t16[] = {16}, t16_33[] = {16, 33}, t1_9_33[] = {1, 9, 33};
  /* The shipped configurations: every shape and token count in bf16; fp16 (the same code but for
   * its conversions) at one, two and five token tiles. */
  add_setting(NULL, all, N_SHAPES, token_counts, N_TOKENS, OPGRAFT_DTYPE_BF16);
  add_setting(NULL, all, N_SHAPES, t1_9_33, 3, OPGRAFT_DTYPE_FP16);
  /* Routed from the logits (no expert map): every shape but the expert-parallel ones. */
  {
    static const int plain[] = {Q30, Q235, MIX, DSV3, KIMI, ODD};
    static const int32_t tr[] = {1, 2, 8, 9, 33, 64};
    job_routing = OPGRAFT_MOE_ROUTING_SOFTMAX_RENORM;
    add_setting(NULL, plain, 6, tr, 6, OPGRAFT_DTYPE_BF16);
    add_setting(NULL, plain, 6, t1, 1, OPGRAFT_DTYPE_FP16);
    add_setting((const char *[]){"OPGRAFT_TUNE_MOE_PDL", "1", "OPGRAFT_TUNE_MOE_DOWN_EARLY", "1",
                                 "OPGRAFT_TUNE_MOE_PDL_IN", "1", NULL}, q30_mix, 2, t1_8, 2, OPGRAFT_DTYPE_BF16);
    add_setting((const char *[]){"OPGRAFT_TUNE_MOE_FUSED", "1", NULL}, q30_mix, 2, t1_8, 2, OPGRAFT_DTYPE_BF16);
    add_setting((const char *[]){"OPGRAFT_TUNE_MOE_PDL", "1", "OPGRAFT_TUNE_MOE_TRIGGER", "1", NULL}, q30_mix, 2, t1_8,
                2, OPGRAFT_DTYPE_BF16);
    add_setting((const char *[]){"OPGRAFT_TUNE_MOE_GATE_UP_SLOT_ROUTING", "1", "OPGRAFT_TUNE_MOE_DOWN_WARP_ROUTING", "1",
                                 NULL}, q30_mix, 2, t1_8, 2, OPGRAFT_DTYPE_BF16);
    job_routing = OPGRAFT_MOE_ROUTING_SOFTMAX;
    add_setting(NULL, q30_mix, 2, t1_8, 2, OPGRAFT_DTYPE_BF16);
    job_routing = OPGRAFT_MOE_ROUTING_TOPK;
  }
  /* Each tunable's other values where they change the code. */
  add_setting((const char *[]){"OPGRAFT_TUNE_MOE_PDL", "1", NULL}, q30_ep2, 2, t1_8, 2, OPGRAFT_DTYPE_BF16);
  add_setting((const char *[]){"OPGRAFT_TUNE_MOE_PDL", "1", "OPGRAFT_TUNE_MOE_DOWN_EARLY", "1", NULL}, q30_ep2, 2, t1_8,
              2, OPGRAFT_DTYPE_BF16);
  add_setting((const char *[]){"OPGRAFT_TUNE_MOE_PDL", "1", "OPGRAFT_TUNE_MOE_DOWN_EARLY", "1",
                               "OPGRAFT_TUNE_MOE_DOWN_ONE_TOKEN", "1", "OPGRAFT_TUNE_MOE_PDL_IN", "1",
                               "OPGRAFT_TUNE_MOE_GATE_UP_ONE_TOKEN", "1", NULL},
              q30_ep2, 2, t1, 1, OPGRAFT_DTYPE_BF16);
  add_setting((const char *[]){"OPGRAFT_TUNE_MOE_GATE_UP_SLOT_ROUTING", "1", "OPGRAFT_TUNE_MOE_DOWN_WARP_ROUTING", "1",
                               NULL},
              (const int[]){Q30}, 1, t4, 1, OPGRAFT_DTYPE_BF16);
  add_setting((const char *[]){"OPGRAFT_TUNE_MOE_GATE_UP_SLOT_ROUTING", "1", "OPGRAFT_TUNE_MOE_DOWN_WARP_ROUTING", "1",
                               NULL},
              (const int[]){MIX}, 1, t16, 1, OPGRAFT_DTYPE_BF16);
  add_setting((const char *[]){"OPGRAFT_TUNE_MOE_FUSED", "1", NULL}, (const int[]){Q30, MIX, KIMI, ODD, EP2}, 5, t1_8, 2,
              OPGRAFT_DTYPE_BF16);
  for (const char *const *v = (const char *const[]){"1", "2", "4", NULL}; *v; ++v)
    add_setting((const char *[]){"OPGRAFT_TUNE_MOE_GATE_UP_MIN_BLOCKS", *v, NULL}, five, 5, t1_8, 2, OPGRAFT_DTYPE_BF16);
  add_setting((const char *[]){"OPGRAFT_TUNE_MOE_GATE_UP_NT", "1", NULL}, five, 5, t16_33, 2, OPGRAFT_DTYPE_BF16);
  add_setting((const char *[]){"OPGRAFT_TUNE_MOE_GATE_UP_NT", "1", "OPGRAFT_TUNE_MOE_GATE_UP_WARPS", "16", NULL}, five, 5,
              t16_33, 2, OPGRAFT_DTYPE_BF16);
  add_setting((const char *[]){"OPGRAFT_TRACE", "1", NULL}, (const int[]){Q30, KIMI, ODD}, 3, t1_8, 2,
              OPGRAFT_DTYPE_BF16);
  add_setting((const char *[]){"OPGRAFT_TRACE", "1", "OPGRAFT_TUNE_MOE_FUSED", "1", NULL}, (const int[]){Q30, KIMI, ODD},
              3, t1_8, 2, OPGRAFT_DTYPE_BF16);
  /* Both weight-load forms in both stages (down's form 4 on sm_90 only: sm_80 keeps form 1). */
  for (const char *const *v = (const char *const[]){"1", "4", NULL}; *v; ++v) {
    add_setting((const char *[]){"OPGRAFT_TUNE_MOE_LOAD", *v, NULL}, q30_mix, 2, t1_8, 2, OPGRAFT_DTYPE_BF16);
    add_setting((const char *[]){"OPGRAFT_TUNE_MOE_DOWN_LOAD", *v, NULL}, q30_mix, 2, t1_8, 2, OPGRAFT_DTYPE_BF16);
  }
  /* FP8 weights (moe_fp8.cu): the shipped configurations with 128x128 block scales over the
   * presets, their per-rank shapes and every token count; 64x64 and 32x32 blocks (vLLM 0.33's
   * refined blocks where I/tp is no multiple of 128) and per-tensor scales at odd sizes; fp16
   * output; then each tunable the FP8 kernels read, where it changes their code. */
  static const int fp8_presets[] = {Q30, Q235, MIX, DSV3, KIMI, EP2, EP64, DSV3_TP8, KIMI_TP8, DSV3_EP8, KIMI_EP8};
  static const int fp8_odd[] = {ODD, Q30_TP4, Q30_TP8, MIX, Q30};
  static const int32_t t1_4_8[] = {1, 4, 8};
  add_setting_q(NULL, fp8_presets, 11, token_counts, N_TOKENS, OPGRAFT_DTYPE_BF16, Q_B128);
  add_setting_q(NULL, (const int[]){Q30_TP4, DSV3_TP8}, 2, t1_9_33, 3, OPGRAFT_DTYPE_BF16, Q_B64);
  add_setting_q(NULL, (const int[]){ODD, Q30_TP8}, 2, t1_9_33, 3, OPGRAFT_DTYPE_BF16, Q_B32);
  add_setting_q(NULL, fp8_odd, 5, token_counts, N_TOKENS, OPGRAFT_DTYPE_BF16, Q_TENSOR);
  /* FP8 routed from the logits: the block shapes the routing seam takes, and PDL */
  job_routing = OPGRAFT_MOE_ROUTING_SOFTMAX_RENORM;
  add_setting_q(NULL, (const int[]){Q30, DSV3_TP8, KIMI_TP8}, 3, (const int32_t[]){1, 2, 4, 8}, 4,
                OPGRAFT_DTYPE_BF16, Q_B128);
  add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_PDL", "1", "OPGRAFT_TUNE_MOE_DOWN_EARLY", "1",
                                 "OPGRAFT_TUNE_MOE_PDL_IN", "1", NULL},
                (const int[]){Q30, DSV3_TP8}, 2, (const int32_t[]){1, 2}, 2, OPGRAFT_DTYPE_BF16, Q_B128);
  add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_TRIGGER", "1", NULL}, (const int[]){Q30, DSV3_TP8}, 2,
                (const int32_t[]){1, 2}, 2, OPGRAFT_DTYPE_BF16, Q_B128);
  /* ... with 16-bit hidden states that gate_up quantizes (the routing seam's calls): both k-steps,
   * 64x64 blocks, fp16, and without the rule's slot routing */
  job_hidden16 = 1;
  static const int xq_shapes[] = {Q30, DSV3, DSV3_TP8, KIMI_TP8, Q235};
  add_setting_q(NULL, xq_shapes, 5, (const int32_t[]){1, 2, 4, 8}, 4, OPGRAFT_DTYPE_BF16, Q_B128);
  add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_FP8_KSTEP", "32", NULL}, xq_shapes, 5, (const int32_t[]){1, 2, 8},
                3, OPGRAFT_DTYPE_BF16, Q_B128);
  add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_PDL", "1", "OPGRAFT_TUNE_MOE_DOWN_EARLY", "1",
                                 "OPGRAFT_TUNE_MOE_PDL_IN", "1", NULL},
                (const int[]){Q30, DSV3_TP8}, 2, (const int32_t[]){1, 2}, 2, OPGRAFT_DTYPE_BF16, Q_B128);
  add_setting_q(NULL, (const int[]){Q30_TP4, DSV3_TP8}, 2, (const int32_t[]){1, 2}, 2, OPGRAFT_DTYPE_BF16, Q_B64);
  add_setting_q(NULL, (const int[]){Q30}, 1, (const int32_t[]){1, 2}, 2, OPGRAFT_DTYPE_FP16, Q_B128);
  add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_GATE_UP_SLOT_ROUTING", "0", "OPGRAFT_TUNE_MOE_GATE_UP_FP8_ROWS", "32",
                                 NULL},
                (const int[]){Q30, DSV3_TP8}, 2, (const int32_t[]){1, 2, 8}, 3, OPGRAFT_DTYPE_BF16, Q_B128);
  /* per-tensor scales, 16-bit hidden states in 1 x 128 groups: Mixtral-8x7B's tuned rows, fp16, PDL */
  add_setting_q(NULL, (const int[]){MIX, Q30}, 2, (const int32_t[]){1, 2, 3, 4, 8}, 5, OPGRAFT_DTYPE_BF16, Q_TENSOR);
  add_setting_q(NULL, (const int[]){MIX}, 1, (const int32_t[]){1, 2}, 2, OPGRAFT_DTYPE_FP16, Q_TENSOR);
  add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_FP8_KSTEP", "32", NULL}, (const int[]){MIX}, 1,
                (const int32_t[]){1, 8}, 2, OPGRAFT_DTYPE_BF16, Q_TENSOR);
  job_hidden16 = 0;
  /* the rows of one GPU name (the H100's FP8 rows): top-k ids, and routed with 16-bit x */
  job_gpu = "NVIDIA H100 80GB HBM3";
  static const int h100_fp8[] = {Q30, Q235_TP4, KIMI_TP8, DSV3_TP8};
  job_routing = OPGRAFT_MOE_ROUTING_TOPK;
  add_setting_q(NULL, h100_fp8, 4, (const int32_t[]){1, 2, 4, 8}, 4, OPGRAFT_DTYPE_BF16, Q_B128);
  job_routing = OPGRAFT_MOE_ROUTING_SOFTMAX_RENORM;
  job_hidden16 = 1;
  add_setting_q(NULL, h100_fp8, 4, (const int32_t[]){1, 2}, 2, OPGRAFT_DTYPE_BF16, Q_B128);
  job_hidden16 = 0;
  job_gpu = NULL;
  job_routing = OPGRAFT_MOE_ROUTING_SOFTMAX;
  add_setting_q(NULL, (const int[]){Q30}, 1, (const int32_t[]){1}, 1, OPGRAFT_DTYPE_FP16, Q_TENSOR);
  job_routing = OPGRAFT_MOE_ROUTING_TOPK;
  add_setting_q(NULL, (const int[]){Q30, ODD}, 2, t1_9_33, 3, OPGRAFT_DTYPE_FP16, Q_B128);
  add_setting_q(NULL, (const int[]){Q30, ODD}, 2, t1_9_33, 3, OPGRAFT_DTYPE_FP16, Q_TENSOR);
  static const quant both[] = {{OPGRAFT_MOE_SCALE_BLOCK, 128}, {OPGRAFT_MOE_SCALE_TENSOR, 0}};
  for (int b = 0; b < 2; ++b) {
    static const int q30_kimi_mix[] = {Q30, KIMI, MIX, EP64};
    add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_PDL", "1", "OPGRAFT_TUNE_MOE_DOWN_EARLY", "1",
                                   "OPGRAFT_TUNE_MOE_PDL_IN", "1", NULL},
                  q30_kimi_mix, 4, t1_4_8, 3, OPGRAFT_DTYPE_BF16, both[b]);
    add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_PDL", "1", NULL}, q30_kimi_mix, 4, t1_4_8, 3, OPGRAFT_DTYPE_BF16,
                  both[b]);
    /* the general routing where the rule takes routing by slot */
    add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_GATE_UP_SLOT_ROUTING", "0", "OPGRAFT_TUNE_MOE_DOWN_WARP_ROUTING",
                                   "0", NULL},
                  q30_kimi_mix, 4, t1_4_8, 3, OPGRAFT_DTYPE_BF16, both[b]);
    for (const char *const *v = (const char *const[]){"1", "4", NULL}; *v; ++v)
      add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_LOAD", *v, "OPGRAFT_TUNE_MOE_DOWN_LOAD", *v, NULL}, q30_mix, 2,
                    t1_8, 2, OPGRAFT_DTYPE_BF16, both[b]);
    for (const char *const *v = (const char *const[]){"0", "1", "4", NULL}; *v; ++v)
      add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_GATE_UP_MIN_BLOCKS", *v, NULL}, q30_kimi_mix, 4, t1_8, 2,
                    OPGRAFT_DTYPE_BF16, both[b]);
    for (const char *const *v = (const char *const[]){"1", "2", "4", "16", NULL}; *v; ++v)
      add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_GATE_UP_WARPS", *v, "OPGRAFT_TUNE_MOE_DOWN_WARPS", *v, NULL},
                    q30_kimi_mix, 4, t1_8, 2, OPGRAFT_DTYPE_BF16, both[b]);
    for (const char *const *v = (const char *const[]){"1", "2", "4", NULL}; *v; ++v)
      add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_GATE_UP_UNROLL", *v, "OPGRAFT_TUNE_MOE_DOWN_UNROLL", *v, NULL},
                    q30_kimi_mix, 4, t1_8, 2, OPGRAFT_DTYPE_BF16, both[b]);
    add_setting_q((const char *[]){"OPGRAFT_TUNE_MOE_DOWN_MIN_BLOCKS", "2", NULL}, q30_kimi_mix, 4, t1_8, 2,
                  OPGRAFT_DTYPE_BF16, both[b]);
    add_setting_q((const char *[]){"OPGRAFT_TRACE", "1", NULL}, (const int[]){Q30, ODD}, 2, t1_8, 2,
                  OPGRAFT_DTYPE_BF16, both[b]);
  }
  og_jobs_compile("MoE");
  return 0;
}

static void test_every_variant_compiles(void **state) {
  og_need_nvrtc();
  assert_true(og_nunique > 50 && og_nunique <= og_njobs);
  int fp8 = 0;
  for (int i = 0; i < og_njobs; ++i) fp8 += job_weight_dtype[i] == OPGRAFT_DTYPE_FP8_E4M3 && og_jobs[i].dup_of < 0;
  assert_true(fp8 > 100);
  og_jobs_check_compiled();
}

static void test_no_spills(void **state) { og_jobs_check_no_spills(); }

static void test_report_matches_the_jobs(void **state) {
  /* opgraft_moe_compile_report (the public entry point) agrees with the job list's compile. */
  og_need_nvrtc();
  opgraft_moe_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = OPGRAFT_DTYPE_BF16;
  a.activation = OPGRAFT_ACT_SILU;
  a.num_tokens = 1, a.hidden = 2048, a.inter = 768, a.num_experts = 128, a.top_k = 8;
  a.topk_weights_dtype = OPGRAFT_DTYPE_FP32;
  a.topk_ids_dtype = OPGRAFT_DTYPE_INT32;
  opgraft_kernel_info ki[3];
  int32_t count = 0;
  assert_int_equal(opgraft_moe_compile_report(&a, 90, ki, 3, &count), OPGRAFT_OK);
  assert_int_equal(count, 2);
  const og_job *r = og_job_result(1); /* Qwen3-30B-A3B bf16 T=1 sm_90 */
  assert_non_null(strstr(og_jobs[1].what, "Qwen3-30B-A3B ("));
  assert_non_null(strstr(og_jobs[1].what, "T=1 sm_90"));
  assert_string_equal(ki[0].name, r->info[0].name);
  assert_int_equal(ki[0].registers, r->info[0].registers);
  assert_int_equal(ki[1].registers, r->info[1].registers);
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
      cmocka_unit_test(test_compile_report_arguments),
      cmocka_unit_test(test_every_variant_compiles),
      cmocka_unit_test(test_no_spills),
      cmocka_unit_test(test_report_matches_the_jobs),
  };
  return cmocka_run_group_tests(tests, setup, og_jobs_teardown);
}
