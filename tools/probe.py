"""Why a kernel is slower inside a model's decode step than in `opgraft bench`: the MoE stages timed
kernel by kernel (torch profiler over CUDA-graph replays, as `python -m tools.e2e --profile-steps` does),
under contexts that add one difference of a real decode step at a time.

  python -m tools.probe [--model Qwen3-30B-A3B] [--tokens 1,2,8] [--layers 16] [--json FILE]

Contexts (each a CUDA graph of one call per layer, over --layers weight copies; all but bench
use the router's routings):
  bench       routings drawn as `opgraft bench` does (uniform, k distinct experts per token), the
              MoE calls back to back;
  router      routings from a random-initialized router on the tokens' hidden states (top-k of
              x @ Wr, Wr ~ N(0, 0.02²) as the e2e study initializes it), back to back;
  step        a decode step's other work between the MoE calls: the attention projections of the
              layer (their own weights: qkv [H, 5120] and o [4096, H], Qwen3-30B-A3B's 32 query and
              4 kv heads of 128), x written from their result, the router GEMM and its top-k;
  gemm, write, route   one part of step alone;
  flush, flush8        a 64 MiB (more than L2) or 8 MiB read;
  pages       one 64-byte line in each 2 MiB page of 2 GiB (TLB reach, almost no bytes).
Per context and token count: µs per call of each MoE kernel (mean over the graph's launches) and
the unique experts per call.
"""
from __future__ import annotations

import argparse
import json
import sys

from opgraft._entry import DefaultsHelp, check_outputs, require_gpu
from opgraft.presets import ConfigError, resolve

KERNELS = ("moe_gate_up", "moe_down", "moe_fused")
# context: the work between two MoE calls ("uniform": bench's routings, else the router's)
CONTEXTS = {
    "bench": {"uniform"}, "router": set(), "step": {"gemm", "write", "route"},
    "gemm": {"gemm"}, "write": {"write"}, "route": {"route"},
    "flush": {"flush"}, "flush8": {"flush8"}, "pages": {"pages"},
}


def _contexts(text: str) -> list[str]:
    names = [c for c in text.split(",") if c]
    bad = [c for c in names if c not in CONTEXTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"contexts are a comma-separated list of {', '.join(CONTEXTS)}")
    return names


def _tokens(text: str) -> list[int]:
    try:
        ts = [int(t) for t in text.split(",")]
    except ValueError:
        ts = []
    if not ts or not all(1 <= t <= 64 for t in ts):
        raise argparse.ArgumentTypeError("tokens are comma-separated integers in 1..64")
    return ts


def router_routing(x, wr, k):
    import torch

    logits = (x.float() @ wr.float())
    w, ids = torch.softmax(logits, dim=1).topk(k, dim=1)
    return (w / w.sum(1, keepdim=True)).float(), ids.to(torch.int32)


