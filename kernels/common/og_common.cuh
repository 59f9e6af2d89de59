// Helpers shared by opgraft's CUDA C kernels (every op). NVRTC compiles these with no include path, so this
// header includes nothing: bf16/fp16 conversions are done with PTX (cvt.rn.bf16.f32 needs sm_80).
#pragma once

typedef unsigned int og_u32;
typedef unsigned short og_u16;

struct __align__(16) og_vec4 {
  og_u32 x, y, z, w;
};

// Streaming 16-byte load for data read exactly once (weights). FORM picks how:
//   1 read-only path, not kept in L1 (L1::no_allocate), first for eviction from L2 (evict_first);
//   4 read-only path, no cache hints.
// Measured on the H200 (bench/NOTES.md, v9): back to back both run alike; after other kernels have
// filled L2 (as in a decode step) the L1::no_allocate form ran a weight stream 25-35% slower and
// form 4 did not. Forms 0, 2 and 3 (no L2 hint, evict_normal, coherent) never won and are gone.
// OG_L2_FETCH (0, 128 or 256) asks L2 to fetch that many bytes around each miss: a lane that reads
// 64 contiguous bytes of a row per instruction turns its next steps into hits.
#ifndef OG_L2_FETCH
#define OG_L2_FETCH 0
#endif
#if OG_L2_FETCH == 256
#define OG_L2_FETCH_Q ".L2::256B"
#elif OG_L2_FETCH == 128
#define OG_L2_FETCH_Q ".L2::128B"
#else
#define OG_L2_FETCH_Q ""
#endif
template <int FORM>
__device__ __forceinline__ og_vec4 og_load_stream(const void *p) {
  static_assert(FORM == 1 || FORM == 4, "og_load_stream: FORM is 1 or 4");
  og_vec4 v;
  if (FORM == 1) {
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint" OG_L2_FETCH_Q ".v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(policy));
  } else {
    asm("ld.global.nc" OG_L2_FETCH_Q ".v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
  }
  return v;
}

