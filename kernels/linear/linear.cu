// Linear for decode (a few rows): y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), m < M <= 8.
//
// One kernel, each weight byte read once. A block owns OG_TILES tiles of 8 rows of W (8 * OG_TILES
// output features); its OG_WARPS warps split K into contiguous ranges of 32-wide k-steps, balanced
// to within one step. Per k-step a lane loads 16 bytes of one W row per tile (og_load_stream) and
// 16 bytes of one row of x (reused by every tile), and the warp multiplies them on tensor cores
// (m16n8k16): x is the A operand (its rows the tokens, rows 8..15 zero), W the B operand (its 8
// columns are the tile's 8 rows of W), so the accumulator holds D[token][row of the tile]. The k
// order inside a step is permuted the same way for both operands (og_mma_k32), so every lane
// loads its operands straight from global memory: lane 4g + c reads W row g and x row g at the
// step's 16-byte chunk c. The block then sums its warps' partials in warp order and adds the bias
// in fp32: no atomics, no split-K, the same bits every run.
//
// Compile-time constants (src/ops/linear/config.c): OG_DTYPE (1 bf16, 2 fp16), OG_K (K, a
// multiple of 8), OG_WARPS, OG_TILES (8-row tiles a block), OG_U (k-steps a warp loads before its
// MMAs), OG_MINB (launch-bounds minimum blocks per SM, 0 = none), OG_LOAD (the weight load's
// form, og_common.cuh), OG_L2_FETCH, OG_PDL, OG_NORM.
//
// OG_PDL (sm_90; the launcher sets the programmatic-serialization attribute): the kernel may start
// while the stream's previous kernel still runs. Each warp issues its first weight loads (weights
// are never written by another kernel), then waits (griddepcontrol.wait) before it reads x;
// every thread has waited before the block writes y. OG_PDL 2 also asks L2 for the rest of the
// warp's weights before the wait, a request a 128-byte line: a previous kernel that lets this one
// start early (decode attention: latency-bound, DRAM idle) then hides the read's ramp.
//
// OG_TRIGGER (sm_90): every block lets the stream's next kernel launch as it starts
// (griddepcontrol.launch_dependents), so a next kernel launched as a programmatic dependent (decode
// attention, which under its OG_PDL 2 loads its first K and V rows before its wait) starts while
// this one streams its weights; that kernel still waits for this one's output.
//
// OG_QKPRO (with OG_QK_D, OG_QKNORM, OG_ROPE; the _qk entry points; sm_90): vLLM's q/k RMSNorm
// and rotary embedding of the output's query and key heads after the product (qkv's [q heads |
// k heads | v heads], OG_QK_D columns a head), so that no kernel of their own follows the
// projection. A head's OG_QK_D / (8 * OG_TILES) blocks are one thread-block cluster: each puts its
// rounded outputs into every block's copy of the head (distributed shared memory), and after the
// cluster's barrier each normalizes and rotates the whole head from its copy and stores its own
// columns. No global round trip, counter or fence: the barrier is the only wait. Every block works
// from the same rounded outputs with og_qk.cuh's code: the attention prologue's bits.
//
// OG_NORM (linear_norm_gemv): vLLM's fused_add_rms_norm of x and a residual before the product.
// After the wait every block normalizes the rows itself (h = x + residual in fp32, the rows' few
// KB read from L2 by every block) into shared memory, from which the MMAs take x, so no kernel
// boundary separates the norm from the projection; block 0 also writes residual_out, and the
// normalized rows where normed_out is set (the MoE experts after a router gate read them).
#include "og_common.cuh"
#include "linear_params.h"