def kernel_times(step, replays: int = 20) -> dict:
    """{kernel name: (launches per replay, mean µs per launch)} of `step` captured in a graph."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from opgraft.bench import capture, profiler_kernels

    g = capture(step)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    b.synchronize()
    wall = a.elapsed_time(b) * 1e3 / replays
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    kernels = {k: (n / replays, us / n) for k, (n, us) in profiler_kernels(prof).items()}
    return {"replay_us": wall, "kernels": kernels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.probe", description=__doc__.split("\n\n")[0],
                                 formatter_class=DefaultsHelp)
    ap.add_argument("--model", default="Qwen3-30B-A3B", help="a preset, a config.json or a model folder holding one")
    ap.add_argument("--tokens", type=_tokens, default=[1, 2, 8], help="comma-separated token counts (1..64)")
    ap.add_argument("--layers", type=int, default=16, help="copies of the layer's weights the calls rotate over")
    ap.add_argument("--contexts", type=_contexts, default=["bench", "router", "step"],
                    help=f"comma-separated, of {', '.join(CONTEXTS)}")
    ap.add_argument("--json", default=None, help="write the rows to this file (default: none)")
    args = ap.parse_args(argv)
    if not 1 <= args.layers <= 256:
        print("tools.probe: --layers must be in 1..256", file=sys.stderr)
        return 2
    try:
        shape = resolve(args.model)
    except ConfigError as e:
        print(f"tools.probe: {e}", file=sys.stderr)
        return 2
    if not check_outputs("tools.probe", {"--json": args.json}):
        return 2
    torch = require_gpu("tools.probe")
    from opgraft.bench.moe import make_routing, make_weights, make_x
    from opgraft.ops import moe as ops

    dev = "cuda"
    H, E, k = shape.hidden, shape.num_experts, shape.top_k
    g = torch.Generator(device=dev).manual_seed(7)
    layers = [make_weights(shape, "bf16", dev, seed=i) for i in range(args.layers)]
    wr = [torch.randn((H, E), generator=g, device=dev).mul_(0.02).bfloat16() for _ in layers]
    qkv = [torch.randn((H, 5120), generator=g, device=dev).mul_(0.02).bfloat16() for _ in layers]
    o = [torch.randn((4096, H), generator=g, device=dev).mul_(0.02).bfloat16() for _ in layers]
    ws = torch.empty(1 << 24, dtype=torch.uint8, device=dev)
    used = set().union(*(CONTEXTS[c] for c in args.contexts))
    sink = torch.empty(1024, dtype=torch.bfloat16, device=dev)
    flush = torch.ones((1 << 15, 1024), dtype=torch.bfloat16, device=dev) if used & {"flush", "flush8"} else None
    pages = torch.ones((1024, 1 << 20), dtype=torch.bfloat16, device=dev) if "pages" in used else None  # 2 MiB rows
    rows = []
    for T in args.tokens:
        xs = [make_x(T, H, "bf16", dev, g) for _ in layers]
        outs = [torch.empty_like(x) for x in xs]
        uni = [make_routing(T, E, k, dev, g) for _ in layers]
        rtr = [router_routing(x, w, k) for x, w in zip(xs, wr)]
        for ctx in args.contexts:
            parts = CONTEXTS[ctx]
            routs = uni if "uniform" in parts else rtr

            def step():
                for i, (w13, w2) in enumerate(layers):
                    if "gemm" in parts:
                        q = xs[i] @ qkv[i]
                        y = q[:, :4096] @ o[i]
                        if "write" in parts:
                            xs[i].add_(0 * y)  # x written just before the call
                    elif "write" in parts:
                        xs[i].mul_(1)
                    if "route" in parts:
                        router_routing(xs[i], wr[i], k)
                    if "flush" in parts:
                        torch.sum(flush, dim=0, out=sink)
                    if "flush8" in parts:
                        torch.sum(flush[: 1 << 12], dim=0, out=sink)
                    if "pages" in parts:
                        torch.sum(pages[:, :32], dim=0, out=sink[:32])
                    ops.moe_experts_into(outs[i], xs[i], w13, w2, *routs[i], workspace=ws)

            kt = kernel_times(step)
            uniq = sum(len(torch.unique(r[1])) for r in routs) / len(routs)
            row = {"model": shape.name, "tokens": T, "context": ctx, "unique_experts": uniq,
                   "replay_us_per_layer": round(kt["replay_us"] / len(layers), 2)}
            for name, (n, us) in kt["kernels"].items():
                for kn in KERNELS:
                    if name.startswith(kn):
                        row[kn + "_us"] = round(us, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{'T':>3} {'context':<8} {'uniq':>5} {'gate_up':>8} {'down':>8} {'layer':>8}")
    for r in rows:
        print(f"{r['tokens']:>3} {r['context']:<8} {r['unique_experts']:>5.1f} {r.get('moe_gate_up_us', 0):>8.2f} "
              f"{r.get('moe_down_us', 0):>8.2f} {r['replay_us_per_layer']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
