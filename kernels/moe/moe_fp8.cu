// MoE experts for decode with FP8 weights: vLLM's Fp8MoEMethod layouts (e4m3 w13 [E, 2I, H] and
// w2 [E, H, I], 128x128-style block scales or one scale per expert matrix) and the e4m3
// activations with their scales that vLLM's prepare step hands TritonExperts.apply.
//
// The products. mma.sync.m16n8k32 e4m3 is Ada's (sm_89); sm_90 has FP8 tensor cores only in
// wgmma, and ptxas turns an e4m3 mma.sync into F2FP conversions of both operands to f16 and two
// m16n8k16 f16 MMAs (read in the SASS). So the kernels convert e4m3 to f16 themselves where a
// k-step takes 64 k (og_mma_step) and keep the e4m3 mma.sync at 32; down feeds the f16
// intermediate as it is, so only the weights are converted there.
//
// Scales. Each k-step's product (32 or 64 k) starts from zero; it is scaled into fp32
// accumulators at once: block scales by (the weight block's scale, uniform over a tile that lies
// in one block_n x block_k block) x (the activation scale of each column's token, per 1 x block_k
// group: the lane's columns 2c and 2c+1), per-tensor scales in the epilogue. So the fp32 sums are
// exact-scaled per step.
//
// Layout of the work (the bf16 kernels' structure, moe.cu, with their routing):
//   moe_gate_up_fp8_<out>: one block per (used expert or routing slot, 16 or 32 rows of I,
//     OG_GU_ROWS). A lane loads 8 or 16 bytes (OG_GU_KS) of each of its 4 rows of a pass (gate g,
//     g+8 and the up rows) a k-step and as many of x; the block sums its warps in a fixed order,
//     then one warp per (token, slot) pair scales act = w * silu(gate) * up by absmax / 448 of
//     each 16 rows (vLLM's group scale, on groups of 16 rows instead of vLLM's 128) and writes it
//     in f16: 11 significant bits, where vLLM's TritonExperts feeds its second GEMM one e4m3 term
//     (4 bits).
//   moe_down_fp8_<out>: one block per 16 rows of H; warps share the (used expert, I chunk) items;
//     a lane's k of a step lie in one group of act, whose scale over its slot's largest scales
//     the lane's act values; the step's product takes the largest and the weight block's scale.
// Why groups of 16 rows: a gate_up block computes every group it writes (no cross-block
// maximum), and 16-row tiles give twice the blocks of 32-row ones: the 192 blocks of a
// one-token Qwen3-30B-A3B call filled 132 SMs unevenly (60 with two blocks, 72 with one).
//
// No atomics and fixed summation orders: the same inputs give the same bits every run. Paths:
// routing by slot (OG_GU_SLOTS, OG_DOWN_WARP) or the general routing, OG_PDL / OG_DOWN_EARLY /
// OG_PDL_IN and the routing from the logits (OG_ROUTE) as in moe.cu; no cooperative kernel and no
// separate one-token paths.
#include "moe_fp8_down.cuh"
#include "moe_fp8_gate_up.cuh"

extern "C" __global__ void __launch_bounds__(OG_W1 * 32, OG_GU_MIN)
    OG_SUFFIX(moe_gate_up_fp8)(const og_moe_fp8_params q) {
  const og_moe_params &p = q.b;
  __shared__ int s_pairs[OG_MAXPAIRS];
  __shared__ int s_npairs;
  __shared__ float s_red[OG_W1][OG_NT][OG_GU_HALVES][2][4][32];
  OG_TS(0, 0);
#if OG_PDL_IN
  og_pdl_wait();  // the previous kernel's results (routing, x) are complete and visible
#endif
#if OG_PDL
  og_pdl_launch_dependents();  // moe_down may take the SMs of blocks that finish
#endif
  OG_ROUTE_CALL(p, true);
  const int tiles = OG_I / OG_GU_ROWS;
#if OG_GU_SLOTS
  __shared__ int s_e;
  const int i = blockIdx.x / tiles;  // the routing slot
  og_slot_pairs(p, i, s_pairs, s_npairs, s_e);
  OG_TS(0, 1);
  if (s_npairs == 0) return;  // routed nowhere on this rank, or an earlier slot's block has the expert
  og_fp8_gate_up<OG_W1, OG_NT, OG_U1>(q, s_e, blockIdx.x - i * tiles, s_pairs, s_npairs, s_red);
#else
  __shared__ og_routing r;
  og_routing_setup(p, r);
  OG_TS(0, 1);
  const int u = blockIdx.x / tiles;
  if (u >= r.nused) return;  // fewer used experts than the grid allows for: nothing to do
  const int e = r.experts[u];
  if (threadIdx.x < 32) og_pairs_of(r, p.T * OG_K, e, threadIdx.x, s_pairs, s_npairs);
  __syncthreads();
  og_fp8_gate_up<OG_W1, OG_NT, OG_U1>(q, e, blockIdx.x - u * tiles, s_pairs, s_npairs, s_red);
#endif
  OG_TS(0, 7);
}

extern "C" __global__ void __launch_bounds__(OG_W2 * 32, OG_DOWN_MIN)
    OG_SUFFIX(moe_down_fp8)(const og_moe_fp8_params q) {
  const og_moe_params &p = q.b;
#if OG_DOWN_WARP
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
#if OG_DOWN_WARP
  og_routing &r = rw[threadIdx.x >> 5];
  og_routing_warp(p, r, p.T * OG_K);
#else
  og_routing_setup(p, r);
#endif
  OG_TS(1, 1);
#if OG_PDL && OG_DOWN_EARLY
  og_fp8_down_tile<OG_W2, true>(q, r, blockIdx.x, s_red);  // waits after its first weight loads
#else
#if OG_PDL
  og_pdl_wait();  // gate_up has finished: act and its scales are complete, x (which out may alias) read
#endif
  OG_TS(1, 3);
  og_fp8_down_tile<OG_W2>(q, r, blockIdx.x, s_red);
#endif
  OG_TS(1, 7);
}
