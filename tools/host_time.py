"""Host microseconds per MoE call in eager mode (no CUDA graph): what the Python layer, ctypes and
the launcher cost on the CPU for each call (GPU only; a development tool).

    PYTHONPATH=python python -m tools.host_time [--model Qwen3-30B-A3B] [--tokens 1,8] [--calls 2000] [--json F]
    PYTHONPATH=python python -m tools.host_time --op prologue [--model Qwen3-30B-A3B] [--tokens 1,128]

--op prologue: the attention prologue alone (ops.attention.qk_prologue: the model's q/k RMSNorm
and NeoX rotary embedding of that many rows), the call every eager prefill makes once a layer.

Two paths: the op called directly (ops.moe.moe_experts_into), and the dispatch path a vLLM call
takes after the seam (an ExpertsCall through dispatch, stats included). The calls are enqueued
back to back on one stream and the host clock is read around them without synchronizing, so the
GPU's own time is not counted (the queue is far deeper than the calls made between two reads;
every 200 calls the stream is synchronized outside the timed region so it never fills). Works with
the package of an older tree too (its op module and dispatch signature are detected), so the same
script measures before and after.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time


def _load():
    """(moe_experts_into, dispatch function, ExpertsCall) of whichever opgraft is importable."""
    try:
        from opgraft.ops import moe as ops
    except ImportError:  # an older tree: opgraft.ops was one module
        from opgraft import ops
    from opgraft import dispatch

    params = list(inspect.signature(dispatch.dispatch).parameters)
    if params and params[0] == "op":
        run = lambda call: dispatch.dispatch("moe", call)  # noqa: E731
    else:
        run = dispatch.dispatch
    return ops.moe_experts_into, run, dispatch.ExpertsCall


def measure(fn, calls: int, sync) -> float:
    """Median over batches of 200 calls of the host µs per call."""
    per = []
    done = 0
    while done < calls:
        sync()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        per.append((time.perf_counter() - t0) / 200 * 1e6)
        done += 200
    return statistics.median(per)


def _row(args, name: str, T: int, path: str, us: float, torch) -> dict:
    print(f"{args.label:<8} {name} T={T:<3} {path:<9} {us:7.2f} us per call (host)", flush=True)
    return {"label": args.label, "model": name, "tokens": T, "path": path, "host_us_per_call": round(us, 2),
            "calls": args.calls, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}


def moe_rows(args, shape, torch) -> list[dict]:
    """Host µs per MoE call: the op called directly, and through dispatch."""
    moe_into, run, ExpertsCall = _load()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    E, H, I, k = shape.num_experts, shape.hidden, shape.inter, shape.top_k
    w13 = torch.randn((E, 2 * I, H), device=dev, generator=g).to(torch.bfloat16)
    w2 = torch.randn((E, H, I), device=dev, generator=g).to(torch.bfloat16)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn((T, H), device=dev, generator=g).to(torch.bfloat16)
        ids = torch.rand((T, E), device=dev, generator=g).topk(k, dim=1).indices.to(torch.int32)
        tw = torch.softmax(torch.randn((T, k), device=dev, generator=g), dim=1)
        out = torch.empty_like(x)
        ws = torch.empty(1 << 24, dtype=torch.uint8, device=dev)
        direct = lambda: moe_into(out, x, w13, w2, tw, ids, workspace=ws)  # noqa: E731

        def via_dispatch():
            run(ExpertsCall(hidden_states=x, w13=w13, w2=w2, topk_weights=tw, topk_ids=ids, activation="silu",
                            apply_router_weight_on_input=False, expert_map=None, delegate=lambda: None,
                            output=out, workspace=ws))

        for fn in (direct, via_dispatch):  # warm up: plans, compiles, caches
            fn()
        torch.cuda.synchronize()
        for path, fn in (("op", direct), ("dispatch", via_dispatch)):
            rows.append(_row(args, shape.name, T, path, measure(fn, args.calls, torch.cuda.synchronize), torch))
        torch.cuda.synchronize()
    return rows


def prologue_rows(args, shape, torch) -> list[dict]:
    """Host µs per call of the attention prologue alone at each row count (an attention preset's
    heads; the bench's q/k RMSNorm and NeoX rotary embedding): ops.attention.qk_prologue, and the
    library's entry alone."""
    from opgraft.bench.attention import prologue_rows as inputs
    from opgraft.ops.attention import qk_prologue

    Hq, Hk, D = shape.heads_q, shape.heads_kv, shape.head_size
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        qkv, pro = inputs(T, Hq, Hk, D, torch.bfloat16, "cuda", seed=T)
        q, k = qkv[:, :Hq * D].view(T, Hq, D), qkv[:, Hq * D:(Hq + Hk) * D].view(T, Hk, D)
        for path, fn in (("prologue", lambda: qk_prologue(q, k, pro)), ("library", _library_call(q, k, pro, torch))):
            fn()
            torch.cuda.synchronize()
            rows.append(_row(args, shape.name, T, path, measure(fn, args.calls, torch.cuda.synchronize), torch))
    return rows


def _library_call(q, k, pro, torch):
    """The library's entry alone (opgraft_attention_prologue_run), its arguments built once: what of
    the prologue's host time is C (the guard, the function lookup, the launch)."""
    import ctypes

    from opgraft import _lib
    from opgraft.ops import current_stream
    from opgraft.ops.attention import prologue_args

    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    a, ko = prologue_args(q, k, q_out, k_out, pro)
    run, ref, stream, kp = _lib.lib().opgraft_attention_prologue_run, ctypes.byref(a), current_stream(q.device), \
        k_out.data_ptr()
    return lambda: _lib.check(run(ref, kp, ko, stream))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.host_time")
    ap.add_argument("--model", default="Qwen3-30B-A3B", help="a preset (default: %(default)s)")
    ap.add_argument("--tokens", default="1,8", help="token counts (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per path (default: %(default)s)")
    ap.add_argument("--label", default="", help="a name for the tree measured (e.g. before, after)")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument("--op", choices=["moe", "prologue"], default="moe", help="the call timed (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("error: tools.host_time measures on a GPU and needs torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA GPU here", file=sys.stderr)
        return 2
    from opgraft.presets import ATTENTION_PRESETS, resolve

    if args.op == "prologue":
        if args.model not in ATTENTION_PRESETS:
            print(f"error: --op prologue takes the attention presets: {', '.join(ATTENTION_PRESETS)}", file=sys.stderr)
            return 2
        rows = prologue_rows(args, ATTENTION_PRESETS[args.model], torch)
    else:
        rows = moe_rows(args, resolve(args.model), torch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
