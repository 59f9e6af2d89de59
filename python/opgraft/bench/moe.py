"""The MoE experts bench: opgraft's kernel against vLLM's own fused_experts (and a plain-torch
baseline) and an fp64 reference at a model's real dims, with the read ceiling of the same run.

Each replay makes one call per routing of a rotating set of random routings, so consecutive calls
touch different experts; with more than one layer (`opgraft bench moe --layers N`) the calls also
rotate over that many copies of the layer's weights, as a model's MoE layers do (48 layers x 0.6
GB for Qwen3-30B-A3B: address translation and DRAM page locality as in a real step).
"""

from __future__ import annotations

import functools
import importlib
import os
import statistics
from dataclasses import dataclass, field

import torch

from ..ops import moe as ops
from ..presets import MoeShape
from . import BETWEEN_MIB, TOLERANCE, between_traffic, rel_err, run_facts, speed, timed_calls
from . import configure as _configure
from . import tunables as _tunables


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# ‖out − ref‖ / ‖ref‖ limits against the fp64 oracle: bf16 keeps 8 significant bits, fp16 11.
@dataclass
class Problem:
    shape: MoeShape
    dtype: str
    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    routings: list = field(default_factory=list)  # [(topk_weights fp32, topk_ids int32)]


def make_weights(shape: MoeShape, dtype: str, device, seed: int = 0):
    """Random normal weights, std 1/sqrt(fan_in) so every stage stays O(1); filled a few experts at
    a time so the fp32 draws never need the whole model's size."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    E, H, I = shape.num_experts, shape.hidden, shape.inter
    w13 = torch.empty((E, 2 * I, H), dtype=dt, device=device)
    w2 = torch.empty((E, H, I), dtype=dt, device=device)
    step = max(1, (256 << 20) // (3 * I * H * 4))
    for e in range(0, E, step):
        n = min(step, E - e)
        w13[e:e + n] = torch.randn((n, 2 * I, H), generator=g, device=device).mul_(H ** -0.5)
        w2[e:e + n] = torch.randn((n, H, I), generator=g, device=device).mul_(I ** -0.5)
    return w13, w2


def make_routing(T: int, E: int, k: int, device, gen: torch.Generator, ids_dtype=torch.int32):
    """k distinct experts per token and softmax-normalised fp32 weights, like a top-k router."""
    scores = torch.rand((T, E), generator=gen, device=device)
    ids = scores.topk(k, dim=1).indices.to(ids_dtype)
    logits = torch.randn((T, k), generator=gen, device=device)
    return torch.softmax(logits, dim=1).float(), ids


def make_x(T: int, H: int, dtype: str, device, gen: torch.Generator):
    return torch.randn((T, H), generator=gen, device=device, dtype=torch.float32).to(TORCH_DTYPES[dtype])


def reference(x, w13, w2, tw, ids, apply_router_weight_on_input=False) -> torch.Tensor:
    """fp64 oracle on the tensors' device, expert by expert."""
    T, H = x.shape
    I = w2.shape[2]
    E = w13.shape[0]
    out = torch.zeros((T, H), dtype=torch.float64, device=x.device)
    xd = x.double()
    idl = ids.long()
    for e in torch.unique(idl).tolist():
        if e < 0 or e >= E:
            continue
        t_idx, j_idx = (idl == e).nonzero(as_tuple=True)
        w = tw[t_idx, j_idx].double()
        xin = xd[t_idx] * (w[:, None] if apply_router_weight_on_input else 1.0)
        h = xin @ w13[e].double().T
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        y = a @ w2[e].double().T
        out.index_add_(0, t_idx, y * (1.0 if apply_router_weight_on_input else w[:, None]))
    return out


def torch_baseline(x, w13, w2, tw, ids):
    """Plain-torch experts (gather the routed experts' weights, batched matmuls): graph-capturable."""
    T, H = x.shape
    k = ids.shape[1]
    I = w2.shape[2]
    flat = ids.reshape(-1).long()
    xs = x.repeat_interleave(k, dim=0).unsqueeze(2)  # [T*k, H, 1]
    h = torch.bmm(w13[flat], xs)  # [T*k, 2I, 1]
    a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    y = torch.bmm(w2[flat], a).view(T, k, H)
    return (y * tw.to(y.dtype).unsqueeze(2)).sum(1)


def vllm_builtin():
    """vLLM's own experts path, (fn, "") when vLLM is importable here, else (None, why not).

    fn(x, w13, w2, topk_weights, topk_ids) is vLLM's functional `fused_experts` (the Triton path
    with its align/sort step), so the time includes everything vLLM does after routing."""
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    except Exception as e:
        return None, f"vLLM is not importable here ({type(e).__name__}: {str(e)[:80]})"
    return (lambda x, w13, w2, tw, ids: fused_experts(x, w13, w2, tw, ids)), ""


def measure_whole_token_range() -> None:
    """Lets the kernel take every token count it supports in this process (unless the caller set
    the threshold): measuring it is separate from the shipped delegation threshold
    (moe.max_tokens), which comes from end-to-end runs."""
    os.environ.setdefault("OPGRAFT_TUNE_MOE_MAX_TOKENS", "64")


def unique_expert_bytes(shape: MoeShape, routings, elem_bytes: int = 2) -> float:
    """Mean over the routings of the bytes that must move: each used expert's weights once."""
    counts = [int(torch.unique(ids[(ids >= 0) & (ids < shape.num_experts)]).numel()) for _, ids in routings]
    return statistics.mean(counts) * shape.expert_bytes(elem_bytes)


