// Paged decode attention: one query token per sequence against its paged K/V cache, for every
// query head, with grouped-query attention, sliding window, logits soft cap and attention sinks.
//
//   out[b, h] = sum_j softmax_j(s_j) v_j,  s_j = scale * q[b, h] . k_j  (or softcap * tanh(. / softcap))
//   over the keys j of sequence b (j < seq_lens[b]; with a window, j >= seq_lens[b] - 1 - window_left),
//   a sink (per head) adding exp(sink_h) to the softmax denominator.
//
// One block per (split, kv head, sequence). Its warps share the split's tokens in 16-token tiles
// (interleaved), each tile read once for all G = heads / kv_heads query heads of the kv head:
//   S^T = K Q^T on tensor cores (m16n8k16, the tile's 16 tokens as M, the query heads as N), the
//   online softmax per head, then O^T += V^T P^T (the head dims as M, tokens as K, heads as N).
// Every lane loads 16 contiguous bytes per (token, 32 or 64 dims) straight from the cache into
// registers (og_mma_k32's trick for K; for V the lane's 8 dims of 4 tokens are paired into A
// fragments with byte permutes, so no shared-memory staging). The next tile's K is loaded while
// the current one is computed; with OG_ROUND a warp loads two tiles' K and V at once.
//
// Splits: the host picks the split count S (gridDim.x) from batch, kv heads and the context hint
// so that one wave of blocks fills the GPU; each block reads seq_lens on the device and derives
// the same split size (at least min_chunk tokens; no split at all for a span of at most one
// 16-token tile a warp), so lengths are never needed on the host and a CUDA graph replays with
// new lengths. Blocks whose split is empty exit. A sequence with one split
// is written directly; otherwise each split writes its unnormalised partial (fp32), and a tree of
// 16-wide combines fixed by split index merges them: the last block to arrive at a node (counters
// in the workspace, reset by that block) merges the node's children in order. The same bits every
// run, whichever block comes last; one launch, and a combine no wider than 16 partials per block
// (one block reading all of many splits' partials would be bound by one SM's bandwidth). The host
// may launch 17..32 splits at fan-in 32 (the entry point attention_decode_fan32_*, with OG_FAN32):
// one 32-wide level instead of two, since a level costs a fence, an atomic and a round trip more
// than a second chunk of loads (v39).
// OG_CLUSTER (sm_90): the splits are launched in thread-block clusters; a sequence short enough
// for one cluster's splits (n <= the cluster size) is merged through distributed shared memory (each
// block merging a slice of the outputs, members in rank order), without the workspace, the
// fences and the counters; a longer one takes the tree.
//
// A block's first tile is known before its length when the split is min_chunk tokens from token
// 0 (any context up to S x min_chunk, no window): its block-table entry is loaded together with
// the length, one dependent DRAM round trip fewer at short contexts.
//
// Padded rows (seq_lens[b] <= 0, vLLM's CUDA-graph padding) get zeros: finite, and what
// FlashAttention returns for a row with no keys.
//
// OG_UPDATE: the kernel also does vLLM's KV-cache write (reshape_and_cache_flash) for the call:
// row b's new key and value (k_new, v_new) go to cache slot slot_mapping[b] (b < slot_count,
// slot >= 0), written by the block of the last split, which takes key L-1 from k_new and v_new
// rather than from the cache (a decode row's slot is its key L-1's place), as one more partial
// merged after its warps'. No block reads the slot being written, so the write needs no ordering.
//
// OG_QKNORM, OG_ROPE (with OG_UPDATE): vLLM's q/k RMSNorm and rotary embedding (the header says
// what they compute) of the row's query heads and new key, in registers as they arrive, before the
// query goes to shared memory and the key to the cache. A head's D/8 16-byte pieces sit in D/8
// consecutive lanes of one warp, so its sum of squares and a NeoX rotation's other half are
// shuffles; a thread's pieces all start at the same dim, so it loads one set of norm weights and
// of cosines and sines (its row's, with the length: the position is the input preparation's).
#include "og_common.cuh"
#include "attn_params.h"

#ifndef OG_D
#define OG_D 128
#endif
#ifndef OG_G
#define OG_G 8
#endif
#ifndef OG_W
#define OG_W 4
#endif
#ifndef OG_MIN_BLOCKS
#define OG_MIN_BLOCKS 1
#endif
#ifndef OG_SOFTCAP
#define OG_SOFTCAP 0
#endif
#ifndef OG_WINDOW
#define OG_WINDOW 0
#endif
// OG_SINKS: 0 none, 1 sinks in the activations' dtype, 2 fp32 sinks.
#ifndef OG_SINKS
#define OG_SINKS 0
#endif
#ifndef OG_LOAD
#define OG_LOAD 4
#endif
// OG_PDL (sm_90): launched as a programmatic dependent of the stream's previous kernel (the KV
// write), which may write the query and the cache but not the lengths or the block table: the
// kernel loads the length and its first block-table entry, then waits for that kernel
// (griddepcontrol.wait) before it reads anything else. OG_PDL 2 also loads the first round's K and
// V rows before the wait (first_round.cuh), so a kernel started early by the previous one (the qkv
// projection's trigger, linear.trigger) has them when that one ends: only with OG_UPDATE, where the
// step's key and value come from registers and every cache row read was written by an earlier
// step, and without a window. Its OG_TRIGGER follows the wait, so the next kernel (the o
// projection) starts no earlier than under OG_PDL 1.
#ifndef OG_PDL
#define OG_PDL 0
#endif
// OG_TRIGGER (sm_90): every block lets the stream's next kernel start as soon as it begins
// (griddepcontrol.launch_dependents), so a next kernel launched as a programmatic dependent (the
// output projection) streams its weights while this latency-bound kernel runs; that kernel
// still waits for this one's output. No effect on a next kernel launched without the attribute.
#ifndef OG_TRIGGER
#define OG_TRIGGER 0
#endif
#ifndef OG_CLUSTER
#define OG_CLUSTER 0
#endif
// OG_VPF: a tile's V rows are loaded with its K, one tile ahead of the V products, so a warp's
// second and later tiles wait for no V round trip of their own (a second set of V registers).
#ifndef OG_VPF
#define OG_VPF 0
#endif
// OG_ROUND: tiles a warp loads at once (1 or 2): a round's K and V rows are in flight together, so
// a warp with two tiles of a split waits one round trip for both (twice the K and V registers).
#ifndef OG_ROUND
#define OG_ROUND 1
#endif
#if OG_ROUND != 1 && OG_ROUND != 2
#error "OG_ROUND must be 1 or 2"
#endif
#if OG_ROUND > 1 && OG_VPF
#error "the V prefetch is a form of one tile a round"
#endif
#ifndef OG_UPDATE
#define OG_UPDATE 0
#endif
#if OG_PDL == 2 && (!OG_UPDATE || OG_WINDOW)
#error "the first round before the wait needs the kernel's own cache write (OG_UPDATE) and no window"
#endif
// OG_FAN32: the module also has the fan-in 32 entry point (attention_decode_fan32_*).
#ifndef OG_FAN32
#define OG_FAN32 0
#endif
// OG_QKNORM, OG_ROPE (0 none, 1 NeoX, 2 GPT-J): og_qk.cuh's, with their defaults.
#define OG_QK_D OG_D
#include "og_qk.cuh"
#define OG_QKPRO (OG_QKNORM || OG_ROPE)
// OG_QK_ONLY: the module holds only attention_qk_prologue_* (the q/k norm and rotary embedding
// alone, for the rows the decode kernel does not take), no decode entry point.
#ifndef OG_QK_ONLY
#define OG_QK_ONLY 0
#endif
#if OG_QKPRO && !OG_UPDATE && !OG_QK_ONLY
#error "q/k norm and rotary embedding need the call's new keys (OG_UPDATE)"
#endif
#if OG_QK_ONLY && (!OG_QKPRO || OG_UPDATE)
#error "OG_QK_ONLY needs q/k norm or rotary embedding, and no decode options"
#endif
#define OG_CHUNK 16  // partials a combine loads at once (a thread's loads in flight)

