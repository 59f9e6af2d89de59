/* The MoE op's rules: tunable values derived from the shape, the GPU and the token count, used
 * wherever no baked row (table.c) matches. Measured on sm_90 (H200); other archs take the same
 * tile rules, unmeasured, and hand every call of more than one token back to vLLM.
 *
 * Where each rule comes from (bench/NOTES.md has the runs):
 * - moe.max_tokens 8 on sm_90: end to end in vLLM 0.26 our kernel up to 8 tokens won on
 *   Qwen3-30B-A3B (ITL batch 1 4.115 -> 3.723 ms, batch 8 floor 9.112 -> 8.904), its tp2 and ep2
 *   per-rank shapes and Mixtral-8x7B (batch 1..8 -1.3..-5.8%); op level against vLLM's kernel on
 *   Qwen3-235B-A22B and Kimi-K2 (1.03-1.15x at T <= 8) and on public shapes that are not presets
 *   (1.00-1.20x at T 1..8, 0.72-0.87x at 16). At 10 or more tokens vLLM's kernel wins on most
 *   shapes (0.94-0.97x), so 8 is where the rule stops.
 * - gate_up warps: a warp should stream about 16 k-steps of 32 over H: 4 warps for H <= 2048
 *   (Qwen3-30B-A3B: 4 warps T=1 24.1 us, 8 warps 25.0), 8 above (Qwen3-235B-A22B, Kimi-K2,
 *   Mixtral-8x7B: 8 won at T <= 8).
 * - down warps: about 2048 warps over the call's H/16 blocks, a power of two in 4..16
 *   (Qwen3-30B-A3B, 128 blocks: 16 won; Kimi-K2, 448 blocks: 4 won, T=1 down 65.9 -> 57.0 us;
 *   Mixtral-8x7B and Qwen3-235B-A22B, 256 blocks: 8).
 * - gate_up's launch-bounds minimum 4 blocks (clamped to 16 warps an SM): never lost at T <= 8 on
 *   7 shapes (v13). Both stages 4 k-steps in flight. L2 fetch 128 B (Kimi-K2 T=8 1590 -> 1223 us).
 * - One token: the one-slot gate_up and per-warp down routing (v18: every preset 0.5-1.2 us
 *   faster). 2..4 tokens: routing by slot in both stages (v19: every preset faster; Mixtral-8x7B
 *   lost at 8 and 16 tokens, where T*k still fits 32 slots).
 *
 * - moe.route (routing from the logits in the kernels) up to 4 tokens: every block computes the
 *   call's routing, which costs little where gate_up's blocks fit one wave and a wave's worth each
 *   more. Router gate + routing + experts as one span, Qwen3-30B-A3B (v27, tools.moe_route, against
 *   vLLM's topk_softmax and our experts): 1.08 / 1.05 / 1.02x at 1 / 2 / 4 tokens, 0.96x at 8; end
 *   to end at batch 8 the step lost 0.2 ms with it.
 *
 * FP8 weights (shape keys "moe:fp8block:..." and "moe:fp8tensor:..."):
 * - moe.fp8 1 on sm_90 up to two tokens: where ours (with vLLM's activation quantization) beat
 *   vLLM 0.26's own FP8 path (its modular kernel with TritonExperts) in the same run on the H200
 *   at every shape measured (bench/results/2026-12-01-h200-v23-fp8/ and -v24-fp8/, vllm/; per
 *   tensor at two tokens: Mixtral-8x7B 1.16x, Qwen3-30B-A3B 1.24x, -v40-fp8-tensor-x16/). From
 *   three tokens the shapes part: table.c takes the block shapes that won there (Qwen3-30B-A3B,
 *   DeepSeek-V3/tp8, Kimi-K2/tp8 to eight tokens, Qwen3-235B-A22B to five: -v36-fp8-shapes/), and
 *   Mixtral-8x7B's per-tensor shape to eight once tuned (-v39-fp8-tensor-combine/); elsewhere
 *   vLLM's. On an H100, block scales up to eight tokens: with the tile rules below, ours with
 *   vLLM's activation quantization against vLLM 0.26's Triton path on six block shapes without
 *   rows, 1.05-1.34x at four tokens and 1.09-1.23x at eight (NOTES v70; the H200 has not run these
 *   tiles). Other GPUs are not measured: vLLM's. OPGRAFT_TUNE_MOE_FP8 overrides it. Of the tile
 *   rules below, the unroll and the down warps were argued from the kernels' structure.
 * - moe.max_tokens as for bf16 (8 on sm_90).
 * - gate_up warps, PDL between the stages and load form 1 as the rows of the six FP8 shapes tuned
 *   on the 16-row tiles chose them (NOTES v69): gate_up at one token 4 warps for H <= 2048 and 8
 *   above (the rows: 4 on Qwen3-30B-A3B and Mixtral-8x7B, 8 on three shapes of H 4096-7168, 2 on
 *   Qwen3-235B-A22B), 4 at two tokens (rows 2-8), 2 from three (rows 1-4); PDL up to two tokens
 *   (every shape at one, every block shape at two); load form 1 from two tokens (all six at two,
 *   five at 3-5, three from six; at one token the GPUs differ). Against the rule before it (v22's
 *   32-row tiles) on six block shapes without rows (Qwen3-235B-A22B/tp2 and /tp8, DeepSeek-V3 and
 *   /tp4, Kimi-K2/tp4, Qwen3-30B-A3B/tp2), H100: 4-16% faster at each of 1, 2, 4 and 8 tokens
 *   (NOTES v70, bench/results/2026-12-07-h100-v70-fp8-rule/).
 * - Both stages unroll 8 32-k steps' worth: config.c turns that into 4 of the 64-k steps (16
 *   bytes of each row a lane), the same bytes in flight, and clamps it where more token tiles need
 *   the registers; down warps as for bf16.
 * - Routing by slot in both stages whenever T*k fits 32 slots (one token included: the FP8
 *   kernels have no separate one-token paths).
 * - moe.route up to 2 tokens: the routing inside the FP8 kernels cost +1.3 µs at 1 and 2 tokens
 *   and +3.8 at 4 (gate + routing + experts as one span against the routing given, Qwen3-30B-A3B,
 *   tools.moe_route --dtype fp8-block, v31), where vLLM's topkGating it replaces took 3.56 µs a
 *   layer in the Qwen3-30B-A3B-FP8 engine step (v30).
 * - moe.fp8_quantize on sm_90 up to 2 tokens (gate_up quantizes the 16-bit hidden states; the
 *   routing seam's calls, moe.route, are those). Block scales: router gate to output 22.05
 *   against 24.27 µs with vLLM's quantization kernel at one token, 31.06 against 33.40 at two
 *   (Qwen3-30B-A3B, tools.moe_route); the op bench -2.0..-2.8 µs on Qwen3-30B-A3B and
 *   DeepSeek-V3/tp8, but +1.9 µs at 4 tokens on Qwen3-30B-A3B (x's registers lower gate_up's
 *   unroll); a batch-1 engine step -89 µs. Bit for bit the e4m3 form where both compile one
 *   configuration (H200 check, NOTES v35). Per-tensor scales (1 x 128 groups in place of vLLM's
 *   dynamic per-tensor quantization, NOTES v40): the op bench -8.9 / -13.0 µs at 1 / 2 tokens on
 *   Mixtral-8x7B, -10.6 / -10.1 on Qwen3-30B-A3B; from three tokens on Mixtral-8x7B a tie, then
 *   up to +4.5 µs. */
