/* Kernel parameters of the paged decode-attention kernel, shared by the host launcher (C11) and
 * the kernel (NVRTC C++): plain types only, passed by value as the kernel's single parameter.
 * Strides are in elements. */
#ifndef OPGRAFT_ATTN_PARAMS_H
#define OPGRAFT_ATTN_PARAMS_H

typedef struct og_attn_params {
  const void *q;          /* [batch, heads, D] */
  const void *k;          /* the K cache: [blocks, block_size, kv_heads, D] through its strides */
  const void *v;          /* the V cache, likewise */
  void *out;              /* [batch, heads, D] */
  const int *block_table; /* [batch, max_blocks] */
  const int *seq_lens;    /* [batch] */
  const void *sinks;      /* OG_SINKS: [heads] in the dtype OG_SINKS names */
  float *part;            /* split partials: [groups][slots_per_group][G][D] unnormalised outputs */
  float *part_ml;         /* [groups][slots_per_group][G][2]: each partial's max (log2 units) and sum */
  unsigned *counters;     /* [groups][counters_per_group] arrivals at the combine tree's nodes; 0 between calls */
  const void *k_new;      /* OG_UPDATE: the call's new keys [batch, kv_heads, D] through kn_st, kn_sh */
  const void *v_new;      /* OG_UPDATE: its new values, likewise */
  const long long *slot_mapping; /* OG_UPDATE: [slot_count] cache slot (block * block_size + row) of row b's new key */
  const void *q_norm_w, *k_norm_w; /* OG_QKNORM: [D] RMSNorm weights of a query head and of a key head */
  const void *cos_sin;             /* OG_ROPE: [rope_rows] rows of cs_stride: D/2 cosines, then D/2 sines */
  const long long *positions;      /* OG_ROPE: [batch] row b's position */
  long long q_st, q_sh;
  long long o_st, o_sh;
  long long k_sb, k_st, k_sh;
  long long v_sb, v_st, v_sh;
  long long bt_stride;
  long long kn_st, kn_sh, vn_st, vn_sh;
  long long cs_stride; /* OG_ROPE */
  int block_size; /* tokens a cache block, a multiple of 16 (a run-time value: the kernel can be
                   * compiled before the cache exists) */
  int max_blocks; /* the block table's columns */
  int num_blocks; /* the cache's blocks: a block id outside [0, num_blocks) contributes nothing */
  int window_left; /* OG_WINDOW: keys j >= seq_len - 1 - window_left only (-1: all) */
  int min_chunk;   /* tokens a split takes at least (a multiple of 16) */
  int slots_per_group, counters_per_group; /* og_attn_tree(gridDim.x, the launch's fan-in) */
  int slot_count;  /* OG_UPDATE: rows of slot_mapping; rows at or past it write nothing */
  float qk_scale;  /* scale * log2(e); with OG_SOFTCAP scale / softcap */
  float cap_log2;  /* OG_SOFTCAP: softcap * log2(e) */
  float qk_eps;    /* OG_QKNORM: the RMSNorm's epsilon */
  int rope_rows;   /* OG_ROPE: rows of cos_sin; a position outside [0, rope_rows) is not rotated */
  /* OG_QK_ONLY: a row's query heads and key heads (q, k_new), and where the keys go (out takes the
   * queries through o_st, o_sh) */
  int pro_heads, pro_kv_heads;
  void *k_out;
  long long ko_st, ko_sh;
} og_attn_params;

/* Threads a block of the prologue-alone kernel (OG_QK_ONLY) has: a multiple of every D / 8. */
#define OG_ATTN_QK_THREADS 256

/* A query row in shared memory, in elements: 64 bytes of padding spread the banks. */
#define OG_ATTN_QROW(D) ((D) + 32)
/* The split combine's fan-in (log2): a node of the combine tree merges 16 partials at most, or 32
 * in a launch of 17..32 splits, which 32 merge in one level and 16 in two (launch.c); the kernel
 * has an entry point for each, the fan-in a compile-time constant in each. */
#define OG_ATTN_FAN_LOG2 4
#define OG_ATTN_FAN_MAX_LOG2 5
#define OG_ATTN_FAN (1 << OG_ATTN_FAN_LOG2)
#define OG_ATTN_FAN_MAX (1 << OG_ATTN_FAN_MAX_LOG2)