#if OG_D != 64 && OG_D != 128 && OG_D != 256
#error "OG_D must be 64, 128 or 256"
#endif
#if OG_G < 1 || OG_G > 16
#error "OG_G must be in 1..16"
#endif

#define OG_FULL 0xffffffffu
#define OG_NH ((OG_G + 7) / 8)  // 8-head column tiles
#define OG_DK (OG_D / 32)       // 32-dim steps of S
#define OG_DV (OG_D / 64)       // 64-dim chunks of V a lane loads per token
#define OG_MT (OG_D / 16)       // 16-dim row tiles of O^T
#define OG_NT (OG_W * 32)
#define OG_QROW OG_ATTN_QROW(OG_D)
#define OG_QITEMS (OG_NH * 8 * (OG_D / 8))             // 16-byte pieces of the block's query rows
#define OG_QREGS ((OG_QITEMS + OG_NT - 1) / OG_NT)  // of them per thread
#define OG_NEWITEMS (2 * (OG_D / 8))                  // 16-byte pieces of a new key and value
#define OG_NEWREGS ((OG_NEWITEMS + OG_NT - 1) / OG_NT)

__device__ __forceinline__ float og_ninf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float og_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float og_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, about 1e-7 absolute error elsewhere
// (tanh.approx's 2^-11 relative error, times a soft cap of 30-50, would move logits too far).
__device__ __forceinline__ float og_tanh(float x) {
  return 1.f - 2.f * og_rcp(og_exp2(x * 2.8853900817779268f) + 1.f);
}
// 16-byte load that bypasses L1: partials other blocks of this grid wrote.
__device__ __forceinline__ float4 og_ld_cg4(const float *p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ float2 og_ld_cg2(const float *p) {
  float2 v;
  asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}
// The length and the first block-table entry, kept where they are written (volatile) so that
// they are in flight together. Read-only (.nc) without PDL; under PDL coherent, because ptxas
// moves a .nc load past griddepcontrol.wait (it did, in this kernel's SASS) and keeps a coherent
// one ahead of it.
__device__ __forceinline__ int og_ld_meta_s32(const int *p) {
  int v;
#if OG_PDL
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
#else
  asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(v) : "l"(p));
#endif
  return v;
}
__device__ __forceinline__ long long og_ld_meta_s64(const long long *p) {
  long long v;
#if OG_PDL
  asm volatile("ld.global.s64 %0, [%1];" : "=l"(v) : "l"(p));
#else
  asm volatile("ld.global.nc.s64 %0, [%1];" : "=l"(v) : "l"(p));
#endif
  return v;
}
__device__ __forceinline__ og_u32 og_reg(const og_vec4 &v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

#if OG_CLUSTER
__device__ __forceinline__ float4 og_ld_dsmem4(unsigned a) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ float2 og_ld_dsmem2(unsigned a) {
  float2 v;
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(a));
  return v;
}
#endif

// The logit in log2 units from a raw dot product q . k.
__device__ __forceinline__ float og_logit(const og_attn_params &p, float qk) {
#if OG_SOFTCAP
  return p.cap_log2 * og_tanh(qk * p.qk_scale);
#else
  return qk * p.qk_scale;
#endif
}

#if OG_SINKS
__device__ __forceinline__ float og_sink_log2(const og_attn_params &p, int head) {
#if OG_SINKS == 2
  const float s = __ldg((const float *)p.sinks + head);
#else
  const float s = og_to_float(__ldg((const unsigned short *)p.sinks + head));
#endif
  return s * 1.4426950408889634f;
}
#endif

// Writes one head's 4 output dims, normalised: acc / (sum + exp2(sink - max)).
__device__ __forceinline__ void og_write_out(const og_attn_params &p, int b, int head, int d, float4 acc, float sum,
                                             float mu) {
  float den = sum;
#if OG_SINKS
  den += og_exp2(og_sink_log2(p, head) - mu);
#endif
  const float inv = den > 0.f ? 1.f / den : 0.f;
  uint2 w;
  w.x = og_pack2(acc.x * inv, acc.y * inv);
  w.y = og_pack2(acc.z * inv, acc.w * inv);
  *(uint2 *)((og_u16 *)p.out + (long long)b * p.o_st + (long long)head * p.o_sh + d) = w;
}

// The block id of the tile that starts at token tb (tb % 16 == 0, so the whole tile is in it), or
// -1 where the table or the cache has no such block; *row receives tb's row in the block.
__device__ __forceinline__ int og_tile_block(const og_attn_params &p, const int *bt, int tb, int *row) {
  const int bi = tb / p.block_size;
  *row = tb - bi * p.block_size;
  if (bi >= p.max_blocks) return -1;
  const int blk = __ldg(bt + bi);
  return blk >= 0 && blk < p.num_blocks ? blk : -1;
}

#if OG_UPDATE
// Does split s of n take the step's key from registers (the last split, where the row has a slot)?
__device__ __forceinline__ bool og_fresh(int s, int n, long long slot) { return s == n - 1 && slot >= 0; }
// The end of a split's keys from the cache: L - 1 where the step's key comes from registers.
__device__ __forceinline__ int og_split_end(int L, int r0, int chunk, bool fresh) {
  return fresh ? L - 1 : min(L, r0 + chunk);
}
#endif

