// Streaming read of a large buffer with 16-byte loads: the read ceiling that opgraft's benchmarks
// quote achieved bandwidth against. Each thread keeps OG_SR_UNROLL independent loads in flight
// per iteration over a grid-stride loop; the XOR of all loads is compared against a value it can
// never equal in practice, so the loads cannot be optimised away and nothing else is written.
#include "og_common.cuh"

#ifndef OG_SR_UNROLL
#define OG_SR_UNROLL 4
#endif

extern "C" __global__ void __launch_bounds__(512) stream_read_u128(const og_vec4 *data,
                                                                  unsigned long long n,
                                                                  og_u32 *sink) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  og_u32 acc = 0;
  for (; i + (OG_SR_UNROLL - 1) * stride < n; i += OG_SR_UNROLL * stride) {
    og_vec4 v[OG_SR_UNROLL];
#pragma unroll
    for (int u = 0; u < OG_SR_UNROLL; ++u) v[u] = og_load_stream<1>(data + i + u * stride);
#pragma unroll
    for (int u = 0; u < OG_SR_UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const og_vec4 v = og_load_stream<1>(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
