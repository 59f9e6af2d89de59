/* The MoE op's plans and launches: a plan resolves the guard, the tunables and the compiled
 * kernels once per (shape, dtypes, strides, flags, GPU); a run fills the pointers and enqueues. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../../kernels/moe/moe_fp8_params.h"
#include "moe.h"

struct opgraft_moe_plan {
  og_plan_head head; /* first: the plan cache reads it */
  opgraft_moe_args args; /* the arguments the plan was made for, pointers cleared */
  int32_t arch;
  og_moe_cfg cfg;
  og_CUfunction fn[OG_MOE_KERNELS];
  unsigned fused_grid; /* blocks of moe_fused that fit on the GPU at once (cooperative launch) */
  unsigned grid1, grid2;
  size_t workspace;
  og_moe_fp8_params proto; /* strides and sizes; a run adds the pointers (.b: all the bf16 kernels take) */
};

/* A 1-D launch with one int-valued launch attribute set to 1 (cooperative, programmatic
 * stream serialization). */
static int32_t launch_flagged(const og_cuda_api *cu, og_CUfunction fn, unsigned grid, unsigned threads,
                              og_CUstream s, int attr_id, void **params, const char *what) {
  og_CUlaunchAttribute attr;
  memset(&attr, 0, sizeof attr);
  attr.id = attr_id;
  attr.value.flag = 1;
  og_CUlaunchConfig lc = {grid, 1, 1, threads, 1, 1, 0, s, &attr, 1};
  return opgraft__cu_check(cu->cuLaunchKernelEx(&lc, fn, params, NULL), what);
}

/* How many blocks of a cooperative kernel can be resident at once: its grid. */
static int32_t fused_capacity(const og_cuda_api *cu, og_CUfunction fn, int threads, unsigned *grid) {
  enum { OG_ATTR_SM_COUNT = 16 }; /* CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT */
  og_CUdevice dev = 0;
  int per_sm = 0, sms = 0;
  int32_t st = opgraft__cu_check(cu->cuCtxGetDevice(&dev), "cuCtxGetDevice");
  if (!st) st = opgraft__cu_check(cu->cuDeviceGetAttribute(&sms, OG_ATTR_SM_COUNT, dev), "cuDeviceGetAttribute");
  if (!st)
    st = opgraft__cu_check(cu->cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, 0),
                           "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  if (st) return st;
  if (per_sm < 1) return opgraft__fail(OPGRAFT_ECUDA, "a cooperative MoE kernel cannot be resident on this GPU");
  *grid = (unsigned)(per_sm * sms);
  return OPGRAFT_OK;
}

#define OG_REASON_FAIL(st) opgraft__fail(st, "MoE call not supported: %s", reason)