#ifndef OG_K
#error "OG_K (in_features) must be defined"
#endif
#if OG_K % 8 != 0 || OG_K < 8
#error "OG_K must be a positive multiple of 8"
#endif
#ifndef OG_WARPS
#define OG_WARPS 8
#endif
#ifndef OG_TILES
#define OG_TILES 1
#endif
#ifndef OG_U
#define OG_U 4
#endif
#ifndef OG_MINB
#define OG_MINB 0
#endif
#ifndef OG_LOAD
#define OG_LOAD 4
#endif
#ifndef OG_PDL
#define OG_PDL 0
#endif
#ifndef OG_TRIGGER
#define OG_TRIGGER 0
#endif
#ifndef OG_NORM
#define OG_NORM 0
#endif
#ifndef OG_QKPRO
#define OG_QKPRO 0
#endif
#if OG_NORM && OG_QKPRO
#define OG_FN OG_SUFFIX(linear_norm_gemv_qk)
#elif OG_NORM
#define OG_FN OG_SUFFIX(linear_norm_gemv)
#elif OG_QKPRO
#define OG_FN OG_SUFFIX(linear_gemv_qk)
#else
#define OG_FN OG_SUFFIX(linear_gemv)
#endif

#define OG_NCH (OG_K / 8)            // 16-byte chunks of a row
#define OG_STEPS ((OG_NCH + 3) / 4)  // 32-wide k-steps (the last one partial when K % 32 != 0)
#define OG_ROWS (8 * OG_TILES)       // rows of W a block owns

#if OG_PDL >= 2
// The warp's weights past its first OG_U k-steps (those are loaded already), asked of L2.
__device__ __forceinline__ void og_prefetch_rest(const og_linear_params &p, long long n0, int s_begin, int s_end,
                                                 int lane) {
  const long long lo = 64LL * min(s_begin + OG_U, s_end), hi = min(64LL * s_end, 2LL * OG_K);
  if (hi <= lo) return;
  const int lines = (int)((hi - lo + 127) >> 7);
  for (int i = lane; i < OG_ROWS * lines; i += 32) {
    const long long n = n0 + i / lines;
    if (n < p.N) og_prefetch_l2((const char *)p.w + 2 * n * p.w_stride + lo + 128LL * (i % lines));
  }
}
#endif

#if OG_NORM
// The normalized rows in shared memory (dynamic, OG_XS_BYTES a row, linear_params.h).
#define OG_XS_BYTES (2 * (OG_K + OG_LINEAR_NORM_PAD))
extern __shared__ __align__(16) char og_xs[];

// h = x + residual of row m at 16-byte chunk i, as 8 floats.
__device__ __forceinline__ void og_h8(const og_linear_params &p, int m, int i, float (&h)[8]) {
  float r[8];
  og_unpack8(og_load_activation<OG_PDL != 0>((const char *)p.x + 2 * (m * p.x_stride + 8LL * i)), h);
  og_unpack8(og_load_activation<OG_PDL != 0>((const char *)p.r + 2 * (m * p.r_stride + 8LL * i)), r);
#pragma unroll
  for (int j = 0; j < 8; ++j) h[j] += r[j];
}

