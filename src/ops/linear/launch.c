/* The linear op's plans and launches: a plan resolves the guard, the tunables and the compiled
 * kernel once per layout; a run fills the pointers and enqueues one kernel. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "linear.h"

struct opgraft_linear_plan {
  og_plan_head head; /* first: the plan cache reads it */
  opgraft_linear_args args; /* the arguments the plan was made for, pointers cleared */
  int32_t arch;
  og_linear_cfg cfg;
  og_CUfunction fn;
  unsigned grid, threads, smem; /* smem: dynamic shared memory (the add + RMSNorm form) */
  unsigned cluster;             /* the q/k epilogue: a head's blocks (0: no clusters) */
  og_linear_params proto; /* strides and sizes; a run adds the pointers */
};

enum { OG_FUNC_ATTR_MAX_DYNAMIC_SHARED = 8 }; /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES */

#define OG_REASON_FAIL(st) opgraft__fail(st, "linear call not supported: %s", reason)

/* The sizes, strides and eps of a call: what a run adds to them is the pointers. */
static void layout_of(const opgraft_linear_args *a, og_linear_params *q) {
  q->x_stride = a->x_stride[0], q->w_stride = a->weight_stride[0], q->y_stride = a->out_stride[0];
  q->M = (int)a->rows, q->N = (int)a->out_features;
  q->ws_stride0 = a->weight_scale_stride[0], q->ws_stride1 = a->weight_scale_stride[1];
  q->r_stride = a->residual_stride[0], q->ro_stride = a->residual_out_stride[0], q->eps = a->norm_eps;
  q->ho_stride = a->normed_out_stride[0];
  q->q_heads = a->q_heads, q->qk_heads = a->qk_heads, q->qk_eps = a->qk_norm_eps;
  q->cs_stride = a->cos_sin_stride, q->rope_rows = a->rope_rows;
}

/* The launch attribute of clusters of n blocks (the q/k epilogue: a head's blocks). */
static og_CUlaunchAttribute cluster_attr(unsigned n) {
  og_CUlaunchAttribute c;
  memset(&c, 0, sizeof c);
  c.id = OG_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, c.value.dim[0] = n, c.value.dim[1] = c.value.dim[2] = 1;
  return c;
}

/* The q/k epilogue's pointers of a call. */
static void set_qk(const opgraft_linear_args *a, og_linear_params *q) {
  q->qk_qw = a->q_norm_weight, q->qk_kw = a->k_norm_weight, q->cos_sin = a->cos_sin_cache;
  q->positions = (const long long *)a->positions;
}