// A weight load that must be issued before a griddepcontrol.wait: ptxas moves the read-only (.nc)
// loads above across the wait (sinking them to their use, seen in the SASS), not a coherent one;
// weights are never written, so the coherent path reads the same bytes.
__device__ __forceinline__ og_vec4 og_load_before_wait(const void *p) {
  og_vec4 v;
  asm volatile("ld.global" OG_L2_FETCH_Q ".v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Programmatic dependent launch (sm_90+; no-ops below). The primary kernel lets the next kernel
// on the stream start while its own blocks still run; the next kernel waits, before it reads
// anything the primary writes (or writes anything the primary may read), until the primary grid
// has finished and its writes are visible.
__device__ __forceinline__ void og_pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void og_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Thread-block clusters (sm_90).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned og_cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned og_cluster_size() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster; shared-memory writes before it are seen after it.
__device__ __forceinline__ void og_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The same meeting without ordering memory (no fence: a thread's loads whose values it has used
// are complete): keeps every block, and its shared memory, until the others have read it.
__device__ __forceinline__ void og_cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
// The address of this block's shared variable p in the shared memory of cluster block `rank`.
__device__ __forceinline__ unsigned og_dsmem(const void *p, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
  return r;
}
#endif

// Asks L2 for the 128-byte line holding p (no destination, no register).
__device__ __forceinline__ void og_prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// 16-byte load for small operands that many blocks read again (activations) and that no kernel
// running at the same time writes: ld.global.nc is read-only for the kernel's whole lifetime, so
// ptxas moves it across a griddepcontrol.wait (it hoisted such loads above the wait, and a kernel
// started early read its predecessor's output before that was written; bench/NOTES.md v26).
// After a wait, read what the previous kernel wrote with og_load_coherent.
__device__ __forceinline__ og_vec4 og_load_shared_operand(const void *p) {
  og_vec4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Activations written by an earlier kernel of the same stream, which may still run while this
// one starts (programmatic dependent launch): a coherent load, volatile so that the compiler keeps
// it after the wait (a plain asm has no memory effects for it).
__device__ __forceinline__ og_vec4 og_load_coherent(const void *p) {
  og_vec4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// An activation: under programmatic dependent launch (PDL, read after the wait) the previous
// kernel may have written it while this one ran, so the coherent load; else the read-only path.
template <bool PDL>
__device__ __forceinline__ og_vec4 og_load_activation(const void *p) {
  return PDL ? og_load_coherent(p) : og_load_shared_operand(p);
}

#ifndef OG_DTYPE
#define OG_DTYPE 1
#endif
#if OG_DTYPE == 1 /* bf16 */
#define OG_SUFFIX(name) name##_bf16
__device__ __forceinline__ float og_to_float(og_u16 h) { return __uint_as_float(((og_u32)h) << 16); }
__device__ __forceinline__ og_u16 og_from_float(float f) {
  og_u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
// Packs (lo, hi) into one register, lo in the low half, rounding to nearest even.
__device__ __forceinline__ og_u32 og_pack2(float lo, float hi) {
  og_u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#define OG_MMA_TYPES "bf16.bf16"
#elif OG_DTYPE == 2 /* fp16 */
#define OG_SUFFIX(name) name##_fp16
__device__ __forceinline__ float og_to_float(og_u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ og_u16 og_from_float(float f) {
  og_u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ og_u32 og_pack2(float lo, float hi) {
  og_u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#define OG_MMA_TYPES "f16.f16"
#else
#error "OG_DTYPE must be 1 (bf16) or 2 (fp16)"
#endif

__device__ __forceinline__ float og_lo(og_u32 v) { return og_to_float((og_u16)(v & 0xffffu)); }
__device__ __forceinline__ float og_hi(og_u32 v) { return og_to_float((og_u16)(v >> 16)); }

// The 8 values of a 16-byte piece, in order.
__device__ __forceinline__ void og_unpack8(const og_vec4 &v, float (&f)[8]) {
  const og_u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) f[2 * j] = og_lo(u[j]), f[2 * j + 1] = og_hi(u[j]);
}
__device__ __forceinline__ og_vec4 og_pack8(const float (&f)[8]) {
  og_vec4 v;
  v.x = og_pack2(f[0], f[1]), v.y = og_pack2(f[2], f[3]), v.z = og_pack2(f[4], f[5]), v.w = og_pack2(f[6], f[7]);
  return v;
}

// round(a * b) for each 16-bit half: the product of two 16-bit floats is exact in fp32, so one
// fused multiply-add with -0 rounds it once, as vLLM's multiply in the 16-bit dtype does.
__device__ __forceinline__ og_u32 og_mul2(og_u32 a, og_u32 b) {
  og_u32 d;
#if OG_DTYPE == 1
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#else
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#endif
  return d;
}

// Tensor-core product D = A (16x16, row) * B (16x8, col) + D with fp32 accumulation (sm_80+).
// Fragment ownership for lane = 4*g + c: a0 = A[g][2c..2c+1], a1 = A[g+8][2c..], a2 = A[g][2c+8..],
// a3 = A[g+8][2c+8..]; b0 = B[2c..2c+1][g], b1 = B[2c+8..][g]; d = D[g][2c..], D[g+8][2c..].
__device__ __forceinline__ void og_mma16816(float (&d)[4], og_u32 a0, og_u32 a1, og_u32 a2,
                                            og_u32 a3, og_u32 b0, og_u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32." OG_MMA_TYPES ".f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two MMAs over 32 consecutive k taken as two 16-byte chunks per lane. The reduction order over k
// does not change a dot product, so lane c's chunk k = 8c..8c+7 is fed to the MMAs' logical
// columns {2c, 2c+1, 2c+8, 2c+9} (elements 0-3) and the same columns of a second MMA (elements
// 4-7). A and B use the same mapping, so each lane can load its operands straight from global
// memory with one 16-byte access per row and no shared-memory staging.
__device__ __forceinline__ void og_mma_k32(float (&d)[4], const og_vec4 &a_row_g,
                                           const og_vec4 &a_row_g8, const og_vec4 &b) {
  og_mma16816(d, a_row_g.x, a_row_g8.x, a_row_g.y, a_row_g8.y, b.x, b.y);
  og_mma16816(d, a_row_g.z, a_row_g8.z, a_row_g.w, a_row_g8.w, b.z, b.w);
}

__device__ __forceinline__ og_vec4 og_zero4() {
  og_vec4 v;
  v.x = v.y = v.z = v.w = 0u;
  return v;
}

__device__ __forceinline__ float og_silu(float x) { return x / (1.0f + __expf(-x)); }
