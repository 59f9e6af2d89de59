"""MoE benchmark harness: opgraft's kernel against a baseline and an fp64 reference at a model's
real dims, with the read ceiling measured in the same run.

How a number is taken (see the project's measuring rules): CUDA-graph replays timed with events
after warm-up, the median of many; each replay makes one call per routing of a rotating set of
random routings, so consecutive calls touch different experts and L2 (60 MB on an H200) does not
hold the weights; inputs are random, never zeros; outputs are poisoned before each check.
With more than one layer (`opgraft bench --layers N`) the calls also rotate over that many
copies of the layer's weights, as a model's MoE layers do: a real decode step streams tens of GB
of weights (48 layers x 0.6 GB for Qwen3-30B-A3B), far beyond what one layer's 0.6 GB exercises
(address translation, DRAM page locality).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import subprocess
from dataclasses import dataclass, field

import torch

from . import ops
from .presets import MoeShape

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# ‖out − ref‖ / ‖ref‖ limits against the fp64 oracle: bf16 keeps 8 significant bits, fp16 11.
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3}


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


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - ref).norm() / ref.norm().clamp_min(1e-300))


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


# In a decode step the other layers' kernels (attention, the dense projections: ~38 MB of weights
# per layer for Qwen3-30B-A3B) run between two MoE calls and leave L2 full of their lines. Kernels
# can run slower after that than back to back (measured: bench/NOTES.md, v9), so by default the
# bench reads this much other data before each call and times the call alone: from its kernels'
# own start/end times (time_calls_span), or as (call + read) minus the read by itself.
BETWEEN_MIB = 64


def between_traffic(mib: int, device):
    """A function that reads `mib` MiB of other data (a column sum), or None for mib <= 0."""
    if mib <= 0:
        return None
    buf = torch.ones((mib << 9, 1024), dtype=torch.bfloat16, device=device)
    sink = torch.empty(1024, dtype=torch.bfloat16, device=device)
    return lambda: torch.sum(buf, dim=0, out=sink)


def time_calls(call, schedule, between=None, reps: int = 30) -> float:
    """Median µs per call of `call(i, w)` over the schedule, with `between()` before each call
    (its own time, measured the same way, subtracted)."""
    if between is None:
        def step():
            for i, w in schedule:
                call(i, w)
        return time_graph(step, len(schedule), reps=reps)
    step_with, step_alone = _traffic_steps(call, schedule, between)
    return time_graph(step_with, len(schedule), reps=reps) - time_graph(step_alone, len(schedule), reps=reps)


def _traffic_steps(call, schedule, between):
    """Two steps over the schedule: [between(), call(i, w)] each, and between() alone each."""
    def step_with():
        for i, w in schedule:
            between()
            call(i, w)

    def step_alone():
        for _ in schedule:
            between()
    return step_with, step_alone


class SpanError(RuntimeError):
    """The profiler's kernel records could not be split into (traffic, call) groups."""


def device_intervals(prof) -> list[tuple[int, int]]:
    """(start ns, end ns) of every device activity (kernel, memset, memcpy) a stopped torch
    profiler recorded, CUDA-graph replays included, sorted by start."""
    from torch.autograd import DeviceType

    out = []
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() != DeviceType.CUDA:
            continue
        annotation = getattr(ev, "is_user_annotation", None)
        if annotation is not None and annotation():  # a named range over kernels, not a kernel
            continue
        start, dur = int(ev.start_ns()), int(ev.duration_ns())
        if dur > 0:
            out.append((start, start + dur))
    return sorted(out)


def call_spans(intervals, n_between: int, n_call: int) -> list[float]:
    """µs each call adds to the stream, from the device intervals of replays of [traffic, call]*n:
    per group of n_between + n_call activities (in start order), the end of the call's last
    activity minus the end of the traffic's last one. Unlike a subtraction of two timings, this
    charges the call only for itself, overlaps with its neighbours (PDL) included."""
    g = n_between + n_call
    if n_between < 1 or n_call < 1 or not intervals or len(intervals) % g:
        raise SpanError(f"{len(intervals)} device activities do not split into groups of "
                        f"{n_between} + {n_call}")
    spans = []
    for i in range(0, len(intervals), g):
        grp = intervals[i:i + g]
        spans.append((max(e for _, e in grp[n_between:]) - max(e for _, e in grp[:n_between])) / 1e3)
    return spans


