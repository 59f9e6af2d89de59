/* The decode-attention op's plans and launches: a plan resolves the guard, the tunables, the
 * compiled kernel and its occupancy once per layout and batch; a run picks the split count from the batch
 * and the length bound, fills the pointers and enqueues one kernel. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../../kernels/attention/attn_params.h"
#include "attention.h"

struct opgraft_attention_plan {
  og_plan_head head; /* first: the plan cache reads it */
  opgraft_attention_args args; /* the layout the plan was made for: pointers and bound cleared */
  int32_t arch;
  og_attn_cfg cfg;
  og_CUfunction fn[2]; /* the kernel at fan-in 16, and at 32 with cfg.fan32 (else NULL) */
  unsigned threads, smem;
  int64_t slots;      /* blocks of one wave: split calls put at most this many in the tree */
  int max_clusters[4]; /* [log2 size]: clusters of 4 and 8 blocks resident at once (up to cfg.cluster) */
  size_t workspace, ml_off, part_off;
  og_attn_params proto; /* strides and scalars; a run adds the pointers */
};

/* The layout fields of args, everything else zero (so that two layouts compare with memcmp). */
static void layout_of(const opgraft_attention_args *a, opgraft_attention_args *k) {
  memset(k, 0, sizeof *k);
  k->struct_size = a->struct_size;
  k->dtype = a->dtype, k->kv_dtype = a->kv_dtype, k->flags = a->flags;
  k->batch = a->batch; /* the guard's attention.max_batch and the tuned rows match by batch */
  k->query_len = a->query_len;
  k->num_heads = a->num_heads, k->num_kv_heads = a->num_kv_heads, k->head_size = a->head_size;
  k->block_size = a->block_size, k->num_blocks = a->num_blocks, k->max_blocks = a->max_blocks;
  k->scale = a->scale, k->softcap = a->softcap, k->window_left = a->window_left;
  memcpy(k->q_stride, a->q_stride, sizeof k->q_stride);
  memcpy(k->k_stride, a->k_stride, sizeof k->k_stride);
  memcpy(k->v_stride, a->v_stride, sizeof k->v_stride);
  k->block_table_dtype = a->block_table_dtype;
  memcpy(k->block_table_stride, a->block_table_stride, sizeof k->block_table_stride);
  k->seq_lens_dtype = a->seq_lens_dtype;
  k->sinks = a->sinks ? (const void *)1 : NULL; /* only whether there are sinks */
  k->sinks_dtype = a->sinks ? a->sinks_dtype : 0;
  memcpy(k->out_stride, a->out_stride, sizeof k->out_stride);
  k->arch = a->arch;
  k->k_new = a->k_new ? (const void *)1 : NULL; /* only whether the call writes the cache */
  if (a->k_new) {
    memcpy(k->k_new_stride, a->k_new_stride, sizeof k->k_new_stride);
    memcpy(k->v_new_stride, a->v_new_stride, sizeof k->v_new_stride);
    k->slot_mapping_dtype = a->slot_mapping_dtype;
  }
  k->q_norm_weight = a->q_norm_weight ? (const void *)1 : NULL; /* only whether there is a q/k norm */
  k->k_norm_weight = a->k_norm_weight ? (const void *)1 : NULL;
  if (a->q_norm_weight) k->qk_norm_dtype = a->qk_norm_dtype, k->qk_norm_eps = a->qk_norm_eps;
  k->rope_style = a->rope_style;
  if (a->rope_style) {
    k->cos_sin_dtype = a->cos_sin_dtype, k->cos_sin_stride = a->cos_sin_stride, k->rope_rows = a->rope_rows;
    k->positions_dtype = a->positions_dtype;
  }
}

#define OG_REASON_FAIL(st) opgraft__fail(st, "attention call not supported: %s", reason)

enum { OG_ATTR_SM_COUNT = 16, OG_FUNC_ATTR_MAX_DYNAMIC_SHARED = 8 };

