"""Measurement on a GPU, for every op: CUDA-graph timing, the read ceiling, traffic between calls,
the per-call time from the kernels' own start/end times, and the JSON rows of a run.

How a number is taken (the project's measuring rules): CUDA-graph replays timed with events after
warm-up, the median of many; the calls rotate over enough inputs that L2 (60 MB on an H200) does
not hold what they read; inputs are random, never zeros; outputs are poisoned before each check;
the read ceiling is measured in the same run. The ops' own benches are bench/<op>.py.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import subprocess

import torch

from .. import _lib, ops

TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3}


def configure(cfg: dict, forget_plans) -> None:
    """Exactly cfg's tunables set through the library's API (above the environment, the tune file
    and the tables): every other tunable back to its usual source. forget_plans (the op's) makes
    its plans be made again."""
    _lib.tune_clear()
    _lib.tune_set(cfg)
    forget_plans()


class tunables:
    """A context in which cfg's tunables are set (configure), cleared again on exit."""

    def __init__(self, cfg: dict, forget_plans):
        self.cfg, self.forget_plans = cfg, forget_plans

    def __enter__(self):
        configure(self.cfg, self.forget_plans)
        return self

    def __exit__(self, *exc):
        configure({}, self.forget_plans)
        return False


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - ref).norm() / ref.norm().clamp_min(1e-300))


def heads_within_two_steps(got, want) -> bool:
    """Every element of got within two rounding steps (of its dtype) of the largest value of its head
    (the last dim) in want (another computation's heads: torch's, an oracle's): rsqrt and fp32
    products differ between them, and a normalized value a step apart moves a rotated one by a step
    of its operands, which cancellation can make large against the result."""
    step = 2.0 ** (-7 if want.dtype == torch.bfloat16 else -10)
    g, w = got.float(), want.float()
    return bool(((g - w).abs() <= 2 * step * w.abs().amax(-1, keepdim=True) + 1e-6).all())


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


def _host_event(ev) -> bool:
    return str(getattr(ev, "device_type", "")).endswith("CPU")


def profiler_kernels(prof) -> dict:
    """{kernel name: (launches, self device µs)} of a stopped torch profiler, kernels inside
    CUDA-graph replays included (torch names the time self_device_time_total, older releases
    self_cuda_time_total). Host ops of a profile that records the CPU too are left out: torch
    gives each the device time of the kernels it launched, which would count them twice; so are
    the device spans of record_function scopes."""
    out = {}
    for ev in prof.key_averages():
        # record_function scopes (vLLM's model-runner phases) also appear on the device as spans
        # over kernels, not kernels
        if _host_event(ev) or getattr(ev, "is_user_annotation", False):
            continue
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = getattr(ev, "self_cuda_time_total", 0.0)
        if ev.count and us > 0:
            out[ev.key] = (int(ev.count), float(us))
    return out


def profiler_exposed(prof) -> dict:
    """{kernel name: exposed device µs} of a stopped torch profiler (the kernels of
    profiler_kernels): of each kernel's span, the part after every kernel that started before it
    had ended. Where kernels overlap (a programmatic dependent launched while the kernel before it
    runs, whose own span then includes its wait) this is the time each adds to the GPU's busy span,
    and the exposed times add up to that span, where self times count the overlap twice."""
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.key) for ev in prof.events()
                   if not _host_event(ev) and not getattr(ev, "is_user_annotation", False)
                   and ev.time_range.end > ev.time_range.start)
    out: dict = {}
    edge = float("-inf")
    for start, end, name in spans:
        out[name] = out.get(name, 0.0) + max(0.0, end - max(start, edge))
        edge = max(edge, end)
    return out


def profiler_host_ops(prof) -> dict:
    """{host op name: (calls, self CPU µs, CPU µs with what runs inside)} of a stopped torch
    profiler that recorded the CPU: aten ops, custom ops such as opgraft::linear, CUDA runtime
    calls, and record_function scopes (whose inclusive time is their wall time)."""
    return {ev.key: (int(ev.count), float(ev.self_cpu_time_total), float(ev.cpu_time_total))
            for ev in prof.key_averages() if _host_event(ev) and ev.count and ev.cpu_time_total > 0}


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


def gpu_facts() -> dict:
    p = torch.cuda.get_device_properties(0)
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        drv = ""
    from ..vllm.compat import vllm_version

    return {"gpu": p.name, "arch": f"sm_{p.major}{p.minor}", "sms": p.multi_processor_count, "driver": drv,
            "torch": torch.__version__, "vllm": vllm_version() or None}


def speed(nbytes: float, us: float, ceiling_tbps: float | None) -> dict:
    """A timed row's speed fields: median µs, bytes, TB/s and its fraction of the run's ceiling."""
    tbps = nbytes / (us * 1e-6) / 1e12
    return dict(median_us=round(us, 2), bytes=int(nbytes), tbps=round(tbps, 3),
                ceiling_tbps=round(ceiling_tbps, 3) if ceiling_tbps else None,
                fraction_of_ceiling=round(tbps / ceiling_tbps, 3) if ceiling_tbps else None)


def print_variants(rows: list[dict], keys: tuple, names: list[str], base: str, ceiling_tbps: float) -> None:
    """A table of the rows' median_us a point (the values of keys) and variant, each with base's
    time over it; "!" marks a row whose output was outside tolerance (row["ok"] false), a missing
    row reads "handed back"."""
    print("\n" + " ".join(f"{k:>7}" for k in keys) + " " + " ".join(f"{n:>16}" for n in names))
    for point in sorted({tuple(r[k] for k in keys) for r in rows}):
        cells = {r["variant"]: r for r in rows if tuple(r[k] for k in keys) == point}
        line = [f"{cells[n]['median_us']:9.2f} {cells[base]['median_us'] / cells[n]['median_us']:4.2f}x"
                + ("" if cells[n]["ok"] else "!") if n in cells and base in cells else f"{'handed back':>16}"
                for n in names]
        print(" ".join(f"{v:>7}" for v in point) + " " + " ".join(line))
    print(f"(x: {base}'s time over the variant's; ! an output outside tolerance; ceiling {ceiling_tbps:.2f} TB/s)")


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




def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def run_facts() -> dict:
    """The fields every row of a run carries: the GPU, its driver, torch, vLLM, the commit, the date."""
    facts = gpu_facts()
    return {"gpu": facts["gpu"], "arch": facts["arch"], "driver": facts["driver"], "torch": facts["torch"],
            "vllm": facts.get("vllm"), "commit": commit_id(), "date": now_utc()}
