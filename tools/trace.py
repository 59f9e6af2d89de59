"""Per-block timeline of one MoE call (GPU only; a diagnostic):

    python -m tools.trace --model Qwen3-30B-A3B --tokens 1 [--tp N] [--configs JSON] [--json FILE]

With OPGRAFT_TRACE=1 the kernels are compiled with OG_TRACE: thread 0 of each block writes
%globaltimer at its phase boundaries into the workspace after the counter area (see
kernels/moe/moe_config.cuh). Each call runs after the bench's traffic between calls (64 MiB of other
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
SLOTS = {0: "start", 1: "routing set up", 2: "gate_up tiles done", 3: "released", 5: "warp 0 k-loop done", 7: "end"}


def _base(k: int, b: int, trace_blocks: int) -> int:
    """Index of block b's slot 0 of kernel k in the flat region."""
    return (k * trace_blocks + b) * 8


def _stats(vals: list) -> dict:
    """n, min, median and max of a sorted, non-empty list."""
    return {"n": len(vals), "min": vals[0], "median": statistics.median(vals), "max": vals[-1]}


def first_start(times, trace_blocks: int):
    """The earliest block start (ns) of any kernel in the flat trace region, or None."""
    starts = [t for k in range(3) for b in range(trace_blocks) if (t := times[_base(k, b, trace_blocks)])]
    return min(starts) if starts else None


def summarize(times, trace_blocks: int) -> dict:
    """times: the flat u64 trace region, [3][trace_blocks][8] (0 = not written). Returns
    {kernel: {slot: {"n", "min", "median", "max"}}} in µs from the earliest start."""
    t0 = first_start(times, trace_blocks)
    if t0 is None:
        return {}
    out = {}
    for k, name in enumerate(KERNELS):
        per_slot = {}
        for slot, label in SLOTS.items():
            vals = [times[_base(k, b, trace_blocks) + slot] for b in range(trace_blocks)]
            vals = sorted((t - t0) / 1000.0 for t in vals if t)
            if vals:
                per_slot[label] = _stats(vals)
        if per_slot:
            out[name] = per_slot
    return out


def per_sm(times, trace_blocks: int) -> dict:
    """Where the blocks ran (slot 6: %smid + 1): for gate_up, how many SMs ran 1, 2, ... of its
    blocks and the median over those SMs of their last block's end; for down, the time from its
    SM's last gate_up block end to its start (the hand-over of the SM), min / median / max; µs from
    the earliest start. Empty without SM records."""
    def blocks(k):
        for b in range(trace_blocks):
            base = _base(k, b, trace_blocks)
            if times[base] and times[base + 6]:
                yield times[base + 6] - 1, times[base], times[base + 7]
    t0, gu = first_start(times, trace_blocks), list(blocks(0))
    if t0 is None or not gu:
        return {}
    last_end, count = {}, {}
    for sm, _, end in gu:
        count[sm] = count.get(sm, 0) + 1
        if end:
            last_end[sm] = max(last_end.get(sm, 0), end)
    out = {"gate_up": {}}
    for n in sorted(set(count.values())):
        sms = [sm for sm, c in count.items() if c == n and sm in last_end]
        if sms:
            out["gate_up"][f"{n} blocks"] = {"sms": len(sms), "last_end_median": statistics.median(
                (last_end[sm] - t0) / 1000.0 for sm in sms)}
    hand = sorted((start - last_end[sm]) / 1000.0 for sm, start, _ in blocks(1) if sm in last_end)
    if hand:
        out["down"] = {"sm_handover": _stats(hand)}
    return out


def raw_records(times, trace_blocks: int) -> list[list[int]]:
    """[kernel, block, SM, start, routing set up, released, end] of every block that started, times
    in ns from the earliest start (0 where a phase was not recorded), SM -1 where not recorded."""
    t0 = first_start(times, trace_blocks)
    if t0 is None:
        return []
    out = []
    for k in range(3):
        for b in range(trace_blocks):
            base = _base(k, b, trace_blocks)
            if times[base]:
                rel = [times[base + s] - t0 if times[base + s] else 0 for s in (0, 1, 3, 7)]
                out.append([k, b, times[base + 6] - 1] + rel)
    return out