int32_t opgraft_attention_plan_create(const opgraft_attention_args *a, opgraft_attention_plan **out, char *reason,
                                      size_t reason_len) {
  char local[256];
  if (!reason || !reason_len) reason = local, reason_len = sizeof local;
  reason[0] = 0;
  if (!out) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_attention_plan_create: no plan pointer");
  *out = NULL;
  if (!opgraft__op_ok(&opgraft__attention_op)) {
    snprintf(reason, reason_len, "the attention op is not registered (its descriptor was refused)");
    return OG_REASON_FAIL(OPGRAFT_EUNSUPPORTED);
  }
  const og_cuda_api *cu;
  og_CUcontext ctx = NULL;
  int32_t st = opgraft__current_ctx(&cu, &ctx);
  if (st) return st;
  if ((st = opgraft__attn_check_static(a, reason, reason_len))) return OG_REASON_FAIL(st);
  char gpu[256] = "";
  int32_t arch = 0;
  const uint32_t gen = opgraft__tune_generation();
  if ((st = opgraft__attn_check_device(a, &arch, gpu, sizeof gpu, reason, reason_len))) return OG_REASON_FAIL(st);

  opgraft_attention_plan *p = calloc(1, sizeof *p);
  if (!p) return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  p->head = (og_plan_head){ctx, gen}, p->arch = arch;
  layout_of(a, &p->args);
  opgraft__attn_config(a, arch, gpu[0] ? gpu : NULL, &p->cfg);
  const int64_t G = a->num_heads / a->num_kv_heads;
  p->threads = 32u * (unsigned)p->cfg.warps;
  p->smem = og_attn_smem_bytes((int)a->head_size, (int)G, p->cfg.warps, p->cfg.cluster > 1);
  og_opts o;
  char names[2][64];
  const int nfn = p->cfg.fan32 ? 2 : 1;
  opgraft__attn_fn_name(a->dtype, OG_ATTN_FAN_LOG2, names[0]);
  opgraft__attn_fn_name(a->dtype, OG_ATTN_FAN_MAX_LOG2, names[1]);
  const char *np[2] = {names[0], names[1]};
  if (!(st = opgraft__attn_options(a, &p->cfg, &o)))
    st = opgraft__get_functions(OG_ATTN_SOURCE, o.ptr, o.n, arch, np, nfn, p->fn);
  for (int f = 0; f < nfn && !st && p->smem > (48u << 10); ++f)
    st = opgraft__cu_check(cu->cuFuncSetAttribute(p->fn[f], OG_FUNC_ATTR_MAX_DYNAMIC_SHARED, (int)p->smem),
                           "cuFuncSetAttribute (attention shared memory)");
  og_CUdevice dev = 0;
  int per_sm = 0, sms = 0;
  if (!st) st = opgraft__cu_check(cu->cuCtxGetDevice(&dev), "cuCtxGetDevice");
  if (!st) st = opgraft__cu_check(cu->cuDeviceGetAttribute(&sms, OG_ATTR_SM_COUNT, dev), "cuDeviceGetAttribute");
  /* The wave and the clusters resident at once: fan-in 16's kernel's (fan-in 32's takes the same
   * launch bounds; a launch at either fan-in is correct whatever is resident). */
  if (!st)
    st = opgraft__cu_check(cu->cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, p->fn[0], (int)p->threads, p->smem),
                           "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  if (!st && per_sm < 1) st = opgraft__fail(OPGRAFT_ECUDA, "the attention kernel cannot be resident on this GPU");
  /* Clusters pack into GPCs: fewer may be resident than blocks / size. Sizes a launch uses only. */
  for (int i = 2, c = 4; !st && c <= p->cfg.cluster; ++i, c *= 2) {
    og_CUlaunchAttribute attr;
    memset(&attr, 0, sizeof attr);
    attr.id = OG_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.dim[0] = (unsigned)c, attr.value.dim[1] = attr.value.dim[2] = 1;
    og_CUlaunchConfig lc = {(unsigned)c, 1, 1, p->threads, 1, 1, p->smem, NULL, &attr, 1};
    st = opgraft__cu_check(cu->cuOccupancyMaxActiveClusters(&p->max_clusters[i], p->fn[0], &lc),
                           "cuOccupancyMaxActiveClusters (attention)");
    if (!st && p->max_clusters[i] < 1)
      st = opgraft__fail(OPGRAFT_ECUDA, "no cluster of %d attention blocks can be resident on this GPU", c);
  }
  if (st) {
    free(p);
    return st;
  }
  p->slots = (int64_t)per_sm * sms;
  if (p->slots > OG_ATTN_MAX_SLOTS) p->slots = OG_ATTN_MAX_SLOTS;
  p->workspace = opgraft__attn_workspace_bytes(a, p->slots, p->cfg.max_splits);
  opgraft__attn_workspace_offsets(a, p->slots, p->cfg.max_splits, &p->ml_off, &p->part_off);
  og_attn_params *q = &p->proto;
  q->q_st = a->q_stride[0], q->q_sh = a->q_stride[1];
  q->o_st = a->out_stride[0], q->o_sh = a->out_stride[1];
  q->k_sb = a->k_stride[0], q->k_st = a->k_stride[1], q->k_sh = a->k_stride[2];
  q->v_sb = a->v_stride[0], q->v_st = a->v_stride[1], q->v_sh = a->v_stride[2];
  q->bt_stride = a->block_table_stride[0];
  q->kn_st = a->k_new_stride[0], q->kn_sh = a->k_new_stride[1];
  q->vn_st = a->v_new_stride[0], q->vn_sh = a->v_new_stride[1];
  q->cs_stride = a->cos_sin_stride;
  q->qk_eps = (float)a->qk_norm_eps;
  q->rope_rows = (int)a->rope_rows;
  q->block_size = (int)a->block_size;
  q->max_blocks = (int)a->max_blocks;
  q->num_blocks = (int)a->num_blocks;
  q->window_left = (int)a->window_left;
  q->min_chunk = p->cfg.min_chunk;
  const double log2e = 1.4426950408889634;
  if (a->softcap > 0) {
    q->qk_scale = (float)(a->scale / a->softcap);
    q->cap_log2 = (float)(a->softcap * log2e);
  } else {
    q->qk_scale = (float)(a->scale * log2e);
  }
  *out = p;
  return OPGRAFT_OK;
}