#include <stdio.h>
#include <string.h>

#include "moe.h"

int opgraft__moe_parse_shape(const char *shape, og_moe_shape *s) {
  char dt[16];
  long long E, H, I, k;
  if (!shape || sscanf(shape, "moe:%15[a-z0-9]:E%lld:H%lld:I%lld:k%lld", dt, &E, &H, &I, &k) != 5) return 0;
  if (E < 1 || H < 1 || I < 1 || k < 1) return 0;
  s->E = E, s->H = H, s->I = I, s->k = k;
  s->fp8 = strcmp(dt, "fp8block") == 0 ? 1 : strncmp(dt, "fp8", 3) == 0 ? 2 : 0;
  return 1;
}

/* The FP8 rules (above); 0 for keys they leave to the shared rules. */
static int fp8_rule(const opgraft_tune_query *q, const og_moe_shape *s, int64_t *value) {
  const char *key = q->key;
  const int32_t T = q->tokens;
  if (strcmp(key, "moe.fp8") == 0) {
    const int h100 = q->gpu && strncmp(q->gpu, "NVIDIA H100", 11) == 0;
    return *value = q->arch == 90 && (T <= 2 || (h100 && s->fp8 == 1 && T <= 8)), 1;
  }
  if (strcmp(key, "moe.route") == 0) return *value = T <= 2, 1;
  if (strcmp(key, "moe.fp8_quantize") == 0) return *value = q->arch == 90 && T <= 2, 1;
  if (strcmp(key, "moe.gate_up.warps") == 0) return *value = T >= 3 ? 2 : T == 2 ? 4 : s->H <= 2048 ? 4 : 8, 1;
  if (strcmp(key, "moe.pdl") == 0) return *value = q->arch >= 90 && T <= 2, 1;
  if (strcmp(key, "moe.load") == 0) return *value = T >= 2 ? 1 : 4, 1;
  if (strcmp(key, "moe.gate_up.unroll") == 0 || strcmp(key, "moe.down.unroll") == 0) return *value = 8, 1;
  if (strcmp(key, "moe.gate_up.slot_routing") == 0 || strcmp(key, "moe.down.warp_routing") == 0)
    return *value = T >= 1 && (int64_t)T * s->k <= 32, 1;
  return 0;
}

