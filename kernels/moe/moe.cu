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
// The compile-time constants are in moe_config.cuh; the stages in moe_gate_up.cuh and
// moe_down.cuh, the routing they share in moe_routing.cuh. This file holds the entry points.
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
#include "moe_down.cuh"
#include "moe_gate_up.cuh"

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
  OG_ROUTE_CALL(p, true);
  const int tiles = OG_I / 16;
#if OG_GU_SLOTS
  __shared__ int s_e;
  const int i = blockIdx.x / tiles;  // the routing slot
  og_slot_pairs(p, i, s_pairs, s_npairs, s_e);
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
#if OG_DOWN_TRIGGER
  og_pdl_launch_dependents();
#endif
  OG_TS(1, 0);
  // The routing (or the logits of OG_ROUTE) was written before gate_up started (or, with
  // OG_PDL_IN, before gate_up let this kernel launch): safe to read here.
  OG_ROUTE_CALL(p, false);
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
  OG_ROUTE_CALL(p, true);
  og_routing_setup(p, r);
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