void opgraft_attention_plan_destroy(opgraft_attention_plan *p) { free(p); }

size_t opgraft_attention_plan_workspace_size(const opgraft_attention_plan *p) { return p ? p->workspace : 0; }

/* The splits of a sequence for a batch: one wave of blocks over batch x kv heads, no more than
 * max_splits, and no more than the length bound makes useful at min_chunk tokens a split. */
static int split_count(const opgraft_attention_plan *plan, int64_t batch, int64_t max_seq_len) {
  const opgraft_attention_args *a = &plan->args;
  const int64_t groups = batch * a->num_kv_heads;
  int64_t S = plan->slots / (groups > 0 ? groups : 1);
  if (S > plan->cfg.max_splits) S = plan->cfg.max_splits;
  if (max_seq_len > 0) {
    int64_t span = max_seq_len + 15; /* the first tile starts up to 15 tokens early */
    if (a->window_left >= 0 && a->window_left + 1 + 15 < span) span = a->window_left + 1 + 15;
    const int64_t useful = (span + plan->cfg.min_chunk - 1) / plan->cfg.min_chunk;
    if (S > useful) S = useful;
  }
  return S < 2 ? 1 : (int)S;
}

int opgraft__attn_fan_of(int fan32, int *S) {
  /* 33..36 splits drop to 32: an eighth fewer blocks cost less than the level they save (v39).
   * 32 keeps a cluster launch's split count a multiple of its cluster size (36 in clusters of 4). */
  if (!fan32 || *S <= OG_ATTN_FAN || *S > OG_ATTN_FAN_MAX + OG_ATTN_FAN_MAX / 8) return OG_ATTN_FAN_LOG2;
  if (*S > OG_ATTN_FAN_MAX) *S = OG_ATTN_FAN_MAX;
  return OG_ATTN_FAN_MAX_LOG2;
}