int32_t opgraft_moe_plan_create(const opgraft_moe_args *a, opgraft_moe_plan **out, char *reason, size_t reason_len) {
  char local[256];
  if (!reason || !reason_len) reason = local, reason_len = sizeof local;
  reason[0] = 0;
  if (!out) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_moe_plan_create: no plan pointer");
  *out = NULL;
  if (!opgraft__op_ok(&opgraft__moe_op)) {
    snprintf(reason, reason_len, "the MoE op is not registered (its descriptor was refused)");
    return OG_REASON_FAIL(OPGRAFT_EUNSUPPORTED);
  }
  const og_cuda_api *cu;
  og_CUcontext ctx = NULL;
  int32_t st = opgraft__current_ctx(&cu, &ctx);
  if (st) return st;
  if ((st = opgraft__moe_check_static(a, reason, reason_len))) return OG_REASON_FAIL(st);
  char gpu[256] = "";
  int32_t arch = 0;
  const uint32_t gen = opgraft__tune_generation();
  if ((st = opgraft__moe_check_device(a, &arch, gpu, sizeof gpu, reason, reason_len))) return OG_REASON_FAIL(st);

  opgraft_moe_plan *p = calloc(1, sizeof *p);
  if (!p) return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  p->head = (og_plan_head){ctx, gen}, p->arch = arch, p->args = *a;
  p->args.hidden_states = p->args.w13 = p->args.w2 = p->args.topk_weights = p->args.topk_ids = NULL;
  p->args.router_logits = NULL;
  p->args.expert_map = a->expert_map ? (const void *)1 : NULL; /* only whether there is one */
  p->args.out = NULL, p->args.gpu_name = NULL;
  opgraft__moe_config(a, arch, gpu[0] ? gpu : NULL, &p->cfg);
  p->args.hidden_scale = p->args.w13_scale = p->args.w2_scale = NULL;
  og_opts o;
  char names[OG_MOE_KERNELS][64];
  opgraft__moe_fn_names(a, names);
  const char *np[OG_MOE_KERNELS] = {names[0], names[1], names[2]};
  const int fp8 = opgraft__moe_is_fp8(a);
  if (!(st = opgraft__moe_options(a, &p->cfg, &o)))
    st = opgraft__get_functions(opgraft__moe_source(a), o.ptr, o.n, arch, np, opgraft__moe_nkernels(a, &p->cfg),
                                p->fn);
  if (!st && p->cfg.fused && !fp8) st = fused_capacity(cu, p->fn[2], 32 * p->cfg.w1, &p->fused_grid);
  if (st) {
    free(p);
    return st;
  }
  const int64_t used_max = a->num_tokens * a->top_k < a->num_experts ? a->num_tokens * a->top_k : a->num_experts;
  /* gate_up's blocks: (used expert, tile), or (routing slot, tile) with the slot routing and the
   * one-slot path: every slot then, also where a rank holds fewer experts than a token picks
   * (k > E under expert parallelism); tiles of 16 rows of I (FP8: 16 or 32) */
  const int64_t gu_rows = p->cfg.gu_slots || p->cfg.gu_one ? a->num_tokens * a->top_k : used_max;
  p->grid1 = (unsigned)(gu_rows * (a->inter / (fp8 ? p->cfg.gu_rows : 16)));
  p->grid2 = (unsigned)(a->hidden / 16);
  opgraft_moe_workspace_size(a, &p->workspace);
  if (fp8) {
    og_moe_fp8_params *f = &p->proto;
    for (int i = 0; i < 3; ++i) {
      if (i < 2) f->xs_stride[i] = a->hidden_scale_stride[i];
      f->w13s_stride[i] = a->w13_scale_stride[i];
      f->w2s_stride[i] = a->w2_scale_stride[i];
    }
  }
  og_moe_params *q = &p->proto.b;
  q->x_stride = a->hidden_states_stride[0];
  q->w13_estride = a->w13_stride[0], q->w13_rstride = a->w13_stride[1];
  q->w2_estride = a->w2_stride[0], q->w2_rstride = a->w2_stride[1];
  q->topk_w_stride = a->topk_weights_stride[0], q->topk_ids_stride = a->topk_ids_stride[0];
  q->out_stride = a->out_stride[0];
  q->logits_stride = a->router_logits_stride[0];
  q->T = (int)a->num_tokens;
  q->emap_len = a->expert_map ? (int)a->expert_map_len : 0;
  if (p->cfg.trace) q->trace_blocks = (int)opgraft__moe_trace_blocks(a);
  *out = p;
  return OPGRAFT_OK;
}

void opgraft_moe_plan_destroy(opgraft_moe_plan *p) { free(p); }

size_t opgraft_moe_plan_workspace_size(const opgraft_moe_plan *p) { return p ? p->workspace : 0; }

/* Enqueues the stages of a plan with its parameters filled in (the FP8 kernels take all of f, the
 * others f->b). */
