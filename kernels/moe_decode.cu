// MoE experts for decode (few tokens): out[t] = sum_j w[t,j] * W2[e] (silu(G[e] x_t) * U[e] x_t).
//
// Two kernels on one stream, each weight byte read once per call:
//   moe_gate_up_<dtype>: one block per (used expert, 16 rows of I). Its warps split H; each warp
//     multiplies its 16 gate rows and 16 up rows by the x of every token routed to the expert
//     (tensor cores, m16n8k16, tokens as the N dimension), the block sums the warps in a fixed
//     order and writes act[t*k+j, :] = w[t,j] * silu(gate) * up to the workspace.
//   moe_down_<dtype>: one block per 16 rows of H. Its warps share the (used expert, I chunk) work
//     items; B is act of each token for that expert (zero for tokens that did not pick it), so the
//     accumulator sums over experts directly, and the block sums the warps in a fixed order.
// No atomics on data and fixed summation orders: the same inputs give the same bits every run.
//
// Compile-time constants (-D): OG_DTYPE (1 bf16, 2 fp16), OG_IDS64, OG_EMAP (expert_map),
// OG_H, OG_I, OG_E, OG_K,
// OG_NT (8-token tiles: the kernels take T <= 8*OG_NT), OG_GU_NT (gate_up's, below), OG_W1/OG_U1 and OG_W2/OG_U2 (warps per
// block and 32-wide k steps in flight per warp), OG_ON_INPUT (apply_router_weight_on_input),
// OG_PREFETCH (L2 prefetch distance in loop iterations, 0 = off), OG_L2_FETCH (L2 fetch size
// hint, og_common.cuh), OG_LOAD / OG_DOWN_LOAD (the weight loads' form per stage, og_common.cuh),
// OG_W2PF_BYTES / OG_W2PF_LAST (below), OG_PDL (below), OG_GU_MIN_BLOCKS / OG_DOWN_MIN_BLOCKS (below).
//
// OG_PDL (sm_90; the launcher sets the down launch's programmatic-serialization attribute):
// gate_up lets moe_down start as soon as every gate_up block has started, so the down blocks
// take the SMs that gate_up's tail frees, run their routing setup, then wait for gate_up to
// finish before they read act or write out. The down stage's launch and ramp hide behind
// gate_up's tail; the bytes read do not change.
//
// moe_fused_<dtype> does both stages in one cooperative launch: blocks loop over the gate_up tiles,
// meet at a grid-wide barrier (a counter the launcher zeroes before the launch), then loop over
// the down tiles. It pays one launch and one routing setup instead of two, which matters for small
// calls. The barrier spins, so the kernel must be launched cooperatively (all blocks resident).
#include "og_common.cuh"
#include "moe_params.h"

#define OG_FULL 0xffffffffu
// OG_TRACE (OPGRAFT_TRACE=1, a diagnostic): thread 0 of each block records %globaltimer at phase
// boundaries into p.trace[kernel][block][slot]: kernel 0 gate_up, 1 down, 2 fused; slot 0 start,
// 1 routing set up, 2 gate_up's tiles done, 3 released (down: after its wait for gate_up; fused:
// after the grid barrier), 7 end; slot 6 holds the block's SM (%smid + 1), written with slot 0.
#ifndef OG_TRACE
#define OG_TRACE 0
#endif
#if OG_TRACE
#define OG_TS(kern, slot)                                                                       \
  do {                                                                                         \
    if (threadIdx.x == 0 && p.trace && (int)blockIdx.x < p.trace_blocks) {                     \
      unsigned long long t_;                                                                   \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                   \
      unsigned long long *rec_ = p.trace + ((long long)(kern) * p.trace_blocks + blockIdx.x) * 8; \
      rec_[slot] = t_;                                                                         \
      if ((slot) == 0) {                                                                       \
        unsigned sm_;                                                                          \
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));                                       \
        rec_[6] = sm_ + 1ULL;                                                                  \
      }                                                                                        \
    }                                                                                          \
  } while (0)
#else
#define OG_TS(kern, slot) \
  do {                    \
  } while (0)