// Every row's add + RMSNorm into og_xs, as the MMA operand: round(round(h * rstd) * w_norm), with
// rstd = rsqrt(mean_k h^2 + eps). The block's threads split each row's chunks and take all rows at
// once (one round trip for every row's loads); the sums go through a shuffle tree, then the warps
// in order (a fixed order); the second pass reads x and the residual again from L1. Block 0 also
// writes residual_out and normed_out (if set). A block barrier: every thread of the block calls it.
__device__ __forceinline__ void og_norm_stage(const og_linear_params &p, float (*s_part)[8], float *s_rstd) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float ss[8];
#pragma unroll
  for (int m = 0; m < 8; ++m) ss[m] = 0.f;
  for (int i = threadIdx.x; i < OG_NCH; i += OG_WARPS * 32) {
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      if (m < p.M) {
        float h[8];
        og_h8(p, m, i, h);
#pragma unroll
        for (int j = 0; j < 8; ++j) ss[m] += h[j] * h[j];
        if (blockIdx.x == 0) *(og_vec4 *)((char *)p.ro + 2 * (m * p.ro_stride + 8LL * i)) = og_pack8(h);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    if (m < p.M) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss[m] += __shfl_xor_sync(0xffffffffu, ss[m], o);
      if (lane == 0) s_part[warp][m] = ss[m];
    }
  }
  __syncthreads();
  if (threadIdx.x < p.M) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < OG_WARPS; ++w) t += s_part[w][threadIdx.x];  // warp order: fixed
    s_rstd[threadIdx.x] = rsqrtf(t / (float)OG_K + p.eps);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < OG_NCH; i += OG_WARPS * 32) {
    const og_vec4 w = og_load_shared_operand((const char *)p.nw + 16LL * i);  // a weight: never written
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      if (m < p.M) {
        float h[8];
        og_h8(p, m, i, h);
        const float r = s_rstd[m];
        og_vec4 o;
        o.x = og_mul2(og_pack2(h[0] * r, h[1] * r), w.x), o.y = og_mul2(og_pack2(h[2] * r, h[3] * r), w.y);
        o.z = og_mul2(og_pack2(h[4] * r, h[5] * r), w.z), o.w = og_mul2(og_pack2(h[6] * r, h[7] * r), w.w);
        *(og_vec4 *)(og_xs + m * OG_XS_BYTES + 16 * i) = o;
        if (blockIdx.x == 0 && p.ho) *(og_vec4 *)((char *)p.ho + 2 * (m * p.ho_stride + 8LL * i)) = o;
      }
    }
  }
  __syncthreads();
}

// The norm weight asked of L1 before the wait (it is never written): the normalization then finds it there.
__device__ __forceinline__ void og_prefetch_norm_weight(const og_linear_params &p) {
  for (int l = threadIdx.x; l < (2 * OG_K + 127) / 128; l += OG_WARPS * 32)
    asm volatile("prefetch.global.L1 [%0];" ::"l"((const char *)p.nw + 128LL * l));
}
#endif

#if OG_QKPRO
#if !defined(OG_QK_D) || (OG_QK_D != 64 && OG_QK_D != 128 && OG_QK_D != 256)
#error "OG_QKPRO needs OG_QK_D: 64, 128 or 256"
#endif
#if OG_QK_D % OG_ROWS != 0 || OG_QK_D / OG_ROWS > 8
#error "a head's blocks are one cluster of at most 8 (8 * OG_TILES divides OG_QK_D, at least OG_QK_D / 64)"
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "the q/k epilogue needs thread-block clusters (sm_90)"
#endif
#include "og_qk.cuh"
#define OG_QK_P (OG_QK_D / 8)       // a head's 16-byte pieces (one 8-row tile each)
#define OG_QK_R (OG_QK_D / OG_ROWS)  // a head's blocks: the cluster

// Piece i's (row i / OG_QK_P, dims 8 * (i % OG_QK_P) ..) norm weights, cosines and sines.
__device__ __forceinline__ void og_qk_piece_consts(const og_linear_params &p, int i, og_qk_consts &k) {
  const int m = min(i / OG_QK_P, p.M - 1);
  og_qk_load(p.qk_qw, p.qk_kw, p.cos_sin, p.cs_stride, p.rope_rows, OG_ROPE ? p.positions[m] : 0,
             8 * (i % OG_QK_P), k);
}