int32_t opgraft_linear_plan_create(const opgraft_linear_args *a, opgraft_linear_plan **out, char *reason,
                                   size_t reason_len) {
  char local[256];
  if (!reason || !reason_len) reason = local, reason_len = sizeof local;
  reason[0] = 0;
  if (!out) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_create: no plan pointer");
  *out = NULL;
  if (!opgraft__op_ok(&opgraft__linear_op)) {
    snprintf(reason, reason_len, "the linear op is not registered (its descriptor was refused)");
    return OG_REASON_FAIL(OPGRAFT_EUNSUPPORTED);
  }
  const og_cuda_api *cu;
  og_CUcontext ctx = NULL;
  int32_t st = opgraft__current_ctx(&cu, &ctx);
  if (st) return st;
  if ((st = opgraft__linear_check_static(a, reason, reason_len))) return OG_REASON_FAIL(st);
  char gpu[256] = "";
  int32_t arch = 0;
  const uint32_t gen = opgraft__tune_generation();
  if ((st = opgraft__linear_check_device(a, &arch, gpu, sizeof gpu, reason, reason_len))) return OG_REASON_FAIL(st);

  opgraft_linear_plan *p = calloc(1, sizeof *p);
  if (!p) return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  p->head = (og_plan_head){ctx, gen}, p->arch = arch, p->args = *a;
  p->args.x = p->args.weight = NULL;
  p->args.bias = a->bias ? (const void *)1 : NULL; /* only whether there is one */
  p->args.out = NULL, p->args.gpu_name = NULL, p->args.weight_scale = NULL;
  p->args.residual = a->residual ? (const void *)1 : NULL; /* likewise */
  p->args.residual_out = NULL, p->args.norm_weight = NULL;
  p->args.normed_out = a->normed_out ? (void *)1 : NULL; /* likewise */
  p->args.q_norm_weight = a->q_norm_weight ? (const void *)1 : NULL; /* likewise */
  p->args.k_norm_weight = a->k_norm_weight ? (const void *)1 : NULL;
  p->args.cos_sin_cache = NULL, p->args.positions = NULL;
  opgraft__linear_config(a, arch, gpu[0] ? gpu : NULL, &p->cfg);
  og_opts o;
  char name[64];
  opgraft__linear_fn_name(a, name);
  const char *np[1] = {name};
  if (!(st = opgraft__linear_options(a, &p->cfg, &o)))
    st = opgraft__get_functions(opgraft__linear_source(a), o.ptr, o.n, arch, np, 1, &p->fn);
  if (st) {
    free(p);
    return st;
  }
  p->grid = opgraft__linear_grid(a, &p->cfg);
  p->threads = 32u * (unsigned)p->cfg.warps;
  p->smem = a->residual ? (unsigned)OG_LINEAR_NORM_SMEM(a->rows, a->in_features) : 0u;
  if (p->smem > 48u * 1024u &&
      (st = opgraft__cu_check(cu->cuFuncSetAttribute(p->fn, OG_FUNC_ATTR_MAX_DYNAMIC_SHARED, (int)p->smem),
                              "cuFuncSetAttribute (linear shared memory)"))) {
    free(p);
    return st;
  }
  if (a->qk_heads) { /* one cluster must fit, else the launch would fail at every call */
    p->cluster = (unsigned)(a->head_size / (8 * p->cfg.tiles));
    og_CUlaunchAttribute ca = cluster_attr(p->cluster);
    og_CUlaunchConfig lc = {p->grid, 1, 1, p->threads, 1, 1, p->smem, NULL, &ca, 1};
    int clusters = 0;
    st = opgraft__cu_check(cu->cuOccupancyMaxActiveClusters(&clusters, p->fn, &lc), "cuOccupancyMaxActiveClusters (linear)");
    if (!st && clusters < 1)
      st = opgraft__fail(OPGRAFT_ECUDA, "no cluster of %u linear blocks can be resident on this GPU", p->cluster);
    if (st) {
      free(p);
      return st;
    }
  }
  layout_of(a, &p->proto);
  *out = p;
  return OPGRAFT_OK;
}

void opgraft_linear_plan_destroy(opgraft_linear_plan *p) { free(p); }

/* One launch; with linear.pdl as a programmatic dependent of the stream's previous kernel; with
 * the q/k epilogue in clusters of a head's blocks. */
static int32_t launch(const og_cuda_api *cu, const opgraft_linear_plan *plan, og_linear_params *p, og_CUstream s) {
  void *params[] = {p};
  if (!plan->cfg.pdl && !plan->cluster)
    return opgraft__cu_check(cu->cuLaunchKernel(plan->fn, plan->grid, 1, 1, plan->threads, 1, 1, plan->smem, s, params, NULL),
                             "launch linear_gemv");
  og_CUlaunchAttribute attrs[2];
  memset(attrs, 0, sizeof attrs);
  unsigned n = 0;
  if (plan->cfg.pdl) attrs[n].id = OG_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, attrs[n++].value.flag = 1;
  if (plan->cluster) attrs[n++] = cluster_attr(plan->cluster);
  og_CUlaunchConfig lc = {plan->grid, 1, 1, plan->threads, 1, 1, plan->smem, s, attrs, n};
  return opgraft__cu_check(cu->cuLaunchKernelEx(&lc, plan->fn, params, NULL),
                           "launch linear_gemv (cuLaunchKernelEx: programmatic dependent launch or clusters)");
}

