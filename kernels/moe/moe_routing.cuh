// The routing of a MoE call as the kernels see it: which local expert each (token, slot) picked,
// the set of used experts in increasing order, and each expert's (token, slot) pairs.
#pragma once
#include "moe_config.cuh"

// The local expert of routing slot i, or -1 (out of range, or another rank's expert under
// expert parallelism: OG_EMAP maps global ids through p.emap).
__device__ __forceinline__ int og_load_id(const og_moe_params &p, int i) {
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