// EARLY: a load that must stay ahead of griddepcontrol.wait (og_load_before_wait's coherent form).
template <bool EARLY = false>
__device__ __forceinline__ og_vec4 og_kv_load(const og_u16 *ptr, bool valid) {
  return valid ? (EARLY ? og_load_before_wait(ptr) : og_load_stream<OG_LOAD>(ptr)) : og_zero4();
}

// V rows of the tile at token tb (cache block blk, its row `row`): tokens c, c+8, c+4, c+12,
// dims 64j + 8g .. +8 (vbase holds the lane's 8g); keys outside [start, r1) or blk < 0 read zeros.
template <bool EARLY = false>
__device__ __forceinline__ void og_v_tile(og_vec4 (&vc)[OG_DV], og_vec4 (&v8)[OG_DV], og_vec4 (&v4)[OG_DV],
                                          og_vec4 (&v12)[OG_DV], const og_attn_params &p, const og_u16 *vbase, int blk,
                                          int row, int tb, int c, int start, int r1) {
  const int j0 = tb + c;
  const bool ok = blk >= 0;
  const bool w0 = ok && j0 >= start && j0 < r1, w8 = ok && j0 + 8 >= start && j0 + 8 < r1;
  const bool w4 = ok && j0 + 4 >= start && j0 + 4 < r1, w12 = ok && j0 + 12 >= start && j0 + 12 < r1;
  const og_u16 *vp = vbase + (long long)max(blk, 0) * p.v_sb + (long long)(row + c) * p.v_st;
#pragma unroll
  for (int j = 0; j < OG_DV; ++j) {
    vc[j] = og_kv_load<EARLY>(vp + 64 * j, w0);
    v8[j] = og_kv_load<EARLY>(vp + 8 * p.v_st + 64 * j, w8);
    v4[j] = og_kv_load<EARLY>(vp + 4 * p.v_st + 64 * j, w4);
    v12[j] = og_kv_load<EARLY>(vp + 12 * p.v_st + 64 * j, w12);
  }
}

// Where a warp's partial keeps the 16-byte chunk `chunk` of head h's row: rows are D floats apart,
// so the four heads a quarter-warp stores (h = 2c + e, c = lane % 4) would share banks; their
// chunks are permuted within each group of eight (bits 1-2, an even mask: a chunk pair stays
// adjacent). The merge reads through the same map, a permutation of each row.
__device__ __forceinline__ int og_so_chunk(int h, int chunk) { return chunk ^ (((h >> 1) & 3) << 1); }

// Combines count (<= FAN, 16 or 32) consecutive partials src .. src+count-1 in order: into the
// output (root) or into the partial dst. All threads of the block take part. A thread loads its
// item's outputs OG_CHUNK partials at a time; those of its first item's first chunk are in flight
// while the maxima and sums go to shared memory, so a pass with one item a thread is one round trip
// to L2 (NOTES v39), two with a second chunk (count > 16, fan-in 32).
static_assert(OG_ATTN_FAN_MAX * 2 <= OG_W * (OG_D + 2), "the combine's maxima and sums fit the warps' partials' room");
template <int FAN>
__device__ __forceinline__ void og_combine(const og_attn_params &p, int b, int hq0, long long src, int count,
                                        bool root, long long dst, float2 *sml) {
  static_assert(FAN == OG_CHUNK || FAN == 2 * OG_CHUNK, "a fan-in 16 node is one chunk, 32 two");
  const int tid = threadIdx.x, items = OG_G * (OG_D / 4);
  float4 v[OG_CHUNK];
  auto load = [&](int it, int c0) {  // partials c0 .. c0 + OG_CHUNK - 1 of item it
    const int h = it / (OG_D / 4), d = (it % (OG_D / 4)) * 4;
#pragma unroll
    for (int i = 0; i < OG_CHUNK; ++i)
      if (c0 + i < count) v[i] = og_ld_cg4(p.part + ((src + c0 + i) * OG_G + h) * OG_D + d);
  };
  auto weigh = [&](int c0, int h, float mu, float4 &acc, float &sum) {  // the loaded chunk, in order
#pragma unroll
    for (int i = 0; i < OG_CHUNK; ++i)
      if (c0 + i < count) {
        const float2 ml = sml[(c0 + i) * OG_G + h];
        const float e = og_exp2(ml.x - mu);
        sum += ml.y * e;
        acc.x += v[i].x * e, acc.y += v[i].y * e, acc.z += v[i].z * e, acc.w += v[i].w * e;
      }
  };
  if (tid < items) load(tid, 0);
  for (int i = tid; i < count * OG_G; i += OG_NT) sml[i] = og_ld_cg2(p.part_ml + (src * OG_G + i) * 2);
  __syncthreads();
  for (int it = tid; it < items; it += OG_NT) {
    if (it != tid) load(it, 0);
    const int h = it / (OG_D / 4), d = (it % (OG_D / 4)) * 4;
    float mx = og_ninf();
    for (int i = 0; i < count; ++i) mx = fmaxf(mx, sml[i * OG_G + h].x);
    const float mu = mx == og_ninf() ? 0.f : mx;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float sum = 0.f;
    if (FAN == OG_CHUNK) {
      weigh(0, h, mu, acc, sum);
    } else {
      // The second chunk after the first's products. Not unrolled: one chunk's registers
      // (unrolled, ptxas overlapped the chunks and the cluster-merge variants spilled).
#pragma unroll 1
      for (int c0 = 0;;) {
        weigh(c0, h, mu, acc, sum);
        if ((c0 += OG_CHUNK) >= count) break;
        load(it, c0);
      }
    }
    if (root) {
      og_write_out(p, b, hq0 + h, d, acc, sum, mu);
    } else {
      *(float4 *)(p.part + (dst * OG_G + h) * OG_D + d) = acc;
      if (d == 0) *(float2 *)(p.part_ml + (dst * OG_G + h) * 2) = make_float2(mx, sum);
    }
  }
}

