// vLLM's q/k RMSNorm and rotary embedding of one head's 8 dims a lane, shared by every kernel
// that does them (a query/key prologue, a projection's epilogue), so all give the same bits. The
// including file defines OG_QK_D (the head size: 64, 128 or 256), OG_QKNORM (0/1, default 0)
// and OG_ROPE (default 0: none, 1 NeoX: dim i with i + D/2, 2 GPT-J: dim 2i with 2i + 1). A head's D/8
// pieces sit in D/8 consecutive lanes of a warp (piece = lane % (D/8)); every lane of the warp
// calls og_qk_piece (the head's lanes meet in shuffles).
#ifndef OG_QK_CUH
#define OG_QK_CUH
#ifndef OG_QKNORM
#define OG_QKNORM 0
#endif
#ifndef OG_ROPE
#define OG_ROPE 0
#endif
#if OG_QKNORM || OG_ROPE

// What a lane's 8 dims (from d) need: the norm weights, and the cosines and sines of the row's
// position (NeoX: of frequencies d % (D/2) .. +8; GPT-J: d/2 .. +4, in x, y); rot: the position
// is inside the cache (outside it the piece is not rotated).
struct og_qk_consts {
  og_vec4 qw, kw, cr, sr;
  bool rot;
};
__device__ __forceinline__ void og_qk_load(const void *q_norm_w, const void *k_norm_w, const void *cos_sin,
                                           long long cs_stride, long long rope_rows, long long pos, int d,
                                           og_qk_consts &k) {
#if OG_QKNORM
  k.qw = og_load_shared_operand((const og_u16 *)q_norm_w + d);  // weights: never written
  k.kw = og_load_shared_operand((const og_u16 *)k_norm_w + d);
#endif
#if OG_ROPE
  k.rot = pos >= 0 && pos < rope_rows;
  const og_u16 *row = (const og_u16 *)cos_sin + (k.rot ? pos : 0) * cs_stride;
#if OG_ROPE == 1
  k.cr = og_load_shared_operand(row + d % (OG_QK_D / 2));
  k.sr = og_load_shared_operand(row + OG_QK_D / 2 + d % (OG_QK_D / 2));
#else
  const uint2 c = __ldg((const uint2 *)(row + d / 2)), s = __ldg((const uint2 *)(row + OG_QK_D / 2 + d / 2));
  k.cr.x = c.x, k.cr.y = c.y, k.sr.x = s.x, k.sr.y = s.y;
#endif
#endif
}

// A query or key piece normalized with the weights w and rotated; second: the piece is in the
// head's second half (dims D/2 .. D). The rotation in fp32 from the normalized 16-bit values,
// rounded once.
__device__ __forceinline__ og_vec4 og_qk_piece(og_vec4 v, const og_vec4 &w, float eps, const og_qk_consts &k,
                                               bool second) {
#if OG_QKNORM
  {
    float x[8];
    og_unpack8(v, x);
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += x[j] * x[j];
#pragma unroll
    for (int o = OG_QK_D / 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float r = rsqrtf(ss / (float)OG_QK_D + eps);
    v.x = og_mul2(og_pack2(x[0] * r, x[1] * r), w.x), v.y = og_mul2(og_pack2(x[2] * r, x[3] * r), w.y);
    v.z = og_mul2(og_pack2(x[4] * r, x[5] * r), w.z), v.w = og_mul2(og_pack2(x[6] * r, x[7] * r), w.w);
  }
#endif
#if OG_ROPE
  if (k.rot) {  // the same in every lane of a head (one row)
    float x[8], o[8];
    og_unpack8(v, x);
#if OG_ROPE == 1
    og_vec4 u;  // the same dims of the head's other half
    u.x = __shfl_xor_sync(0xffffffffu, v.x, OG_QK_D / 16), u.y = __shfl_xor_sync(0xffffffffu, v.y, OG_QK_D / 16);
    u.z = __shfl_xor_sync(0xffffffffu, v.z, OG_QK_D / 16), u.w = __shfl_xor_sync(0xffffffffu, v.w, OG_QK_D / 16);
    float y[8], c[8], s[8];
    og_unpack8(u, y), og_unpack8(k.cr, c), og_unpack8(k.sr, s);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = second ? x[j] * c[j] + y[j] * s[j] : x[j] * c[j] - y[j] * s[j];
#else
    (void)second;
    const float c[4] = {og_lo(k.cr.x), og_hi(k.cr.x), og_lo(k.cr.y), og_hi(k.cr.y)};
    const float s[4] = {og_lo(k.sr.x), og_hi(k.sr.x), og_lo(k.sr.y), og_hi(k.sr.y)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      o[2 * j] = x[2 * j] * c[j] - x[2 * j + 1] * s[j];
      o[2 * j + 1] = x[2 * j + 1] * c[j] + x[2 * j] * s[j];
    }
#endif
    v = og_pack8(o);
  }
#endif
  return v;
}

#endif
#endif