static int32_t launch(const og_cuda_api *cu, const opgraft_moe_plan *plan, og_moe_fp8_params *f, void *workspace,
                      og_CUstream s, uint32_t stages) {
  const opgraft_moe_args *a = &plan->args;
  const size_t act = opgraft__moe_act_bytes(a);
  og_moe_params *p = &f->b;
  p->act = workspace;
  if (opgraft__moe_is_fp8(a)) f->act_scale = (float *)((char *)workspace + opgraft__moe_act_scale_offset(a));
  if (plan->cfg.trace) p->trace = (unsigned long long *)((char *)workspace + act + 256u);
  void *params[] = {opgraft__moe_is_fp8(a) ? (void *)f : (void *)p};
  int32_t st;
  if (plan->cfg.fused && stages == OPGRAFT_MOE_STAGE_ALL) {
    /* One cooperative launch: every block is resident, so the grid-wide barrier cannot hang. */
    const unsigned long long counter = (unsigned long long)(uintptr_t)workspace + act;
    p->sync = (unsigned *)(uintptr_t)counter;
    const unsigned want = plan->grid1 > plan->grid2 ? plan->grid1 : plan->grid2;
    const unsigned grid = want < plan->fused_grid ? want : plan->fused_grid;
    if ((st = opgraft__cu_check(cu->cuMemsetD32Async(counter, 0u, 1, s), "cuMemsetD32Async (moe_fused counter)")))
      return st;
    return launch_flagged(cu, plan->fn[2], grid, 32u * (unsigned)plan->cfg.w1, s, OG_LAUNCH_ATTRIBUTE_COOPERATIVE,
                          params, "launch moe_fused (cooperative)");
  }
  if (stages & OPGRAFT_MOE_STAGE_GATE_UP) {
    /* With moe.pdl_in gate_up may start while the stream's previous kernel ends; it waits
     * (griddepcontrol.wait) before it reads or writes anything. */
    const unsigned t1 = 32u * (unsigned)plan->cfg.w1;
    st = plan->cfg.pdl_in ? launch_flagged(cu, plan->fn[0], plan->grid1, t1, s,
                                           OG_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, params,
                                           "launch moe_gate_up (programmatic dependent launch)")
                          : opgraft__cu_check(cu->cuLaunchKernel(plan->fn[0], plan->grid1, 1, 1, t1, 1, 1, 0, s, params, NULL),
                                              "launch moe_gate_up");
    if (st) return st;
  }
  if (!(stages & OPGRAFT_MOE_STAGE_DOWN)) return OPGRAFT_OK;
  const unsigned t2 = 32u * (unsigned)plan->cfg.w2;
  if (plan->cfg.pdl && (stages & OPGRAFT_MOE_STAGE_GATE_UP)) {
    /* moe_down may start while moe_gate_up's blocks still run; it waits (griddepcontrol.wait)
     * before it touches what gate_up writes or reads. */
    return launch_flagged(cu, plan->fn[1], plan->grid2, t2, s, OG_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                          params, "launch moe_down (programmatic dependent launch)");
  }
  return opgraft__cu_check(cu->cuLaunchKernel(plan->fn[1], plan->grid2, 1, 1, t2, 1, 1, 0, s, params, NULL),
                           "launch moe_down");
}

/* The routing pointers of a launch: the router's logits and the optional routing outputs of a
 * routed plan, else the given topk_weights and topk_ids. */
static void set_routing(og_moe_params *p, int routed, const void *logits, const void *topk_weights,
                        const void *topk_ids) {
  if (routed)
    p->logits = logits, p->route_w = (float *)(uintptr_t)topk_weights, p->route_ids = (int *)(uintptr_t)topk_ids;
  else
    p->topk_w = topk_weights, p->topk_ids = topk_ids;
}

/* The pointer checks and the launch of the run entry points; xs, w13s and w2s are the FP8 scales
 * (NULL for other plans), logits the router's (NULL for plans without routing: topk_weights and
 * topk_ids are then inputs, else optional outputs). */