static int64_t pow2_floor(int64_t v) {
  int64_t p = 1;
  while (p * 2 <= v) p *= 2;
  return p;
}

int opgraft__moe_rule(const opgraft_tune_query *q, int64_t *value) {
  const char *key = q->key;
  const int32_t T = q->tokens;
  og_moe_shape fs;
  if (opgraft__moe_parse_shape(q->shape, &fs) && fs.fp8 && fp8_rule(q, &fs, value)) return 1;
  if (strcmp(key, "moe.fp8") == 0) return *value = 0, 1; /* a query without an FP8 shape */
  if (strcmp(key, "moe.max_tokens") == 0) return *value = q->arch == 90 ? 8 : 1, 1;
  if (strcmp(key, "moe.gate_up.unroll") == 0 || strcmp(key, "moe.down.unroll") == 0) return *value = 4, 1;
  if (strcmp(key, "moe.gate_up.min_blocks") == 0) return *value = 4, 1;
  if (strcmp(key, "moe.l2_fetch") == 0) return *value = 128, 1;
  if (strcmp(key, "moe.gate_up.one_token") == 0 || strcmp(key, "moe.down.one_token") == 0)
    return *value = T == 1, 1;
  if (strcmp(key, "moe.gate_up.slot_routing") == 0 || strcmp(key, "moe.down.warp_routing") == 0)
    return *value = T >= 2 && T <= 4, 1;
  if (strcmp(key, "moe.route") == 0) return *value = T <= 4, 1;
  og_moe_shape s;
  if (!opgraft__moe_parse_shape(q->shape, &s)) return 0;
  if (strcmp(key, "moe.gate_up.warps") == 0) return *value = s.H <= 2048 ? 4 : 8, 1;
  if (strcmp(key, "moe.down.warps") == 0) {
    int64_t w = 2048 / (s.H / 16 > 0 ? s.H / 16 : 1);
    w = w < 4 ? 4 : w > 16 ? 16 : w;
    return *value = pow2_floor(w), 1;
  }
  return 0;
}
