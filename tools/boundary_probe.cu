// The cost of a kernel boundary in a decode step, and what can hide it (a development probe, GPU
// only; bench/NOTES.md v41 has what it measured on an H200):
//
//   nvcc -O3 -arch=sm_90 -o /tmp/boundary_probe tools/boundary_probe.cu && /tmp/boundary_probe [FILE.json]
//
// Stand-ins for the kernels of a step, each replay of a CUDA graph starting with a 64 MiB read (F,
// so L2 holds none of W), timed by events over 200 replays, median of 5 interleaved rounds:
//   A  latency-bound: 8 blocks spin 4 or 7 us, the other SMs' blocks exit at once (decode attention
//      at batch 1); At lets the next kernel launch as it starts (griddepcontrol.launch_dependents)
//   X  a bandwidth-bound read of 25 MB, 2 blocks an SM (the MoE down stage at one token)
//   N  one block of ~2 us (vLLM's norm between two of our kernels)
//   B  a streaming read of W (16 or 21 MB: the next projection's weights), 2 blocks an SM; Bp is
//      launched as a programmatic dependent and waits (griddepcontrol.wait) before its reads, Bpp
//      also asks L2 for its slice first
//   T  W read once right before B (B then reads it from L2)
// pf variants: A's idle blocks, or X's blocks once done, ask L2 for W (lines, lines with evict_last,
// or bulk prefetches). B's share: the replay minus the same replay without B.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));  \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

struct __align__(16) u4 { unsigned x, y, z, w; };

