"""Per-block timeline of one MoE call (GPU only; a diagnostic):

    python -m opgraft.trace --model Qwen3-30B-A3B --tokens 1 [--tp N] [--configs JSON] [--json FILE]

With OPGRAFT_TRACE=1 the kernels are compiled with OG_TRACE: thread 0 of each block writes
%globaltimer at its phase boundaries into the workspace after the counter area (see
kernels/moe_decode.cu). Each call runs after the bench's traffic between calls (64 MiB of other
reads), then the times are read back; the table gives, per kernel and phase, the earliest, median
and latest block in µs from the call's first block start, each the median over the repetitions.
The tracing stores are a few per block; the figures to trust are the shapes of the timeline (when
blocks start, wait, finish), not a µs or two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

KERNELS = ("gate_up", "down", "fused")
SLOTS = {0: "start", 1: "routing set up", 2: "gate_up tiles done", 3: "released", 7: "end"}


def summarize(times, trace_blocks: int) -> dict:
    """times: the flat u64 trace region, [3][trace_blocks][8] (0 = not written). Returns
    {kernel: {slot: {"n", "min", "median", "max"}}} in µs from the earliest start."""
    starts = [times[(k * trace_blocks + b) * 8] for k in range(3) for b in range(trace_blocks)]
    starts = [t for t in starts if t]
    if not starts:
        return {}
    t0 = min(starts)
    out = {}
    for k, name in enumerate(KERNELS):
        per_slot = {}
        for slot, label in SLOTS.items():
            vals = [times[(k * trace_blocks + b) * 8 + slot] for b in range(trace_blocks)]
            vals = sorted((t - t0) / 1000.0 for t in vals if t)
            if vals:
                per_slot[label] = {"n": len(vals), "min": vals[0], "median": statistics.median(vals),
                                   "max": vals[-1]}
        if per_slot:
            out[name] = per_slot
    return out


def combine(runs: list[dict]) -> dict:
    """The median over repetitions of each (kernel, phase, statistic)."""
    out = {}
    for name in KERNELS:
        labels = [lab for lab in SLOTS.values() if all(name in r and lab in r[name] for r in runs)]
        if runs and labels:
            out[name] = {lab: {s: statistics.median(r[name][lab][s] for r in runs)
                               for s in ("n", "min", "median", "max")} for lab in labels}
    return out


def format_table(summary: dict) -> str:
    lines = [f"{'kernel':8} {'phase':20} {'blocks':>6} {'first':>8} {'median':>8} {'last':>8}"]
    for name, phases in summary.items():
        for label, st in phases.items():
            lines.append(f"{name:8} {label:20} {int(st['n']):6d} {st['min']:8.2f} {st['median']:8.2f} {st['max']:8.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opgraft.trace")
    ap.add_argument("--model", default="Qwen3-30B-A3B")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1, help="one rank's shape under tensor parallelism")
    ap.add_argument("--configs", default="[{}]", help='JSON list of tunable settings, e.g. [{}, {"moe.pdl": 0}]')
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ["OPGRAFT_TRACE"] = "1"  # before any plan is made

    import torch

    from . import ops
    from .presets import resolve
    from .sweep import Fixture, apply_config

    shape = resolve(args.model).per_rank(args.tp)
    fx = Fixture(shape, args.tokens)
    a = ops.moe_args(fx.xs[0], fx.w13, fx.w2, *fx.routings[0], fx.outs[0])
    with_trace = ops.moe_workspace_bytes(a)
    os.environ["OPGRAFT_TRACE"] = "0"
    plain = ops.moe_workspace_bytes(a)
    os.environ["OPGRAFT_TRACE"] = "1"
    trace_blocks = (with_trace - plain) // (3 * 8 * 8)
    ws = torch.empty(max(with_trace, fx.ws.numel()), dtype=torch.uint8, device="cuda")
    region = ws[plain:with_trace]
    results = []
    for cfg in json.loads(args.configs):
        apply_config(cfg)
        runs = []
        for _ in range(args.reps + 1):  # the first call compiles and is dropped
            region.zero_()
            if fx.between:
                fx.between()
            ops.moe_experts_into(fx.outs[0], fx.xs[0], fx.w13, fx.w2, *fx.routings[0], workspace=ws)
            torch.cuda.synchronize()
            runs.append(summarize(region.view(torch.int64).cpu().tolist(), trace_blocks))
        summary = combine(runs[1:])
        print(f"== {shape.name} T={args.tokens} {cfg}")
        print(format_table(summary), flush=True)
        results.append({"model": shape.name, "tokens": args.tokens, "config": cfg, "timeline_us": summary})
    apply_config({})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