int opgraft__attn_cluster_of(int cluster, const int resident_of[4], int64_t groups, int *S) {
  int c = 1, i = 0;
  while (c * 2 <= cluster && c * 2 <= *S && i < 3) c *= 2, ++i;
  for (; c >= 4; c /= 2, --i) { /* a cluster of 2 merged no faster than the tree (v25) */
    int64_t per = *S / c;    /* clusters a group, no more than fit at once (else they run in waves) */
    if (groups * per > resident_of[i]) per = resident_of[i] / groups;
    if (per >= 1 && 10 * per * c >= 7 * (int64_t)*S) { /* at most 30% fewer splits */
      *S = (int)(per * c);
      return c;
    }
  }
  return 1;
}

static int32_t launch(const og_cuda_api *cu, const opgraft_attention_plan *plan, og_attn_params *p, int64_t batch,
                      int64_t max_seq_len, void *workspace, og_CUstream s) {
  int S = split_count(plan, batch, max_seq_len);
  const int cs =
      S > 1 ? opgraft__attn_cluster_of(plan->cfg.cluster, plan->max_clusters, batch * plan->args.num_kv_heads, &S) : 1;
  og_CUfunction fn = plan->fn[0];
  if (S > 1) { /* the fan-in on the final split count, after the clusters' rounding */
    const int lg = opgraft__attn_fan_of(plan->cfg.fan32, &S);
    fn = plan->fn[lg - OG_ATTN_FAN_LOG2];
    og_attn_tree(S, lg, &p->slots_per_group, &p->counters_per_group);
    p->counters = (unsigned *)workspace;
    p->part_ml = (float *)((char *)workspace + plan->ml_off);
    p->part = (float *)((char *)workspace + plan->part_off);
  }
  void *params[] = {p};
  const unsigned gy = (unsigned)plan->args.num_kv_heads, gz = (unsigned)batch;
  og_CUlaunchAttribute attrs[2];
  unsigned na = 0;
  memset(attrs, 0, sizeof attrs);
  if (plan->cfg.pdl) {
    /* The kernel waits (griddepcontrol.wait) for the previous kernel before any global access. */
    attrs[na].id = OG_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[na++].value.flag = 1;
  }
  if (cs > 1) {
    attrs[na].id = OG_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[na].value.dim[0] = (unsigned)cs, attrs[na].value.dim[1] = attrs[na].value.dim[2] = 1;
    ++na;
  }
  if (na) {
    og_CUlaunchConfig lc = {(unsigned)S, gy, gz, plan->threads, 1, 1, plan->smem, s, attrs, na};
    return opgraft__cu_check(cu->cuLaunchKernelEx(&lc, fn, params, NULL),
                             "launch attention_decode (cuLaunchKernelEx: programmatic dependent launch or clusters)");
  }
  return opgraft__cu_check(cu->cuLaunchKernel(fn, (unsigned)S, gy, gz, plan->threads, 1, 1, plan->smem, s, params,
                                              NULL),
                           "launch attention_decode");
}

static int misaligned(const void *p, unsigned n) { return ((uintptr_t)p & (n - 1u)) != 0; }

/* Every run entry point: k_new NULL for a plan without the cache write; pro (the q/k norm weights,
 * the cos/sin cache and the positions) NULL from the entry points that have none. */