/* The norm form's pointers of a run (all NULL without a residual). */
typedef struct og_norm_ptrs {
  const void *residual, *norm_weight;
  void *residual_out, *normed_out;
} og_norm_ptrs;

static int32_t plan_run(const opgraft_linear_plan *plan, const void *x, const void *weight, const void *weight_scale,
                        const void *bias, void *out, og_norm_ptrs nrm, const opgraft_linear_args *qk, void *stream) {
  const og_cuda_api *cu;
  og_CUcontext ctx = NULL;
  int32_t st = opgraft__current_ctx(&cu, &ctx);
  if (st) return st;
  if ((st = opgraft__plan_check(ctx, &plan->head, "linear plan"))) return st;
  if (plan->args.rows == 0) return OPGRAFT_OK;
  if (!x || !weight || !out || !bias != !plan->args.bias)
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run: a NULL pointer (or bias unlike the plan's)");
  if ((((uintptr_t)x | (uintptr_t)weight) & 15u) || (((uintptr_t)out | (uintptr_t)bias) & 1u))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run: a pointer is misaligned");
  if (opgraft__linear_is_fp8(&plan->args) && (!weight_scale || ((uintptr_t)weight_scale & 3u)))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run_fp8: weight_scale NULL or misaligned");
  if (plan->args.residual &&
      (!nrm.residual || !nrm.norm_weight || !nrm.residual_out || !nrm.normed_out != !plan->args.normed_out ||
       (((uintptr_t)nrm.residual | (uintptr_t)nrm.norm_weight | (uintptr_t)nrm.residual_out |
         (uintptr_t)nrm.normed_out) & 15u)))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run_norm: residual, norm_weight or residual_out NULL, "
                                         "normed_out unlike the plan's, or one not 16-byte aligned");
  if (plan->args.qk_heads) {
    const opgraft_linear_args *a = qk;
    if (!a || !a->q_norm_weight != !plan->args.q_norm_weight || !a->k_norm_weight != !plan->args.k_norm_weight ||
        a->rope_style != plan->args.rope_style)
      return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run_args: no arguments, or norm weights or rotary style unlike the plan's");
    const char *problem = opgraft__linear_qk_pointer_problem(a);
    if (problem) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run_args: %s", problem);
  }
  og_linear_params p = plan->proto;
  p.x = x, p.w = weight, p.bias = bias, p.y = out, p.ws = weight_scale;
  p.r = nrm.residual, p.nw = nrm.norm_weight, p.ro = nrm.residual_out, p.ho = nrm.normed_out;
  if (qk) set_qk(qk, &p);
  return launch(cu, plan, &p, (og_CUstream)stream);
}

int32_t opgraft_linear_plan_run_args(const opgraft_linear_plan *plan, const opgraft_linear_args *a, void *stream) {
  if (!plan || !a) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run_args: no plan or arguments");
  return plan_run(plan, a->x, a->weight, a->weight_scale, a->bias, a->out,
                  (og_norm_ptrs){a->residual, a->norm_weight, a->residual_out, a->normed_out},
                  plan->args.qk_heads ? a : NULL, stream);
}

int32_t opgraft_linear_plan_run(const opgraft_linear_plan *plan, const void *x, const void *weight, const void *bias,
                                void *out, void *stream) {
  if (!plan) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run: no plan");
  if (opgraft__linear_is_fp8(&plan->args))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run: an FP8 plan (opgraft_linear_plan_run_fp8 runs it)");
  if (plan->args.residual)
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run: a plan with a residual (opgraft_linear_plan_run_norm runs it)");
  if (plan->args.qk_heads)
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run: a plan with the q/k epilogue (opgraft_linear_plan_run_args runs it)");
  return plan_run(plan, x, weight, NULL, bias, out, (og_norm_ptrs){0}, NULL, stream);
}