#if OG_CLUSTER
#define OG_CLUSTER_MAX 8
// The output of a sequence whose m (<= the cluster size) splits are the cluster's first m blocks:
// res is each block's [G][D] unnormalised output followed by its [G] (max, sum) pairs; every
// block of the cluster merges a slice of the outputs, members in rank order. Every thread of
// every block of the cluster calls it; no block leaves before all have read.
__device__ __forceinline__ void og_cluster_merge(const og_attn_params &p, int b, int hq0, const float *res, int m,
                                                 int crank, int csize) {
  og_cluster_sync();
  unsigned rb[OG_CLUSTER_MAX];
#pragma unroll
  for (int i = 0; i < OG_CLUSTER_MAX; ++i) rb[i] = i < m ? og_dsmem(res, i) : 0u;
  const int total = OG_G * (OG_D / 4), per = (total + csize - 1) / csize;
  const int end = min(total, (crank + 1) * per);
  for (int it = crank * per + (int)threadIdx.x; it < end; it += OG_NT) {
    const int h = it / (OG_D / 4), d = (it % (OG_D / 4)) * 4;
    float2 ml[OG_CLUSTER_MAX];
    float4 v[OG_CLUSTER_MAX];
#pragma unroll
    for (int i = 0; i < OG_CLUSTER_MAX; ++i)  // every load in flight before the first product
      if (i < m) {
        ml[i] = og_ld_dsmem2(rb[i] + (unsigned)(OG_G * OG_D + 2 * h) * 4u);
        v[i] = og_ld_dsmem4(rb[i] + (unsigned)(h * OG_D + d) * 4u);
      }
    float mx = og_ninf();
#pragma unroll
    for (int i = 0; i < OG_CLUSTER_MAX; ++i)
      if (i < m) mx = fmaxf(mx, ml[i].x);
    const float mu = mx == og_ninf() ? 0.f : mx;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < OG_CLUSTER_MAX; ++i)
      if (i < m) {
        const float e = og_exp2(ml[i].x - mu);
        sum += ml[i].y * e;
        acc.x += v[i].x * e, acc.y += v[i].y * e, acc.z += v[i].z * e, acc.w += v[i].w * e;
      }
    og_write_out(p, b, hq0 + h, d, acc, sum, mu);
  }
  og_cluster_sync_relaxed();
}
#endif

#if OG_UPDATE
// Piece i (16 bytes) of row b's new key (i < D/8) or value, for kv head hk.
__device__ __forceinline__ og_vec4 og_new_piece(const og_attn_params &p, int b, int hk, int i) {
  const bool isk = i < OG_D / 8;
  const int d = (isk ? i : i - OG_D / 8) * 8;
  const og_u16 *src = isk ? (const og_u16 *)p.k_new + (long long)b * p.kn_st + (long long)hk * p.kn_sh
                          : (const og_u16 *)p.v_new + (long long)b * p.vn_st + (long long)hk * p.vn_sh;
  return og_load_activation<OG_PDL != 0>(src + d);
}
// Where kv head hk's new key goes in the cache: the slot's K row (its V row is at *vrow), or NULL
// where there is no slot or its block is outside the cache. A 32-bit division where the slot
// allows (a 64-bit one is a subroutine of ~70 dependent instructions).
__device__ __forceinline__ og_u16 *og_slot_rows(const og_attn_params &p, int hk, long long slot, og_u16 **vrow) {
  const long long blk = slot >= 0 && slot <= 0xffffffffll ? (long long)((unsigned)slot / (unsigned)p.block_size)
                                                          : slot / p.block_size;
  const long long row = slot - blk * p.block_size;
  if (slot < 0 || blk >= p.num_blocks) return *vrow = nullptr;
  *vrow = (og_u16 *)p.v + blk * p.v_sb + row * p.v_st + (long long)hk * p.v_sh;
  return (og_u16 *)p.k + blk * p.k_sb + row * p.k_st + (long long)hk * p.k_sh;
}
// Stores piece i of the new key (i < D/8) or value into those rows.
__device__ __forceinline__ void og_store_piece(og_u16 *krow, og_u16 *vrow, int i, og_vec4 v) {
  const bool isk = i < OG_D / 8;
  *(og_vec4 *)((isk ? krow : vrow) + (isk ? i : i - OG_D / 8) * 8) = v;
}
#endif

#if OG_QKPRO
// The thread's 8 dims are at d = 8 * (tid % (D/8)) of its head (the callers' layout).
__device__ __forceinline__ void og_qk_load(const og_attn_params &p, long long pos, og_qk_consts &k) {
  og_qk_load(p.q_norm_w, p.k_norm_w, p.cos_sin, p.cs_stride, p.rope_rows, pos, 8 * ((int)threadIdx.x % (OG_D / 8)), k);
}
__device__ __forceinline__ og_vec4 og_qk_piece(const og_attn_params &p, og_vec4 v, const og_vec4 &w,
                                               const og_qk_consts &k) {
  return og_qk_piece(v, w, p.qk_eps, k, threadIdx.x & (OG_D / 16));
}
#endif