#endif
#ifndef OG_PREFETCH
#define OG_PREFETCH 0
#endif
#ifndef OG_EMAP
#define OG_EMAP 0
#endif
#ifndef OG_W2PF_BYTES
#define OG_W2PF_BYTES 0
#endif
#ifndef OG_PDL
#define OG_PDL 0
#endif
#ifndef OG_DOWN_EARLY
#define OG_DOWN_EARLY 0
#endif
// OG_PDL_IN (moe.pdl_in, sm_90; the launcher sets gate_up's programmatic-serialization
// attribute): gate_up may be launched before the stream's previous kernel has finished (it takes
// the SMs as that kernel's blocks exit) and waits for it (griddepcontrol.wait) before it reads
// anything: the routing and x are that kernel's or an earlier one's results, and act, out may be
// what it still reads. Only then does gate_up let moe_down launch, so down's reads of the routing
// before its own wait see them too. What it saves is gate_up's launch after the previous kernel.
#ifndef OG_PDL_IN
#define OG_PDL_IN 0
#endif
// OG_GU_ONE (moe.gate_up.one_token; one-token calls only): gate_up's block (slot j, tile) reads
// only topk_ids[0][j] and multiplies that expert for that one (token, slot) pair: no bitmap of
// used experts, no list, one block barrier (for the pair's slot) before the first weight load. A
// token that lists an expert twice gets the expert computed twice (each slot's block writes its
// own act row, with the same bits as the general path), an id routed nowhere (-1, E, another
// rank's) ends its blocks.
#ifndef OG_GU_ONE
#define OG_GU_ONE 0
#endif
// OG_DOWN_ONE (moe.down.one_token; one-token calls only): each down warp reads the K routing ids
// itself and builds its own copy of the routing (used experts sorted, duplicates once) with warp
// shuffles: no shared bitmap and no block-wide barriers before down's first weight loads. The
// items, their order and so the sums are the general path's.
#ifndef OG_DOWN_ONE
#define OG_DOWN_ONE 0
#endif
// OG_GU_SLOTS (moe.gate_up.slot_routing; calls of T*K <= 32 routing slots): gate_up's block is
// (routing slot i, tile). Its first warp loads the T*K ids (one a lane) and, by ballot, finds
// slot i's expert, whether an earlier slot lists it (then the block ends: that slot's block has
// the expert) and the expert's (token, slot) pairs in increasing slot order, as og_pairs_of
// lists them: one block barrier before the first weight load instead of four, same sums.
// OG_DOWN_WARP (moe.down.warp_routing; T*K <= 32): OG_DOWN_ONE for T*K slots (og_routing_warp).
#ifndef OG_GU_SLOTS
#define OG_GU_SLOTS 0
#endif
#ifndef OG_DOWN_WARP
#define OG_DOWN_WARP 0
#endif
// From two token tiles on, the accumulators need more than 128 registers, and ptxas otherwise
// aims at two blocks per SM and spills: one block per SM is enough for those (longer) calls.
#define OG_MIN_BLOCKS (OG_NT >= 2 ? 1 : 0)
// gate_up's own minimum (OG_GU_MIN_BLOCKS, moe.gate_up.min_blocks; 0 = OG_MIN_BLOCKS). Without one,
// ptxas compiles Qwen3-30B-A3B's one-tile gate_up to 64 registers and moves each weight load down
// to the MMA that uses it, so a warp has about one k-step of loads in flight instead of OG_U1;
// with a minimum of 1 or 2 blocks per SM it keeps all 4*OG_U1 loads ahead of the MMAs (118-120
// registers). Which of the two streams faster is for the GPU to say (bench/NOTES.md, v13).
#ifndef OG_GU_MIN_BLOCKS
#define OG_GU_MIN_BLOCKS 0
#endif
// gate_up's single-pass token tiles (OG_GU_NT, moe.gate_up.nt; 1..OG_NT, default OG_NT). gate_up's
// token dimension is a tile's (token, slot) pairs for its one expert, not the call's tokens: at 16
// tokens over many experts an expert rarely has more than 8 pairs, so one 8-pair MMA tile per pass
// keeps one tile's registers (and the launch-bounds minimum) at two tiles' token count. A tile
// whose expert has more pairs takes a second path with all OG_NT tiles in one pass and one k-step
// in flight per warp: every weight byte is still read once.
#ifndef OG_GU_NT
#define OG_GU_NT OG_NT
#endif
#if OG_GU_NT < 1 || OG_GU_NT > OG_NT
#error "OG_GU_NT must be in 1..OG_NT"
#endif
#define OG_GU_MIN (OG_GU_MIN_BLOCKS > 0 ? OG_GU_MIN_BLOCKS : (OG_GU_NT >= 2 ? 1 : 0))
// down's own minimum (OG_DOWN_MIN_BLOCKS, moe.down.min_blocks; 0 = OG_MIN_BLOCKS). At two token
// tiles ptxas otherwise takes ~200 registers a thread, so only 2 blocks of 4 warps fit an SM.
#ifndef OG_DOWN_MIN_BLOCKS
#define OG_DOWN_MIN_BLOCKS 0
#endif
#define OG_DOWN_MIN (OG_DOWN_MIN_BLOCKS > 0 ? OG_DOWN_MIN_BLOCKS : OG_MIN_BLOCKS)
#define OG_EWORDS ((OG_E + 31) / 32)
#define OG_MAXPAIRS (8 * OG_NT * OG_K)

#if OG_H % 32 != 0 || OG_I % 32 != 0
#error "H and I must be multiples of 32"
#endif

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

// The down stage's weights, requested into L2 while gate_up streams its own (OG_W2PF_BYTES > 0):
// the first OG_W2PF_BYTES of them in the order the down stage reads them (used experts in
// increasing order, rows in order), spread over every thread of the grid, one 128-byte line per
// request. Only lines that hold W2 bytes are touched. The HBM traffic is the same; what changes is
// when it happens: during gate_up (which leaves bandwidth idle while it ramps up and drains),
// instead of in the down stage's own ramp. Worth it only when the prefetched part survives in L2
// until the down stage reads it, which bounds the useful budget by the L2 size.
__device__ __forceinline__ void og_prefetch_w2(const og_moe_params &p, const og_routing &r) {
#if OG_W2PF_BYTES > 0
  const bool dense = p.w2_rstride == OG_I;  // each expert's [H, I] is one contiguous slab
  const long long span = dense ? 2LL * OG_H * OG_I : 2LL * OG_I;  // bytes per run of lines
  const long long runs = dense ? 1 : OG_H;                        // runs per expert
  const long long run_lines = span / 128 + 2;  // upper bound: a run may straddle one more line
  long long total = (long long)r.nused * runs * run_lines;
  const long long cap = (OG_W2PF_BYTES + 127) / 128;
  if (total > cap) total = cap;
  const long long nthreads = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += nthreads) {
    const long long per_exp = runs * run_lines;
    const long long u = i / per_exp, rem = i - u * per_exp;
    const long long run = rem / run_lines, l = rem - run * run_lines;
    const unsigned long long start = (unsigned long long)(const char *)p.w2 +
                                     2ULL * (unsigned long long)(r.experts[u] * p.w2_estride + run * p.w2_rstride);
    const unsigned long long line = (start & ~127ULL) + 128ULL * (unsigned long long)l;
    if (line < start + (unsigned long long)span) og_prefetch_l2_keep((const void *)line);
  }