/* Where a block's result for its cluster's merge starts (OG_CLUSTER), in floats after the start of
 * the warps' partials (outputs W*G*D, maxima and sums W*G*2), at a 16-byte boundary; it takes
 * G*D + G*2 floats. */
#define OG_ATTN_RES_OFF(D, G, W) ((((W) * (G) * (D) + (W) * (G) * 2) + 3) / 4 * 4)

/* The split and tree arithmetic, shared by the kernel and the host (whose tests check it). */
#ifdef __CUDACC_RTC__
#define OG_ATTN_FN __device__ __forceinline__
#else
#define OG_ATTN_FN static inline
#endif

/* How a sequence of length L whose keys start at `start` splits over S blocks: tiles begin at
 * a0 = start rounded down to 16 tokens, each split takes chunk tokens (a multiple of 16, at least
 * min_chunk) from a0 on; a span of at most `one` tokens is one split; returns the number of
 * non-empty splits n (1 <= n <= S). */
OG_ATTN_FN int og_attn_split(int L, int start, int S, int min_chunk, int one, int *a0, int *chunk) {
  const int first = start & ~15, span = L - first;
  int ch = (span + S - 1) / S;
  if (ch < min_chunk) ch = min_chunk;
  if (ch < span && span <= one) ch = span;
  ch = (ch + 15) & ~15;
  *a0 = first, *chunk = ch;
  return (span + ch - 1) / ch;
}

/* A node of the combine tree: child idx of a level with cnt live nodes out of cap, whose partials
 * are slots off.. of the group and whose parents' counters are coff.. of the group. Every
 * function takes the tree's fan-in as its log2 lg (in the kernel a constant). */
typedef struct og_attn_node {
  int idx, cnt, cap, off, coff;
} og_attn_node;
OG_ATTN_FN int og_attn_parent(const og_attn_node *n, int lg) { return n->idx / (1 << lg); }
OG_ATTN_FN int og_attn_members(const og_attn_node *n, int lg) {
  const int rest = n->cnt - og_attn_parent(n, lg) * (1 << lg);
  return rest < (1 << lg) ? rest : 1 << lg;
}
/* Is the parent the root (its merge is the output)? */
OG_ATTN_FN int og_attn_parent_is_root(const og_attn_node *n, int lg) { return n->cnt <= 1 << lg; }
/* The parent's slot (where its merge goes when it is not the root). */
OG_ATTN_FN int og_attn_parent_slot(const og_attn_node *n, int lg) { return n->off + n->cap + og_attn_parent(n, lg); }
/* Moves to the parent. */
OG_ATTN_FN void og_attn_up(og_attn_node *n, int lg) {
  const int pcap = (n->cap + (1 << lg) - 1) / (1 << lg);
  n->off += n->cap, n->coff += pcap;
  n->idx = og_attn_parent(n, lg), n->cnt = (n->cnt + (1 << lg) - 1) / (1 << lg), n->cap = pcap;
}
#ifndef __CUDACC_RTC__
/* The combine tree of S splits at fan-in 1 << lg: the partial slots and node counters one group
 * (a sequence's kv head) needs. Level l has c_l nodes (c_0 = S, c_{l+1} = ceil(c_l / fan-in));
 * every level with more than one node keeps its partials, every node above level 0 a counter. */
static inline void og_attn_tree(int S, int lg, int *slots, int *counters) {
  int c = S, sl = 0, co = 0;
  while (c > 1) {
    sl += c;
    c = (c + (1 << lg) - 1) / (1 << lg);
    co += c;
  }
  *slots = sl, *counters = co;
}

/* Bytes of dynamic shared memory the kernel takes for (D, G, warps, cluster merge or not): the
 * query rows, then the warps' partials (outputs, maxima, sums; with the cluster merge the block's
 * result after them), whose room a combine reuses for up to OG_ATTN_FAN_MAX partials' maxima and
 * sums (W * (D + 2) >= 2 * 32 floats a head for every W and D). */
static inline unsigned og_attn_smem_bytes(int D, int G, int W, int cluster) {
  const unsigned nh8 = (unsigned)((G + 7) / 8) * 8u;
  const unsigned sq = nh8 * (unsigned)OG_ATTN_QROW(D) * 2u;
  return sq + (cluster ? (unsigned)(OG_ATTN_RES_OFF(D, G, W) + G * D + G * 2) * 4u
                       : (unsigned)(W * G * D) * 4u + (unsigned)(W * G) * 8u);
}
#endif

#endif