// The kernel's body at the combine tree's fan-in 1 << LG (a compile-time value: an entry point
// each, below).
template <int LG>
__device__ __forceinline__ void og_attention(const og_attn_params &p) {
  extern __shared__ __align__(16) unsigned char og_smem[];
  og_u16 *sq = (og_u16 *)og_smem;
  float *region = (float *)(og_smem + OG_NH * 8 * OG_QROW * 2);
  __shared__ int s_last;
  const int s = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int hq0 = hk * OG_G;  // the block's first query head
#if OG_TRIGGER && OG_PDL != 2
  og_pdl_launch_dependents();
#endif
  og_vec4 qreg[OG_QREGS];
  const og_u16 *qb = (const og_u16 *)p.q + (long long)b * p.q_st + (long long)hq0 * p.q_sh;
#if OG_UPDATE
  // The row's new key and value, loaded by every block with the query (whether the block is the
  // one that uses them is known only with the length): no round trip after the length's.
  og_vec4 nreg[OG_NEWREGS];
#endif
  auto load_q = [&] {
#pragma unroll
    for (int r = 0; r < OG_QREGS; ++r) {
      const int i = tid + r * OG_NT, h = i / (OG_D / 8), d = (i % (OG_D / 8)) * 8;
      qreg[r] = i < OG_QITEMS && h < OG_G ? og_load_activation<OG_PDL != 0>(qb + (long long)h * p.q_sh + d) : og_zero4();
    }
#if OG_UPDATE
#pragma unroll
    for (int r = 0; r < OG_NEWREGS; ++r) {
      const int i = tid + r * OG_NT;
      if (i < OG_NEWITEMS) nreg[r] = og_new_piece(p, b, hk, i);
#if OG_QKPRO  // defined values in the lanes that only take part in the key's shuffles
      else nreg[r] = og_zero4();
#endif
    }
#endif
  };
#if !OG_PDL  // the query in flight with the length; under PDL it is read after the wait
  load_q();
#endif
  const int *bt = p.block_table + (long long)b * p.bt_stride;
#if !OG_WINDOW
  // The first round's tiles if the split is min_chunk tokens from token 0; loaded with the length.
  int tb_guess[OG_ROUND], bi_guess[OG_ROUND], blk_guess[OG_ROUND];
#pragma unroll
  for (int u = 0; u < OG_ROUND; ++u) {
    tb_guess[u] = s * p.min_chunk + 16 * (warp + u * OG_W), bi_guess[u] = tb_guess[u] / p.block_size;
    blk_guess[u] = bi_guess[u] < p.max_blocks ? og_ld_meta_s32(bt + bi_guess[u]) : -1;
  }
#endif
  const int L = og_ld_meta_s32(p.seq_lens + b);
#if OG_UPDATE  // the row's cache slot, in flight with the length
  const long long slot = b < p.slot_count ? og_ld_meta_s64(p.slot_mapping + b) : -1;
#endif
#if OG_QKPRO
  og_qk_consts qk;
  og_qk_load(p, OG_ROPE ? og_ld_meta_s64(p.positions + b) : 0, qk);  // constants: before the wait
#endif
#if OG_PDL == 2
  // The first round before the wait, for the split the code below takes (start 0: no window).
  // K rows of a tile: tokens g and g+8, dims 32k + 8c .. +8; a round's tiles t, t + W, ...
  og_vec4 kg[OG_ROUND][OG_DK], k8[OG_ROUND][OG_DK];
#if OG_VPF
  og_vec4 vc[OG_DV], v8[OG_DV], v4[OG_DV], v12[OG_DV];  // this tile's V rows (og_v_tile)
#endif
  int t = warp, row[OG_ROUND], blk[OG_ROUND];
#if !OG_VPF
  og_vec4 vc[OG_ROUND][OG_DV], v8[OG_ROUND][OG_DV], v4[OG_ROUND][OG_DV], v12[OG_ROUND][OG_DV];  // its V
#endif
  {
    const int start = 0;
    int a0, chunk;
    const int n = og_attn_split(L, start, gridDim.x, p.min_chunk, 16 * OG_W * OG_ROUND, &a0, &chunk);
    const int r0 = a0 + s * chunk, r1 = og_split_end(L, r0, chunk, og_fresh(s, n, slot));
    const int ntiles = (r1 - r0 + 15) >> 4;
    const og_u16 *kbase = (const og_u16 *)p.k + (long long)hk * p.k_sh + 8 * c;
    const og_u16 *vbase = (const og_u16 *)p.v + (long long)hk * p.v_sh + 8 * g;
    if (L > 0 && s < n) {
#include "first_round.cuh"
    }
  }
#endif
#if OG_PDL
  og_pdl_wait();
#if OG_TRIGGER && OG_PDL == 2
  og_pdl_launch_dependents();
#endif
  load_q();
#endif
#if OG_QKPRO
#pragma unroll
  for (int r = 0; r < OG_QREGS; ++r) qreg[r] = og_qk_piece(p, qreg[r], qk.qw, qk);
  if (warp == 0) {  // the new key's pieces are warp 0's first D/8 lanes (r = 0)
    const og_vec4 kn = og_qk_piece(p, nreg[0], qk.kw, qk);
    if (tid < OG_D / 8) nreg[0] = kn;
  }
#endif
  if (L <= 0) {  // a padded row: zeros
    if (s == 0) {
      for (int i = tid; i < OG_G * (OG_D / 8); i += OG_NT) {
        const int h = i / (OG_D / 8), d = (i % (OG_D / 8)) * 8;
        *(og_vec4 *)((og_u16 *)p.out + (long long)b * p.o_st + (long long)(hq0 + h) * p.o_sh + d) = og_zero4();
      }
#if OG_UPDATE  // the cache write still happens where the row has a slot
      og_u16 *vrow, *krow = og_slot_rows(p, hk, slot, &vrow);
      if (krow)
#pragma unroll
        for (int r = 0; r < OG_NEWREGS; ++r) {
          const int i = tid + r * OG_NT;
          if (i < OG_NEWITEMS) og_store_piece(krow, vrow, i, nreg[r]);
        }
#endif
    }
    return;
  }
  int start = 0;
#if OG_WINDOW
  if (p.window_left >= 0 && L - 1 - p.window_left > 0) start = L - 1 - p.window_left;
#endif
  // Tiles start at multiples of 16 tokens, so a tile never straddles a block; the split size is
  // derived from the length alone, the same in every block of the sequence. A span that one tile
  // a warp covers stays one split: a second would add only the combine's chain (v55).
  const int S = gridDim.x;
  int a0, chunk;
  const int n = og_attn_split(L, start, S, p.min_chunk, 16 * OG_W * OG_ROUND, &a0, &chunk);
  if (s >= n) {
#if OG_CLUSTER  // past the last split: still merges a slice when the splits are its cluster's
    const int csize = (int)og_cluster_size();
    if (n > 1 && n <= csize && s < csize)
      og_cluster_merge(p, b, hq0, region + OG_ATTN_RES_OFF(OG_D, OG_G, OG_W), n, (int)og_cluster_rank(), csize);
#endif
    return;
  }
  const int r0 = a0 + s * chunk;
#if OG_UPDATE
  // The last split's block writes the new key and value and takes key L-1 from them.
  const bool fresh = og_fresh(s, n, slot);
  const int r1 = og_split_end(L, r0, chunk, fresh);
  __shared__ __align__(16) og_u16 s_new[2 * OG_D];  // the new key, then the new value
  __shared__ float s_xnew[OG_G];                    // the new key's logit per head (log2 units)
#else
  const int r1 = min(L, r0 + chunk);
#endif
  const int ntiles = (r1 - r0 + 15) >> 4;

  // The block's query rows (heads hq0 .. hq0+G-1; rows up to the 8-head tile are zero), loaded
  // before the length so that both loads are in flight together (under PDL: after the wait).
#pragma unroll
  for (int r = 0; r < OG_QREGS; ++r) {
    const int i = tid + r * OG_NT, h = i / (OG_D / 8), d = (i % (OG_D / 8)) * 8;
    if (i < OG_QITEMS) *(og_vec4 *)(sq + h * OG_QROW + d) = qreg[r];
  }
#if OG_UPDATE
  if (fresh) {
    og_u16 *vrow, *krow = og_slot_rows(p, hk, slot, &vrow);
#pragma unroll
    for (int r = 0; r < OG_NEWREGS; ++r) {
      const int i = tid + r * OG_NT;
      if (i < OG_NEWITEMS) {
        *(og_vec4 *)(s_new + 8 * i) = nreg[r];
        if (krow) og_store_piece(krow, vrow, i, nreg[r]);
      }
    }
  }
#endif
  const og_u16 *kbase = (const og_u16 *)p.k + (long long)hk * p.k_sh + 8 * c;  // this lane's 8 dims of a 32
  const og_u16 *vbase = (const og_u16 *)p.v + (long long)hk * p.v_sh + 8 * g;  // this lane's 8 dims of a 64
  __syncthreads();

  float o[OG_NH][OG_MT][4];
  float m[OG_NH][2], l[OG_NH][2];
#pragma unroll
  for (int nh = 0; nh < OG_NH; ++nh) {
    m[nh][0] = m[nh][1] = og_ninf();
    l[nh][0] = l[nh][1] = 0.f;
#pragma unroll
    for (int mt = 0; mt < OG_MT; ++mt) o[nh][mt][0] = o[nh][mt][1] = o[nh][mt][2] = o[nh][mt][3] = 0.f;
  }

#if OG_PDL != 2
  // K rows of a tile: tokens g and g+8, dims 32k + 8c .. +8; a round's tiles t, t + W, ...
  og_vec4 kg[OG_ROUND][OG_DK], k8[OG_ROUND][OG_DK];
#if OG_VPF
  og_vec4 vc[OG_DV], v8[OG_DV], v4[OG_DV], v12[OG_DV];  // this tile's V rows (og_v_tile)
#endif
  int t = warp, row[OG_ROUND], blk[OG_ROUND];
#include "first_round.cuh"
#endif
  for (; t < ntiles; t += OG_ROUND * OG_W) {
    int row_next[OG_ROUND], blk_next[OG_ROUND];
#pragma unroll
    for (int u = 0; u < OG_ROUND; ++u) {
      const int tn = t + (OG_ROUND + u) * OG_W;
      row_next[u] = 0;
      blk_next[u] = tn < ntiles ? og_tile_block(p, bt, r0 + 16 * tn, &row_next[u]) : -1;
    }
#if !OG_VPF
#if OG_PDL != 2
    og_vec4 vc[OG_ROUND][OG_DV], v8[OG_ROUND][OG_DV], v4[OG_ROUND][OG_DV], v12[OG_ROUND][OG_DV];
#else
    if (t != warp)  // the first round's came before the wait
#endif
#pragma unroll
    for (int u = 0; u < OG_ROUND; ++u)
      og_v_tile(vc[u], v8[u], v4[u], v12[u], p, vbase, blk[u], row[u], r0 + 16 * (t + u * OG_W), c, start, r1);
#endif
    // S^T: [token g / g+8][head 2c / 2c+1] of each 8-head tile.
    float sc[OG_ROUND][OG_NH][4];
#pragma unroll
    for (int u = 0; u < OG_ROUND; ++u)
#pragma unroll
      for (int nh = 0; nh < OG_NH; ++nh) {
        sc[u][nh][0] = sc[u][nh][1] = sc[u][nh][2] = sc[u][nh][3] = 0.f;
#pragma unroll
        for (int k = 0; k < OG_DK; ++k) {
          const og_vec4 qv = *(const og_vec4 *)(sq + (nh * 8 + g) * OG_QROW + 32 * k + 8 * c);
          og_mma_k32(sc[u][nh], kg[u][k], k8[u][k], qv);
        }
      }
    // The next round's K, in flight while this round's softmax and V products run.
#pragma unroll
    for (int u = 0; u < OG_ROUND; ++u) {
      const int tn = t + (OG_ROUND + u) * OG_W;
      if (tn < ntiles) {
        const int tbn = r0 + 16 * tn;
        const bool v0 = blk_next[u] >= 0 && tbn + g < r1, v1 = blk_next[u] >= 0 && tbn + g + 8 < r1;
        const og_u16 *kp = kbase + (long long)max(blk_next[u], 0) * p.k_sb + (long long)(row_next[u] + g) * p.k_st;
#pragma unroll
        for (int k = 0; k < OG_DK; ++k) {
          kg[u][k] = og_kv_load(kp + 32 * k, v0);
          k8[u][k] = og_kv_load(kp + 8 * p.k_st + 32 * k, v1);
        }
      }
    }
#if OG_VPF  // and its V (zeros without a load past the last tile: blk_next is -1 there)
    og_vec4 vn[OG_DV], vn8[OG_DV], vn4[OG_DV], vn12[OG_DV];
    og_v_tile(vn, vn8, vn4, vn12, p, vbase, blk_next[0], row_next[0], r0 + 16 * (t + OG_W), c, start, r1);
#endif
    // The round's tiles in order (a warp's tiles t, t + W, ... as one tile a round takes them).
#pragma unroll
    for (int u = 0; u < OG_ROUND; ++u) {
      const int tb = r0 + 16 * (t + u * OG_W);
      if (u > 0 && t + u * OG_W >= ntiles) break;  // the warp's last round may have fewer tiles
      const bool sv0 = blk[u] >= 0 && tb + g >= start && tb + g < r1,
                 sv1 = blk[u] >= 0 && tb + g + 8 >= start && tb + g + 8 < r1;
      // Online softmax per head; P^T fragments for the V products.
      og_u32 pb0[OG_NH], pb1[OG_NH];
#pragma unroll
      for (int nh = 0; nh < OG_NH; ++nh) {
        float x[4];
        x[0] = sv0 ? og_logit(p, sc[u][nh][0]) : og_ninf();
        x[1] = sv0 ? og_logit(p, sc[u][nh][1]) : og_ninf();
        x[2] = sv1 ? og_logit(p, sc[u][nh][2]) : og_ninf();
        x[3] = sv1 ? og_logit(p, sc[u][nh][3]) : og_ninf();
        float mx0 = fmaxf(x[0], x[2]), mx1 = fmaxf(x[1], x[3]);
#pragma unroll
        for (int sh = 4; sh < 32; sh <<= 1) {
          mx0 = fmaxf(mx0, __shfl_xor_sync(OG_FULL, mx0, sh));
          mx1 = fmaxf(mx1, __shfl_xor_sync(OG_FULL, mx1, sh));
        }
        const float mn0 = fmaxf(m[nh][0], mx0), mn1 = fmaxf(m[nh][1], mx1);
        const float mu0 = mn0 == og_ninf() ? 0.f : mn0, mu1 = mn1 == og_ninf() ? 0.f : mn1;
        const float al0 = og_exp2(m[nh][0] - mu0), al1 = og_exp2(m[nh][1] - mu1);
        m[nh][0] = mn0, m[nh][1] = mn1;
        const float p0 = og_exp2(x[0] - mu0), p1 = og_exp2(x[1] - mu1);
        const float p2 = og_exp2(x[2] - mu0), p3 = og_exp2(x[3] - mu1);
        l[nh][0] = l[nh][0] * al0 + (p0 + p2);
        l[nh][1] = l[nh][1] * al1 + (p1 + p3);
#pragma unroll
        for (int mt = 0; mt < OG_MT; ++mt) {
          o[nh][mt][0] *= al0, o[nh][mt][2] *= al0;
          o[nh][mt][1] *= al1, o[nh][mt][3] *= al1;
        }
        // Lane (g', c') holds P[head 2c' / 2c'+1][token g' and g'+8]; lane (g, c) needs, for head
        // g, tokens c, c+8 (b0) and c+4, c+12 (b1): those of lanes (c, g/2) and (c+4, g/2).
        const og_u32 ph0 = og_pack2(p0, p2), ph1 = og_pack2(p1, p3);
        const int src = 4 * c + (g >> 1);
        const og_u32 a_lo = __shfl_sync(OG_FULL, ph0, src), a_hi = __shfl_sync(OG_FULL, ph1, src);
        const og_u32 b_lo = __shfl_sync(OG_FULL, ph0, src + 16), b_hi = __shfl_sync(OG_FULL, ph1, src + 16);
        pb0[nh] = (g & 1) ? a_hi : a_lo;
        pb1[nh] = (g & 1) ? b_hi : b_lo;
      }
      // O^T += V^T P^T: row g of row tile (j, i) is dim 64j + 8g + 2i, row g+8 the next dim; the
      // K index pairs (2c, 2c+1) and (2c+8, 2c+9) are tokens (c, c+8) and (c+4, c+12).
#pragma unroll
      for (int j = 0; j < OG_DV; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#if OG_VPF
          const og_u32 x0 = og_reg(vc[j], i), x8 = og_reg(v8[j], i), x4 = og_reg(v4[j], i), x12 = og_reg(v12[j], i);
#else
          const og_u32 x0 = og_reg(vc[u][j], i), x8 = og_reg(v8[u][j], i), x4 = og_reg(v4[u][j], i),
                       x12 = og_reg(v12[u][j], i);
#endif
          const og_u32 a0 = __byte_perm(x0, x8, 0x5410), a1 = __byte_perm(x0, x8, 0x7632);
          const og_u32 a2 = __byte_perm(x4, x12, 0x5410), a3 = __byte_perm(x4, x12, 0x7632);
#pragma unroll
          for (int nh = 0; nh < OG_NH; ++nh) og_mma16816(o[nh][4 * j + i], a0, a1, a2, a3, pb0[nh], pb1[nh]);
        }
    }
#if OG_VPF
#pragma unroll
    for (int j = 0; j < OG_DV; ++j) vc[j] = vn[j], v8[j] = vn8[j], v4[j] = vn4[j], v12[j] = vn12[j];
#endif
#pragma unroll
    for (int u = 0; u < OG_ROUND; ++u) blk[u] = blk_next[u], row[u] = row_next[u];
  }

#if OG_UPDATE
  // The new key's logits: warp w takes heads w, w+W, ..., a lane two dims of every 64. Every
  // block computes them (only the last split's block has the key and uses them): in code that
  // may diverge, the shuffles would need the warp re-converged around each one.
#pragma unroll
  for (int r = 0; r < (OG_G + OG_W - 1) / OG_W; ++r) {
    const int h = min(warp + r * OG_W, OG_G - 1);
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < OG_D / 64; ++j) {
      const int d = 64 * j + 2 * lane;
      const og_u32 qv = *(const og_u32 *)(sq + h * OG_QROW + d), kv = *(const og_u32 *)(s_new + d);
      dot += og_lo(qv) * og_lo(kv);
      dot += og_hi(qv) * og_hi(kv);
    }
#pragma unroll
    for (int sh = 16; sh; sh >>= 1) dot += __shfl_xor_sync(OG_FULL, dot, sh);
    if (lane == 0 && warp + r * OG_W < OG_G) s_xnew[h] = og_logit(p, dot);
  }
