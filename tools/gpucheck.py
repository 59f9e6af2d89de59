"""GPU check (`make gpu-test`): every op's correctness cases against its fp64 oracle, then each op's
bench at real model dims with the read ceiling measured in the same run.

    python -m tools.gpucheck [--ops moe,...] [--quick] [--only TEXT] [--out DIR]

Each op's cases and bench are in tools/checks/<op>.py. Prints a short table last and writes
<op>_check.json and <op>_bench.json under --out.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import time

from opgraft._entry import require_gpu

from . import checks


def check_names() -> list[str]:
    """The ops with a tools/checks/<op>.py, found without importing them (they need torch)."""
    return sorted(m.name for m in pkgutil.iter_modules(checks.__path__))


def check_modules(names=None) -> dict:
    """{op: module} of tools/checks/<op>.py."""
    out = {}
    for name in names or check_names():
        mod = importlib.import_module(f"{checks.__name__}.{name}")
        out[mod.NAME] = mod
    return out


def main(argv=None) -> int:
    names = check_names()
    ap = argparse.ArgumentParser(prog="python -m tools.gpucheck")
    ap.add_argument("--ops", default=",".join(names), help="the ops to check (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="correctness only, no benchmark")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where the JSON goes (default: $OUT or .)")
    ap.add_argument("--only", default="", help="run only the correctness cases whose name contains this")
    args = ap.parse_args(argv)
    unknown = [o for o in args.ops.split(",") if o not in names]
    if unknown:
        print(f"tools.gpucheck: error: no checks for {', '.join(unknown)} (have: {', '.join(names)})", file=sys.stderr)
        return 2
    torch = require_gpu("tools.gpucheck", ": the GPU check needs one")
    from opgraft import _lib, bench

    mods = check_modules(args.ops.split(","))
    torch.cuda.init()
    os.makedirs(args.out, exist_ok=True)
    facts = bench.gpu_facts()
    print("device:", facts, flush=True)
    print("runtime:", _lib.runtime_info(), flush=True)
    summary, failed_any = [], False
    for op in args.ops.split(","):
        mod = mods[op]
        mod.prepare()
        t0 = time.time()
        results = []
        for c in mod.cases():
            if args.only not in c["name"]:
                continue
            r = mod.run_case(c)
            results.append(r)
            print(f"  {'PASS' if r['passed'] else 'FAIL'} {op:<9} {r['name']:<52} rel_err={r.get('rel_err', float('nan')):.2e} "
                  f"det={r.get('deterministic')} {r.get('reason', '')}", flush=True)
        with open(os.path.join(args.out, f"{op}_check.json"), "w") as f:
            json.dump({"device": facts, "cases": results}, f, indent=1, default=str)
        failed = [r for r in results if not r["passed"]]
        failed_any |= bool(failed)
        summary.append(f"{op}: {len(results) - len(failed)}/{len(results)} cases pass ({time.time() - t0:.0f} s)")
        print(summary[-1], flush=True)
    if not args.quick:
        ceiling = bench.measure_read_ceiling("cuda")
        print(f"read ceiling (stream_read, 4 GiB): {ceiling:.3f} TB/s", flush=True)
        for op in args.ops.split(","):
            mod = mods[op]
            if not hasattr(mod, "bench_rows"):
                continue
            rows = mod.bench_rows(ceiling)
            bench.write_rows(os.path.join(args.out, f"{op}_bench.json"), ceiling, rows, facts)
            print(mod.format_rows(rows))
        summary.append(f"read ceiling {ceiling:.3f} TB/s")
    print("; ".join(summary))
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
