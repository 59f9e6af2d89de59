"""Measures the MoE kernels' time split and sweeps their tunables at one shape (GPU only).

    python -m opgraft.sweep --model Mixtral-8x7B --tokens 1,8 [--grid] [--pdl] [--min-blocks] [--loads]
        [--configs JSON] [--descent] [--json FILE]

Each configuration is set through the tunables' environment variables, re-resolved with
opgraft_tune_reload(), checked against the fp64 oracle, then timed (CUDA-graph replays, rotating
routings) for the gate/up stage alone, the down stage alone, and both.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys

import torch

from . import _lib, bench, ops
from .presets import resolve

from .tune import MOE_SPACE, coordinate_descent


def env_name(key: str) -> str:
    return "OPGRAFT_TUNE_" + key.upper().replace(".", "_")


@contextlib.contextmanager
def tunables_set(cfg: dict):
    """cfg's tunables set through their env vars inside the block; each variable is put back as it
    was (set or not) afterwards."""
    saved = {k: os.environ.get(env_name(k)) for k in cfg}
    try:
        for k, v in cfg.items():
            os.environ[env_name(k)] = str(v)
        _lib.lib().opgraft_tune_reload()
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(env_name(k), None)
            else:
                os.environ[env_name(k)] = v
        _lib.lib().opgraft_tune_reload()


def apply_config(cfg: dict) -> None:
    """Only cfg's tunables set through the environment: every other moe kernel tunable's variable
    is cleared (moe.max_tokens, which decides what is measured at all, is left as it is)."""
    keep = env_name("moe.max_tokens")
    for name in [n for n in os.environ if n.startswith("OPGRAFT_TUNE_MOE_") and n != keep]:
        del os.environ[name]
    for k, v in cfg.items():
        os.environ[env_name(k)] = str(v)
    _lib.lib().opgraft_tune_reload()


class Fixture:
    """Weights, routings and buffers of one (shape, T, dtype)."""

    def __init__(self, shape, T, dtype="bf16", n_routings=16, w13=None, w2=None):
        self.shape, self.T, self.dtype = shape, T, dtype
        bench.measure_whole_token_range()
        if w13 is None:
            w13, w2 = bench.make_weights(shape, dtype, "cuda")
        self.w13, self.w2 = w13, w2
        gen = torch.Generator(device="cuda").manual_seed(77 + T)
        self.xs = [bench.make_x(T, shape.hidden, dtype, "cuda", gen) for _ in range(n_routings)]
        self.routings = [bench.make_routing(T, shape.num_experts, shape.top_k, "cuda", gen) for _ in range(n_routings)]
        self.outs = [torch.empty_like(x) for x in self.xs]
        self.ws = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
        self.ref = bench.reference(self.xs[0], w13, w2, *self.routings[0])
        self.bytes = bench.unique_expert_bytes(shape, self.routings)
        # Timed as the bench times: other data read before each call (bench.BETWEEN_MIB).
        self.between = bench.between_traffic(bench.BETWEEN_MIB, "cuda")

    def check(self) -> float:
        out = torch.full_like(self.xs[0], float("nan"))
        ops.moe_experts_into(out, self.xs[0], self.w13, self.w2, *self.routings[0], workspace=self.ws)
        return bench.rel_err(out, self.ref)

    def time(self, stages=ops.STAGE_ALL, reps=30) -> float:
        def call(i, _):
            ops.moe_experts_into(self.outs[i], self.xs[i], self.w13, self.w2, *self.routings[i],
                                 workspace=self.ws, stages=stages)

        return bench.timed_calls(call, [(i, None) for i in range(len(self.xs))], self.between, reps,
                                 cross_check=False)[0]


def measure(fx: Fixture, cfg: dict, stages_all=True) -> dict:
    apply_config(cfg)
    err = fx.check()
    r = {"config": dict(cfg), "rel_err": err, "ok": err <= bench.TOLERANCE[fx.dtype]}
    if not r["ok"]:
        return r
    r["all_us"] = fx.time(ops.STAGE_ALL)
    if stages_all:
        r["gate_up_us"] = fx.time(ops.STAGE_GATE_UP)
        r["down_us"] = fx.time(ops.STAGE_DOWN)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opgraft.sweep")
    ap.add_argument("--model", default="Mixtral-8x7B")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--tp", type=int, default=1, help="one rank's shape under tensor parallelism")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--grid", action="store_true", help="sweep warps x unroll of each stage")
    ap.add_argument("--descent", action="store_true", help="coordinate descent over all tunables")
    ap.add_argument("--pdl", action="store_true",
                    help="moe.pdl 1 and 0: moe_down launched while gate_up's tail runs (sm_90)")
    ap.add_argument("--w2pf", action="store_true",
                    help="the down stage's weights requested into L2 during gate_up: budgets x priority")
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
    shape = resolve(args.model).per_rank(args.tp)
    ceiling = bench.measure_read_ceiling("cuda")
    w13, w2 = bench.make_weights(shape, args.dtype, "cuda")
    results = []
    for T in [int(t) for t in args.tokens.split(",")]:
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
        if args.w2pf:
            for mb, last in itertools.product([4, 8, 16, 24, 32, 48], [0, 1]):
                rows.append(measure(fx, {"moe.w2_prefetch": mb, "moe.w2_prefetch_last": last}, stages_all=False))
        if args.min_blocks:
            for mb in (1, 2):
                rows.append(measure(fx, {"moe.gate_up.min_blocks": mb}, stages_all=True))
        if args.loads:
            for a, b in itertools.product([4, 1], [1, 4]):
                rows.append(measure(fx, {"moe.load": a, "moe.down_load": b}, stages_all=True))
        for cfg in json.loads(args.configs) if args.configs else []:
            # one launch for both stages (fused, stream): the per-stage times would be other kernels'
            one = bool(cfg.get("moe.fused") or cfg.get("moe.stream"))
            rows.append(measure(fx, cfg, stages_all=not one))
        if args.descent:
            apply_config({})
            props = torch.cuda.get_device_properties(0)
            arch = props.major * 10 + props.minor
            start = {k: _lib.tune_get(k, arch, props.name, shape.tune_key(args.dtype), T)[0] for k in MOE_SPACE}
            start.update(json.loads(args.start) if args.start else {})

            def cost(cfg):
                r = measure(fx, cfg, stages_all=False)
                rows.append(r)
                return r["all_us"] if r["ok"] else float("inf")

            best, best_us, _ = coordinate_descent(cost, MOE_SPACE, start, rounds=args.rounds,
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
    apply_config({})
    if args.json:
        bench.write_rows(args.json, ceiling, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