#endif
  // The warps' results into shared memory: maxima, sums (over the lanes' tokens) and outputs.
  float *so = region, *sml = region + OG_W * OG_G * OG_D;
#pragma unroll
  for (int nh = 0; nh < OG_NH; ++nh) {
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int sh = 4; sh < 32; sh <<= 1) l[nh][e] += __shfl_xor_sync(OG_FULL, l[nh][e], sh);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int h = nh * 8 + 2 * c + e;
      if (h >= OG_G) continue;
      if (g == 0) sml[(warp * OG_G + h) * 2] = m[nh][e], sml[(warp * OG_G + h) * 2 + 1] = l[nh][e];
#pragma unroll
      for (int j = 0; j < OG_DV; ++j) {
        // Dims 64j + 8g .. +8 as two 16-byte chunks, placed by og_so_chunk; odd g store their
        // upper chunk first, so each quarter-warp's stores fall in eight bank groups.
        float *row = so + (warp * OG_G + h) * OG_D;
        const int ch = og_so_chunk(h, 16 * j + 2 * g), odd = g & 1;
        const float4 lo = make_float4(o[nh][4 * j][e], o[nh][4 * j][e + 2], o[nh][4 * j + 1][e], o[nh][4 * j + 1][e + 2]);
        const float4 hi =
            make_float4(o[nh][4 * j + 2][e], o[nh][4 * j + 2][e + 2], o[nh][4 * j + 3][e], o[nh][4 * j + 3][e + 2]);
        *(float4 *)(row + 4 * (ch + odd)) = odd ? hi : lo;
        *(float4 *)(row + 4 * (ch + 1 - odd)) = odd ? lo : hi;
      }
    }
  }
  __syncthreads();

  // The block's result, warps in order; written out (one split), kept for the cluster's merge
  // (the splits are its cluster's), or written as this split's partial.