__device__ __forceinline__ u4 ld_nc(const void *p) {
  u4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void pf_line(const void *p, int mode) {
  if (mode == 2) asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
  else asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
__device__ __forceinline__ void pf_bulk(const void *p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
// Asks L2 for slice i of n of [w, w + bytes): mode 1 lines, 2 lines evict_last, 3 bulk (thread 0,
// pieces of at most 64 KiB).
__device__ void pf_slice(const char *w, size_t bytes, int i, int n, int mode) {
  const size_t per = ((bytes + n - 1) / n + 127) & ~(size_t)127;
  const size_t lo = (size_t)i * per, hi = min(bytes, lo + per);
  if (lo >= hi) return;
  if (mode == 3) {
    if (threadIdx.x == 0)
      for (size_t o = lo; o < hi; o += 65536) pf_bulk(w + o, (unsigned)min((size_t)65536, hi - o));
    return;
  }
  for (size_t o = lo + 128 * threadIdx.x; o < hi; o += 128 * blockDim.x) pf_line(w + o, mode);
}

__global__ void k_read(const u4 *d, size_t n, unsigned *sink) {  // streaming read (F, T)
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  unsigned acc = 0;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    u4 v0 = ld_nc(d + i), v1 = ld_nc(d + i + stride), v2 = ld_nc(d + i + 2 * stride), v3 = ld_nc(d + i + 3 * stride);
    acc ^= v0.x ^ v1.y ^ v2.z ^ v3.w;
  }
  for (; i < n; i += stride) acc ^= ld_nc(d + i).x;
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// A: blocks < busy spin for ns; with pf, the idle blocks ask L2 for W (sliced over them).
__global__ void k_lat(int busy, unsigned long long ns, const char *w, size_t wbytes, int pf, int trigger) {
  if (trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if ((int)blockIdx.x < busy) {
    if (threadIdx.x == 0) {
      const unsigned long long t0 = gtime();
      while (gtime() - t0 < ns) {
      }
    }
    __syncthreads();
    return;
  }
  if (pf) pf_slice(w, wbytes, blockIdx.x - busy, gridDim.x - busy, pf);
}

// The block's contiguous slice [*lo, *hi) of [0, n).
__device__ void slice_of(size_t n, size_t *lo, size_t *hi) {
  const size_t per = (n + gridDim.x - 1) / gridDim.x;
  *lo = blockIdx.x * per, *hi = min(n, *lo + per);
}

// The block's slice of d[0, n), 16-byte loads, 4 in flight a thread.
__device__ void read_slice(const u4 *d, size_t n, unsigned *sink) {
  size_t lo, hi;
  slice_of(n, &lo, &hi);
  unsigned acc = 0;
  size_t i = lo + threadIdx.x;
  for (; i + 3 * blockDim.x < hi; i += 4 * blockDim.x) {
    u4 v0 = ld_nc(d + i), v1 = ld_nc(d + i + blockDim.x), v2 = ld_nc(d + i + 2 * blockDim.x),
       v3 = ld_nc(d + i + 3 * blockDim.x);
    acc ^= v0.x ^ v1.y ^ v2.z ^ v3.w;
  }
  for (; i < hi; i += blockDim.x) acc ^= ld_nc(d + i).x;
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// X: a streaming read of d, each block a contiguous slice; then, with pf, its slice of W.
__global__ void k_bw(const u4 *d, size_t n, unsigned *sink, const char *w, size_t wbytes, int pf, int trigger) {
  if (trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  read_slice(d, n, sink);
  if (pf) {
    __syncthreads();
    pf_slice(w, wbytes, blockIdx.x, gridDim.x, pf);
  }
}

// N: one block reads 4 KiB and spins ~ns.
__global__ void k_small(const u4 *d, unsigned *sink, unsigned long long ns, int trigger, int pdl) {
  if (trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  unsigned acc = ld_nc(d + threadIdx.x).x;
  if (threadIdx.x == 0) {
    const unsigned long long t0 = gtime();
    while (gtime() - t0 < ns) {
    }
  }
  __syncthreads();
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// B: each block a contiguous slice of W. pdl: launched as a programmatic dependent; it asks L2 for
// its slice (pdl_pf) and waits before the reads.
__global__ void k_gemv(const u4 *w, size_t n, unsigned *sink, int pdl, int pdl_pf) {
  if (pdl) {
    size_t lo, hi;
    slice_of(n, &lo, &hi);
    if (pdl_pf)
      for (size_t o = lo * 16 + 128 * threadIdx.x; o < hi * 16; o += 128 * blockDim.x) pf_line((const char *)w + o, 1);
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  read_slice(w, n, sink);
}

struct Bufs {
  u4 *flush, *a2, *w, *small;
  size_t nflush, na2, nw;
  unsigned *sink;
  int sms;
};

struct Step {  // one kernel of a variant
  char kind;   // F, A, X, N, B or T (the header)
  int pf = 0, trigger = 0, pdl = 0, pdl_pf = 0;
};

// 256 threads a block, as a programmatic dependent of the stream's previous kernel where pdl.
template <typename... P, typename... A>
static void launch_pdl(void (*kernel)(P...), unsigned grid, cudaStream_t st, int pdl, A... args) {
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(grid), c.blockDim = dim3(256), c.stream = st;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  if (pdl) c.attrs = at, c.numAttrs = 1;
  CK(cudaLaunchKernelEx(&c, kernel, args...));
}

static void launch(const Bufs &b, const Step &s, cudaStream_t st, size_t wbytes, unsigned long long lat_ns) {
  switch (s.kind) {
    case 'F': k_read<<<2 * b.sms, 512, 0, st>>>(b.flush, b.nflush, b.sink); break;
    case 'T': k_read<<<2 * b.sms, 512, 0, st>>>(b.w, wbytes / 16, b.sink); break;
    case 'A': k_lat<<<b.sms, 256, 0, st>>>(8, lat_ns, (const char *)b.w, wbytes, s.pf, s.trigger); break;
    case 'X': k_bw<<<2 * b.sms, 256, 0, st>>>(b.a2, b.na2, b.sink, (const char *)b.w, wbytes, s.pf, s.trigger); break;
    case 'N': launch_pdl(k_small, 1, st, s.pdl, (const u4 *)b.small, b.sink, 1500ULL, s.trigger, s.pdl); break;
    case 'B': launch_pdl(k_gemv, 2 * b.sms, st, s.pdl, (const u4 *)b.w, wbytes / 16, b.sink, s.pdl, s.pdl_pf); break;
  }
  CK(cudaGetLastError());
}

// Mean µs per replay of the steps as one graph (reps replays after warm-up).
static double time_graph(const Bufs &b, const std::vector<Step> &steps, size_t wbytes, unsigned long long lat_ns,
                         int reps) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (const Step &s : steps) launch(b, s, st, wbytes, lat_ns);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 10; ++i) CK(cudaGraphLaunch(ge, st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0, st));
  for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(ge, st));
  CK(cudaEventRecord(e1, st));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaStreamDestroy(st));
  return 1000.0 * ms / reps;
}

struct Variant {
  const char *name, *base;  // base: the same without B (its time is subtracted)
  std::vector<Step> steps;
};

int main(int argc, char **argv) {
  const char *json = argc > 1 ? argv[1] : nullptr;
  Bufs b;
  CK(cudaDeviceGetAttribute(&b.sms, cudaDevAttrMultiProcessorCount, 0));
  b.nflush = (64u << 20) / 16, b.na2 = (25u << 20) / 16, b.nw = (24u << 20) / 16;
  CK(cudaMalloc(&b.flush, b.nflush * 16));
  CK(cudaMalloc(&b.a2, b.na2 * 16));
  CK(cudaMalloc(&b.w, b.nw * 16));
  CK(cudaMalloc(&b.small, 4096));
  CK(cudaMalloc(&b.sink, 64));
  CK(cudaMemset(b.flush, 1, b.nflush * 16));
  CK(cudaMemset(b.a2, 2, b.na2 * 16));
  CK(cudaMemset(b.w, 3, b.nw * 16));
  CK(cudaMemset(b.small, 4, 4096));
  CK(cudaDeviceSynchronize());

  Step F{'F'}, A{'A'}, Apf{'A', 1}, Apf2{'A', 2}, Apf3{'A', 3}, At{'A', 0, 1}, Atpf{'A', 1, 1};
  Step X{'X'}, Xpf{'X', 1}, Xpf2{'X', 2}, N{'N'}, T{'T'};
  Step B{'B'}, Bp{'B', 0, 0, 1, 0}, Bpp{'B', 0, 0, 1, 1};
  Step Xt{'X', 0, 1}, Nt{'N', 0, 1}, Ntp{'N', 0, 1, 1};
  std::vector<Variant> vs = {
      {"F", nullptr, {F}},
      {"F B (cold read)", "F", {F, B}},
      {"F T", "F", {F, T}},
      {"F T B (W in L2)", "F T", {F, T, B}},
      {"F A", "F", {F, A}},
      {"F A B", "F A", {F, A, B}},
      {"F Apf", "F", {F, Apf}},
      {"F Apf B (idle blocks ask L2: lines)", "F Apf", {F, Apf, B}},
      {"F Apf2", "F", {F, Apf2}},
      {"F Apf2 B (lines, evict_last)", "F Apf2", {F, Apf2, B}},
      {"F Apf3", "F", {F, Apf3}},
      {"F Apf3 B (bulk)", "F Apf3", {F, Apf3, B}},
      {"F At Bp (trigger, B waits)", "F A", {F, At, Bp}},
      {"F At Bpp (trigger, B asks L2 first)", "F A", {F, At, Bpp}},
      {"F Atpf Bp (trigger, idle blocks ask)", "F A", {F, Atpf, Bp}},
      {"F A Bp (PDL, A no trigger)", "F A", {F, A, Bp}},
      {"F N", "F", {F, N}},
      {"F N B", "F N", {F, N, B}},
      {"F N Bp (PDL, N no trigger)", "F N", {F, N, Bp}},
      {"F Nt Bpp (N triggers, B asks L2 first)", "F N", {F, Nt, Bpp}},
      {"F X N B (the layer boundary as today)", "F", {F, X, N, B}},
      {"F X Nt Bpp (the norm triggers)", "F", {F, X, Nt, Bpp}},
      {"F Xt Ntp Bpp (every kernel triggers)", "F", {F, Xt, Ntp, Bpp}},
      {"F X N", "F", {F, X, N}},
      {"F X N B", "F X N", {F, X, N, B}},
      {"F Xpf N", "F", {F, Xpf, N}},
      {"F Xpf N B (finished blocks ask L2)", "F Xpf N", {F, Xpf, N, B}},
      {"F Xpf2 N", "F", {F, Xpf2, N}},
      {"F Xpf2 N B (evict_last)", "F Xpf2 N", {F, Xpf2, N, B}},
  };
  const size_t sizes[] = {16u << 20, 21u << 20};
  const unsigned long long lats[] = {4000, 7000};
  const int rounds = 5, reps = 200;
  FILE *jf = json ? fopen(json, "w") : nullptr;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  if (jf) fprintf(jf, "{\"gpu\": \"%s\", \"sms\": %d, \"rows\": [\n", prop.name, b.sms);
  bool first = true;
  printf("%-42s %6s %5s %9s %9s\n", "variant", "W MB", "A us", "replay", "B share");
  for (size_t wb : sizes)
    for (unsigned long long lat : lats) {
      std::vector<std::vector<double>> t(vs.size());
      for (int r = 0; r < rounds; ++r)  // interleaved rounds: drift hits every variant alike
        for (size_t v = 0; v < vs.size(); ++v) t[v].push_back(time_graph(b, vs[v].steps, wb, lat, reps));
      std::vector<double> med(vs.size());
      for (size_t v = 0; v < vs.size(); ++v) {
        std::vector<double> s = t[v];
        std::sort(s.begin(), s.end());
        med[v] = s[s.size() / 2];
      }
      for (size_t v = 0; v < vs.size(); ++v) {
        double share = -1;
        if (vs[v].base)
          for (size_t u = 0; u < vs.size(); ++u)
            if (!strcmp(vs[u].name, vs[v].base)) share = med[v] - med[u];
        printf("%-42s %6.1f %5.1f %9.2f %9.2f\n", vs[v].name, wb / 1048576.0, lat / 1000.0, med[v], share);
        if (jf) {
          fprintf(jf,
                  "%s{\"variant\": \"%s\", \"w_bytes\": %zu, \"a_ns\": %llu, \"replay_us\": %.3f, "
                  "\"share_us\": %.3f, \"runs\": [",
                  first ? "" : ",\n", vs[v].name, wb, lat, med[v], share);
          for (size_t r = 0; r < t[v].size(); ++r) fprintf(jf, "%s%.3f", r ? ", " : "", t[v][r]);
          fprintf(jf, "]}");
          first = false;
        }
      }
    }
  if (jf) fprintf(jf, "\n]}\n"), fclose(jf);
  return 0;
}