def bench_shape(shape: MoeShape, tokens: list[int], dtype: str = "bf16", device="cuda", n_routings: int = 16,
                reps: int = 30, ceiling_tbps: float | None = None, baseline: bool = True, progress=None,
                w13=None, w2=None, extra_layers=(), between_mib: int = BETWEEN_MIB,
                timing: str = "span") -> list[dict]:
    """Rows for one model shape at each token count: opgraft, the torch baseline, checked vs fp64.
    extra_layers: more (w13, w2) copies; the timed calls rotate over (w13, w2) and these, as a
    model's layers do. Correctness is checked on (w13, w2).
    between_mib: before each timed call, read this many MiB of other data (0: calls back to back);
    see `between_traffic`.
    timing: with traffic, "span" charges each call from its kernels' own start/end times
    (`time_calls_span`; the subtraction's figure is kept as median_us_subtract), "subtract" takes
    (traffic + call) minus traffic alone."""
    if timing not in ("span", "subtract"):
        raise ValueError(f"timing must be 'span' or 'subtract', not {timing!r}")
    if w13 is None:
        w13, w2 = make_weights(shape, dtype, device)
    weights = [(w13, w2), *extra_layers]
    L = len(weights)
    gen = torch.Generator(device=device).manual_seed(1234)
    between = between_traffic(between_mib, device)

    def timed(fn, schedule, n_reps):
        return timed_calls(fn, schedule, between, n_reps, timing)

    base = {**run_facts(), "op": "moe", "model": shape.name, "E": shape.num_experts, "H": shape.hidden, "I": shape.inter, "top_k": shape.top_k,
            "dtype": dtype, "layers": L, "between_mib": max(between_mib, 0)}
    rows = []
    for T in tokens:
        if progress:
            progress(f"{shape.name} T={T}")
        xs = [make_x(T, shape.hidden, dtype, device, gen) for _ in range(n_routings)]
        routings = [make_routing(T, shape.num_experts, shape.top_k, device, gen) for _ in range(n_routings)]
        nbytes = unique_expert_bytes(shape, routings)
        # call c: routing c % n_routings on layer c % L
        schedule = [(c % n_routings, weights[c % L]) for c in range(max(n_routings, L))]
        ok, reason = ops.moe_supports(xs[0], w13, w2, *routings[0])
        results = {}
        # Correctness first: fresh inputs, poisoned outputs, against the fp64 oracle.
        ref = reference(xs[0], w13, w2, *routings[0])
        if ok:
            out = torch.full((T, shape.hidden), float("nan"), dtype=xs[0].dtype, device=device)
            ops.moe_experts_into(out, xs[0], w13, w2, *routings[0])
            err = rel_err(out, ref)
            again = torch.full_like(out, float("nan"))
            ops.moe_experts_into(again, xs[0], w13, w2, *routings[0])
            deterministic = bool(torch.equal(out, again))
            outs = [torch.empty_like(out) for _ in range(n_routings)]
            ws = torch.empty(1 << 24, dtype=torch.uint8, device=device)

            def call(i, w):
                ops.moe_experts_into(outs[i], xs[i], *w, *routings[i], workspace=ws)

            us, how = timed(call, schedule, reps)
            results["opgraft"] = (us, err, {"deterministic": deterministic, **how})
        builtin, builtin_why = vllm_builtin()
        if builtin is not None:
            try:
                vout = builtin(xs[0], w13, w2, *routings[0])
                verr = rel_err(vout, ref)

                def vcall(i, w):
                    builtin(xs[i], *w, *routings[i])

                us, how = timed(vcall, schedule, reps)
                results["vllm-builtin"] = (us, verr, how)
            except Exception as e:  # report, do not hide: the column says why it is missing
                builtin_why = f"vLLM's fused_experts failed here ({type(e).__name__}: {str(e)[:80]})"
        gathered = T * shape.top_k * shape.expert_bytes()
        if baseline and gathered <= (6 << 30):
            bout = torch_baseline(xs[0], w13, w2, *routings[0])
            berr = rel_err(bout, ref)

            def bcall(i, w):
                torch_baseline(xs[i], *w, *routings[i])

            us, how = timed(bcall, schedule, max(5, reps // 3))
            results["torch-gather-bmm"] = (us, berr, how)
        base_impl = "vllm-builtin" if "vllm-builtin" in results else "torch-gather-bmm"
        base_us = results.get(base_impl, (None,))[0]
        for impl, (us, err, extra) in results.items():
            row = dict(base, tokens=T, impl=impl, **speed(nbytes, us, ceiling_tbps),
                       baseline_impl=base_impl if base_us else None, builtin_missing=builtin_why or None,
                       speedup_vs_baseline=round(base_us / us, 2) if base_us else None, rel_err=float(f"{err:.3g}"),
                       tolerance=TOLERANCE[dtype], guard="take" if ok else f"delegate: {reason}")
            row.update(extra)
            rows.append(row)
        if not ok:
            rows.append(dict(base, tokens=T, impl="opgraft", median_us=None, bytes=int(nbytes),
                             guard=f"delegate: {reason}"))
    return rows


def format_table(rows: list[dict]) -> str:
    w = max([16] + [len(str(r["model"])) for r in rows])  # a long model name widens the column
    head = (f"{'model':<{w}} {'dt':<4} {'T':>3} {'impl':<17} {'us':>9} {'MB':>8} {'TB/s':>6} {'ceil%':>6} "
            f"{'xbase':>6} {'relerr':>8}  decision")
    lines = [head, "-" * len(head)]
    missing = sorted({r["builtin_missing"] for r in rows if r.get("builtin_missing")})
    for m in missing:
        fp8 = any(r.get("dtype") in FP8_KINDS and r.get("builtin_missing") == m for r in rows)
        lines.insert(0, f"vLLM {'FP8 backends' if fp8 else 'builtin column'} missing: {m}" +
                     ("" if fp8 else "; speedups are against torch-gather-bmm"))
    for r in rows:
        if r.get("median_us") is None:
            lines.append(f"{r['model']:<{w}} {r['dtype']:<4} {r['tokens']:>3} {r['impl']:<17} {r.get('guard', '')}")
            continue
        frac = r.get("fraction_of_ceiling")
        sp = r.get("speedup_vs_baseline")
        # FP8 rows: vLLM's own error vs the oracle next to ours, and ours vs vLLM's result
        extra = ""
        if r.get("vllm_rel_err") is not None and r["impl"].startswith("opgraft"):
            extra = f" (vLLM's err {r['vllm_rel_err']:.1e}, vs vLLM {r.get('rel_err_vs_vllm') or 0:.1e})"
        lines.append(
            f"{r['model']:<{w}} {r['dtype']:<4} {r['tokens']:>3} {r['impl']:<17} {r['median_us']:>9.1f} "
            f"{r['bytes'] / 1e6:>8.1f} {r['tbps']:>6.2f} {(frac or 0) * 100:>5.1f}% "
            f"{(sp if sp else 0):>6.2f} {r['rel_err']:>8.1e}  "
            f"{(r.get('guard') or '') if r['impl'] == 'opgraft' else ''}{extra}")
    return "\n".join(lines)


def configure(cfg: dict) -> None:
    """bench.configure for the MoE op: exactly cfg's tunables, its plans re-made."""
    _configure(cfg, ops.forget_plans)


class Fixture:
    """Weights, routings and buffers of one (shape, T, dtype), for the tuner, profile and sweeps."""

    def __init__(self, shape, T, dtype="bf16", n_routings=16, w13=None, w2=None):
        self.shape, self.T, self.dtype = shape, T, dtype
        measure_whole_token_range()
        if w13 is None:
            w13, w2 = make_weights(shape, dtype, "cuda")
        self.w13, self.w2 = w13, w2
        gen = torch.Generator(device="cuda").manual_seed(77 + T)
        self.xs = [make_x(T, shape.hidden, dtype, "cuda", gen) for _ in range(n_routings)]
        self.routings = [make_routing(T, shape.num_experts, shape.top_k, "cuda", gen) for _ in range(n_routings)]
        self.outs = [torch.empty_like(x) for x in self.xs]
        self.scales = [None] * n_routings  # FP8 scales a call (Fp8Fixture)
        self.ws = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
        self.ref = reference(self.xs[0], w13, w2, *self.routings[0])
        self.bytes = unique_expert_bytes(shape, self.routings)
        self.tolerance = TOLERANCE[dtype]
        self.tokens, self.tune_key, self.label = T, shape.tune_key(dtype), f"{shape.name} {dtype} T={T}"
        # Timed as the bench times: other data read before each call.
        self.between = between_traffic(BETWEEN_MIB, "cuda")

    def forget_plans(self) -> None:
        ops.forget_plans()

    def check(self) -> float:
        out = torch.full_like(self.outs[0], float("nan"))
        ops.moe_experts_into(out, self.xs[0], self.w13, self.w2, *self.routings[0], workspace=self.ws,
                             fp8=self.scales[0])
        return rel_err(out, self.ref)

    def time(self, stages=ops.STAGE_ALL, reps=30) -> float:
        def call(i, _):
            ops.moe_experts_into(self.outs[i], self.xs[i], self.w13, self.w2, *self.routings[i],
                                 workspace=self.ws, stages=stages, fp8=self.scales[i])

        return timed_calls(call, [(i, None) for i in range(len(self.xs))], self.between, reps, cross_check=False)[0]


def measure(fx: Fixture, cfg: dict, stages_all=True) -> dict:
    """One configuration checked against the fp64 oracle, then timed (both stages, and each alone)."""
    configure(cfg)
    err = fx.check()
    r = {"config": dict(cfg), "rel_err": err, "ok": err <= fx.tolerance}
    if not r["ok"]:
        return r
    r["all_us"] = fx.time(ops.STAGE_ALL)
    if stages_all:
        r["gate_up_us"] = fx.time(ops.STAGE_GATE_UP)
        r["down_us"] = fx.time(ops.STAGE_DOWN)
    return r


class tunables(_tunables):
    """bench.tunables for the MoE op."""

    def __init__(self, cfg: dict):
        super().__init__(cfg, ops.forget_plans)


# ---- FP8 weights ------------------------------------------------------------------------------
#
# The FP8 bench and checks: weights block- or per-tensor-quantized from the random bf16 weights
# above with vLLM's own quantization where it imports (vllm.utils.deep_gemm.per_block_cast_to_fp8
# for 128x128 blocks, scaled_fp8_quant per tensor), else with the same math in torch; activations
# quantized as vLLM's prepare step does (per_token_group_quant_fp8 in 1 x block_k groups, or one
# dynamic per-tensor scale). So the scales have a checkpoint's ranges (weights ~1e-4 a block).

FP8_KINDS = ("fp8-block", "fp8-tensor")
FP8_MAX = 448.0
FP8_BLOCK = (128, 128)
X16_GROUP = 128  # the k of gate_up's own activation groups with per-tensor scales (OG_MOE_X_GROUP)


def kernel_group(block_shape) -> int:
    """The k of the groups gate_up quantizes 16-bit hidden states in: the weight blocks' k, or
    X16_GROUP with per-tensor scales (block_shape None)."""
    return X16_GROUP if block_shape is None else int(block_shape[1])


def _vllm_attr(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:
        return None


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (already scaled into range) to e4m3fn, rounded to nearest even; torch makes NaN of
    values past the largest rounding boundary, so clamp first."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_as_the_kernel(x: torch.Tensor, block_k: int):
    """x [T, H] quantized per token and 1 x block_k group as gate_up does with 16-bit hidden states
    (og_fp8.cuh): amax in fp32 floored at 1e-10, q = e4m3(x * (448 / amax)), scale amax / 448."""
    T, H = x.shape
    g = x.float().view(T, H // block_k, block_k)
    amax = g.abs().amax(dim=2, keepdim=True).clamp_min(1e-10)
    # Both quotients as divisions of tensors: on CUDA torch computes scalar / tensor and tensor /
    # scalar as a reciprocal times the other, an ulp off the kernel's IEEE quotients (448 / amax
    # moves the many exact ties of bf16 ratios; amax / 448 the group's scale)
    c = torch.full_like(amax, 448.0)
    return _to_e4m3(g * (c / amax)).view(T, H), (amax / c).view(T, -1).contiguous()


def block_quantize(w: torch.Tensor, block=FP8_BLOCK):
    """One matrix [N, K] to e4m3 with one fp32 scale per block (amax / 448, amax at least 1e-4):
    (q [N, K], s [ceil(N/bn), ceil(K/bk)]), by vLLM's per_block_cast_to_fp8 where it imports."""
    fn = _vllm_attr("vllm.utils.deep_gemm", "per_block_cast_to_fp8")
    if fn is not None:
        try:
            q, s = fn(w, list(block), use_ue8m0=False)
            return q, s.float()
        except Exception:
            pass
    bn, bk = block
    N, K = w.shape
    pn, pk = -(-N // bn) * bn, -(-K // bk) * bk
    pad = torch.zeros((pn, pk), dtype=torch.float32, device=w.device)
    pad[:N, :K] = w.float()
    v = pad.view(pn // bn, bn, pk // bk, bk)
    s = v.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-4) / FP8_MAX
    q = _to_e4m3(v * (1.0 / s)).view(pn, pk)[:N, :K].contiguous()
    return q, s.view(pn // bn, pk // bk)


def tensor_quantize(w: torch.Tensor):
    """One matrix to e4m3 with one scale (amax / 448): (q, s [1]), by vLLM's scaled_fp8_quant
    where it runs (its CUDA op), else in torch."""
    fn = _vllm_attr("vllm._custom_ops", "scaled_fp8_quant")
    if fn is not None and w.is_cuda:
        try:
            q, s = fn(w.reshape(-1, w.shape[-1]).contiguous())
            return q.view(w.shape), s.float().view(1)
        except Exception:
            pass
    s = (w.abs().amax().float().clamp_min(1e-12) / FP8_MAX).view(1)
    return _to_e4m3(w.float() / s), s


def quantize_weights_fp8(w13: torch.Tensor, w2: torch.Tensor, kind: str, block=FP8_BLOCK):
    """bf16 w13 [E, 2I, H], w2 [E, H, I] to FP8 with scales in vLLM's layouts: block, each half
    of w13 quantized on its own (ceil(I/bn) row blocks each, the gate's first); per-tensor, one
    scale per expert for w13 (vLLM's max over w1 and w3, both halves requantized with it) and one
    for w2. Returns (w13_q, w13_scale, w2_q, w2_scale)."""
    E, I2, H = w13.shape
    I = I2 // 2
    q13 = torch.empty(w13.shape, dtype=torch.float8_e4m3fn, device=w13.device)
    q2 = torch.empty(w2.shape, dtype=torch.float8_e4m3fn, device=w2.device)
    if kind == "fp8-block":
        bn, bk = block
        nbi = -(-I // bn)
        s13 = torch.empty((E, 2 * nbi, -(-H // bk)), dtype=torch.float32, device=w13.device)
        s2 = torch.empty((E, -(-H // bn), -(-I // bk)), dtype=torch.float32, device=w2.device)
        for e in range(E):
            for half in range(2):
                q, s = block_quantize(w13[e, half * I:(half + 1) * I], block)
                q13[e, half * I:(half + 1) * I], s13[e, half * nbi:(half + 1) * nbi] = q, s
            q2[e], s2[e] = block_quantize(w2[e], block)
        return q13, s13, q2, s2
    s13 = torch.empty((E,), dtype=torch.float32, device=w13.device)
    s2 = torch.empty((E,), dtype=torch.float32, device=w2.device)
    for e in range(E):
        q13[e], s = tensor_quantize(w13[e])
        s13[e] = s[0]
        q2[e], s = tensor_quantize(w2[e])
        s2[e] = s[0]
    return q13, s13, q2, s2


def quantize_activations_fp8(x: torch.Tensor, kind: str, block_k: int = FP8_BLOCK[1]):
    """x [T, H] as vLLM's prepare step quantizes it for TritonExperts: block, 1 x block_k groups
    with scale max(amax, 1e-10) / 448 (per_token_group_quant_fp8 where it runs, its row-major
    [T, H/block_k] scales); per-tensor, one dynamic scale (scaled_fp8_quant)."""
    if kind == "fp8-block":
        fn = _vllm_attr("vllm.model_executor.layers.quantization.utils.fp8_utils", "per_token_group_quant_fp8")
        if fn is not None and x.is_cuda:
            try:  # vLLM's default: UE8M0 (power-of-two) scales where DeepGEMM's E8M0 is in use
                q, s = fn(x, block_k)
                return q, s
            except Exception:
                pass
        T, H = x.shape
        g = x.float().view(T, -1, block_k)
        s = g.abs().amax(dim=2, keepdim=True).clamp_min(1e-10) / FP8_MAX
        return _to_e4m3(g / s).view(T, H), s.view(T, -1).contiguous()
    return tensor_quantize(x)


def make_weights_fp8(shape: MoeShape, kind: str, device, seed: int = 0, block=FP8_BLOCK):
    """make_weights' random bf16 experts quantized to FP8 a few experts at a time (the bf16 copy of
    the whole model is never held): (w13_q, w13_scale, w2_q, w2_scale) in vLLM's layouts."""
    E, H, I = shape.num_experts, shape.hidden, shape.inter
    q13 = torch.empty((E, 2 * I, H), dtype=torch.float8_e4m3fn, device=device)
    q2 = torch.empty((E, H, I), dtype=torch.float8_e4m3fn, device=device)
    s13 = s2 = None
    step = max(1, (1 << 30) // (3 * I * H * 2))
    for e in range(0, E, step):
        n = min(step, E - e)
        part = MoeShape(shape.name, n, H, I, shape.top_k)
        w13, w2 = make_weights(part, "bf16", device, seed=seed * 100003 + e)
        a, b, c, d = quantize_weights_fp8(w13, w2, kind, block)
        if s13 is None:
            s13 = torch.empty((E, *b.shape[1:]), dtype=torch.float32, device=device)
            s2 = torch.empty((E, *d.shape[1:]), dtype=torch.float32, device=device)
        q13[e:e + n], s13[e:e + n], q2[e:e + n], s2[e:e + n] = a, b, c, d
        del w13, w2
    return q13, s13, q2, s2


def fp8_scales(kind: str, xs, s13, s2, block=FP8_BLOCK) -> ops.Fp8Scales:
    return ops.Fp8Scales(xs, s13, s2, tuple(block) if kind == "fp8-block" else None)


def dequantize_fp8(q: torch.Tensor, s: torch.Tensor, kind: str, block=None, halves: int = 1) -> torch.Tensor:
    """One expert's (or the activations') e4m3 matrix [N, K] times its scales, in fp64: block
    scales [ceil(N/bn), ceil(K/bk)] (halves 2: w13's two halves, each with its own row blocks),
    or one scale."""
    d = q.double()
    if kind != "fp8-block":
        return d * s.double().reshape(-1)[0]
    bn, bk = block
    N, K = q.shape
    n = N // halves
    nb = -(-n // bn)
    rows = torch.cat([torch.arange(n, device=q.device) // bn + h * nb for h in range(halves)])
    cols = torch.arange(K, device=q.device) // bk
    return d * s.double()[rows][:, cols]


def reference_fp8(x_q, fp8: ops.Fp8Scales, w13_q, w2_q, tw, ids) -> torch.Tensor:
    """fp64 oracle of the quantized model on the tensors' device, expert by expert: dequantized
    e4m3 activations and weights, the intermediate exact (the C oracle's math)."""
    kind = "fp8-block" if fp8.block_shape is not None else "fp8-tensor"
    T, H = x_q.shape
    E, I = w13_q.shape[0], w2_q.shape[2]
    if fp8.hidden_scale.numel() > 1:  # 1 x g groups (block scales, or the kernel's with per-tensor ones)
        x = dequantize_fp8(x_q, fp8.hidden_scale, "fp8-block", (1, H // fp8.hidden_scale.shape[-1]))
    else:
        x = dequantize_fp8(x_q, fp8.hidden_scale, kind)
    out = torch.zeros((T, H), dtype=torch.float64, device=x_q.device)
    idl = ids.long()
    per_half = fp8.w13_scale.dim() == 1 or fp8.w13_scale.numel() == E
    for e in torch.unique(idl).tolist():
        if e < 0 or e >= E:
            continue
        t_idx, j_idx = (idl == e).nonzero(as_tuple=True)
        w = tw[t_idx, j_idx].double()
        if kind == "fp8-block":
            g13 = dequantize_fp8(w13_q[e], fp8.w13_scale[e], kind, fp8.block_shape, halves=2)
            g2 = dequantize_fp8(w2_q[e], fp8.w2_scale[e], kind, fp8.block_shape)
        else:
            s13 = fp8.w13_scale.reshape(E, -1)
            g13 = torch.cat([dequantize_fp8(w13_q[e, :I], s13[e, 0], kind),
                             dequantize_fp8(w13_q[e, I:], s13[e, 0 if per_half else 1], kind)])
            g2 = dequantize_fp8(w2_q[e], fp8.w2_scale.reshape(-1)[e], kind)
        h = x[t_idx] @ g13.T
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        out.index_add_(0, t_idx, (a @ g2.T) * w[:, None])
    return out


def fp8_scale_bytes(shape: MoeShape, kind: str, block=FP8_BLOCK) -> int:
    """Bytes of one expert's weight scales."""
    if kind != "fp8-block":
        return 8
    bn, bk = block
    H, I = shape.hidden, shape.inter
    return 4 * (2 * -(-I // bn) * -(-H // bk) + -(-H // bn) * -(-I // bk))


def unique_expert_bytes_fp8(shape: MoeShape, kind: str, routings, local=None) -> float:
    """Mean over the routings of the bytes that must move: each used local expert's e4m3
    weights and their scales once. local: the expert_map ([global] -> local or -1), if any."""
    counts = []
    for _, ids in routings:
        ids = ids.long()
        if local is not None:
            ids = local[ids]
        counts.append(int(torch.unique(ids[(ids >= 0) & (ids < shape.num_experts)]).numel()))
    return statistics.mean(counts) * (shape.expert_bytes(1) + fp8_scale_bytes(shape, kind))


# FP8 against the fp64 oracle of the quantized model: ours measured 1.6-1.7e-3 (the intermediate
# in f16), vLLM's Triton path 2.7-3.4e-2 (H200, 2026-12-01); the checks' limit.
FP8_TOLERANCE = 1e-2


class Fp8Fixture(Fixture):
    """Fixture's FP8 counterpart for the tuner: e4m3 weights and activations of one (shape, T,
    kind), the activations quantized beforehand (the kernel's own time, as the seam calls it after
    vLLM's prepare step), checked against the fp64 oracle of the quantized model."""

    def __init__(self, shape, T, kind, n_routings=16, weights=None):
        self.shape, self.T, self.dtype = shape, T, kind
        measure_whole_token_range()
        os.environ.setdefault("OPGRAFT_TUNE_MOE_FP8", "1")  # the rule takes few tokens; tune every T
        if weights is None:
            weights = make_weights_fp8(shape, kind, "cuda")
        self.w13, s13, self.w2, s2 = weights
        gen = torch.Generator(device="cuda").manual_seed(77 + T)
        xs = [make_x(T, shape.hidden, "bf16", "cuda", gen) for _ in range(n_routings)]
        qx = [quantize_activations_fp8(x, kind) for x in xs]
        self.xs = [q for q, _ in qx]
        self.scales = [fp8_scales(kind, s, s13, s2) for _, s in qx]
        self.routings = [make_routing(T, shape.num_experts, shape.top_k, "cuda", gen) for _ in range(n_routings)]
        self.outs = [torch.empty((T, shape.hidden), dtype=torch.bfloat16, device="cuda") for _ in xs]
        self.ws = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
        self.ref = reference_fp8(self.xs[0], self.scales[0], self.w13, self.w2, *self.routings[0])
        self.bytes = unique_expert_bytes_fp8(shape, kind, self.routings)
        self.tolerance = FP8_TOLERANCE
        self.tokens, self.tune_key, self.label = T, shape.tune_key(kind.replace("-", "")), f"{shape.name} {kind} T={T}"
        self.between = between_traffic(BETWEEN_MIB, "cuda")


def _vllm_workspace(device) -> None:
    """vLLM's modular MoE kernel takes its scratch buffers from the workspace manager that each
    GPU worker creates (GPUModelRunner); outside an engine, this process makes it once."""
    try:
        from vllm.v1.worker import workspace
    except ImportError:  # a vLLM without one: its kernels allocate their own
        return
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device(device))


def flashinfer_block_weights(w13_q, w13_scale, w2_scale):
    """Block-FP8 weights as vLLM prepares them for FlashInfer's CUTLASS MoE
    (prepare_fp8_moe_layer_for_fi, not TRT-LLM): w13 and its scales with the gate and up halves
    swapped (FlashInfer takes [up; gate]) and every block scale at least 1e-10 (the kernel gives NaN
    for near-zero scales on sm_90). Copies; returns (w31, w31_scale, w2_scale)."""
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import swap_w13_to_w31

    return (swap_w13_to_w31(w13_q).contiguous(), swap_w13_to_w31(w13_scale).clamp(min=1e-10).contiguous(),
            w2_scale.clamp(min=1e-10))


# FlashInfer's CUTLASS MoE module generator for each compute capability (flashinfer.jit.fused_moe).
_FI_CUTLASS_MOE_GEN = {90: "sm90", 100: "sm100", 103: "sm103", 110: "sm100", 120: "sm120", 121: "sm120"}


@functools.cache
def flashinfer_cutlass_moe_built(device="cuda") -> bool | None:
    """Whether FlashInfer's CUTLASS MoE module for this GPU is compiled (ahead of time or in its JIT
    cache), so that its first call does not build it; None where this FlashInfer or GPU does not say.
    Once a process (the module's spec generates its CUTLASS sources)."""
    try:
        from flashinfer.jit import fused_moe as fi_jit

        major, minor = torch.cuda.get_device_capability(device)
        gen = getattr(fi_jit, f"gen_cutlass_fused_moe_{_FI_CUTLASS_MOE_GEN[10 * major + minor]}_module")
        return bool(gen().is_compiled)
    except Exception:
        return None


def vllm_fp8_experts(shape: MoeShape, kind: str, w13_q, w13_scale, w2_q, w2_scale, global_experts: int,
                     backend: str = "triton", device="cuda", flashinfer_build: bool = False):
    """vLLM's own FP8 MoE path as Fp8MoEMethod builds it for TritonExperts: the modular kernel
    (MoEPrepareAndFinalizeNoDPEPModular, which quantizes the bf16 activations, then
    TritonExperts.apply, then the finalize step) with the FP8 quant config of the scales.
    Returns (fn(x_bf16, topk_weights, topk_ids, expert_map) -> out, "") or (None, why not).
    backend "deep_gemm": TritonOrDeepGemmExperts on the weights converted as vLLM converts them
    for it (prepare_fp8_moe_layer_for_deepgemm: UE8M0 requantization where E8M0 is in use, its
    scale layout), where vLLM finds DeepGEMM (installed or vendored) and the GPU supports it; backend
    "flashinfer_cutlass": FlashInferExperts (block FP8 only) on the weights as vLLM prepares them for
    it (flashinfer_block_weights), taking the bf16 activations, where vLLM finds it usable and its
    module is built (FlashInfer compiles it on first use, for about 35 minutes on a 16-core H100 host:
    flashinfer_build lets that happen)."""
    try:
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                                RoutingMethodType, fp8_w8a8_moe_quant_config)
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
        from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular
    except Exception as e:
        return None, f"vLLM's modular FP8 MoE is not importable here ({type(e).__name__}: {str(e)[:80]})"
    from ..vllm import moe_seam

    if backend == "flashinfer_cutlass":
        if kind != "fp8-block":
            return None, ("FlashInfer's CUTLASS MoE takes per-tensor FP8 with static activation scales only; "
                          "these rows quantize the activations dynamically")
        if global_experts != shape.num_experts:
            return None, "FlashInfer's CUTLASS MoE takes expert parallelism as ranks (ep_rank, ep_size), not an expert map"
        try:
            from vllm.model_executor.layers.fused_moe.experts.flashinfer_cutlass_moe import FlashInferExperts
        except Exception as e:
            return None, f"FlashInferExperts is not importable here ({type(e).__name__}: {str(e)[:80]})"
        if not FlashInferExperts._supports_current_device():
            return None, "vLLM finds no usable FlashInfer CUTLASS MoE here (flashinfer's fused MoE on sm_90, 10x, 12x)"
        if not flashinfer_build and flashinfer_cutlass_moe_built(device) is False:
            return None, ("FlashInfer's CUTLASS MoE module is not built on this machine (its first call compiles it, "
                          "about 35 minutes on a 16-core H100 host); --flashinfer-build builds it")
    if backend != "flashinfer_cutlass" and moe_seam.installed():
        return None, "opgraft's seam is installed in this process (TritonExperts.apply would be ours)"
    try:
        _vllm_workspace(device)
        cfg = FusedMoEConfig(num_experts=global_experts, experts_per_token=shape.top_k, hidden_dim=shape.hidden,
                             intermediate_size=shape.inter, num_local_experts=shape.num_experts,
                             num_logical_experts=global_experts, activation=MoEActivation.SILU, device=device,
                             routing_method=RoutingMethodType.Renormalize,
                             moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16,
                             intermediate_size_per_partition=shape.inter)
        qc = fp8_w8a8_moe_quant_config(w1_scale=w13_scale, w2_scale=w2_scale,
                                       block_shape=list(FP8_BLOCK) if kind == "fp8-block" else None)
        w1, w2 = w13_q, w2_q
        if backend == "deep_gemm":
            if kind != "fp8-block":
                return None, "DeepGEMM takes block FP8 only"
            from vllm.utils.deep_gemm import is_deep_gemm_supported

            if not is_deep_gemm_supported():
                return None, "vLLM finds no usable DeepGEMM here (not installed or vendored, or not this GPU)"
            from vllm.model_executor.layers.fused_moe.experts.triton_deep_gemm_moe import TritonOrDeepGemmExperts
            from vllm.model_executor.layers.quantization.utils.fp8_utils import prepare_fp8_moe_layer_for_deepgemm

            w1, w2, s13, s2 = prepare_fp8_moe_layer_for_deepgemm(w13_q.clone(), w2_q.clone(), w13_scale.clone(),
                                                                  w2_scale.clone(), tuple(FP8_BLOCK))
            qc = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=list(FP8_BLOCK))
            experts = TritonOrDeepGemmExperts(cfg, qc)
        elif backend == "flashinfer_cutlass":  # bf16 activations in: the kernel quantizes them (1 x 128 groups)
            w1, s13, s2 = flashinfer_block_weights(w13_q, w13_scale, w2_scale)
            qc = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=list(FP8_BLOCK))
            experts = FlashInferExperts(cfg, qc)
        else:
            experts = TritonExperts(cfg, qc)
        kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
    except Exception as e:
        return None, f"vLLM's FP8 experts could not be built ({type(e).__name__}: {str(e)[:100]})"

    def fn(x, tw, ids, expert_map=None):
        return kernel.apply(x, w1, w2, tw, ids, activation=MoEActivation.SILU, global_num_experts=global_experts,
                            expert_map=expert_map, apply_router_weight_on_input=False)

    return fn, ""


def ep_map(shape: MoeShape, global_experts: int, device, seed: int = 0):
    """An expert_map: this rank holds shape.num_experts random experts of global_experts."""
    local = torch.randperm(global_experts, generator=torch.Generator().manual_seed(seed))[: shape.num_experts]
    emap = torch.full((global_experts,), -1, dtype=torch.int32)
    emap[local] = torch.arange(shape.num_experts, dtype=torch.int32)
    return emap.to(device)


def bench_shape_fp8(shape: MoeShape, tokens: list[int], kind: str, device="cuda", n_routings: int = 16,
                    reps: int = 30, ceiling_tbps: float | None = None, weights=None, global_experts: int = 0,
                    between_mib: int = BETWEEN_MIB, timing: str = "span",
                    backends=("triton", "deep_gemm", "flashinfer_cutlass"),
                    progress=None, cross_check: bool = False, flashinfer_build: bool = False) -> list[dict]:
    """Rows for one shape with FP8 weights (kind "fp8-block" or "fp8-tensor") at each token count:
    opgraft's kernel ("opgraft", on activations quantized beforehand: the bytes and the ceiling
    fraction are the kernel's), opgraft as the seam runs in vLLM ("opgraft+quant": vLLM's
    activation quantization, then the kernel), opgraft on the bf16 hidden states ("opgraft-x16":
    gate_up quantizes them in 1 x 128 groups, checked against the oracle of that quantization; a
    delegate row where the rule says no, moe.fp8_quantize), and vLLM's own FP8
    path for each backend (vLLM's modular kernel: quantization, TritonExperts or DeepGEMM,
    finalize; FlashInfer's CUTLASS MoE on the bf16 activations), each checked against the
    fp64 oracle of the quantized model. Speedups are opgraft+quant over vLLM's TritonExperts (the
    path vLLM selects on an H200 under tensor parallelism), each backend's error stated next to
    ours. global_experts > shape.num_experts: expert parallelism, the routing over the global
    experts and an expert_map. weights: (w13_q, w13_s, w2_q, w2_s) or None (made here).
    cross_check: the subtraction's timing next to the span's (timed_calls); off by default to
    keep the FP8 bench short. flashinfer_build: time FlashInfer's CUTLASS MoE even where its module
    must be compiled first (vllm_fp8_experts)."""
    if weights is None:
        weights = make_weights_fp8(shape, kind, device)
    w13_q, w13_s, w2_q, w2_s = weights
    G = global_experts or shape.num_experts
    emap = ep_map(shape, G, device) if G != shape.num_experts else None
    gen = torch.Generator(device=device).manual_seed(4321)
    between = between_traffic(between_mib, device)
    base = {**run_facts(), "op": "moe", "model": shape.name, "E": shape.num_experts, "H": shape.hidden,
            "I": shape.inter, "top_k": shape.top_k, "dtype": kind, "global_experts": G, "layers": 1,
            "between_mib": max(between_mib, 0),
            "block": list(FP8_BLOCK) if kind == "fp8-block" else None}
    builtins = {b: vllm_fp8_experts(shape, kind, w13_q, w13_s, w2_q, w2_s, G, b, device, flashinfer_build)
                for b in backends}
    rows = []
    for T in tokens:
        if progress:
            progress(f"{shape.name} {kind} T={T}")
        xs = [make_x(T, shape.hidden, "bf16", device, gen) for _ in range(n_routings)]
        qx = [quantize_activations_fp8(x, kind) for x in xs]
        routings = [make_routing(T, G, shape.top_k, device, gen) for _ in range(n_routings)]
        scales = [fp8_scales(kind, s, w13_s, w2_s) for _, s in qx]
        nbytes = unique_expert_bytes_fp8(shape, kind, routings, emap)
        schedule = [(c, None) for c in range(n_routings)]
        local_ids = routings[0][1] if emap is None else emap[routings[0][1].long()]
        ref = reference_fp8(qx[0][0], scales[0], w13_q, w2_q, routings[0][0], local_ids)
        ok, reason = ops.moe_supports(qx[0][0], w13_q, w2_q, *routings[0], expert_map=emap, fp8=scales[0])
        results = {}
        outs = [torch.empty((T, shape.hidden), dtype=torch.bfloat16, device=device) for _ in range(n_routings)]
        ws = torch.empty(1 << 24, dtype=torch.uint8, device=device)

        def first(x, fp8):
            """The first routing's output from poisoned buffers, and whether a rerun gives its bits."""
            o = [torch.full((T, shape.hidden), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(2)]
            for oi in o:
                ops.moe_experts_into(oi, x, w13_q, w2_q, *routings[0], expert_map=emap, fp8=fp8)
            return o[0], bool(torch.equal(*o))

        def timed(name, inputs, err, det):
            def call(i, _):
                x, fp8 = inputs(i)
                ops.moe_experts_into(outs[i], x, w13_q, w2_q, *routings[i], expert_map=emap, workspace=ws, fp8=fp8)

            us, how = timed_calls(call, schedule, between, reps, timing, cross_check)
            results[name] = (us, err, {"deterministic": det, **how})

        out = None
        if ok:
            out, det = first(qx[0][0], scales[0])
            err = rel_err(out, ref)
            timed("opgraft", lambda i: (qx[i][0], scales[i]), err, det)

            def quantized_here(i):  # vLLM's prepare step's quantization inside the timed call
                q, s = quantize_activations_fp8(xs[i], kind)
                return q, fp8_scales(kind, s, w13_s, w2_s)

            timed("opgraft+quant", quantized_here, err, det)
        x16 = ops.Fp8Scales(None, w13_s, w2_s, tuple(FP8_BLOCK) if kind == "fp8-block" else None)
        ok16, why16 = ops.moe_supports(xs[0], w13_q, w2_q, *routings[0], expert_map=emap, fp8=x16)
        if ok16:  # bf16 hidden states in, quantized by gate_up: what the seam runs when the rule takes it
            kq, ks = quantize_as_the_kernel(xs[0], kernel_group(x16.block_shape))
            ref16 = reference_fp8(kq, fp8_scales(kind, ks, w13_s, w2_s), w13_q, w2_q, routings[0][0], local_ids)
            out16, det16 = first(xs[0], x16)
            timed("opgraft-x16", lambda i: (xs[i], x16), rel_err(out16, ref16), det16)
        missing, vs_vllm = {}, None
        for b, (fn, why) in builtins.items():
            name = f"vllm-{b.replace('_', '-')}"
            if fn is None:
                missing[name] = why
                continue
            try:
                vout = fn(xs[0], *routings[0], emap)
                verr = rel_err(vout, ref)
                if name == "vllm-triton" and out is not None:
                    vs_vllm = rel_err(out, vout.double())

                def vcall(i, _, fn=fn):
                    fn(xs[i], *routings[i], emap)

                us, how = timed_calls(vcall, schedule, between, reps, timing, cross_check)
                results[name] = (us, verr, how)
            except Exception as e:  # report, do not hide
                missing[name] = f"failed here ({type(e).__name__}: {str(e)[:100]})"
        base_us = results.get("vllm-triton", (None,))[0]
        vllm_err = results.get("vllm-triton", (None, None))[1]
        for impl, (us, err, extra) in results.items():
            row = dict(base, tokens=T, impl=impl, **speed(nbytes, us, ceiling_tbps),
                       baseline_impl="vllm-triton" if base_us else None,
                       speedup_vs_baseline=round(base_us / us, 2) if base_us else None,
                       rel_err=float(f"{err:.3g}"),
                       vllm_rel_err=None if vllm_err is None else float(f"{vllm_err:.3g}"),
                       rel_err_vs_vllm=(float(f"{vs_vllm:.3g}") if vs_vllm is not None and impl.startswith("opgraft")
                                        else None),
                       builtin_missing="; ".join(f"{k}: {v}" for k, v in missing.items()) or None,
                       guard="take" if ok else f"delegate: {reason}")
            row.update(extra)
            rows.append(row)
        if not ok:
            rows.append(dict(base, tokens=T, impl="opgraft", median_us=None, bytes=int(nbytes),
                             guard=f"delegate: {reason}"))
        if not ok16:
            rows.append(dict(base, tokens=T, impl="opgraft-x16", median_us=None, bytes=int(nbytes),
                             guard=f"delegate: {why16}"))
    return rows