static int32_t run(const char *what, const opgraft_attention_plan *plan, const void *q, const void *k_new,
                   const void *v_new, const void *slot_mapping, int64_t slot_count, const void *k_cache,
                   const void *v_cache, const void *block_table, const void *seq_lens, const void *sinks, void *out,
                   void *workspace, int64_t batch, int64_t max_seq_len, const opgraft_attention_args *pro,
                   void *stream) {
  if (!plan) return opgraft__fail(OPGRAFT_EINVAL, "%s: no plan", what);
  const int has_pro = plan->cfg.qknorm || plan->cfg.rope;
  if (has_pro && !pro)
    return opgraft__fail(OPGRAFT_EINVAL, "%s: the plan was made with q/k norm or rotary embedding (run it with "
                                         "opgraft_attention_plan_run_args)", what);
  if (!k_new != !plan->args.k_new)
    return opgraft__fail(OPGRAFT_EINVAL, "%s: the plan was made %s new keys (run it with %s)", what,
                         plan->args.k_new ? "with" : "without",
                         plan->args.k_new ? "opgraft_attention_plan_run_update" : "opgraft_attention_plan_run");
  if (has_pro && ((plan->cfg.qknorm && (!pro->q_norm_weight || !pro->k_norm_weight ||
                                                misaligned(pro->q_norm_weight, 16) || misaligned(pro->k_norm_weight, 16))) ||
                  (plan->cfg.rope && batch > 0 &&
                   (!pro->cos_sin_cache || !pro->positions || misaligned(pro->cos_sin_cache, 16) ||
                    misaligned(pro->positions, 8)))))
    return opgraft__fail(OPGRAFT_EINVAL, "%s: q/k norm weights, cos/sin cache or positions NULL or misaligned", what);
  if (k_new && (!v_new || slot_count < 0 || (slot_count > 0 && !slot_mapping) || misaligned(k_new, 16) ||
                misaligned(v_new, 16) || misaligned(slot_mapping, 8)))
    return opgraft__fail(OPGRAFT_EINVAL, "%s: new values, slot mapping or slot count %lld bad", what,
                         (long long)slot_count);
  if (batch < 0 || batch > OG_ATTN_MAX_BATCH || max_seq_len < 0)
    return opgraft__fail(OPGRAFT_EINVAL, "%s: batch %lld, max_seq_len %lld", what, (long long)batch,
                         (long long)max_seq_len);
  if (batch > plan->args.batch) /* the guard decided for the plan's batch, not a larger one */
    return opgraft__fail(OPGRAFT_EINVAL, "%s: batch %lld > the plan's %lld", what, (long long)batch,
                         (long long)plan->args.batch);
  const og_cuda_api *cu;
  og_CUcontext ctx = NULL;
  int32_t st = opgraft__current_ctx(&cu, &ctx);
  if (st) return st;
  if ((st = opgraft__plan_check(ctx, &plan->head, "attention plan"))) return st;
  if (batch == 0) return OPGRAFT_OK;
  if (!q || !k_cache || !v_cache || !block_table || !seq_lens || !out || !sinks != !plan->args.sinks ||
      (plan->workspace && !workspace))
    return opgraft__fail(OPGRAFT_EINVAL, "%s: a NULL pointer (or sinks unlike the plan's)", what);
  if (misaligned(q, 16) || misaligned(k_cache, 16) || misaligned(v_cache, 16) || misaligned(out, 16) ||
      misaligned(workspace, 16) || misaligned(block_table, 4) || misaligned(seq_lens, 4) ||
      misaligned(sinks, plan->args.sinks_dtype == OPGRAFT_DTYPE_FP32 ? 4u : 2u))
    return opgraft__fail(OPGRAFT_EINVAL, "%s: a pointer is misaligned", what);
  og_attn_params p = plan->proto;
  p.q = q, p.k = k_cache, p.v = v_cache, p.out = out;
  p.block_table = (const int *)block_table, p.seq_lens = (const int *)seq_lens, p.sinks = sinks;
  p.k_new = k_new, p.v_new = v_new, p.slot_mapping = (const long long *)slot_mapping;
  p.slot_count = slot_count > batch ? (int)batch : (int)slot_count;
  if (has_pro) {
    p.q_norm_w = pro->q_norm_weight, p.k_norm_w = pro->k_norm_weight;
    p.cos_sin = pro->cos_sin_cache, p.positions = (const long long *)pro->positions;
  }
  return launch(cu, plan, &p, batch, max_seq_len, workspace, (og_CUstream)stream);
}