#if OG_CLUSTER
  const bool on_chip = n <= (int)og_cluster_size();  // (read again: fewer registers live through the loop)
  float *res = region + OG_ATTN_RES_OFF(OG_D, OG_G, OG_W);
#endif
  const int group = b * gridDim.y + hk;
  const long long base = (long long)group * p.slots_per_group;
  for (int it = tid; it < OG_G * (OG_D / 4); it += OG_NT) {
    const int h = it / (OG_D / 4), d = (it % (OG_D / 4)) * 4;
    float mx = og_ninf();
#pragma unroll
    for (int w = 0; w < OG_W; ++w) mx = fmaxf(mx, sml[(w * OG_G + h) * 2]);
#if OG_UPDATE
    const float xn = fresh ? s_xnew[h] : og_ninf();
    mx = fmaxf(mx, xn);
#endif
    const float mu = mx == og_ninf() ? 0.f : mx;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < OG_W; ++w) {
      const float e = og_exp2(sml[(w * OG_G + h) * 2] - mu);
      const float4 v = *(const float4 *)(so + (w * OG_G + h) * OG_D + 4 * og_so_chunk(h, d / 4));
      sum += sml[(w * OG_G + h) * 2 + 1] * e;
      acc.x += v.x * e, acc.y += v.y * e, acc.z += v.z * e, acc.w += v.w * e;
    }