#endif
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

// A warp's gate and up partials of one tile, into its row of the block's reduction buffer.
template <int NP>
__device__ __forceinline__ void og_stash_gate_up(float (*s_red_w)[2][4][32], const float (&acc_g)[NP][4],
                                                 const float (&acc_u)[NP][4], int lane) {
#pragma unroll
  for (int pt = 0; pt < NP; ++pt)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      s_red_w[pt][0][q][lane] = acc_g[pt][q];
      s_red_w[pt][1][q][lane] = acc_u[pt][q];
    }
}

// gate_up's epilogue for pairs p0.. of one tile: sums the W warps' gate and up partials in warp
// order and writes act = w * silu(gate) * up (or with the router weight on the input) for each
// pair. Threads tid, tid + nthreads, ... share the work.
template <int W, int NP, int NB = NP>
__device__ __forceinline__ void og_write_act(const og_moe_params &p, const float (*s_red)[NB][2][4][32],
                                             const int *s_pairs, int npairs, int p0, int tile, int tid,
                                             int nthreads) {
  for (int idx = tid; idx < NP * 4 * 32; idx += nthreads) {
    const int pt = idx / 128, q = (idx / 32) & 3, l = idx & 31;
    const int n = p0 + pt * 8 + (l & 3) * 2 + (q & 1);
    if (n >= npairs) continue;
    float gs = 0.f, us = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      gs += s_red[w][pt][0][q][l];
      us += s_red[w][pt][1][q][l];
    }
    const int i = s_pairs[n];
    const int t = i / OG_K, j = i - t * OG_K;
    const float rw = p.topk_w[t * p.topk_w_stride + j];
#if OG_ON_INPUT
    const float a = og_silu(gs * rw) * (us * rw);
#else
    const float a = og_silu(gs) * us * rw;
#endif
    const int row = tile * 16 + (l >> 2) + (q >> 1) * 8;
    ((og_u16 *)p.act)[(long long)i * OG_I + row] = og_from_float(a);
  }
}

// down: for each token tile, the workspace row of this lane's token (nt*8 + g) for expert e, or
// -1; src1 != -1 where the token lists e more than once (its rows are summed, og_sum_copies).
__device__ __forceinline__ void og_act_sources(const og_routing &r, int T, int e, int g, int (&src0)[OG_NT],
                                               int (&src1)[OG_NT]) {
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt) {
    const int t = nt * 8 + g;
    src0[nt] = src1[nt] = -1;
    if (t < T) {
      for (int j = 0; j < OG_K; ++j) {
        if (r.ids[t * OG_K + j] == e) {
          if (src0[nt] < 0) src0[nt] = t * OG_K + j;
          else src1[nt] = -2;
        }
      }
    }
  }
}

// The sum of token t's act rows for expert e (a token routed to it more than once), 8 elements at
// one k offset; load(i) returns workspace row i's 16 bytes there.
template <class L>
__device__ __forceinline__ og_vec4 og_sum_copies(const og_routing &r, int t, int e, L load) {
  float v[8];
  for (int z = 0; z < 8; ++z) v[z] = 0.f;
  for (int j = 0; j < OG_K; ++j) {
    if (r.ids[t * OG_K + j] != e) continue;
    const og_vec4 x = load(t * OG_K + j);
    v[0] += og_lo(x.x), v[1] += og_hi(x.x), v[2] += og_lo(x.y), v[3] += og_hi(x.y);
    v[4] += og_lo(x.z), v[5] += og_hi(x.z), v[6] += og_lo(x.w), v[7] += og_hi(x.w);
  }
  og_vec4 b;
  b.x = og_pack2(v[0], v[1]), b.y = og_pack2(v[2], v[3]);
  b.z = og_pack2(v[4], v[5]), b.w = og_pack2(v[6], v[7]);
  return b;
}

// down's epilogue for rows h0..h0+15: sums the W warps' partials in warp order, writes out.
template <int W>
__device__ __forceinline__ void og_write_out(const og_moe_params &p, const float (*s_red)[OG_NT][4][32], int h0,
                                             int tid, int nthreads) {
  for (int idx = tid; idx < OG_NT * 4 * 32; idx += nthreads) {
    const int nt = idx / 128, q = (idx / 32) & 3, l = idx & 31;
    const int t = nt * 8 + (l & 3) * 2 + (q & 1);
    if (t >= p.T) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) sum += s_red[w][nt][q][l];
    const int h = h0 + (l >> 2) + (q >> 1) * 8;
    ((og_u16 *)p.out)[(long long)t * p.out_stride + h] = og_from_float(sum);
  }
}