int32_t opgraft_attention_plan_run(const opgraft_attention_plan *plan, const void *q, const void *k_cache,
                                   const void *v_cache, const void *block_table, const void *seq_lens,
                                   const void *sinks, void *out, void *workspace, int64_t batch, int64_t max_seq_len,
                                   void *stream) {
  return run("opgraft_attention_plan_run", plan, q, NULL, NULL, NULL, 0, k_cache, v_cache, block_table, seq_lens,
             sinks, out, workspace, batch, max_seq_len, NULL, stream);
}

int32_t opgraft_attention_plan_run_update(const opgraft_attention_plan *plan, const void *q, const void *k_new,
                                          const void *v_new, const void *slot_mapping, int64_t slot_count,
                                          const void *k_cache, const void *v_cache, const void *block_table,
                                          const void *seq_lens, const void *sinks, void *out, void *workspace,
                                          int64_t batch, int64_t max_seq_len, void *stream) {
  if (!k_new) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_attention_plan_run_update: no new keys");
  return run("opgraft_attention_plan_run_update", plan, q, k_new, v_new, slot_mapping, slot_count, k_cache, v_cache,
             block_table, seq_lens, sinks, out, workspace, batch, max_seq_len, NULL, stream);
}

int32_t opgraft_attention_plan_run_args(const opgraft_attention_plan *plan, const opgraft_attention_args *a,
                                        void *workspace, void *stream) {
  if (!a || a->struct_size < sizeof *a)
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_attention_plan_run_args: no arguments, or an older ABI's");
  if (plan) { /* strides or options other than the plan's would be read wrongly */
    opgraft_attention_args layout;
    layout_of(a, &layout);
    layout.batch = plan->args.batch;
    if (memcmp(&layout, &plan->args, sizeof layout) != 0)
      return opgraft__fail(OPGRAFT_EINVAL, "opgraft_attention_plan_run_args: the arguments' layout is not the plan's");
  }
  return run("opgraft_attention_plan_run_args", plan, a->q, a->k_new, a->v_new, a->slot_mapping, a->slot_count,
             a->k_cache, a->v_cache, a->block_table, a->seq_lens, a->sinks, a->out, workspace, a->batch,
             a->max_seq_len, a, stream);
}

/* ---- the prologue alone ---- */

int32_t opgraft_attention_prologue_run(const opgraft_attention_args *a, void *k_out, const int64_t k_out_stride[2],
                                       void *stream) {
  char reason[256];
  int32_t st = opgraft__attn_check_prologue_alone(a, k_out_stride, reason, sizeof reason);
  if (st) return opgraft__fail(st, "attention prologue not supported: %s", reason);
  if (a->batch == 0) return OPGRAFT_OK;
  const int norm = a->q_norm_weight != NULL, rope = a->rope_style != OPGRAFT_ROPE_NONE;
  if (!a->q || !a->out || !a->k_new || !k_out || misaligned(a->q, 16) || misaligned(a->out, 16) ||
      misaligned(a->k_new, 16) || misaligned(k_out, 16) ||
      (norm && (misaligned(a->q_norm_weight, 16) || misaligned(a->k_norm_weight, 16))) ||
      (rope && (!a->cos_sin_cache || !a->positions || misaligned(a->cos_sin_cache, 16) || misaligned(a->positions, 8))))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_attention_prologue_run: a NULL or misaligned pointer");
  const og_cuda_api *cu;
  og_CUcontext ctx = NULL;
  if ((st = opgraft__current_ctx(&cu, &ctx))) return st;
  int32_t arch = 0;
  if ((st = opgraft__current_device(NULL, &arch, NULL, 0))) return st;
  if (arch < OG_ATTN_MIN_ARCH)
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "attention prologue not supported: sm_%d is older than sm_%d", arch,
                         OG_ATTN_MIN_ARCH);
  og_opts o;
  char name[64];
  const char *np[1] = {name};
  og_CUfunction fn = NULL;
  opgraft__attn_prologue_fn_name(a->dtype, name);
  if ((st = opgraft__attn_prologue_options(a, &o)) ||
      (st = opgraft__get_functions(OG_ATTN_SOURCE, o.ptr, o.n, arch, np, 1, &fn)))
    return st;
  og_attn_params p;
  memset(&p, 0, sizeof p);
  p.q = a->q, p.out = a->out, p.k_new = a->k_new, p.k_out = k_out;
  p.q_st = a->q_stride[0], p.q_sh = a->q_stride[1], p.o_st = a->out_stride[0], p.o_sh = a->out_stride[1];
  p.kn_st = a->k_new_stride[0], p.kn_sh = a->k_new_stride[1], p.ko_st = k_out_stride[0], p.ko_sh = k_out_stride[1];
  p.pro_heads = (int)a->num_heads, p.pro_kv_heads = (int)a->num_kv_heads;
  p.q_norm_w = a->q_norm_weight, p.k_norm_w = a->k_norm_weight, p.qk_eps = (float)a->qk_norm_eps;
  p.cos_sin = a->cos_sin_cache, p.cs_stride = a->cos_sin_stride, p.rope_rows = (int)a->rope_rows;
  p.positions = (const long long *)a->positions;
  void *params[] = {&p};
  return opgraft__cu_check(cu->cuLaunchKernel(fn, (unsigned)a->batch, 1, 1, OG_ATTN_QK_THREADS, 1, 1, 0,
                                              (og_CUstream)stream, params, NULL),
                           "launch attention_qk_prologue");
}

