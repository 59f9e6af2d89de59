// The routing of a MoE call as the kernels see it: which local expert each (token, slot) picked,
// the set of used experts in increasing order, and each expert's (token, slot) pairs.
#pragma once
#include "moe_config.cuh"

// OG_ROUTE (opgraft_moe_args.routing): the kernels route the call themselves from the router's
// logits instead of reading topk_ids and topk_weights: 1 softmax top-k, 2 the same renormalized
// over the k picked (vLLM's topk_softmax without and with renormalize). Every block computes the
// whole routing into og_s_topk (og_route, a warp a token) before it reads a slot's expert; the
// ids and weights are then the same in every block and every kernel of the call.
#ifndef OG_ROUTE
#define OG_ROUTE 0
#endif
#if OG_ROUTE
#if OG_EMAP
#error "OG_ROUTE takes no expert map"
#endif
struct og_topk {
  int id[OG_MAXPAIRS];
  float w[OG_MAXPAIRS];
};
__shared__ og_topk og_s_topk;

// A logit, 16 bits, written by the previous kernel (which may still run under PDL before the
// wait): a coherent load, volatile so that it stays after the wait.
__device__ __forceinline__ og_u32 og_load_logit(const og_u16 *p) {
  unsigned short v;
  asm volatile("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

// The 16-bit key of a bf16/fp16 logit whose unsigned order is the values' order (-0 as +0).
__device__ __forceinline__ og_u32 og_logit_key(og_u32 b) {
  if (b == 0x8000u) b = 0u;
  return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
}
__device__ __forceinline__ float og_key_logit(og_u32 k) {
  return og_to_float((og_u16)((k & 0x8000u) ? (k & 0x7fffu) : (~k & 0xffffu)));
}

// Block-wide: the routing of the call from p.logits into og_s_topk, warp w taking tokens w, w+W,
// ... Keys are (logit key << 16 | 0xffff - e): k rounds of a warp-wide max (redux.sync) pick the
// largest logits, ties to the lower expert as vLLM's topk_softmax; the weights are
// exp(l - max) over the sum of all E (OG_ROUTE 1) or of the k picked (2), summed in a fixed order.
// Block 0 also writes the routing to p.route_ids / p.route_w where they are set. WEIGHTS false
// (moe_down, which reads the weighted act): the ids only.
template <bool WEIGHTS>
__device__ __forceinline__ void og_route(const og_moe_params &p) {
  constexpr int NPL = (OG_E + 31) / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int t = warp; t < p.T; t += nw) {
    const og_u16 *row = (const og_u16 *)p.logits + (long long)t * p.logits_stride;
    og_u32 key[NPL];
#pragma unroll
    for (int q = 0; q < NPL; ++q) {
      const int e = q * 32 + lane;
      key[q] = (OG_E % 32 == 0 || e < OG_E) ? (og_logit_key(og_load_logit(row + e)) << 16) | (0xffffu - e) : 0u;
    }
#if OG_ROUTE == 1
    og_u32 all[NPL];
    if (WEIGHTS)
#pragma unroll
      for (int q = 0; q < NPL; ++q) all[q] = key[q];
#endif
    int ids[OG_K];
    float lg[OG_K];
#pragma unroll
    for (int r = 0; r < OG_K; ++r) {
      og_u32 m = key[0];
#pragma unroll
      for (int q = 1; q < NPL; ++q) m = max(m, key[q]);
      m = __reduce_max_sync(OG_FULL, m);
#pragma unroll
      for (int q = 0; q < NPL; ++q)
        if (key[q] == m) key[q] = 0u;
      ids[r] = (int)(0xffffu - (m & 0xffffu));
      lg[r] = og_key_logit(m >> 16);
    }
    if (!WEIGHTS) {
#pragma unroll
      for (int r = 0; r < OG_K; ++r)
        if (lane == r) og_s_topk.id[t * OG_K + r] = ids[r];
      continue;
    }
    float sum = 0.f;
#if OG_ROUTE == 1
#pragma unroll
    for (int q = 0; q < NPL; ++q)
      if (all[q]) sum += expf(og_key_logit(all[q] >> 16) - lg[0]);
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(OG_FULL, sum, o);  // same bits in every lane
#else
#pragma unroll
    for (int r = 0; r < OG_K; ++r) sum += expf(lg[r] - lg[0]);
#endif
#pragma unroll
    for (int r = 0; r < OG_K; ++r)
      if (lane == r) {
        const float w = expf(lg[r] - lg[0]) / sum;
        og_s_topk.id[t * OG_K + r] = ids[r];
        og_s_topk.w[t * OG_K + r] = w;
        if (blockIdx.x == 0 && p.route_ids) p.route_ids[t * OG_K + r] = ids[r];
        if (blockIdx.x == 0 && p.route_w) p.route_w[t * OG_K + r] = w;
      }
  }
  __syncthreads();
}
#define OG_ROUTE_CALL(p, weights) og_route<weights>(p)
#else
#define OG_ROUTE_CALL(p, weights) \
  do {                            \
  } while (0)
#endif

// A routing slot's router weight.
__device__ __forceinline__ float og_topk_weight(const og_moe_params &p, int t, int j) {
#if OG_ROUTE
  return og_s_topk.w[t * OG_K + j];
#else
  return p.topk_w[t * p.topk_w_stride + j];
#endif
}

// The local expert of routing slot i, or -1 (out of range, or another rank's expert under
// expert parallelism: OG_EMAP maps global ids through p.emap).
__device__ __forceinline__ int og_load_id(const og_moe_params &p, int i) {
#if OG_ROUTE
  return og_s_topk.id[i];
#else
  const int t = i / OG_K, j = i - t * OG_K;
#if OG_IDS64
  long long e = ((const long long *)p.topk_ids)[t * p.topk_ids_stride + j];
#else
  long long e = ((const int *)p.topk_ids)[t * p.topk_ids_stride + j];
#endif
#if OG_EMAP
  e = (e >= 0 && e < p.emap_len) ? p.emap[e] : -1;
#endif
  return (e >= 0 && e < OG_E) ? (int)e : -1;
#endif
}

// Loads the routing ids into shared memory and marks the used experts in a bitmap.
__device__ __forceinline__ void og_load_routing(const og_moe_params &p, int nk, int *s_ids,
                                                og_u32 *s_bits) {
  for (int i = threadIdx.x; i < OG_EWORDS; i += blockDim.x) s_bits[i] = 0u;
  __syncthreads();
  for (int i = threadIdx.x; i < nk; i += blockDim.x) {
    const int e = og_load_id(p, i);
    s_ids[i] = e;
    if (e >= 0) atomicOr(&s_bits[e >> 5], 1u << (e & 31));
  }
  __syncthreads();
}

// Warp-wide: calls f(rank, expert) for every used expert, in increasing expert order.
template <class F>
__device__ __forceinline__ int og_for_each_expert(const og_u32 *s_bits, int lane, F f) {
  int base = 0;
  for (int w0 = 0; w0 < OG_EWORDS; w0 += 32) {
    const og_u32 word = (w0 + lane < OG_EWORDS) ? s_bits[w0 + lane] : 0u;
    const int cnt = __popc(word);
    int incl = cnt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(OG_FULL, incl, o);
      if (lane >= o) incl += v;
    }
    int rank = base + incl - cnt;
    og_u32 rest = word;
    while (rest) {
      const int b = __ffs(rest) - 1;
      f(rank++, (w0 + lane) * 32 + b);
      rest &= rest - 1;
    }
    base += __shfl_sync(OG_FULL, incl, 31);
  }
  return base;
}