// gate_up's passes over one tile's npairs (token, slot) pairs: NT 8-pair MMA tiles a pass, U k-steps
// of loads in flight per warp; s_red is the block's reduction buffer (NB >= NT tiles a warp).
template <int W, int NT, int U, int NB>
__device__ __forceinline__ void og_gate_up_passes(const og_moe_params &p, int e, int tile, const int *s_pairs,
                                                  int npairs, float (*s_red)[NB][2][4][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const char *wg = (const char *)p.w13 +
                   2 * (e * p.w13_estride + (long long)(tile * 16 + g) * p.w13_rstride);
  const long long row8 = 2 * 8 * p.w13_rstride, up_off = 2 * (long long)OG_I * p.w13_rstride;
  const int steps = OG_H / 32;

  for (int p0 = 0; p0 < npairs; p0 += 8 * NT) {
    const char *xrow[NT];
    bool xval[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int n = p0 + nt * 8 + g;
      xval[nt] = n < npairs;
      const int t = xval[nt] ? s_pairs[n] / OG_K : 0;
      xrow[nt] = (const char *)p.x + 2 * (long long)t * p.x_stride;
    }
    float acc_g[NT][4], acc_u[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc_g[nt][q] = acc_u[nt][q] = 0.f;

    for (int s0 = warp * U; s0 < steps; s0 += W * U) {
#if OG_PREFETCH
      {  // L2 prefetch of this lane's rows OG_PREFETCH iterations ahead
        const int sp = s0 + OG_PREFETCH * W * U;
        if (sp < steps) {
          const long long off = 2 * (long long)(sp * 32 + c * 8);
          og_prefetch_l2(wg + off);
          og_prefetch_l2(wg + row8 + off);
          og_prefetch_l2(wg + up_off + off);
          og_prefetch_l2(wg + up_off + row8 + off);
        }
      }
#endif
      og_vec4 ag[U], ag8[U], au[U], au8[U], bx[U][NT];
#pragma unroll
      for (int q = 0; q < U; ++q) {
        const int s = s0 + q;
        if (steps % (W * U) == 0 || s < steps) {
          const long long off = 2 * (long long)(s * 32 + c * 8);
          ag[q] = og_load_stream<OG_LOAD>(wg + off);
          ag8[q] = og_load_stream<OG_LOAD>(wg + row8 + off);
          au[q] = og_load_stream<OG_LOAD>(wg + up_off + off);
          au8[q] = og_load_stream<OG_LOAD>(wg + up_off + row8 + off);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            bx[q][nt] = xval[nt] ? og_load_shared_operand(xrow[nt] + off) : og_zero4();
        }
      }
#pragma unroll
      for (int q = 0; q < U; ++q) {
        const int s = s0 + q;
        if (steps % (W * U) == 0 || s < steps) {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if (p0 + nt * 8 < npairs) {
              og_mma_k32(acc_g[nt], ag[q], ag8[q], bx[q][nt]);
              og_mma_k32(acc_u[nt], au[q], au8[q], bx[q][nt]);
            }
          }
        }
      }
    }

    og_stash_gate_up<NT>(s_red[warp], acc_g, acc_u, lane);
    __syncthreads();
    og_write_act<W, NT, NB>(p, s_red, s_pairs, npairs, p0, tile, threadIdx.x, blockDim.x);
    __syncthreads();
  }
}

// gate_up for one tile of expert e over its npairs (token, slot) pairs s_pairs[0..npairs).
template <int W>
__device__ __forceinline__ void og_gate_up_pairs(const og_moe_params &p, int e, int tile, const int *s_pairs,
                                                 int npairs, float (*s_red)[OG_NT][2][4][32]) {
#if OG_GU_NT < OG_NT
  if (npairs > 8 * OG_GU_NT) {  // more pairs than one pass of the hot path holds (rare; see OG_GU_NT)
    og_gate_up_passes<W, OG_NT, 1, OG_NT>(p, e, tile, s_pairs, npairs, s_red);
    return;
  }
#endif
  og_gate_up_passes<W, OG_GU_NT, OG_U1, OG_NT>(p, e, tile, s_pairs, npairs, s_red);
}

// gate_up for one tile: 16 rows of I of used expert number u, for every token routed to it.
template <int W>
__device__ __forceinline__ void og_gate_up_tile(const og_moe_params &p, const og_routing &r, int u, int tile,
                                                int *s_pairs, int &s_npairs, float (*s_red)[OG_NT][2][4][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nk = p.T * OG_K;
  const int e = r.experts[u];
  if (warp == 0) og_pairs_of(r, nk, e, lane, s_pairs, s_npairs);
  __syncthreads();
  og_gate_up_pairs<W>(p, e, tile, s_pairs, s_npairs, s_red);
}

// down's B operand at one k offset: act of each token tile's lane token for the current expert
// (workspace row src0[nt]), or zero where that token did not pick it.
__device__ __forceinline__ void og_load_act(const og_moe_params &p, const int (&src0)[OG_NT], long long off,
                                            og_vec4 (&b)[OG_NT]) {
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt)
    b[nt] = src0[nt] >= 0 ? og_load_coherent((const char *)p.act + 2 * ((long long)src0[nt] * OG_I) + off)
                          : og_zero4();
}

// down for one tile: 16 rows of H, summed over every used expert and token. EARLY (moe_down under
// programmatic dependent launch with OG_DOWN_EARLY): each warp issues its first work item's weight
// loads, which depend on nothing gate_up writes, before it waits for gate_up's grid; act is read
// and out written only after the wait.
template <int W, bool EARLY = false>
__device__ __forceinline__ void og_down_tile(const og_moe_params &p, const og_routing &r, int htile,
                                             float (*s_red)[OG_NT][4][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int T = p.T;
  const int h0 = htile * 16;
  const int nused = r.nused;
  const int steps = OG_I / 32;
  const int nchunks = (steps + OG_U2 - 1) / OG_U2;
  const int items = nused * nchunks;
  const long long row8 = 2 * 8 * p.w2_rstride;

  float acc[OG_NT][4];
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;

  int cur_u = -1;
  const char *wrow = 0;
  // For each token tile: the workspace row of this lane's token for the current expert, or -1
  // (og_act_sources).
  int src0[OG_NT], src1[OG_NT];
  for (int it = warp; it < items; it += W) {
    const int uu = it / nchunks, ch = it - uu * nchunks;
    if (uu != cur_u) {
      cur_u = uu;
      const int e = r.experts[uu];
      wrow = (const char *)p.w2 + 2 * (e * p.w2_estride + (long long)(h0 + g) * p.w2_rstride);
      og_act_sources(r, T, e, g, src0, src1);
    }
#if OG_PREFETCH
    {  // L2 prefetch of the work item OG_PREFETCH items ahead
      const int ip = it + OG_PREFETCH * W;
      if (ip < items) {
        const int up = ip / nchunks, cp = ip - up * nchunks, sp = cp * OG_U2;
        if (sp < steps) {
          const char *w = (const char *)p.w2 + 2 * (r.experts[up] * p.w2_estride + (long long)(h0 + g) * p.w2_rstride);
          const long long off = 2 * (long long)(sp * 32 + c * 8);
          og_prefetch_l2(w + off);
          og_prefetch_l2(w + row8 + off);
        }
      }
    }
#endif
    og_vec4 a[OG_U2], a8[OG_U2], b[OG_U2][OG_NT];
#pragma unroll
    for (int q = 0; q < OG_U2; ++q) {
      const int s = ch * OG_U2 + q;
      if (steps % OG_U2 == 0 || s < steps) {
        const long long off = 2 * (long long)(s * 32 + c * 8);
        a[q] = og_load_stream<OG_DOWN_LOAD>(wrow + off);
        a8[q] = og_load_stream<OG_DOWN_LOAD>(wrow + row8 + off);
        if (!EARLY) og_load_act(p, src0, off, b[q]);
      }
    }
    if (EARLY) {  // act's loads after the wait (the first item's), after the weights' in any case
      if (it == warp) {
        og_pdl_wait();
        OG_TS(1, 3);
      }
#pragma unroll
      for (int q = 0; q < OG_U2; ++q) {
        const int s = ch * OG_U2 + q;
        if (steps % OG_U2 == 0 || s < steps) og_load_act(p, src0, 2 * (long long)(s * 32 + c * 8), b[q]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < OG_NT; ++nt) {
      if (src1[nt] != -1) {  // rare: a token routed to this expert more than once
        const int e = r.experts[uu];
        const int t = nt * 8 + g;
#pragma unroll
        for (int q = 0; q < OG_U2; ++q) {
          const int s = ch * OG_U2 + q;
          if (steps % OG_U2 == 0 || s < steps) {
            const long long off = 2 * (long long)(s * 32 + c * 8);
            b[q][nt] = og_sum_copies(r, t, e, [&](int i) {
              return og_load_coherent((const char *)p.act + 2 * ((long long)i * OG_I) + off);
            });
          }
        }
      }
    }
#pragma unroll
    for (int q = 0; q < OG_U2; ++q) {
      const int s = ch * OG_U2 + q;
      if (steps % OG_U2 == 0 || s < steps) {
#pragma unroll
        for (int nt = 0; nt < OG_NT; ++nt)
          if (nt * 8 < T) og_mma_k32(acc[nt], a[q], a8[q], b[q][nt]);
      }
    }
  }

  if (EARLY) og_pdl_wait();  // warps without items: out may alias x, which gate_up reads
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) s_red[warp][nt][q][lane] = acc[nt][q];
  __syncthreads();
  og_write_out<W>(p, s_red, h0, threadIdx.x, blockDim.x);
  __syncthreads();  // s_red is reused by the next tile
}

extern "C" __global__ void __launch_bounds__(OG_W1 * 32, OG_GU_MIN)
    OG_SUFFIX(moe_gate_up)(const og_moe_params p) {
  __shared__ og_routing r;
  __shared__ int s_pairs[OG_MAXPAIRS];
  __shared__ int s_npairs;
  __shared__ float s_red[OG_W1][OG_NT][2][4][32];
  OG_TS(0, 0);
#if OG_PDL_IN
  og_pdl_wait();  // the previous kernel's results (routing, x) are complete and visible
#endif
#if OG_PDL
  og_pdl_launch_dependents();  // moe_down may take the SMs of blocks that finish
#endif
  const int tiles = OG_I / 16;
#if OG_GU_SLOTS
  __shared__ int s_e;
  const int i = blockIdx.x / tiles;  // the routing slot
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
  OG_TS(0, 1);
  if (s_npairs == 0) return;  // routed nowhere on this rank, or an earlier slot's block has the expert
  og_gate_up_pairs<OG_W1>(p, s_e, blockIdx.x - i * tiles, s_pairs, s_npairs, s_red);
#elif OG_GU_ONE
  const int j = blockIdx.x / tiles;  // the token's routing slot
  const int e = og_load_id(p, j);
  OG_TS(0, 1);
  if (e < 0) return;  // routed nowhere on this rank: the slot has no act row, and down skips it
  if (threadIdx.x == 0) s_pairs[0] = j;
  __syncthreads();
  og_gate_up_passes<OG_W1, OG_GU_NT, OG_U1, OG_NT>(p, e, blockIdx.x - j * tiles, s_pairs, 1, s_red);
#else
  og_routing_setup(p, r);
  og_prefetch_w2(p, r);
  OG_TS(0, 1);
  const int u = blockIdx.x / tiles;
  if (u >= r.nused) return;  // fewer used experts than the grid allows for: nothing to do
  og_gate_up_tile<OG_W1>(p, r, u, blockIdx.x - u * tiles, s_pairs, s_npairs, s_red);
#endif
  OG_TS(0, 7);
}

extern "C" __global__ void __launch_bounds__(OG_W2 * 32, OG_DOWN_MIN)
    OG_SUFFIX(moe_down)(const og_moe_params p) {
  // (declared in this order: with s_red first, NVRTC 13.0 compiled Mixtral-8x7B's T=8 down with
  // the other load forms to 80 registers and a spill instead of 88 and none)
#if OG_DOWN_ONE || OG_DOWN_WARP
  __shared__ og_routing rw[OG_W2];
#else
  __shared__ og_routing r;
#endif
  __shared__ float s_red[OG_W2][OG_NT][4][32];
  OG_TS(1, 0);
  // The routing was written before gate_up started (or, with OG_PDL_IN, before gate_up let this
  // kernel launch): safe to read here.
#if OG_DOWN_ONE || OG_DOWN_WARP
  og_routing &r = rw[threadIdx.x >> 5];
  og_routing_warp(p, r, OG_DOWN_WARP ? p.T * OG_K : OG_K);
#else
  og_routing_setup(p, r);
#endif
  OG_TS(1, 1);
#if OG_PDL && OG_DOWN_EARLY
  og_down_tile<OG_W2, true>(p, r, blockIdx.x, s_red);  // waits after its first weight loads
#else
#if OG_PDL
  og_pdl_wait();  // gate_up has finished: act is complete and x (which out may alias) is read
#endif
  OG_TS(1, 3);
  og_down_tile<OG_W2>(p, r, blockIdx.x, s_red);
#endif
  OG_TS(1, 7);
}

// Grid-wide barrier for a cooperative launch: one arrival per block on a zeroed counter.
__device__ __forceinline__ void og_grid_barrier(unsigned *counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    while (*(volatile unsigned *)counter < gridDim.x) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(OG_W1 * 32, 1)
    OG_SUFFIX(moe_fused)(const og_moe_params p) {
  __shared__ og_routing r;
  __shared__ int s_pairs[OG_MAXPAIRS];
  __shared__ int s_npairs;
  __shared__ float s_red[OG_W1 * OG_NT * 2 * 4 * 32];
  OG_TS(2, 0);
  og_routing_setup(p, r);
  og_prefetch_w2(p, r);
  OG_TS(2, 1);
  const int tiles = OG_I / 16;
  for (int t = blockIdx.x; t < r.nused * tiles; t += gridDim.x)
    og_gate_up_tile<OG_W1>(p, r, t / tiles, t % tiles, s_pairs, s_npairs,
                           reinterpret_cast<float (*)[OG_NT][2][4][32]>(s_red));
  OG_TS(2, 2);
  og_grid_barrier(p.sync);
  OG_TS(2, 3);
  for (int h = blockIdx.x; h < OG_H / 16; h += gridDim.x)
    og_down_tile<OG_W1>(p, r, h, reinterpret_cast<float (*)[OG_NT][4][32]>(s_red));
  OG_TS(2, 7);
}

// ---------------------------------------------------------------------------------------------
// moe_stream_<dtype> (OG_STREAM, sm_90; opt-in, slower than the two kernels so far, NOTES v14):
// both stages in one persistent cooperative launch whose weight stream is meant never to stop.
// One producer warp per block copies weight chunks into a ring of OG_SS shared-memory slots with
// bulk asynchronous copies (cp.async.bulk, one row chunk a lane, completion counted in bytes on
// the slot's "full" mbarrier); OG_SW consumer warps multiply a slot's rows out of shared memory
// and release it on its "empty" mbarrier. The producer walks the block's gate_up tiles and then,
// without waiting for anything but free slots, its down tiles: W2 does not depend on gate_up, so
// the ring fills with down's weights while the consumers finish gate_up and meet the other
// blocks at the grid barrier (act must be complete before down reads it). Tiles go to blocks
// round-robin; every sum keeps a fixed order, so the output is deterministic.
//   A slot holds 16 rows x OG_KC elements (moe.stream.kc): 16 gate rows or 16 up rows of a
//   gate_up tile (a chunk of H), or 16 rows of W2 for one used expert (a chunk of I). One bulk
//   copy per row, and long rows: the number of copies bounded the first versions (H200: 512-byte
//   copies streamed ~17 GB/s an SM, 1 KB copies ~29). Rows are padded by 64 bytes so the
//   consumers' 16-byte reads (8 rows x 64 bytes a quarter-warp) hit distinct banks.
// OG_SPT: 8-pair tiles of a gate_up tile's (token, slot) pairs, ceil(T*K/8) <= 8, all in one pass.
// The consumers' other operand sits in shared memory too (a global load per slot would put an L2
// round trip on every slot's path): x's T rows, copied in at the start, then, after the grid
// barrier, act's T*K rows in the same place. Rows are padded by 64 bytes, as the ring's.
// Dynamic shared memory: the ring, the warps' reduction buffers, the operand rows (OG_OPB bytes),
// then the 2*OG_SS mbarriers.
#if OG_STREAM
#ifndef OG_SW
#define OG_SW 4
#endif
#ifndef OG_SS
#define OG_SS 6
#endif
#ifndef OG_SPT
#define OG_SPT 1
#endif
#ifndef OG_KC
#define OG_KC 1024
#endif
#define OG_RS (2 * OG_KC + 64)
#define OG_SLOT (16 * OG_RS)
#define OG_RED_FLOATS (OG_SW * (OG_SPT > OG_NT ? OG_SPT : OG_NT) * 2 * 4 * 32)
#define OG_XS (2 * OG_H + 64)
#define OG_AS (2 * OG_I + 64)
#ifndef OG_OPB
#define OG_OPB 16
#endif

__device__ __forceinline__ unsigned og_smem_addr(const void *p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void og_mbar_init(unsigned long long *b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(og_smem_addr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void og_mbar_expect_tx(unsigned long long *b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(og_smem_addr(b)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void og_mbar_arrive(unsigned long long *b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(og_smem_addr(b)) : "memory");
}
__device__ __forceinline__ void og_mbar_wait(unsigned long long *b, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra W;\n}" ::"r"(og_smem_addr(b)),
      "r"(parity)
      : "memory");
}
// One bulk copy global -> shared of `bytes` (a multiple of 16; both addresses 16-byte aligned),
// counted on mbarrier b. OG_STREAM_EF (moe.stream.evict_first) marks the lines first for eviction
// from L2, as the register path's down loads do.
#ifndef OG_STREAM_EF
#define OG_STREAM_EF 0
#endif
__device__ __forceinline__ void og_bulk_copy(void *dst, const void *src, unsigned bytes, unsigned long long *b) {
#if OG_STREAM_EF
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          og_smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(og_smem_addr(b)), "l"(policy)
      : "memory");
#else
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          og_smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(og_smem_addr(b))
      : "memory");
#endif
}
__device__ __forceinline__ og_vec4 og_lds128(const unsigned char *p) { return *(const og_vec4 *)p; }
// Barrier of the consumer warps only (the producer never joins it).
__device__ __forceinline__ void og_consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(OG_SW * 32) : "memory");
}

// The producer's walk: every slot this block fills, in order.
__device__ __forceinline__ void og_stream_produce(const og_moe_params &p, const og_routing &r, unsigned char *ring,
                                                  unsigned long long *full, unsigned long long *empty) {
  const int lane = threadIdx.x & 31;
  const int tiles1 = OG_I / 16, ntiles1 = r.nused * tiles1;
  unsigned it = 0;
  auto acquire = [&](unsigned bytes) -> unsigned char * {
    const unsigned slot = it % OG_SS;
    if (it >= OG_SS) og_mbar_wait(&empty[slot], ((it / OG_SS) - 1) & 1);
    if (lane == 0) og_mbar_expect_tx(&full[slot], bytes);
    __syncwarp();
    return ring + slot * OG_SLOT;
  };
  for (int t = blockIdx.x; t < ntiles1; t += gridDim.x) {
    const int u = t / tiles1, tile = t - u * tiles1;
    const int e = r.experts[u];
    const char *src = (const char *)p.w13 + 2 * (e * p.w13_estride + (long long)(tile * 16 + (lane & 15)) * p.w13_rstride);
    for (int k0 = 0; k0 < OG_H; k0 += OG_KC) {
      const unsigned len = 2u * (unsigned)(OG_H - k0 < OG_KC ? OG_H - k0 : OG_KC);
      for (int half = 0; half < 2; ++half) {  // the gate rows' chunk, then the up rows'
        unsigned char *slot = acquire(16u * len);
        if (lane < 16)
          og_bulk_copy(slot + lane * OG_RS, src + 2 * (half * (long long)OG_I * p.w13_rstride + k0), len,
                       &full[it % OG_SS]);
        ++it;
      }
    }
  }
  for (int h = blockIdx.x; h < OG_H / 16; h += gridDim.x) {
    for (int uu = 0; uu < r.nused; ++uu) {
      const char *src = (const char *)p.w2 + 2 * (r.experts[uu] * p.w2_estride + (long long)(h * 16 + (lane & 15)) * p.w2_rstride);
      for (int k0 = 0; k0 < OG_I; k0 += OG_KC) {
        const unsigned len = 2u * (unsigned)(OG_I - k0 < OG_KC ? OG_I - k0 : OG_KC);
        unsigned char *slot = acquire(16u * len);
        if (lane < 16) og_bulk_copy(slot + lane * OG_RS, src + 2 * k0, len, &full[it % OG_SS]);
        ++it;
      }
    }
  }
}

// Copies `rows` rows of `bytes` each (16-byte multiples, 16-byte aligned) from global memory into
// shared memory with row pitch `pitch`, with the consumer warps; plain loads, many in flight.
__device__ __forceinline__ void og_rows_to_shared(unsigned char *dst, int pitch, const char *src, long long src_pitch,
                                                  int rows, int bytes) {
  const int per_row = bytes / 16, n = rows * per_row;
  for (int i = threadIdx.x; i < n; i += OG_SW * 32) {
    const int rr = i / per_row, cc = i - rr * per_row;
    *(og_vec4 *)(dst + rr * pitch + cc * 16) = og_load_coherent(src + rr * src_pitch + cc * 16);
  }
}

__device__ __forceinline__ void og_stream_consume(const og_moe_params &p, const og_routing &r, unsigned char *ring,
                                                  float *red, unsigned char *opr, unsigned long long *full,
                                                  unsigned long long *empty, int *s_pairs, int &s_npairs) {
  const int lane = threadIdx.x & 31, cw = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int tiles1 = OG_I / 16, ntiles1 = r.nused * tiles1;
  const int nk = p.T * OG_K;
  unsigned it = 0;
  auto take = [&]() -> const unsigned char * {
    const unsigned slot = it % OG_SS;
    og_mbar_wait(&full[slot], (it / OG_SS) & 1);
    return ring + slot * OG_SLOT;
  };
  auto release = [&]() {
    __syncwarp();
    if (lane == 0) og_mbar_arrive(&empty[it % OG_SS]);
    ++it;
  };
  float(*s_red1)[OG_SPT][2][4][32] = reinterpret_cast<float(*)[OG_SPT][2][4][32]>(red);
  og_rows_to_shared(opr, OG_XS, (const char *)p.x, 2 * p.x_stride, p.T, 2 * OG_H);
  og_consumers_sync();

  // gate_up
  for (int t = blockIdx.x; t < ntiles1; t += gridDim.x) {
    const int u = t / tiles1, tile = t - u * tiles1;
    const int e = r.experts[u];
    if (cw == 0) og_pairs_of(r, nk, e, lane, s_pairs, s_npairs);
    og_consumers_sync();
    const int npairs = s_npairs;
    const unsigned char *xrow[OG_SPT];
    bool xval[OG_SPT];
#pragma unroll
    for (int pt = 0; pt < OG_SPT; ++pt) {
      const int n = pt * 8 + g;
      xval[pt] = n < npairs;
      xrow[pt] = opr + (xval[pt] ? s_pairs[n] / OG_K : 0) * OG_XS + c * 16;
    }
    float acc_g[OG_SPT][4], acc_u[OG_SPT][4];
#pragma unroll
    for (int pt = 0; pt < OG_SPT; ++pt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc_g[pt][q] = acc_u[pt][q] = 0.f;
    for (int k0 = 0; k0 < OG_H; k0 += OG_KC) {
      const int steps = (OG_H - k0 < OG_KC ? OG_H - k0 : OG_KC) / 32;
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // the gate rows' slot, then the up rows'
        const unsigned char *slot = take();
        for (int s = cw; s < steps; s += OG_SW) {
          og_vec4 bx[OG_SPT];
#pragma unroll
          for (int pt = 0; pt < OG_SPT; ++pt) bx[pt] = xval[pt] ? og_lds128(xrow[pt] + 2 * (k0 + s * 32)) : og_zero4();
          const int off = s * 64 + c * 16;
          const og_vec4 a = og_lds128(slot + g * OG_RS + off), a8 = og_lds128(slot + (g + 8) * OG_RS + off);
#pragma unroll
          for (int pt = 0; pt < OG_SPT; ++pt)
            if (pt * 8 < npairs) og_mma_k32(half ? acc_u[pt] : acc_g[pt], a, a8, bx[pt]);
        }
        release();
      }
    }
    og_stash_gate_up<OG_SPT>(s_red1[cw], acc_g, acc_u, lane);
    og_consumers_sync();
    og_write_act<OG_SW, OG_SPT>(p, s_red1, s_pairs, npairs, 0, tile, threadIdx.x, OG_SW * 32);
    og_consumers_sync();  // s_red and s_pairs are reused by the next tile
  }

  // Every block's act is written before any block's down reads it. The producer does not wait
  // here: its down slots fill meanwhile. Then act's rows replace x's in shared memory.
  og_consumers_sync();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(p.sync, 1u);
    while (*(volatile unsigned *)p.sync < gridDim.x) __nanosleep(32);
    __threadfence();
  }
  og_consumers_sync();
  og_rows_to_shared(opr, OG_AS, (const char *)p.act, 2LL * OG_I, p.T * OG_K, 2 * OG_I);
  og_consumers_sync();

  // down
  float(*s_red2)[OG_NT][4][32] = reinterpret_cast<float(*)[OG_NT][4][32]>(red);
  const int T = p.T;
  for (int h = blockIdx.x; h < OG_H / 16; h += gridDim.x) {
    float acc[OG_NT][4];
#pragma unroll
    for (int nt = 0; nt < OG_NT; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;
    for (int uu = 0; uu < r.nused; ++uu) {
      const int e = r.experts[uu];
      int src0[OG_NT], src1[OG_NT];
      og_act_sources(r, T, e, g, src0, src1);
      for (int k0 = 0; k0 < OG_I; k0 += OG_KC) {
        const int steps = (OG_I - k0 < OG_KC ? OG_I - k0 : OG_KC) / 32;
        const unsigned char *slot = take();
        for (int s = cw; s < steps; s += OG_SW) {
          const int koff = 2 * (k0 + s * 32 + c * 8);
          og_vec4 b[OG_NT];
#pragma unroll
          for (int nt = 0; nt < OG_NT; ++nt) {
            if (src1[nt] == -1) {
              b[nt] = src0[nt] >= 0 ? og_lds128(opr + src0[nt] * OG_AS + koff) : og_zero4();
            } else {  // rare: a token routed to this expert more than once
              b[nt] = og_sum_copies(r, nt * 8 + g, e, [&](int i) { return og_lds128(opr + i * OG_AS + koff); });
            }
          }
          const int off = s * 64 + c * 16;
          const og_vec4 a = og_lds128(slot + g * OG_RS + off), a8 = og_lds128(slot + (g + 8) * OG_RS + off);
#pragma unroll
          for (int nt = 0; nt < OG_NT; ++nt)
            if (nt * 8 < T) og_mma_k32(acc[nt], a, a8, b[nt]);
        }
        release();
      }
    }
#pragma unroll
    for (int nt = 0; nt < OG_NT; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) s_red2[cw][nt][q][lane] = acc[nt][q];
    og_consumers_sync();
    og_write_out<OG_SW>(p, s_red2, h * 16, threadIdx.x, OG_SW * 32);
    og_consumers_sync();
  }
}

extern "C" __global__ void __launch_bounds__((OG_SW + 1) * 32, 1) OG_SUFFIX(moe_stream)(const og_moe_params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char og_dyn[];
  __shared__ og_routing r;
  __shared__ int s_pairs[OG_SPT * 8];
  __shared__ int s_npairs;
  unsigned char *ring = og_dyn;
  float *red = (float *)(og_dyn + OG_SS * OG_SLOT);
  unsigned char *opr = (unsigned char *)(red + OG_RED_FLOATS);
  unsigned long long *full = (unsigned long long *)(opr + OG_OPB), *empty = full + OG_SS;
  if (threadIdx.x == 0) {
    for (int i = 0; i < OG_SS; ++i) og_mbar_init(&full[i], 1), og_mbar_init(&empty[i], OG_SW);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  og_routing_setup(p, r);  // its __syncthreads also publishes the mbarriers' initialisation
  if ((int)(threadIdx.x >> 5) == OG_SW)
    og_stream_produce(p, r, ring, full, empty);
  else
    og_stream_consume(p, r, ring, red, opr, full, empty, s_pairs, s_npairs);
#endif
}
#endif
