"""The paged decode-attention bench: opgraft's kernel against the decode kernels vLLM ships for
this GPU, each called as vLLM's backend calls it, in the same run, with the read ceiling.

- vllm-fa3: vllm.vllm_flash_attn.flash_attn_varlen_func as FlashAttentionImpl.forward calls it
  (vLLM 0.26): cu_seqlens_q = arange, seqused_k = seq_lens, the block table, k/v_descale of ones
  expanded to (batch, kv_heads), scheduler metadata from get_scheduler_metadata as the metadata
  builder computes it for a full CUDA graph (num_splits = max_num_splits = 32, vLLM's
  flash_attn_max_num_splits_for_cuda_graph), num_splits = 32.
- vllm-triton: vLLM's unified_attention as TritonAttentionImpl.forward calls it, with the
  builder's 3D-kernel segment buffers (threshold 128 // kv_heads, 16 segments).
- vllm-flashinfer: FlashInfer's BatchDecodeWithPagedKVCacheWrapper (tensor cores, CUDA-graph
  buffers, NHD) planned and run as vLLM's FlashInfer backend does on its native decode path (not
  the TRT-LLM/XQA kernels it prefers where those apply).
Every implementation reads the same cache: vLLM's FlashAttention layout, logical (blocks, kv_heads,
block_size, 2*D), physically [block, token, head, K|V], K and V the views forward() splits off,
with a shuffled block table. Bytes: K and V of every context token once. Before each timed call
64 MiB of other data is read (bench.between_traffic), and calls are timed from their kernels'
start/end times (bench.timed_calls), as in a decode step.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass

import torch

from .. import _lib
from ..ops import attention as ops
from ..presets import ATTENTION_POINTS as DEFAULT_POINTS
from ..presets import ATTENTION_PRESETS as PRESETS
from ..presets import AttnShape
from . import BETWEEN_MIB, TOLERANCE, between_traffic, rel_err, run_facts, speed, timed_calls

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Problem:
    """One decode batch over a paged cache in vLLM's FlashAttention layout."""

    kv_cache: torch.Tensor  # logical (blocks, kv_heads, block_size, 2*D)
    key_cache: torch.Tensor  # [blocks, block_size, kv_heads, D] views, as forward() splits them
    value_cache: torch.Tensor
    query: torch.Tensor  # [batch, heads, D]
    block_table: torch.Tensor  # int32 [batch, max_blocks]
    seq_lens: torch.Tensor  # int32 [batch]
    scale: float
    softcap: float = 0.0
    window_left: int = -1
    sinks: torch.Tensor | None = None


def vllm_kv_cache(num_blocks: int, block_size: int, heads_kv: int, head_size: int, dtype, device, layout: str = "NHD"):
    """A cache as vLLM 0.26's FlashAttention backend allocates it: shape (blocks, kv_heads,
    block_size, 2*D), physically (0, 2, 1, 3) for NHD, (0, 1, 2, 3) for HND; returns (kv_cache, K
    view, V view) with K and V split as FlashAttentionImpl.forward splits them."""
    if layout == "NHD":
        phys = torch.empty((num_blocks, block_size, heads_kv, 2 * head_size), dtype=dtype, device=device)
        kv = phys.permute(0, 2, 1, 3)
    else:
        kv = torch.empty((num_blocks, heads_kv, block_size, 2 * head_size), dtype=dtype, device=device)
    k, v = kv.transpose(1, 2).split(head_size, dim=-1)
    return kv, k, v