// The routing of the call, shared by a block's tiles: ids (-1 where not routed here), a bitmap of
// the used experts, and their list in increasing order.
struct og_routing {
  int ids[OG_MAXPAIRS];
  og_u32 bits[OG_EWORDS];
  short experts[OG_MAXPAIRS < OG_E ? OG_MAXPAIRS : OG_E];
  int nused;
};

__device__ __forceinline__ void og_routing_setup(const og_moe_params &p, og_routing &r) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  og_load_routing(p, p.T * OG_K, r.ids, r.bits);
  if (warp == 0) {
    const int n = og_for_each_expert(r.bits, lane, [&](int rank, int e) { r.experts[rank] = (short)e; });
    if (lane == 0) r.nused = n;
  }
  __syncthreads();
}

// Warp-wide, calls of at most 32 routing slots (OG_DOWN_ONE: nk = K; OG_DOWN_WARP: nk = T*K): the
// routing into this warp's own r (ids, used experts in increasing order, their count; not the
// bitmap), from one id a lane and shuffles.
__device__ __forceinline__ void og_routing_warp(const og_moe_params &p, og_routing &r, int nk) {
  const int lane = threadIdx.x & 31;
  const int e = lane < nk ? og_load_id(p, lane) : -1;
  if (lane < nk) r.ids[lane] = e;
  bool first = e >= 0;  // the slot's expert is used, and no earlier slot lists it
#pragma unroll
  for (int l = 0; l < nk; ++l) {
    const int el = __shfl_sync(OG_FULL, e, l);
    if (l < lane && el == e) first = false;
  }
  const og_u32 fm = __ballot_sync(OG_FULL, first);
  int rank = 0;  // used experts below this one
#pragma unroll
  for (int l = 0; l < nk; ++l) {
    const int el = __shfl_sync(OG_FULL, e, l);
    if (((fm >> l) & 1u) && el < e) ++rank;
  }
  if (first) r.experts[rank] = (short)e;
  if (lane == 0) r.nused = __popc(fm);
  __syncwarp();
}

// Calls of at most 32 routing slots, a block per (routing slot i, tile): the first warp finds slot
// i's expert e into s_e and, when no earlier slot lists e (else that slot's block has it), e's slots
// in increasing order into s_pairs; s_npairs is their count, 0 when this block has nothing to do.
__device__ __forceinline__ void og_slot_pairs(const og_moe_params &p, int i, int *s_pairs, int &s_npairs,
                                              int &s_e) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, nk = p.T * OG_K;
    const int id = lane < nk ? og_load_id(p, lane) : -1;
    const int e = __shfl_sync(OG_FULL, id, i);
    const og_u32 same = __ballot_sync(OG_FULL, lane < nk && id == e);  // the slots that list e
    const bool owner = e >= 0 && (same & ((1u << i) - 1u)) == 0;      // and none before slot i
    if (owner && ((same >> lane) & 1u)) s_pairs[__popc(same & ((1u << lane) - 1u))] = lane;
    if (lane == 0) s_npairs = owner ? __popc(same) : 0, s_e = e;
  }
  __syncthreads();
}

// Warp-wide (one warp): the routing slots i = t*K + j that picked expert e, in increasing order,
// into s_pairs; lane 0 stores their count in s_npairs.
__device__ __forceinline__ void og_pairs_of(const og_routing &r, int nk, int e, int lane, int *s_pairs,
                                            int &s_npairs) {
  int n = 0;
  for (int i0 = 0; i0 < nk; i0 += 32) {
    const int i = i0 + lane;
    const bool m = i < nk && r.ids[i] == e;
    const og_u32 b = __ballot_sync(OG_FULL, m);
    if (m) s_pairs[n + __popc(b & ((1u << lane) - 1u))] = i;
    n += __popc(b);
  }
  if (lane == 0) s_npairs = n;
}
