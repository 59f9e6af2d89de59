"""Measures the MoE kernels' time split and sweeps their tunables at one shape (GPU only; a
development tool, not part of the package).

    python -m tools.sweep --model Mixtral-8x7B --tokens 1,8 [--grid] [--pdl] [--min-blocks] [--loads]
        [--configs JSON] [--descent] [--json FILE]

Each configuration is set through the library's tunables API (opgraft_tune_set), checked against
the fp64 oracle, then timed (CUDA-graph replays, rotating routings) for the gate/up stage alone,
the down stage alone, and both.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from opgraft import _lib
from opgraft._entry import check_outputs, require_gpu
from opgraft.presets import ConfigError, resolve
from opgraft.tune import coordinate_descent


def _tokens(text: str) -> list[int]:
    try:
        ts = [int(t) for t in text.split(",")]
    except ValueError:
        ts = []
    if not ts or not all(1 <= t <= 64 for t in ts):
        raise argparse.ArgumentTypeError(f"tokens are comma-separated integers in 1..64, got {text!r}")
    return ts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.sweep")
    ap.add_argument("--model", default="Mixtral-8x7B")
    ap.add_argument("--tokens", type=_tokens, default=[1], help="comma-separated token counts")
    ap.add_argument("--tp", type=int, default=1, help="one rank's shape under tensor parallelism")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--grid", action="store_true", help="sweep warps x unroll of each stage")
    ap.add_argument("--descent", action="store_true", help="coordinate descent over all tunables")
    ap.add_argument("--pdl", action="store_true",
                    help="moe.pdl 1 and 0: moe_down launched while gate_up's tail runs (sm_90)")
    ap.add_argument("--min-blocks", action="store_true",
                    help="moe.gate_up.min_blocks 1, 2: gate_up's launch bounds (its loads issued together)")
    ap.add_argument("--loads", action="store_true",
                    help="the weight loads' form per stage: moe.load x moe.down_load in {1, 4}")
    ap.add_argument("--configs", default=None,
                    help='JSON list of configurations to measure, e.g. [{"moe.gate_up.warps": 8}]')
    ap.add_argument("--start", default=None, help="JSON object: the descent's starting configuration")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        shape = resolve(args.model).per_rank(args.tp)
    except ConfigError as e:
        print(f"tools.sweep: error: {e}", file=sys.stderr)
        return 2
    if not check_outputs("tools.sweep", {"--json": args.json}):
        return 2
    torch = require_gpu("tools.sweep")
    from opgraft import bench
    from opgraft.bench.moe import Fixture, configure, make_weights, measure

    ceiling = bench.measure_read_ceiling("cuda")
    w13, w2 = make_weights(shape, args.dtype, "cuda")
    results = []
    for T in args.tokens:
        fx = Fixture(shape, T, args.dtype, w13=w13, w2=w2)
        rows = [measure(fx, {}), measure(fx, {"moe.fused": 1}, stages_all=False)]
        if args.grid:
            for w, u in itertools.product([1, 2, 4, 8, 16], [1, 2, 4, 8]):
                r = measure(fx, {"moe.gate_up.warps": w, "moe.gate_up.unroll": u}, stages_all=True)
                rows.append(r)
            for w, u in itertools.product([2, 4, 8, 16], [1, 2, 4, 8]):
                rows.append(measure(fx, {"moe.down.warps": w, "moe.down.unroll": u}, stages_all=True))
        if args.pdl:
            for cfg in ({"moe.pdl": 1}, {"moe.pdl": 0}):
                rows.append(measure(fx, cfg, stages_all=False))
        if args.min_blocks:
            for mb in (1, 2):
                rows.append(measure(fx, {"moe.gate_up.min_blocks": mb}, stages_all=True))
        if args.loads:
            for a, b in itertools.product([4, 1], [1, 4]):
                rows.append(measure(fx, {"moe.load": a, "moe.down_load": b}, stages_all=True))
        for cfg in json.loads(args.configs) if args.configs else []:
            # one launch for both stages (fused): the per-stage times would be other kernels'
            one = bool(cfg.get("moe.fused"))
            rows.append(measure(fx, cfg, stages_all=not one))
        if args.descent:
            configure({})
            props = torch.cuda.get_device_properties(0)
            arch = props.major * 10 + props.minor
            space = _lib.tune_space("moe")
            start = {k: _lib.tune_get(k, arch, props.name, shape.tune_key(args.dtype), T)[0] for k in space}
            start.update(json.loads(args.start) if args.start else {})

            def cost(cfg):
                r = measure(fx, cfg, stages_all=False)
                rows.append(r)
                return r["all_us"] if r["ok"] else float("inf")

            best, best_us, _ = coordinate_descent(cost, space, start, rounds=args.rounds,
                                                  progress=lambda m: print(f"  {shape.name} T={T} {m}", flush=True))
            r = measure(fx, best)
            r["best"] = True
            rows.append(r)
        for r in rows:
            r.update(model=shape.name, tokens=T, bytes=fx.bytes, ceiling_tbps=ceiling)
            if r.get("all_us"):
                r["fraction_of_ceiling"] = fx.bytes / (r["all_us"] * 1e-6) / 1e12 / ceiling
            print(f"{'BEST ' if r.get('best') else ''}{shape.name} T={T} {r['config']} all={r.get('all_us', 0):.1f} gate_up={r.get('gate_up_us', 0):.1f} "
                  f"down={r.get('down_us', 0):.1f} frac={r.get('fraction_of_ceiling', 0):.3f} err={r['rel_err']:.1e}",
                  flush=True)
        results += rows
    configure({})
    if args.json:
        bench.write_rows(args.json, ceiling, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