def per_call_time(spans, n_calls: int) -> float:
    """µs per call from the spans of replays of a schedule of n_calls different calls (in schedule
    order, replay after replay): each call's median over the replays, then the mean over the
    calls. The calls differ in bytes (another routing uses another number of experts), and the
    bytes are averaged over them, so the time must be too: a median over all spans picks the
    time of the commoner count instead (Mixtral-8x7B at T=2: 3 or 4 experts a call)."""
    if n_calls < 1 or not spans or len(spans) % n_calls:
        raise SpanError(f"{len(spans)} spans do not split into replays of {n_calls} calls")
    return statistics.mean(statistics.median(spans[i::n_calls]) for i in range(n_calls))


def _profiled_intervals(graph, replays: int) -> list[tuple[int, int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return device_intervals(prof)


def time_calls_span(call, schedule, between, reps: int = 30) -> float:
    """µs per call of `call(i, w)` with `between()` before each, from the kernels' own start/end
    times (torch profiler over graph replays; see call_spans): per schedule entry the median over
    the replays, averaged over the entries (per_call_time). Raises SpanError when the records
    cannot be grouped (a call whose kernel count varies, a profiler without device records)."""
    n = len(schedule)
    step_with, step_alone = _traffic_steps(call, schedule, between)
    replays = max(2, min(reps, 10))
    alone = _profiled_intervals(capture(step_alone), replays)
    if not alone or len(alone) % (n * replays):
        raise SpanError(f"traffic alone: {len(alone)} device activities in {n * replays} reads")
    n_between = len(alone) // (n * replays)
    both = _profiled_intervals(capture(step_with), replays)
    if len(both) % (n * replays):
        raise SpanError(f"{len(both)} device activities in {n * replays} calls")
    n_call = len(both) // (n * replays) - n_between
    return per_call_time(call_spans(both, n_between, n_call), n)


def profiler_kernels(prof) -> dict:
    """{kernel name: (launches, self device µs)} of a stopped torch profiler, kernels inside
    CUDA-graph replays included (torch names the time self_device_time_total, older releases
    self_cuda_time_total)."""
    out = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = getattr(ev, "self_cuda_time_total", 0.0)
        if ev.count and us > 0:
            out[ev.key] = (int(ev.count), float(us))
    return out


def capture(step, warmup: int = 3) -> "torch.cuda.CUDAGraph":
    """`step` run once eagerly (compiles kernels, settles allocations), then captured into a CUDA
    graph, replayed `warmup` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph(step, calls_per_replay: int, reps: int = 30, warmup: int = 3) -> float:
    """Median microseconds per call of `step` captured into a CUDA graph."""
    graph = capture(step, warmup)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls_per_replay)
    return statistics.median(times)


def measure_read_ceiling(device, gib: float = 4.0, reps: int = 20) -> float:
    """TB/s of our 16-byte streaming-read kernel over a buffer far larger than L2."""
    n = int(gib * (1 << 30)) // 16 * 16
    buf = torch.randint(-(2 ** 31), 2 ** 31 - 1, (n // 4,), dtype=torch.int32, device=device)
    sink = torch.zeros(4, dtype=torch.int32, device=device)
    us = time_graph(lambda: ops.stream_read(buf, sink), 1, reps=reps)
    del buf
    return n / (us * 1e-6) / 1e12


def measure_whole_token_range() -> None:
    """Lets the kernel take every token count it supports in this process (unless the caller set
    the threshold): measuring it is separate from the shipped delegation threshold
    (moe.max_tokens), which comes from end-to-end runs."""
    os.environ.setdefault("OPGRAFT_TUNE_MOE_MAX_TOKENS", "64")


def gpu_facts() -> dict:
    p = torch.cuda.get_device_properties(0)
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        drv = ""
    from .vllm.compat import vllm_version

    return {"gpu": p.name, "arch": f"sm_{p.major}{p.minor}", "sms": p.multi_processor_count, "driver": drv,
            "torch": torch.__version__, "vllm": vllm_version() or None}


def write_rows(path: str, ceiling_tbps: float, rows: list[dict], facts: dict | None = None) -> None:
    """One GPU run's JSON: the device, the read ceiling measured in the run, and its rows."""
    with open(path, "w") as f:
        json.dump({"device": facts or gpu_facts(), "ceiling_tbps": ceiling_tbps, "rows": rows}, f, indent=1)


def commit_id() -> str:
    env = os.environ.get("OPGRAFT_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              timeout=10, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def unique_expert_bytes(shape: MoeShape, routings, elem_bytes: int = 2) -> float:
    """Mean over the routings of the bytes that must move: each used expert's weights once."""
    counts = [int(torch.unique(ids[(ids >= 0) & (ids < shape.num_experts)]).numel()) for _, ids in routings]
    return statistics.mean(counts) * shape.expert_bytes(elem_bytes)


def timed_calls(call, schedule, between=None, reps: int = 30, timing: str = "span",
                cross_check: bool = True) -> tuple[float, dict]:
    """(µs per call, how it was timed) of `call(i, w)` over the schedule: back to back without
    traffic; with it, by span (cross_check: the subtraction's figure too, as median_us_subtract;
    the subtraction alone where the profiler's records cannot be grouped) or by subtraction."""
    if between is None:
        return time_calls(call, schedule, None, reps), {"timing": "back-to-back"}
    if timing == "subtract":
        return time_calls(call, schedule, between, reps), {"timing": "subtract"}
    try:
        us = time_calls_span(call, schedule, between, reps)
    except SpanError as e:
        return time_calls(call, schedule, between, reps), {"timing": "subtract", "span_error": str(e)}
    how = {"timing": "span", "statistic": "mean over the schedule's calls of each call's median"}
    if cross_check:
        how["median_us_subtract"] = round(time_calls(call, schedule, between, reps), 2)
    return us, how


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

    facts = gpu_facts()
    base = {"gpu": facts["gpu"], "arch": facts["arch"], "driver": facts["driver"], "torch": facts["torch"],
            "vllm": facts.get("vllm"),
            "commit": commit_id(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "model": shape.name, "E": shape.num_experts, "H": shape.hidden, "I": shape.inter, "top_k": shape.top_k,
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
    head = (f"{'model':<16} {'dt':<4} {'T':>3} {'impl':<17} {'us':>9} {'MB':>8} {'TB/s':>6} {'ceil%':>6} "
            f"{'xbase':>6} {'relerr':>8}  decision")
    lines = [head, "-" * len(head)]
    missing = sorted({r["builtin_missing"] for r in rows if r.get("builtin_missing")})
    for m in missing:
        lines.insert(0, f"vLLM builtin column missing: {m}; speedups are against torch-gather-bmm")
    for r in rows:
        if r.get("median_us") is None:
            lines.append(f"{r['model']:<16} {r['dtype']:<4} {r['tokens']:>3} {r['impl']:<17} {r.get('guard', '')}")
            continue
        frac = r.get("fraction_of_ceiling")
        sp = r.get("speedup_vs_baseline")
        lines.append(
            f"{r['model']:<16} {r['dtype']:<4} {r['tokens']:>3} {r['impl']:<17} {r['median_us']:>9.1f} "
            f"{r['bytes'] / 1e6:>8.1f} {r['tbps']:>6.2f} {(frac or 0) * 100:>5.1f}% "
            f"{(sp if sp else 0):>6.2f} {r['rel_err']:>8.1e}  "
            f"{(r.get('guard') or '') if r['impl'] == 'opgraft' else ''}")
    return "\n".join(lines)