/* ---- the argument-struct entry point, through plans cached here ---- */

OG_PLAN_CACHE(plans, 64);

static int plan_matches(const void *plan, const void *layout) { /* layout: layout_of the call's args */
  return memcmp(&((const opgraft_attention_plan *)plan)->args, layout, sizeof(opgraft_attention_args)) == 0;
}

int32_t opgraft_attention_workspace_size(const opgraft_attention_args *a, size_t *bytes) {
  char reason[256];
  if (!a || !bytes) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_attention_workspace_size: bad arguments");
  const int32_t st = opgraft__attn_check_static(a, reason, sizeof reason);
  if (st) return opgraft__fail(st, "attention call not supported: %s", reason);
  og_attn_cfg cfg;
  opgraft__attn_config(a, a->arch ? a->arch : 90, a->gpu_name, &cfg);
  *bytes = opgraft__attn_workspace_bytes(a, OG_ATTN_MAX_SLOTS, cfg.max_splits);
  return OPGRAFT_OK;
}

int32_t opgraft_attention_run(const opgraft_attention_args *a, void *workspace, size_t workspace_bytes, void *stream) {
  char reason[256];
  int32_t st;
  if ((st = opgraft__attn_check_static(a, reason, sizeof reason)) ||
      (st = opgraft__attn_check_pointers(a, reason, sizeof reason)))
    return opgraft__fail(st, "attention call not supported: %s", reason);
  if (a->batch == 0) return OPGRAFT_OK;
  const og_cuda_api *cu;
  og_CUcontext ctx = NULL;
  if ((st = opgraft__current_ctx(&cu, &ctx))) return st;
  opgraft_attention_args layout;
  layout_of(a, &layout);
  opgraft_attention_plan local, *plan = &local; /* a copy: the cached one may be evicted meanwhile */
  if (!opgraft__plan_cache_find(&plans, ctx, plan_matches, &layout, &local, sizeof local)) {
    opgraft_attention_plan *made = NULL;
    if ((st = opgraft_attention_plan_create(a, &made, reason, sizeof reason))) return st;
    local = *made;
    opgraft__plan_cache_put(&plans, made);
  }
  if (plan->workspace > workspace_bytes)
    return opgraft__fail(OPGRAFT_EINVAL, "workspace of %zu bytes given, %zu needed", workspace_bytes, plan->workspace);
  return run("opgraft_attention_run", plan, a->q, a->k_new, a->v_new, a->slot_mapping, a->slot_count, a->k_cache,
             a->v_cache, a->block_table, a->seq_lens, a->sinks, a->out, workspace, a->batch, a->max_seq_len, a,
             stream);
}