// The block's head, whose rows' own pieces (OG_TILES from `first`) the block has put in s_head:
// those go to every other block of the cluster, then, after its barrier, the whole head is
// normalized and rotated from s_head and the block stores its own pieces. Whole warps take the
// M x OG_QK_P pieces, a head's pieces in OG_QK_P consecutive lanes (og_qk.cuh's layout); lanes
// past the end redo row M - 1's pieces for the shuffles and store nothing. k0: the consts of the
// thread's first piece (i = threadIdx.x), asked for before the barrier.
__device__ __forceinline__ void og_qk_epilogue(const og_linear_params &p, int head, int first,
                                               og_u16 (*s_head)[OG_QK_D], const og_qk_consts &k0) {
  const unsigned me = og_cluster_rank();
  for (int j = threadIdx.x; j < OG_QK_R * p.M * OG_TILES; j += OG_WARPS * 32) {
    const unsigned r = j / (p.M * OG_TILES);
    const int m = j / OG_TILES % p.M, t = j % OG_TILES;
    if (r == me) continue;
    const og_vec4 v = *(const og_vec4 *)&s_head[m][8 * (first + t)];
    asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(og_dsmem(&s_head[m][8 * (first + t)], r)),
                 "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  }
  og_cluster_sync();
  const int lane = threadIdx.x & 31;
  const bool isq = head < p.q_heads;
  for (int i = threadIdx.x; i - lane < p.M * OG_QK_P; i += OG_WARPS * 32) {
    const int m = min(i / OG_QK_P, p.M - 1), piece = i % OG_QK_P;
    og_qk_consts k = k0;
    if (i != (int)threadIdx.x) og_qk_piece_consts(p, i, k);
    const og_vec4 v = *(const og_vec4 *)&s_head[m][8 * piece];
    const og_vec4 w = OG_QKNORM ? (isq ? k.qw : k.kw) : v;  // a copy: a reference to either member
    const og_vec4 o = og_qk_piece(v, w, p.qk_eps, k, piece & (OG_QK_P / 2));  // would put both on the stack
    if (i < p.M * OG_QK_P && piece - first >= 0 && piece - first < OG_TILES)
      *(og_vec4 *)((og_u16 *)p.y + (long long)m * p.y_stride + (long long)head * OG_QK_D + 8 * piece) = o;
  }
}
#endif

// Is chunk 4s + c of a row inside K? Only the last step of a K that is not a multiple of 32 has
// chunks past the end; their operands are zero, which adds nothing to the sums.
__device__ __forceinline__ bool og_chunk_in(int s, int c) { return OG_NCH % 4 == 0 || 4 * s + c < OG_NCH; }

extern "C" __global__ void __launch_bounds__(OG_WARPS * 32, OG_MINB)
    OG_FN(const og_linear_params p) {
  __shared__ float s_red[OG_WARPS][OG_TILES][2][32];
#if OG_NORM
  __shared__ float s_part[OG_WARPS][8], s_rstd[8];
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const long long n0 = (long long)blockIdx.x * OG_ROWS;
#if OG_TRIGGER
  og_pdl_launch_dependents();
#endif

  // This lane's W row in each tile (row n0 + 8t + g), and its x row (token g), at chunk c.
  const char *wrow[OG_TILES];
  bool wok[OG_TILES];
#pragma unroll
  for (int t = 0; t < OG_TILES; ++t) {
    const long long n = n0 + t * 8 + g;
    wok[t] = n < p.N;
    wrow[t] = (const char *)p.w + 2 * (wok[t] ? n : 0LL) * p.w_stride + 16 * c;
  }
  const bool xok = g < p.M;
  const char *xrow = (const char *)p.x + 2 * (long long)(xok ? g : 0) * p.x_stride + 16 * c;

  float acc[OG_TILES][4];
#pragma unroll
  for (int t = 0; t < OG_TILES; ++t)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[t][q] = 0.f;
  const og_vec4 zero = og_zero4();

  // The warp's contiguous range of k-steps, OG_U at a time. With OG_PDL or OG_NORM the first group
  // is its own copy of the body (first = true), run by every warp, even one without k-steps: its
  // weights are loaded before the wait (and the norm's block barrier) inside it.
  const int s_begin = warp * OG_STEPS / OG_WARPS, s_end = (warp + 1) * OG_STEPS / OG_WARPS;
  auto group = [&](const int s0, const bool first) {
    og_vec4 b[OG_U][OG_TILES], a[OG_U];
#pragma unroll
    for (int q = 0; q < OG_U; ++q) {
      const int s = s0 + q;
      const bool ok = s < s_end && og_chunk_in(s, c);
#pragma unroll
      for (int t = 0; t < OG_TILES; ++t)
        b[q][t] = !(ok && wok[t]) ? zero
                  : OG_PDL && first ? og_load_before_wait(wrow[t] + 64LL * s)
                                    : og_load_stream<OG_LOAD>(wrow[t] + 64LL * s);
    }
    if ((OG_PDL || OG_NORM) && first) {  // x may be the previous kernel's output: read it only after that kernel ends
#if OG_PDL >= 2
      og_prefetch_rest(p, n0, s_begin, s_end, lane);
#endif
#if OG_NORM
      og_prefetch_norm_weight(p);
#endif
      if (OG_PDL) og_pdl_wait();
#if OG_NORM
      og_norm_stage(p, s_part, s_rstd);
#endif
    }
#pragma unroll
    for (int q = 0; q < OG_U; ++q) {
      const int s = s0 + q;
#if OG_NORM
      a[q] = s < s_end && og_chunk_in(s, c) && xok ? *(const og_vec4 *)(og_xs + g * OG_XS_BYTES + 16 * c + 64 * s) : zero;
#else
      a[q] = s < s_end && og_chunk_in(s, c) && xok ? og_load_activation<OG_PDL != 0>(xrow + 64LL * s) : zero;
#endif
    }
#pragma unroll
    for (int q = 0; q < OG_U; ++q) {
      if (s0 + q < s_end) {  // the same for the whole warp: mma.sync needs every lane
#pragma unroll
        for (int t = 0; t < OG_TILES; ++t) og_mma_k32(acc[t], a[q], zero, b[q][t]);
      }
    }
  };
  int s0 = s_begin;
#if OG_PDL || OG_NORM
  group(s0, true);
  s0 += OG_U;
#endif
  for (; s0 < s_end; s0 += OG_U) group(s0, false);

#if OG_QKPRO
  // A query or key head's block (its whole cluster: a cluster is a head) keeps its outputs for the
  // epilogue; the consts of its first piece are asked for now, their latency behind the sums.
  const int head = (int)(n0 / OG_QK_D);
  const bool qk = head < p.qk_heads;
  __shared__ __align__(16) og_u16 s_head[8][OG_QK_D];
  og_qk_consts k0;
  if (qk) og_qk_piece_consts(p, threadIdx.x, k0);
#endif
  // acc[t][0..1] = D[token g][rows 2c, 2c+1 of tile t]; acc[t][2..3] belong to tokens 8..15 (zero).
#pragma unroll
  for (int t = 0; t < OG_TILES; ++t) {
    s_red[warp][t][0][lane] = acc[t][0];
    s_red[warp][t][1][lane] = acc[t][1];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < OG_TILES * 64; idx += OG_WARPS * 32) {
    const int t = idx >> 6, q = (idx >> 5) & 1, l = idx & 31;
    const int m = l >> 2;
    const long long n = n0 + t * 8 + 2 * (l & 3) + q;
    if (m >= p.M || n >= p.N) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < OG_WARPS; ++w) sum += s_red[w][t][q][l];  // warp order: fixed
    if (p.bias) sum += og_to_float(((const og_u16 *)p.bias)[n]);
#if OG_QKPRO
    if (qk) {
      s_head[m][n - (long long)head * OG_QK_D] = og_from_float(sum);
      continue;
    }
#endif
    ((og_u16 *)p.y)[(long long)m * p.y_stride + n] = og_from_float(sum);
  }
#if OG_QKPRO
  if (qk) {
    __syncthreads();
    og_qk_epilogue(p, head, (int)(n0 % OG_QK_D) / 8, s_head, k0);
  }
#endif
}