int32_t opgraft_linear_plan_run_norm(const opgraft_linear_plan *plan, const void *x, const void *residual,
                                     const void *norm_weight, const void *weight, const void *bias, void *out,
                                     void *residual_out, void *normed_out, void *stream) {
  if (!plan) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run_norm: no plan");
  if (!plan->args.residual)
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run_norm: a plan without a residual");
  if (plan->args.qk_heads)
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run_norm: a plan with the q/k epilogue (opgraft_linear_plan_run_args runs it)");
  return plan_run(plan, x, weight, NULL, bias, out, (og_norm_ptrs){residual, norm_weight, residual_out, normed_out}, NULL,
                  stream);
}

int32_t opgraft_linear_plan_run_fp8(const opgraft_linear_plan *plan, const void *x, const void *weight,
                                    const void *weight_scale, const void *bias, void *out, void *stream) {
  if (!plan) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run_fp8: no plan");
  if (!opgraft__linear_is_fp8(&plan->args))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_linear_plan_run_fp8: a plan of 16-bit weights (opgraft_linear_plan_run runs it)");
  return plan_run(plan, x, weight, weight_scale, bias, out, (og_norm_ptrs){0}, NULL, stream);
}

/* ---- the argument-struct entry point, through plans cached here ---- */

OG_PLAN_CACHE(plans, 128);

/* Do two argument sets give the same plan? Strides are not compared: this entry point takes them
 * from each call's arguments. */
static int same_plan(const opgraft_linear_args *p, const opgraft_linear_args *q) {
  return p->dtype == q->dtype && p->weight_dtype == q->weight_dtype && p->out_dtype == q->out_dtype &&
         p->block_n == q->block_n && p->block_k == q->block_k &&
         !p->bias == !q->bias && (!p->bias || p->bias_dtype == q->bias_dtype) && p->rows == q->rows &&
         !p->residual == !q->residual && (!p->residual || (p->norm_dtype == q->norm_dtype && p->norm_eps == q->norm_eps)) &&
         p->out_features == q->out_features && p->in_features == q->in_features && p->arch == q->arch &&
         p->qk_heads == q->qk_heads &&
         (!p->qk_heads || (p->head_size == q->head_size && p->q_heads == q->q_heads && p->rope_style == q->rope_style &&
                           !p->q_norm_weight == !q->q_norm_weight && p->qk_norm_eps == q->qk_norm_eps));
}

static int plan_matches(const void *plan, const void *args) {
  return same_plan(&((const opgraft_linear_plan *)plan)->args, args);
}

int32_t opgraft_linear_run(const opgraft_linear_args *a, void *stream) {
  char reason[256];
  int32_t st;
  if ((st = opgraft__linear_check_static(a, reason, sizeof reason)) ||
      (st = opgraft__linear_check_pointers(a, reason, sizeof reason)))
    return opgraft__fail(st, "linear call not supported: %s", reason);
  if (a->rows == 0) return OPGRAFT_OK;
  const og_cuda_api *cu;
  og_CUcontext ctx = NULL;
  if ((st = opgraft__current_ctx(&cu, &ctx))) return st;

  opgraft_linear_plan local, *plan = &local; /* a copy: the cached one may be evicted meanwhile */
  if (!opgraft__plan_cache_find(&plans, ctx, plan_matches, a, &local, sizeof local)) {
    opgraft_linear_plan *made = NULL;
    if ((st = opgraft_linear_plan_create(a, &made, reason, sizeof reason))) return st;
    local = *made;
    opgraft__plan_cache_put(&plans, made);
  }
  og_linear_params p = plan->proto;
  layout_of(a, &p); /* this entry point takes the strides from each call */
  p.x = a->x, p.w = a->weight, p.bias = a->bias, p.y = a->out, p.ws = a->weight_scale;
  p.r = a->residual, p.nw = a->norm_weight, p.ro = a->residual_out, p.ho = a->normed_out;
  set_qk(a, &p);
  return launch(cu, plan, &p, (og_CUstream)stream);
}