static int32_t plan_run(const opgraft_moe_plan *plan, int fp8_entry, const void *x, const void *xs, const void *w13,
                        const void *w13s, const void *w2, const void *w2s, const void *logits,
                        const void *topk_weights, const void *topk_ids, const void *expert_map, void *out,
                        void *workspace, void *stream, const char *what) {
  if (!plan) return opgraft__fail(OPGRAFT_EINVAL, "%s: no plan", what);
  const og_cuda_api *cu;
  og_CUcontext ctx = NULL;
  int32_t st = opgraft__current_ctx(&cu, &ctx);
  if (st) return st;
  if ((st = opgraft__plan_check(ctx, &plan->head, "MoE plan"))) return st;
  const opgraft_moe_args *a = &plan->args;
  const int fp8 = opgraft__moe_is_fp8(a), routed = opgraft__moe_routed(a);
  const char *entry = routed && fp8 ? "_routed_fp8" : routed ? "_routed" : fp8 ? "_fp8" : "";
  if (!fp8 != !fp8_entry)
    return opgraft__fail(OPGRAFT_EINVAL, "%s: a plan %s FP8 weights (use opgraft_moe_plan_run%s)", what,
                         fp8 ? "of" : "without", entry);
  const int xq = opgraft__moe_quantizes_x(a);
  if (fp8 && !xq == !xs)
    return opgraft__fail(OPGRAFT_EINVAL, "%s: %s hidden_scale for a plan whose hidden states are %s", what,
                         xs ? "a" : "no", xq ? "16-bit (the kernel quantizes them)" : "e4m3");
  if (!routed != !logits)
    return opgraft__fail(OPGRAFT_EINVAL, "%s: a plan %s routing from logits (use opgraft_moe_plan_run%s)", what,
                         routed ? "of" : "without", entry);
  if (a->num_tokens == 0) return OPGRAFT_OK;
  const int ids64 = a->topk_ids_dtype == OPGRAFT_DTYPE_INT64;
  if (!x || !w13 || !w2 || (!routed && (!topk_weights || !topk_ids)) || !out || !workspace ||
      !expert_map != !a->expert_map || (fp8 && (!w13s || !w2s)))
    return opgraft__fail(OPGRAFT_EINVAL, "%s: a NULL pointer (or expert_map unlike the plan's)", what);
  if ((((uintptr_t)x | (uintptr_t)w13 | (uintptr_t)w2 | (uintptr_t)workspace) & 15u) || ((uintptr_t)out & 1u) ||
      ((uintptr_t)topk_weights & 3u) || ((uintptr_t)topk_ids & (ids64 ? 7u : 3u)) || ((uintptr_t)expert_map & 3u) ||
      (((uintptr_t)xs | (uintptr_t)w13s | (uintptr_t)w2s) & 3u) || ((uintptr_t)logits & 1u))
    return opgraft__fail(OPGRAFT_EINVAL, "%s: a pointer is misaligned", what);
  og_moe_fp8_params f = plan->proto;
  og_moe_params *p = &f.b;
  p->x = x, p->w13 = w13, p->w2 = w2, p->out = out;
  set_routing(p, routed, logits, topk_weights, topk_ids);
  p->emap = (const int *)expert_map;
  f.x_scale = xs, f.w13_scale = w13s, f.w2_scale = w2s;
  return launch(cu, plan, &f, workspace, (og_CUstream)stream, OPGRAFT_MOE_STAGE_ALL);
}

int32_t opgraft_moe_plan_run(const opgraft_moe_plan *plan, const void *x, const void *w13, const void *w2,
                             const void *topk_weights, const void *topk_ids, const void *expert_map, void *out,
                             void *workspace, void *stream) {
  return plan_run(plan, 0, x, NULL, w13, NULL, w2, NULL, NULL, topk_weights, topk_ids, expert_map, out, workspace,
                  stream, "opgraft_moe_plan_run");
}

int32_t opgraft_moe_plan_run_routed(const opgraft_moe_plan *plan, const void *x, const void *w13, const void *w2,
                                    const void *router_logits, void *topk_weights, void *topk_ids, void *out,
                                    void *workspace, void *stream) {
  if (!router_logits) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_moe_plan_run_routed: no router_logits");
  return plan_run(plan, 0, x, NULL, w13, NULL, w2, NULL, router_logits, topk_weights, topk_ids, NULL, out, workspace,
                  stream, "opgraft_moe_plan_run_routed");
}

int32_t opgraft_moe_plan_run_fp8(const opgraft_moe_plan *plan, const void *x, const void *x_scale, const void *w13,
                                 const void *w13_scale, const void *w2, const void *w2_scale,
                                 const void *topk_weights, const void *topk_ids, const void *expert_map, void *out,
                                 void *workspace, void *stream) {
  return plan_run(plan, 1, x, x_scale, w13, w13_scale, w2, w2_scale, NULL, topk_weights, topk_ids, expert_map, out,
                  workspace, stream, "opgraft_moe_plan_run_fp8");
}

int32_t opgraft_moe_plan_run_routed_fp8(const opgraft_moe_plan *plan, const void *x, const void *x_scale,
                                        const void *w13, const void *w13_scale, const void *w2, const void *w2_scale,
                                        const void *router_logits, void *topk_weights, void *topk_ids, void *out,
                                        void *workspace, void *stream) {
  if (!router_logits) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_moe_plan_run_routed_fp8: no router_logits");
  return plan_run(plan, 1, x, x_scale, w13, w13_scale, w2, w2_scale, router_logits, topk_weights, topk_ids, NULL, out,
                  workspace, stream, "opgraft_moe_plan_run_routed_fp8");
}

/* ---- the argument-struct entry points, through plans cached here ---- */

OG_PLAN_CACHE(plans, 128);

/* Do two argument sets give the same plan? Strides are not compared: these entry points take
 * them from each call's arguments. */
