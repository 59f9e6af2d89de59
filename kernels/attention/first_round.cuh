// A piece of og_attention (attention.cu), included where the kernel loads a warp's first round:
// the tiles' blocks (the guesses loaded with the length where the tile is the guessed one), rows
// and K rows, and V where it is loaded ahead (the V prefetch's first tile; OG_PDL 2's first
// round). Under OG_PDL 2 before griddepcontrol.wait (coherent loads that stay ahead of it), else
// after the query's store; one text for both places, so a kernel without OG_PDL 2 is compiled from
// the same source it always was.
#pragma unroll
  for (int u = 0; u < OG_ROUND; ++u) {
    const int tu = t + u * OG_W, tb = r0 + 16 * tu;
    row[u] = 0;
#if !OG_WINDOW
    if (tb == tb_guess[u]) {
      row[u] = tb_guess[u] - bi_guess[u] * p.block_size;
      blk[u] = tu < ntiles && blk_guess[u] >= 0 && blk_guess[u] < p.num_blocks ? blk_guess[u] : -1;
    } else
#endif
      blk[u] = tu < ntiles ? og_tile_block(p, bt, tb, &row[u]) : -1;
    const bool v0 = blk[u] >= 0 && tb + g >= start && tb + g < r1,
               v1 = blk[u] >= 0 && tb + g + 8 >= start && tb + g + 8 < r1;
    const og_u16 *kp = kbase + (long long)max(blk[u], 0) * p.k_sb + (long long)(row[u] + g) * p.k_st;
#pragma unroll
    for (int k = 0; k < OG_DK; ++k) {
      kg[u][k] = og_kv_load<OG_PDL == 2>(kp + 32 * k, v0);
      k8[u][k] = og_kv_load<OG_PDL == 2>(kp + 8 * p.k_st + 32 * k, v1);
    }
  }
#if OG_VPF
  og_v_tile<OG_PDL == 2>(vc, v8, v4, v12, p, vbase, blk[0], row[0], r0 + 16 * t, c, start, r1);
#elif OG_PDL == 2
#pragma unroll
  for (int u = 0; u < OG_ROUND; ++u)
    og_v_tile<true>(vc[u], v8[u], v4[u], v12[u], p, vbase, blk[u], row[u], r0 + 16 * (t + u * OG_W), c, start, r1);
#endif