def make_problem(lens: list[int], heads_q: int, heads_kv: int, head_size: int, dtype: str = "bf16", device="cuda",
                 block_size: int = 16, seed: int = 0, layout: str = "NHD", softcap: float = 0.0, window_left: int = -1,
                 sinks: str | None = None, spare_blocks: int = 7, q_pad: int = 0) -> Problem:
    """Random K/V (normal, std 1) and queries for sequences of the given lengths (0: a padded
    row), in shuffled blocks (each row owns at least one, filled whole); the cache's other blocks
    hold NaN, so a read of one shows. q_pad > 0 makes the query rows a view with that many extra
    elements a row (as a fused qkv output)."""
    dt = TORCH_DTYPES[dtype]
    g = torch.Generator(device=device).manual_seed(seed)
    B = len(lens)
    per_seq = [max(1, (L + block_size - 1) // block_size) for L in lens]
    max_blocks = max(per_seq) + 1
    num_blocks = sum(per_seq) + spare_blocks
    kv, k, v = vllm_kv_cache(num_blocks, block_size, heads_kv, head_size, dt, device, layout)
    kv.fill_(float("nan"))
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    bt = torch.zeros((B, max_blocks), dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(per_seq):
        bt[b, :n] = torch.tensor(perm[nxt:nxt + n], dtype=torch.int32)
        nxt += n
    bt = bt.to(device)
    for b in range(B):
        n = per_seq[b]
        blocks = bt[b, :n].long()
        kk = torch.randn((n * block_size, heads_kv, head_size), generator=g, device=device).to(dt)
        vv = torch.randn((n * block_size, heads_kv, head_size), generator=g, device=device).to(dt)
        k[blocks] = kk.view(n, block_size, heads_kv, head_size)
        v[blocks] = vv.view(n, block_size, heads_kv, head_size)
    qfull = torch.randn((B, heads_q * head_size + q_pad), generator=g, device=device).to(dt)
    q = qfull[:, : heads_q * head_size].view(B, heads_q, head_size)
    s = None
    if sinks is not None:
        s = (2 * torch.randn((heads_q,), generator=g, device=device)).to(torch.float32 if sinks == "fp32" else dt)
    return Problem(kv, k, v, q, bt, torch.tensor(lens, dtype=torch.int32, device=device), head_size ** -0.5, softcap,
                   window_left, s)


def reference(p: Problem, rows: int | None = None) -> torch.Tensor:
    """fp64 decode attention on the problem's device, gathering each sequence's keys through its
    block table (independent of the C oracle); float64 [rows, heads, D]."""
    B = p.seq_lens.shape[0] if rows is None else min(rows, p.seq_lens.shape[0])
    H, D = p.query.shape[1], p.query.shape[2]
    Hk, bs = p.key_cache.shape[2], p.key_cache.shape[1]
    G = H // Hk
    out = torch.zeros((B, H, D), dtype=torch.float64, device=p.query.device)
    lens = p.seq_lens.tolist()
    for b in range(B):
        L = lens[b]
        if L <= 0:
            continue
        start = max(0, L - 1 - p.window_left) if p.window_left >= 0 else 0
        j = torch.arange(start, L, device=p.query.device)
        blk = p.block_table[b, j // bs].long()
        k = p.key_cache[blk, j % bs].double()  # [n, Hk, D]
        v = p.value_cache[blk, j % bs].double()
        q = p.query[b].double().view(Hk, G, D)
        s = torch.einsum("hgd,nhd->hgn", q, k) * p.scale
        if p.softcap > 0:
            s = p.softcap * torch.tanh(s / p.softcap)
        if p.sinks is not None:
            s = torch.cat([s, p.sinks.double().view(Hk, G, 1)], dim=-1)
        w = torch.softmax(s, dim=-1)
        if p.sinks is not None:
            w = w[..., :-1]
        out[b] = torch.einsum("hgn,nhd->hgd", w, v).reshape(H, D)
    return out


def run_ours(p: Problem, out: torch.Tensor, max_seq_len: int = 0, key=None, value=None,
             slot_mapping=None, pro=None, flags: int = 0) -> torch.Tensor:
    """Our kernel on the problem; with key, value and slot_mapping it also stores them in the cache
    (with pro, the query and the new keys normalized and rotated first); flags: launch hints."""
    return ops.attention_decode_into(out, p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, p.scale,
                                     p.softcap, p.window_left, p.sinks, max_seq_len, key, value, slot_mapping, pro,
                                     flags)


def rope_cache(rows: int, head_size: int, dtype, device, base: float = 1e6) -> torch.Tensor:
    """vLLM's RotaryEmbedding cos/sin cache (rotary_dim = head_size; Qwen3's base 1e6): [rows, D],
    the D/2 cosines then the D/2 sines of position x inverse frequency, in dtype."""
    inv = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float, device=device) / head_size))
    freqs = torch.outer(torch.arange(rows, dtype=torch.float, device=device), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def make_prologue(heads_dtype, head_size: int, rows: int, device, norm: bool = True, rope: int = 1,
                  rope_rows: int = 40960, seed: int = 0, eps: float = 1e-6) -> ops.QKPrologue:
    """A QKPrologue as Qwen3's attention has it (norm weights near 1, NeoX rotation, 40960
    positions), positions all 0 (the caller writes them: int64 [rows])."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = lambda: (1 + 0.5 * torch.rand((head_size,), generator=g, device=device)).to(heads_dtype)
    return ops.QKPrologue(w() if norm else None, w() if norm else None, eps,
                          rope_cache(rope_rows, head_size, heads_dtype, device) if rope else None,
                          torch.zeros((rows,), dtype=torch.int64, device=device), rope)


def prologue_rows(rows: int, heads_q: int, heads_kv: int, head_size: int, dtype, device, seed: int,
                  norm: bool = True, rope: int = 1, rope_rows: int = 40960):
    """A prefill's qkv projection output [rows, (heads_q + 2 heads_kv) * head_size] (random, seeded)
    and the QKPrologue of its rows at random positions in [0, rope_rows): what the prologue alone
    takes, its q and k being views of the qkv rows."""
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn((rows, (heads_q + 2 * heads_kv) * head_size), generator=g, device=device).to(dtype)
    pro = make_prologue(dtype, head_size, rows, device, norm, rope, rope_rows=rope_rows)
    pro.positions.copy_(torch.randint(0, rope_rows, (rows,), generator=g, device=device))
    return qkv, pro


def qk_prologue_torch(x: torch.Tensor, weight, pro: ops.QKPrologue) -> torch.Tensor:
    """vLLM's RMSNorm over each head (vllm.ir's rms_norm) and rotary embedding
    (RotaryEmbedding.forward_static, in fp32 and rounded once, as Inductor compiles it) of a query
    or key [rows, heads, D] whose row r has position pro.positions[r]; a position outside the
    cache is not rotated (the kernel's rule)."""
    dt, D, rows = x.dtype, x.shape[-1], x.shape[0]
    if weight is not None:
        xf = x.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + pro.eps)).to(dt) * weight
    if pro.rope_style == _lib.ROPE_NONE:
        return x
    cs = pro.cos_sin_cache
    pos = pro.positions[:rows].long()
    inside = (pos >= 0) & (pos < cs.shape[0])
    c = cs[pos.clamp(0, cs.shape[0] - 1)].float()
    cos, sin = c[:, None, : D // 2], c[:, None, D // 2: D]
    xf = x.float()
    if pro.rope_style == _lib.ROPE_NEOX:
        x1, x2 = xf[..., : D // 2], xf[..., D // 2:]
        o = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xf[..., ::2], xf[..., 1::2]
        o = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.where(inside[:, None, None], o.to(dt), x)


def _kwargs_for(fn, kwargs: dict) -> dict:
    """kwargs limited to fn's parameters (the vLLM versions differ in a few optional ones)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(q.kind == q.VAR_KEYWORD for q in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def vllm_fa3(p: Problem, max_seq_len: int):
    """(fn(out), "") calling vLLM's FA3 as FlashAttentionImpl.forward does, or (None, why not)."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
    except Exception as e:
        return None, f"vllm.vllm_flash_attn is not importable ({type(e).__name__}: {str(e)[:80]})"
    B, H, D = p.seq_lens.shape[0], p.query.shape[1], p.query.shape[2]
    Hk, bs = p.key_cache.shape[2], p.key_cache.shape[1]
    dev = p.query.device
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
    num_splits = 32  # the builder's max_num_splits for a full CUDA graph (attention_config default)
    window = [p.window_left, 0] if p.window_left >= 0 else [-1, -1]
    try:
        sched = get_scheduler_metadata(**_kwargs_for(get_scheduler_metadata, dict(
            batch_size=B, max_seqlen_q=1, max_seqlen_k=max_seq_len, num_heads_q=H, num_heads_kv=Hk, headdim=D,
            cache_seqlens=p.seq_lens, qkv_dtype=p.query.dtype, cu_seqlens_q=cu, page_size=bs, causal=True,
            window_size=tuple(window), has_softcap=p.softcap > 0, num_splits=num_splits)))
    except Exception as e:
        return None, f"get_scheduler_metadata failed ({type(e).__name__}: {str(e)[:80]})"
    ones = torch.ones((1,), dtype=torch.float32, device=dev)
    kwargs = dict(q=p.query, k=p.key_cache, v=p.value_cache, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=p.seq_lens,
                  max_seqlen_k=max_seq_len, softmax_scale=p.scale, causal=True, alibi_slopes=None, window_size=window,
                  block_table=p.block_table, softcap=p.softcap, scheduler_metadata=sched, fa_version=3,
                  q_descale=None, k_descale=ones.expand(B, Hk), v_descale=ones.expand(B, Hk), num_splits=num_splits,
                  s_aux=p.sinks)
    kwargs = _kwargs_for(flash_attn_varlen_func, kwargs)

    def fn(out):
        flash_attn_varlen_func(out=out, **kwargs)
        return out

    return fn, ""


def vllm_triton(p: Problem, max_seq_len: int):
    """(fn(out), "") calling vLLM's Triton unified_attention as TritonAttentionImpl.forward does."""
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception as e:
        return None, f"vLLM's Triton attention is not importable ({type(e).__name__}: {str(e)[:80]})"
    B, H, D = p.seq_lens.shape[0], p.query.shape[1], p.query.shape[2]
    Hk = p.key_cache.shape[2]
    dev = p.query.device
    threshold, segments = 128 // Hk, 16  # MIN_LAUNCH_GRID_SIZE_2D // kv heads, NUM_PAR_SOFTMAX_SEGMENTS
    dpad = 1 << (D - 1).bit_length()
    seg_out = torch.empty((threshold, H, segments, dpad), dtype=torch.float32, device=dev)
    seg_max = torch.empty((threshold, H, segments), dtype=torch.float32, device=dev)
    seg_sum = torch.empty((threshold, H, segments), dtype=torch.float32, device=dev)
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
    ones = torch.ones((1,), dtype=torch.float32, device=dev)
    kwargs = _kwargs_for(unified_attention, dict(
        q=p.query, k=p.key_cache, v=p.value_cache, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=p.seq_lens,
        max_seqlen_k=max_seq_len, softmax_scale=p.scale, causal=True,
        window_size=(p.window_left, 0) if p.window_left >= 0 else (-1, -1), block_table=p.block_table,
        softcap=p.softcap, q_descale=None, k_descale=ones.expand(B, Hk), v_descale=ones.expand(B, Hk),
        seq_threshold_3D=threshold, num_par_softmax_segments=segments, softmax_segm_output=seg_out,
        softmax_segm_max=seg_max, softmax_segm_expsum=seg_sum, sinks=p.sinks))

    def fn(out):
        unified_attention(out=out, **kwargs)
        return out

    return fn, ""


def vllm_flashinfer(p: Problem, max_seq_len: int):
    """(fn(out), "") running FlashInfer's paged decode as vLLM's FlashInfer backend plans it."""
    try:
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper
    except Exception as e:
        return None, f"flashinfer is not importable ({type(e).__name__}: {str(e)[:80]})"
    B, H, D = p.seq_lens.shape[0], p.query.shape[1], p.query.shape[2]
    Hk, bs = p.key_cache.shape[2], p.key_cache.shape[1]
    dev = p.query.device
    lens = p.seq_lens.tolist()
    pages = [max(1, (L + bs - 1) // bs) for L in lens]
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32)
    indices = torch.cat([p.block_table[b, :pages[b]].cpu() for b in range(B)]).to(torch.int32)
    last = torch.tensor([(L - 1) % bs + 1 if L > 0 else 0 for L in lens], dtype=torch.int32)
    try:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        wrapper = BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr.to(dev),
            paged_kv_indices_buffer=indices.to(dev), paged_kv_last_page_len_buffer=last.to(dev),
            use_tensor_cores=True)
        wrapper.plan(indptr, indices.to(dev), last, H, Hk, D, bs, pos_encoding_mode="NONE", sm_scale=p.scale,
                     window_left=p.window_left, logits_soft_cap=p.softcap or None, q_data_type=p.query.dtype,
                     kv_data_type=p.key_cache.dtype)
    except Exception as e:
        return None, f"FlashInfer's decode wrapper failed to plan ({type(e).__name__}: {str(e)[:80]})"
    kv = (p.key_cache, p.value_cache)

    def fn(out):
        wrapper.run(p.query, kv, out=out)
        return out

    return fn, ""


BASELINES = {"vllm-fa3": vllm_fa3, "vllm-flashinfer": vllm_flashinfer, "vllm-triton": vllm_triton}


def kv_bytes(p: Problem) -> int:
    """K and V of every context token once."""
    Hk, D = p.key_cache.shape[2], p.key_cache.shape[3]
    return int(p.seq_lens.clamp_min(0).sum().item()) * Hk * D * 2 * p.key_cache.element_size()


def bench_point(shape: AttnShape, batch: int, context: int, dtype: str = "bf16", ceiling_tbps: float | None = None,
                reps: int = 20, between_mib: int = BETWEEN_MIB, impls=("opgraft", *BASELINES), check_rows: int = 4,
                hint: int = 0, progress=None) -> list[dict]:
    """Rows for one (shape, batch, context): each implementation checked against fp64 (the first
    check_rows sequences), then timed. hint is the max_seq_len our kernel is given (0, as in a
    CUDA graph captured before the lengths are known, is the default)."""
    if progress:
        progress(f"{shape.name} batch={batch} context={context}")
    p = make_problem([context] * batch, shape.heads_q, shape.heads_kv, shape.head_size, dtype, seed=batch + context)
    ref = reference(p, check_rows)
    nbytes = kv_bytes(p)
    between = between_traffic(between_mib, "cuda")
    base = {**run_facts(), "op": "attention", "model": shape.name, "dtype": dtype, "batch": batch, "context": context,
            "heads_q": shape.heads_q, "heads_kv": shape.heads_kv, "head_size": shape.head_size, "block_size": 16,
            "bytes": nbytes, "between_mib": max(between_mib, 0),
            "ceiling_tbps": round(ceiling_tbps, 3) if ceiling_tbps else None}
    rows = []
    for impl in impls:
        if impl == "opgraft":
            ok, why = ops.supports(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, None, p.scale)
            fn = (lambda out: run_ours(p, out, hint)) if ok else None
            why = "" if ok else f"guard: {why}"
        else:
            fn, why = BASELINES[impl](p, context)
        row = dict(base, impl=impl)
        if fn is None:
            rows.append(dict(row, median_us=None, missing=why))
            continue
        outs = [torch.full_like(p.query, float("nan")) for _ in range(2)]
        try:
            fn(outs[0])
            torch.cuda.synchronize()
            err = rel_err(outs[0][:check_rows], ref)
            fn(outs[1])
            torch.cuda.synchronize()
            det = bool(torch.equal(outs[0], outs[1]))
            us, how = timed_calls(lambda i, _w: fn(outs[i]), [(0, None), (1, None)], between, reps)
        except Exception as e:  # report, do not hide: the row says why it is missing
            rows.append(dict(row, median_us=None, missing=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        rows.append(dict(row, **speed(nbytes, us, ceiling_tbps),
                         rel_err=float(f"{err:.3g}"), tolerance=TOLERANCE[dtype], deterministic=det, **how))
    del p
    torch.cuda.empty_cache()
    return rows


class TuneFixture:
    """Decode batches of one shape and batch size at several contexts, for the tuner: a
    configuration is checked on each (fp64, the first rows) and timed as bench_point times ours
    (max_seq_len 0, as in a CUDA graph); its cost is the geometric mean over the contexts, since a
    row holds for every context of its batch range (the lengths live on the device)."""

    def __init__(self, shape: AttnShape, batch: int, contexts, dtype: str = "bf16", reps: int = 20,
                 between_mib: int = BETWEEN_MIB, check_rows: int = 4):
        self.shape, self.batch, self.contexts, self.dtype, self.reps = shape, batch, list(contexts), dtype, reps
        self.problems = [make_problem([c] * batch, shape.heads_q, shape.heads_kv, shape.head_size, dtype,
                                      seed=batch + c) for c in self.contexts]
        self.check_rows = check_rows
        self.refs = [reference(p, check_rows) for p in self.problems]
        self.outs = [[torch.empty_like(p.query) for _ in range(2)] for p in self.problems]
        self.bytes = sum(kv_bytes(p) for p in self.problems)
        self.tolerance = TOLERANCE[dtype]
        self.between = between_traffic(between_mib, "cuda")
        self.tokens = batch
        self.tune_key = f"attention:{dtype}:D{shape.head_size}:G{shape.heads_q // shape.heads_kv}:bs16"
        self.label = f"{shape.name} batch {batch} contexts {','.join(map(str, self.contexts))}"

    def forget_plans(self) -> None:
        ops.forget_plans()

    def check(self) -> float:
        err = 0.0
        for p, ref in zip(self.problems, self.refs):
            ok, _ = ops.supports(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, None, p.scale)
            if not ok:
                return float("inf")
            out = torch.full_like(p.query, float("nan"))
            run_ours(p, out)
            err = max(err, rel_err(out[: self.check_rows], ref))
        return err

    def times(self) -> list[float]:
        out = []
        for p, outs in zip(self.problems, self.outs):
            out.append(timed_calls(lambda i, _w, p=p, outs=outs: run_ours(p, outs[i]), [(0, None), (1, None)],
                                   self.between, self.reps, cross_check=False)[0])
        return out

    def time(self) -> float:
        ts = self.times()
        return math.exp(sum(math.log(t) for t in ts) / len(ts))


IMPLS = ("opgraft", *BASELINES)


PROLOGUE_IMPLS = ("opgraft-fused", "norm-rope+opgraft", "vllm-qk-norm-rope+opgraft")


def vllm_fused_qk_norm_rope():
    """vLLM's q/k norm + rope CUDA op through its Python wrapper, whose import loads vllm._C (the op
    is not registered under torch.ops._C before that); None where vLLM is not importable."""
    try:
        from vllm._custom_ops import fused_qk_norm_rope
    except Exception:
        return None
    return fused_qk_norm_rope


def _compiled_prologue():
    """vLLM's q/k RMSNorm and rotary embedding as its compiled model runs them: the functions
    traced by Inductor (Dynamo's caches reset first)."""
    torch._dynamo.reset()

    def both(q, k, pro):
        return qk_prologue_torch(q, pro.q_norm_weight, pro), qk_prologue_torch(k, pro.k_norm_weight, pro)

    return torch.compile(both, fullgraph=True, dynamic=False)


def bench_prologue_point(shape: AttnShape, batch: int, context: int, dtype: str = "bf16",
                         ceiling_tbps: float | None = None, reps: int = 20, between_mib: int = BETWEEN_MIB,
                         impls=PROLOGUE_IMPLS, progress=None) -> list[dict]:
    """Rows for a decode step's q/k RMSNorm, rotary embedding, KV-cache write and attention (Qwen3's
    attention: norm weights, NeoX, positions L-1) from the qkv projection's output: our kernel doing
    all of it (opgraft-fused) against the compiled norm + rotary followed by our kernel with the
    cache write (norm-rope+opgraft, what the engine runs without the fusion), and vLLM's
    fused_qk_norm_rope CUDA op followed by ours (vllm-qk-norm-rope+opgraft, vLLM's
    enable_qk_norm_rope_fusion). Each is checked against fp64 attention over torch's normalized
    and rotated query and the cache as it wrote it, then timed from its kernels' start to end."""
    if progress:
        progress(f"{shape.name} batch={batch} context={context} with q/k norm + rotary")
    dt = TORCH_DTYPES[dtype]
    p = make_problem([context] * batch, shape.heads_q, shape.heads_kv, shape.head_size, dtype, seed=batch + context)
    Hq, Hk, D = shape.heads_q, shape.heads_kv, shape.head_size
    g = torch.Generator(device="cuda").manual_seed(11)
    qkv = torch.randn((batch, (Hq + 2 * Hk) * D), generator=g, device="cuda").to(dt)
    views = lambda t: (t[:, :Hq * D].view(batch, Hq, D), t[:, Hq * D:(Hq + Hk) * D].view(batch, Hk, D),
                       t[:, (Hq + Hk) * D:].view(batch, Hk, D))
    bs = p.key_cache.shape[1]
    last = context - 1
    slots = torch.tensor([int(p.block_table[b, last // bs]) * bs + last % bs for b in range(batch)],
                         dtype=torch.int64, device="cuda")
    pro = make_prologue(dt, D, batch, "cuda")
    pro.positions.fill_(last)
    q0, k0, v0 = views(qkv)
    q_t = qk_prologue_torch(q0, pro.q_norm_weight, pro)
    k_t = qk_prologue_torch(k0, pro.k_norm_weight, pro).float()
    stored = lambda: p.key_cache[slots // bs, slots % bs].float()  # [batch, Hk, D] the written keys
    nbytes = kv_bytes(p)
    between = between_traffic(between_mib, "cuda")
    base = {**run_facts(), "op": "attention", "model": shape.name, "dtype": dtype, "batch": batch, "context": context,
            "heads_q": Hq, "heads_kv": Hk, "head_size": D, "block_size": bs, "bytes": nbytes,
            "between_mib": max(between_mib, 0), "ceiling_tbps": round(ceiling_tbps, 3) if ceiling_tbps else None,
            "prologue": "qk_norm+neox", "baseline": "norm-rope+opgraft"}
    compiled = _compiled_prologue()
    bufs = [qkv.clone() for _ in range(2)]  # vLLM's op rewrites its buffer: one a timed call
    buf_views = [views(b) for b in bufs]
    rows = []
    for impl in impls:
        row = dict(base, impl=impl)
        fn, why = None, ""
        if impl == "opgraft-fused":
            ok, why = ops.supports(q0, p.key_cache, p.value_cache, p.block_table, p.seq_lens, None, p.scale,
                                   key=k0, value=v0, slot_mapping=slots, pro=pro)
            if ok:
                def fn(out, i):
                    ops.attention_decode_into(out, q0, p.key_cache, p.value_cache, p.block_table, p.seq_lens, p.scale,
                                              key=k0, value=v0, slot_mapping=slots, pro=pro)
            why = "" if ok else f"guard: {why}"
        elif impl == "norm-rope+opgraft":
            def fn(out, i):
                qn, kn = compiled(q0, k0, pro)
                ops.attention_decode_into(out, qn, p.key_cache, p.value_cache, p.block_table, p.seq_lens, p.scale,
                                          key=kn, value=v0, slot_mapping=slots)
        elif impl == "vllm-qk-norm-rope+opgraft":
            op = vllm_fused_qk_norm_rope()
            if op is None:
                why = "vllm._custom_ops.fused_qk_norm_rope is not importable (vLLM and its _C)"
            else:
                def fn(out, i):
                    op(bufs[i], Hq, Hk, Hk, D, pro.eps, pro.q_norm_weight, pro.k_norm_weight, pro.cos_sin_cache, True,
                       pro.positions)
                    q, k, v = buf_views[i]
                    ops.attention_decode_into(out, q, p.key_cache, p.value_cache, p.block_table, p.seq_lens, p.scale,
                                              key=k, value=v, slot_mapping=slots)
        else:
            why = f"unknown implementation {impl}"
        if fn is None:
            rows.append(dict(row, median_us=None, missing=why))
            continue
        outs = [torch.full_like(p.query, float("nan")) for _ in range(2)]
        try:
            for b in bufs:
                b.copy_(qkv)
            fn(outs[0], 0)
            torch.cuda.synchronize()
            err = rel_err(outs[0], reference(dataclasses.replace(p, query=q_t)))
            kerr = float(((stored() - k_t).abs().amax(-1) / k_t.abs().amax(-1).clamp_min(1e-6)).max())  # a head's
            bufs[0].copy_(qkv)
            fn(outs[1], 0)
            torch.cuda.synchronize()
            det = bool(torch.equal(outs[0], outs[1]))
            us, how = timed_calls(lambda i, _w: fn(outs[i], i), [(0, None), (1, None)], between, reps, "span")
        except Exception as e:  # report, do not hide: the row says why it is missing
            rows.append(dict(row, median_us=None, missing=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        rows.append(dict(row, **speed(nbytes, us, ceiling_tbps), rel_err=float(f"{err:.3g}"),
                         stored_key_rel_err=float(f"{kerr:.3g}"), tolerance=TOLERANCE[dtype], deterministic=det,
                         **how))
    del p, bufs
    torch.cuda.empty_cache()
    return rows


PROLOGUE_ALONE_IMPLS = ("opgraft-prologue", "inductor-norm-rope", "vllm-cat-fused")


def bench_prologue_alone(shape: AttnShape, rows: int, dtype: str = "bf16", ceiling_tbps: float | None = None,
                         reps: int = 20, between_mib: int = BETWEEN_MIB, impls=PROLOGUE_ALONE_IMPLS,
                         progress=None) -> list[dict]:
    """Rows for the q/k RMSNorm and rotary embedding alone on `rows` token rows (a prefill's, from
    the qkv projection's output, Qwen3's norm and NeoX at random positions): our kernel
    (opgraft-prologue, ops.attention.qk_prologue) against what a stock prefill runs (the
    functions compiled by Inductor, inductor-norm-rope, the baseline) and what the prologue seam's
    hand-back ran before ABI 13 (a copy of q|k|v and vLLM's fused_qk_norm_rope on it,
    vllm-cat-fused). Bytes: q and k read once and written once. `batch` holds the rows, `context` 0."""
    if progress:
        progress(f"{shape.name} q/k norm + rotary alone on {rows} rows")
    Hq, Hk, D = shape.heads_q, shape.heads_kv, shape.head_size
    qkv, pro = prologue_rows(rows, Hq, Hk, D, TORCH_DTYPES[dtype], "cuda", seed=rows)
    q, k, v = qkv[:, :Hq * D], qkv[:, Hq * D:(Hq + Hk) * D], qkv[:, (Hq + Hk) * D:]
    q3, k3 = q.view(rows, Hq, D), k.view(rows, Hk, D)
    want = (qk_prologue_torch(q3, pro.q_norm_weight, pro), qk_prologue_torch(k3, pro.k_norm_weight, pro))
    nbytes = 2 * rows * (Hq + Hk) * D * qkv.element_size()
    between = between_traffic(between_mib, "cuda")
    base = {**run_facts(), "op": "attention", "model": shape.name, "dtype": dtype, "batch": rows, "context": 0,
            "heads_q": Hq, "heads_kv": Hk, "head_size": D, "between_mib": max(between_mib, 0),
            "prologue": "qk_norm+neox alone", "baseline": "inductor-norm-rope"}
    out = []
    for impl in impls:
        row = dict(base, impl=impl)
        fn, why = None, ""
        if impl == "opgraft-prologue":
            def fn():
                return ops.qk_prologue(q3, k3, pro)
        elif impl == "inductor-norm-rope":
            compiled = _compiled_prologue()

            def fn():
                return compiled(q3, k3, pro)
        elif impl == "vllm-cat-fused":
            op = vllm_fused_qk_norm_rope()
            if op is None:
                why = "vllm._custom_ops.fused_qk_norm_rope is not importable (vLLM and its _C)"
            else:
                def fn():
                    buf = torch.cat((q, k, v), dim=-1)
                    op(buf, Hq, Hk, Hk, D, pro.eps, pro.q_norm_weight, pro.k_norm_weight, pro.cos_sin_cache, True,
                       pro.positions)
                    return buf[:, :Hq * D].view(rows, Hq, D), buf[:, Hq * D:(Hq + Hk) * D].view(rows, Hk, D)
        else:
            why = f"unknown implementation {impl}"
        if fn is None:
            out.append(dict(row, median_us=None, missing=why))
            continue
        try:
            got = fn()
            again = fn()
            torch.cuda.synchronize()
            err = max(rel_err(got[0], want[0]), rel_err(got[1], want[1]))
            det = bool(torch.equal(got[0], again[0]) and torch.equal(got[1], again[1]))
            us, how = timed_calls(lambda i, _w: fn(), [(0, None), (1, None)], between, reps, "span")
        except Exception as e:  # report, do not hide: the row says why it is missing
            out.append(dict(row, median_us=None, missing=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        out.append(dict(row, **speed(nbytes, us, ceiling_tbps), rel_err=float(f"{err:.3g}"), tolerance=TOLERANCE[dtype],
                        deterministic=det, **how))
    return out


def bench_rows(ceiling_tbps: float, points=DEFAULT_POINTS, dtype: str = "bf16", reps: int = 20,
               between_mib: int = BETWEEN_MIB, hint: int = 0, impls=IMPLS, progress=print,
               shapes=PRESETS, prologue: bool = False) -> list[dict]:
    """Rows for (shape name, batch, context) points; shapes maps the names to their heads. With
    prologue, bench_prologue_point's (impls from PROLOGUE_IMPLS)."""
    rows = []
    for name, batch, context in points:
        if prologue:
            rows += bench_prologue_point(shapes[name], batch, context, dtype, ceiling_tbps, reps, between_mib,
                                         impls=impls, progress=lambda m: progress("  bench " + m))
            continue
        rows += bench_point(shapes[name], batch, context, dtype, ceiling_tbps, reps, between_mib, impls=impls,
                            hint=hint, progress=lambda m: progress("  bench " + m))
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows' table; the speedup column is against the row's baseline (vLLM's FA3, or for the
    q/k norm + rotary rows the compiled norm + rotary followed by our kernel)."""
    head = (f"{'model':<14} {'batch':>5} {'ctx':>6} {'impl':<25} {'us':>9} {'MB':>8} {'TB/s':>6} {'ceil%':>6} "
            f"{'xbase':>6} {'relerr':>8}  note")
    lines = [head, "-" * len(head)]
    base = {(r["model"], r["batch"], r["context"], r["impl"]): r["median_us"] for r in rows if r.get("median_us")}
    for r in rows:
        key = (r["model"], r["batch"], r["context"], r.get("baseline", "vllm-fa3"))
        if r.get("median_us") is None:
            lines.append(f"{r['model']:<14} {r['batch']:>5} {r['context']:>6} {r['impl']:<25} {'-':>9}  "
                         f"{r.get('missing', '')}")
            continue
        sp = base.get(key, 0) / r["median_us"] if base.get(key) else 0
        lines.append(f"{r['model']:<14} {r['batch']:>5} {r['context']:>6} {r['impl']:<25} {r['median_us']:>9.1f} "
                     f"{r['bytes'] / 1e6:>8.1f} {r['tbps']:>6.2f} {(r.get('fraction_of_ceiling') or 0) * 100:>5.1f}% "
                     f"{sp:>6.2f} {r['rel_err']:>8.1e}  {'' if r.get('deterministic') else 'NOT bit-identical'}")
    return "\n".join(lines)