static int same_plan(const opgraft_moe_args *p, const opgraft_moe_args *q) {
  const int fp8 = opgraft__moe_is_fp8(p);
  if (fp8 != opgraft__moe_is_fp8(q)) return 0;
  if (fp8 && (p->scale_layout != q->scale_layout || p->block_n != q->block_n || p->block_k != q->block_k ||
              p->scale_dtype != q->scale_dtype || opgraft__moe_quantizes_x(p) != opgraft__moe_quantizes_x(q)))
    return 0;
  return p->dtype == q->dtype && p->activation == q->activation && p->routing == q->routing &&
         !p->apply_router_weight_on_input == !q->apply_router_weight_on_input && p->num_tokens == q->num_tokens &&
         p->hidden == q->hidden && p->inter == q->inter && p->num_experts == q->num_experts && p->top_k == q->top_k &&
         p->topk_ids_dtype == q->topk_ids_dtype && !p->expert_map == !q->expert_map &&
         p->expert_map_len == q->expert_map_len && p->arch == q->arch;
}

static int plan_matches(const void *plan, const void *args) {
  return same_plan(&((const opgraft_moe_plan *)plan)->args, args);
}

int32_t opgraft_moe_run_stages(const opgraft_moe_args *a, void *workspace, size_t workspace_bytes, void *stream,
                               uint32_t stages) {
  char reason[256];
  if (stages == 0 || (stages & ~(uint32_t)OPGRAFT_MOE_STAGE_ALL))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_moe_run_stages: bad stage mask %u", stages);
  int32_t st;
  if ((st = opgraft__moe_check_static(a, reason, sizeof reason)) ||
      (st = opgraft__moe_check_pointers(a, reason, sizeof reason)))
    return opgraft__fail(st, "MoE call not supported: %s", reason);
  size_t need = 0;
  opgraft_moe_workspace_size(a, &need);
  if (a->num_tokens == 0) return OPGRAFT_OK;
  if (!workspace || workspace_bytes < need)
    return opgraft__fail(OPGRAFT_EINVAL, "workspace of %zu bytes given, %zu needed", workspace_bytes, need);
  if ((uintptr_t)workspace & 15u) return opgraft__fail(OPGRAFT_EINVAL, "workspace not 16-byte aligned");
  const og_cuda_api *cu;
  og_CUcontext ctx = NULL;
  if ((st = opgraft__current_ctx(&cu, &ctx))) return st;

  opgraft_moe_plan local, *plan = &local; /* a copy: the cached one may be evicted meanwhile */
  if (!opgraft__plan_cache_find(&plans, ctx, plan_matches, a, &local, sizeof local)) {
    opgraft_moe_plan *made = NULL;
    if ((st = opgraft_moe_plan_create(a, &made, reason, sizeof reason))) return st;
    local = *made;
    opgraft__plan_cache_put(&plans, made);
  }
  if (plan->cfg.trace && workspace_bytes < need) /* a workspace sized before OPGRAFT_TRACE was set */
    return opgraft__fail(OPGRAFT_EINVAL, "workspace too small for the trace records");
  og_moe_fp8_params f = plan->proto;
  og_moe_params *p = &f.b;
  p->x = a->hidden_states, p->w13 = a->w13, p->w2 = a->w2;
  p->out = a->out;
  set_routing(p, opgraft__moe_routed(a), a->router_logits, a->topk_weights, a->topk_ids);
  p->logits_stride = a->router_logits_stride[0];
  p->x_stride = a->hidden_states_stride[0];
  p->w13_estride = a->w13_stride[0], p->w13_rstride = a->w13_stride[1];
  p->w2_estride = a->w2_stride[0], p->w2_rstride = a->w2_stride[1];
  p->topk_w_stride = a->topk_weights_stride[0], p->topk_ids_stride = a->topk_ids_stride[0];
  p->out_stride = a->out_stride[0];
  p->emap = (const int *)a->expert_map;
  f.x_scale = a->hidden_scale, f.w13_scale = a->w13_scale, f.w2_scale = a->w2_scale;
  for (int i = 0; i < 3; ++i) {
    if (i < 2) f.xs_stride[i] = a->hidden_scale_stride[i];
    f.w13s_stride[i] = a->w13_scale_stride[i];
    f.w2s_stride[i] = a->w2_scale_stride[i];
  }
  return launch(cu, plan, &f, workspace, (og_CUstream)stream, stages);
}

int32_t opgraft_moe_run(const opgraft_moe_args *a, void *workspace, size_t workspace_bytes, void *stream) {
  return opgraft_moe_run_stages(a, workspace, workspace_bytes, stream, OPGRAFT_MOE_STAGE_ALL);
}
