// Compile-time configuration of the MoE experts kernels: the -D constants the launcher sets
// (src/ops/moe/config.c), their defaults, and what follows from them.
//
// OG_DTYPE (1 bf16, 2 fp16), OG_IDS64, OG_EMAP (expert_map), OG_H, OG_I, OG_E, OG_K, OG_NT (8-token
// tiles: the kernels take T <= 8*OG_NT), OG_GU_NT (gate_up's, below), OG_W1/OG_U1 and OG_W2/OG_U2
// (warps per block and 32-wide k steps in flight per warp), OG_ON_INPUT
// (apply_router_weight_on_input), OG_L2_FETCH (L2 fetch size hint, og_common.cuh), OG_LOAD /
// OG_DOWN_LOAD (the weight loads' form per stage, og_common.cuh), OG_PDL and the paths below.
#pragma once
#include "og_common.cuh"
#include "moe_params.h"

#define OG_FULL 0xffffffffu
// The form of gate_up's and down's weight loads (og_load_stream): moe.load and moe.down_load.
#ifndef OG_LOAD
#define OG_LOAD 4
#endif
#ifndef OG_DOWN_LOAD
#define OG_DOWN_LOAD 1
#endif
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
#ifndef OG_EMAP
#define OG_EMAP 0
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
// OG_DOWN_TRIGGER (moe.trigger, sm_90): every moe_down block lets the stream's next kernel launch as
// it starts (griddepcontrol.launch_dependents), so a next kernel launched as a programmatic
// dependent (the next layer's qkv projection) streams its weights while down, latency-bound at few
// tokens, leaves DRAM idle; that kernel still waits for down's output. No effect on a next kernel
// launched without the attribute.
#ifndef OG_DOWN_TRIGGER
#define OG_DOWN_TRIGGER 0
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
