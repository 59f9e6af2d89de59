"""The MoE experts bench: opgraft's kernel against vLLM's own fused_experts (and a plain-torch
baseline) and an fp64 reference at a model's real dims, with the read ceiling of the same run.

Each replay makes one call per routing of a rotating set of random routings, so consecutive calls
touch different experts; with more than one layer (`opgraft bench moe --layers N`) the calls also
rotate over that many copies of the layer's weights, as a model's MoE layers do (48 layers x 0.6
GB for Qwen3-30B-A3B: address translation and DRAM page locality as in a real step).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

import torch

from .. import _lib
from ..ops import moe as ops
from ..presets import MoeShape
from . import BETWEEN_MIB, TOLERANCE, between_traffic, rel_err, run_facts, timed_calls


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
            tbps = nbytes / (us * 1e-6) / 1e12
            row = dict(base, tokens=T, impl=impl, median_us=round(us, 2), bytes=int(nbytes), tbps=round(tbps, 3),
                       ceiling_tbps=round(ceiling_tbps, 3) if ceiling_tbps else None,
                       fraction_of_ceiling=round(tbps / ceiling_tbps, 3) if ceiling_tbps else None,
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
        lines.insert(0, f"vLLM builtin column missing: {m}; speedups are against torch-gather-bmm")
    for r in rows:
        if r.get("median_us") is None:
            lines.append(f"{r['model']:<{w}} {r['dtype']:<4} {r['tokens']:>3} {r['impl']:<17} {r.get('guard', '')}")
            continue
        frac = r.get("fraction_of_ceiling")
        sp = r.get("speedup_vs_baseline")
        lines.append(
            f"{r['model']:<{w}} {r['dtype']:<4} {r['tokens']:>3} {r['impl']:<17} {r['median_us']:>9.1f} "
            f"{r['bytes'] / 1e6:>8.1f} {r['tbps']:>6.2f} {(frac or 0) * 100:>5.1f}% "
            f"{(sp if sp else 0):>6.2f} {r['rel_err']:>8.1e}  "
            f"{(r.get('guard') or '') if r['impl'] == 'opgraft' else ''}")
    return "\n".join(lines)


def configure(cfg: dict) -> None:
    """Exactly cfg's tunables set through the library's API (above the environment, the tune file
    and the tables): every other tunable back to its usual source. The op's plans are re-made."""
    _lib.tune_clear()
    _lib.tune_set(cfg)
    ops.forget_plans()


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
        self.ws = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
        self.ref = reference(self.xs[0], w13, w2, *self.routings[0])
        self.bytes = unique_expert_bytes(shape, self.routings)
        # Timed as the bench times: other data read before each call.
        self.between = between_traffic(BETWEEN_MIB, "cuda")

    def check(self) -> float:
        out = torch.full_like(self.xs[0], float("nan"))
        ops.moe_experts_into(out, self.xs[0], self.w13, self.w2, *self.routings[0], workspace=self.ws)
        return rel_err(out, self.ref)

    def time(self, stages=ops.STAGE_ALL, reps=30) -> float:
        def call(i, _):
            ops.moe_experts_into(self.outs[i], self.xs[i], self.w13, self.w2, *self.routings[i],
                                 workspace=self.ws, stages=stages)

        return timed_calls(call, [(i, None) for i in range(len(self.xs))], self.between, reps, cross_check=False)[0]


def measure(fx: Fixture, cfg: dict, stages_all=True) -> dict:
    """One configuration checked against the fp64 oracle, then timed (both stages, and each alone)."""
    configure(cfg)
    err = fx.check()
    r = {"config": dict(cfg), "rel_err": err, "ok": err <= TOLERANCE[fx.dtype]}
    if not r["ok"]:
        return r
    r["all_us"] = fx.time(ops.STAGE_ALL)
    if stages_all:
        r["gate_up_us"] = fx.time(ops.STAGE_GATE_UP)
        r["down_us"] = fx.time(ops.STAGE_DOWN)
    return r


class tunables:
    """A context in which cfg's tunables are set (configure), cleared again on exit."""

    def __init__(self, cfg: dict):
        self.cfg = cfg

    def __enter__(self):
        configure(self.cfg)
        return self

    def __exit__(self, *exc):
        configure({})
        return False