#if OG_UPDATE
    if (fresh) {  // the new key, after the warps' partials
      const float e = og_exp2(xn - mu);
      const uint2 vb = *(const uint2 *)(s_new + OG_D + d);
      sum += e;
      acc.x += og_lo(vb.x) * e, acc.y += og_hi(vb.x) * e, acc.z += og_lo(vb.y) * e, acc.w += og_hi(vb.y) * e;
    }
#endif
    if (n == 1) {
      og_write_out(p, b, hq0 + h, d, acc, sum, mu);
#if OG_CLUSTER
    } else if (on_chip) {
      *(float4 *)(res + h * OG_D + d) = acc;
      if (d == 0) *(float2 *)(res + OG_G * OG_D + 2 * h) = make_float2(mx, sum);
#endif
    } else {
      *(float4 *)(p.part + ((base + s) * OG_G + h) * OG_D + d) = acc;
      if (d == 0) *(float2 *)(p.part_ml + ((base + s) * OG_G + h) * 2) = make_float2(mx, sum);
    }
  }
  if (n == 1) return;
#if OG_CLUSTER
  if (on_chip) {
    og_cluster_merge(p, b, hq0, res, n, (int)og_cluster_rank(), (int)og_cluster_size());
    return;
  }
#endif
  og_attn_node node = {s, n, S, 0, 0};

  // A tree of (1 << LG)-wide combines over the splits, fixed by split index: the last block to
  // arrive at a node (a counter in the workspace, which that block resets) combines the node's
  // children in order into the node's partial, or into the output at the root. Level l's
  // partials are slots off_l .. off_l + c_l of the group (c_0 = S, c_{l+1} = ceil(c_l / (1 << LG))).
  for (;;) {
    __threadfence();
    __syncthreads();
    const int members = og_attn_members(&node, LG);
    unsigned *counter = p.counters + (long long)group * p.counters_per_group + node.coff + og_attn_parent(&node, LG);
    if (tid == 0) s_last = atomicAdd(counter, 1u) == (unsigned)(members - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    if (tid == 0) *counter = 0u;  // every child has arrived: ready for the next call
    const bool root = og_attn_parent_is_root(&node, LG);
    og_combine<1 << LG>(p, b, hq0, base + node.off + (long long)og_attn_parent(&node, LG) * (1 << LG), members, root,
                        base + og_attn_parent_slot(&node, LG), (float2 *)region);
    if (root) return;
    og_attn_up(&node, LG);
  }
}

#if !OG_QK_ONLY
// The entry points: fan-in 16, and with OG_FAN32 fan-in 32 for the launches the host gives it
// (opgraft__attn_fan_of). Each is its own function, so fan-in 16's code is as it was before
// fan-in 32 existed.
extern "C" __global__ void __launch_bounds__(OG_NT, OG_MIN_BLOCKS) OG_SUFFIX(attention_decode)(const og_attn_params p) {
  og_attention<OG_ATTN_FAN_LOG2>(p);
}
#if OG_FAN32
extern "C" __global__ void __launch_bounds__(OG_NT, OG_MIN_BLOCKS)
    OG_SUFFIX(attention_decode_fan32)(const og_attn_params p) {
  og_attention<OG_ATTN_FAN_MAX_LOG2>(p);
}
#endif
#else
// The prologue alone, out of place: row t's query heads (q) and key heads (k_new) normalized and
// rotated as in the decode kernel (the same bits), into out and k_out, for the token rows the
// decode kernel does not take (a prefill's, which vLLM would give its own norm and rotary kernels).
// One block a row: its threads take the row's (heads + kv heads) * D/8 16-byte pieces a warp at a
// time, so a head's pieces sit in D/8 consecutive lanes and a thread's dims never change (the
// block is a multiple of D/8 threads); OG_QK_UNROLL pieces a thread are loaded before any is
// computed (one round trip for up to 1024 pieces, e.g. Qwen3-30B-A3B's 576). Lanes past the end
// load zeros for the shuffles and store nothing; warps wholly past it skip the piece. Loads are
// coherent, not read-only (.nc), so that out may be q and k_out k_new (in place): a piece is
// loaded and stored by one lane, its head's lanes meeting only in shuffles between. Launch
// bounds with a minimum of one block: with the thread count alone ptxas held the fp16 NeoX form
// to 64 registers and spilled (54-72 without a cap: 3-4 blocks an SM, 12-16 KB in flight each).
#define OG_QK_THREADS OG_ATTN_QK_THREADS
#define OG_QK_UNROLL 4
extern "C" __global__ void __launch_bounds__(OG_QK_THREADS, 1) OG_SUFFIX(attention_qk_prologue)(const og_attn_params p) {
  const long long t = blockIdx.x;
  const int lane = threadIdx.x & 31, hq = p.pro_heads, total = (hq + p.pro_kv_heads) * (OG_D / 8);
  og_qk_consts qk;
  og_qk_load(p, OG_ROPE ? __ldg(p.positions + t) : 0, qk);
  auto row = [&](int h, bool isq) -> long long {  // where head h starts in q, or (h >= hq) in k_new
    return isq ? t * p.q_st + (long long)h * p.q_sh : t * p.kn_st + (long long)(h - hq) * p.kn_sh;
  };
  for (int base = threadIdx.x; base - lane < total; base += OG_QK_THREADS * OG_QK_UNROLL) {
    og_vec4 v[OG_QK_UNROLL];
#pragma unroll
    for (int r = 0; r < OG_QK_UNROLL; ++r) {
      const int i = base + r * OG_QK_THREADS, h = i / (OG_D / 8), d = (i % (OG_D / 8)) * 8;
      const bool isq = h < hq;
      v[r] = i < total ? og_load_activation<true>((const og_u16 *)(isq ? p.q : p.k_new) + row(h, isq) + d)
                       : og_zero4();
    }
#pragma unroll
    for (int r = 0; r < OG_QK_UNROLL; ++r) {
      const int i = base + r * OG_QK_THREADS, h = i / (OG_D / 8), d = (i % (OG_D / 8)) * 8;
      if (i - lane >= total) continue;  // the whole warp
      const bool isq = h < hq;
      const og_vec4 w = OG_QKNORM ? (isq ? qk.qw : qk.kw) : v[r];  // a copy: a reference to either member
      const og_vec4 o = og_qk_piece(p, v[r], w, qk);              // would put both on the stack
      og_u16 *dst = isq ? (og_u16 *)p.out + t * p.o_st + (long long)h * p.o_sh
                        : (og_u16 *)p.k_out + t * p.ko_st + (long long)(h - hq) * p.ko_sh;
      if (i < total) *(og_vec4 *)(dst + d) = o;
    }
  }
}
#endif