def combine_sm(runs: list[dict]) -> dict:
    """The median over repetitions of every number in per_sm's results (keys in all runs)."""
    def merge(vals):
        if all(isinstance(v, dict) for v in vals):
            keys = set.intersection(*(set(v) for v in vals))
            return {k: merge([v[k] for v in vals]) for k in sorted(keys)}
        return statistics.median(vals)
    return merge(runs) if runs and all(runs) else {}


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
    from opgraft._entry import DefaultsHelp

    ap = argparse.ArgumentParser(prog="python -m tools.trace", formatter_class=DefaultsHelp)
    ap.add_argument("--model", default="Qwen3-30B-A3B", help="a preset, a config.json or a model folder holding one")
    ap.add_argument("--tokens", type=int, default=1, help="tokens of the traced call")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp8-block", "fp8-tensor"], default="bf16",
                    help="the weights' type (FP8: e4m3 weights, activations quantized beforehand)")
    ap.add_argument("--tp", type=int, default=1, help="one rank's shape under tensor parallelism")
    ap.add_argument("--configs", default="[{}]", help='JSON list of tunable settings, e.g. [{}, {"moe.pdl": 0}]')
    ap.add_argument("--reps", type=int, default=9, help="repetitions (after one dropped call that compiles)")
    ap.add_argument("--json", default=None, help="write the timelines to this file (default: none)")
    ap.add_argument("--raw", action="store_true",
                    help="also store every block's records (kernel, block, SM, start, routing set up, released, end; "
                         "ns from the call's first start) of every repetition in the JSON")
    args = ap.parse_args(argv)
    from opgraft._entry import check_outputs, require_gpu
    from opgraft.presets import ConfigError, resolve

    try:
        shape = resolve(args.model).per_rank(args.tp)
        configs = json.loads(args.configs)
    except ConfigError as e:
        print(f"tools.trace: error: {e}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as e:
        print(f"tools.trace: error: --configs is not JSON ({e})", file=sys.stderr)
        return 2
    if not 1 <= args.tokens <= 64 or args.reps < 1:
        print("tools.trace: error: --tokens must be in 1..64 and --reps >= 1", file=sys.stderr)
        return 2
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        print("tools.trace: error: --configs must be a JSON list of objects", file=sys.stderr)
        return 2
    if not check_outputs("tools.trace", {"--json": args.json}):
        return 2
    torch = require_gpu("tools.trace", " (the timeline is read from the GPU's kernels)")
    os.environ["OPGRAFT_TRACE"] = "1"  # before any plan is made

    import ctypes

    from opgraft import _lib
    from opgraft.bench.moe import FP8_KINDS, Fixture, Fp8Fixture, configure
    from opgraft.ops import moe as ops

    def workspace_bytes(a):
        n = ctypes.c_size_t()
        _lib.check(_lib.lib().opgraft_moe_workspace_size(ctypes.byref(a), ctypes.byref(n)))
        return n.value

    fx = (Fp8Fixture if args.dtype in FP8_KINDS else Fixture)(shape, args.tokens, args.dtype)
    a = ops.moe_args(fx.xs[0], fx.w13, fx.w2, *fx.routings[0], fx.outs[0], fp8=fx.scales[0])
    with_trace = workspace_bytes(a)
    os.environ["OPGRAFT_TRACE"] = "0"
    plain = workspace_bytes(a)
    os.environ["OPGRAFT_TRACE"] = "1"
    trace_blocks = (with_trace - plain) // (3 * 8 * 8)
    ws = torch.empty(max(with_trace, fx.ws.numel()), dtype=torch.uint8, device="cuda")
    region = ws[plain:with_trace]
    results = []
    for cfg in configs:
        configure(cfg)
        ops.forget_plans()  # plans made before OPGRAFT_TRACE=1 was read would not trace
        runs, raw = [], []
        for _ in range(args.reps + 1):  # the first call compiles and is dropped
            region.zero_()
            if fx.between:
                fx.between()
            ops.moe_experts_into(fx.outs[0], fx.xs[0], fx.w13, fx.w2, *fx.routings[0], workspace=ws, fp8=fx.scales[0])
            torch.cuda.synchronize()
            times = region.view(torch.int64).cpu().tolist()
            runs.append((summarize(times, trace_blocks), per_sm(times, trace_blocks)))
            if args.raw:
                raw.append(raw_records(times, trace_blocks))
        summary = combine([r[0] for r in runs[1:]])
        sms = combine_sm([r[1] for r in runs[1:]])
        print(f"== {shape.name} {args.dtype} T={args.tokens} {cfg}")
        print(format_table(summary), flush=True)
        print("per SM:", json.dumps(sms), flush=True)
        results.append({"model": shape.name, "tokens": args.tokens, "config": cfg, "timeline_us": summary,
                        "per_sm_us": sms})
        if args.raw:
            results[-1]["raw"] = raw[1:]
    configure({})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
