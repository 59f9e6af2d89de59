"""A MoE layer from the router gate to the experts' output, as a decode step runs it (GPU only).

    PYTHONPATH=python python3 -m tools.moe_route [--model Qwen3-30B-A3B] [--tokens 1,2,4,8]
        [--dtype bf16|fp8-block] [--variants NAME,...] [--extra NAME=KEY:VALUE,...[@x16]] [--json FILE]

A call: the router gate (opgraft's linear op, [E, H]), then either vLLM's topk_softmax
(fused_topk, what FusedTopKRouter runs; "vllm-topk", where vLLM imports) or torch's softmax and
topk ("torch-topk") followed by opgraft's experts kernels with that routing, or opgraft's experts
kernels routing from the logits themselves ("routed"; where the guard keeps vLLM's routing, e.g.
moe.route 0 above 4 tokens, the row says so, and OPGRAFT_TUNE_MOE_ROUTE=1 times it anyway). Timed like every op here: 64 MiB of other
reads before each call, the span from the end of those reads to the end of the call
(bench.time_calls_span), over 16 random inputs; the first output is checked against fp64 with the
routing recomputed from the logits, after the eager call and again after the timed graph replays.
"given": the experts with the routing computed before the span (the gate still in it): what the
routing costs the other variants. --dtype fp8-block: block-FP8
weights, the activations quantized before the span (vLLM's prepare step runs in every variant),
the gate on the bf16 hidden states; two more variants: "routed+quant" (that quantization inside the
span, as the routing seam runs it where moe.fp8_quantize is 0) and "routed-x16" (the bf16 hidden states
to the kernels, which quantize them; checked against the oracle of their own quantization).
bf16 has two more, from the previous layer's output and the residual (vLLM's add + RMSNorm before
the MoE layer in the span): "norm+routed" (the norm compiled by Inductor, as the compiled model
runs it, then the gate and "routed") and "routed-norm" (the gate's kernel does the norm and writes
the normalized rows the experts read: the norm fusion's MoE form).
--extra adds a variant that runs "routed" (with @x16: "routed-x16") with those tunables set,
linear.* for the gate and moe.* for the experts: e.g. in0=moe.pdl_in:0, gate_up launched after the
gate ends instead of as its programmatic dependent.
"""
import argparse
import sys

from opgraft._entry import check_outputs, require_gpu
from tools import tunable_variants

DEVICE = "cuda"  # a test runs the tool on the CPU with stand-ins for the kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.moe_route")
    ap.add_argument("--model", default="Qwen3-30B-A3B")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp8-block"))
    ap.add_argument("--variants", default=None, help="comma list of the variants to run (default: all)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=KEY:VALUE,...[@x16]",
                    help="one more variant: routed (or routed-x16) with these tunables set")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    specs = tunable_variants(args.extra, "x16", "tools.moe_route")
    if specs is None:
        return 2
    # name: (the variant it runs, its tunables)
    extra = {name: ("routed-x16" if x16 else "routed", cfg) for name, cfg, x16 in specs}
    if not check_outputs("tools.moe_route", {"--json": args.json}):
        return 2
    torch = require_gpu("tools.moe_route")
    from opgraft import bench
    from opgraft.bench import linear as linear_bench
    from opgraft.bench import moe as moe_bench
    from opgraft.ops import linear as linear_ops
    from opgraft.ops import moe as ops
    from opgraft.presets import PRESETS

    shape = PRESETS[args.model]
    E, H, k = shape.num_experts, shape.hidden, shape.top_k
    moe_bench.measure_whole_token_range()
    ceiling = bench.measure_read_ceiling(DEVICE)
    between = bench.between_traffic(bench.BETWEEN_MIB, DEVICE)
    fp8 = args.dtype == "fp8-block"
    if fp8:
        w13, s13, w2, s2 = moe_bench.make_weights_fp8(shape, "fp8-block", DEVICE)
    else:
        w13, w2 = moe_bench.make_weights(shape, "bf16", DEVICE)
    gate = (torch.randn((E, H), device=DEVICE) * H ** -0.5).to(torch.bfloat16)
    try:
        from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
    except Exception as e:
        fused_topk = None
        print(f"(vllm-topk: vLLM is not importable here: {type(e).__name__})")

    def torch_topk(x, logits):
        w, ids = torch.topk(torch.softmax(logits.float(), -1), k, -1)
        return w / w.sum(-1, keepdim=True), ids.to(torch.int32)

    routers = {"torch-topk": torch_topk}
    if fused_topk is not None:
        routers["vllm-topk"] = lambda x, logits: fused_topk(x, logits, k, True)[:2]
    names = ["given"] + list(routers) + ["routed"] + (["routed+quant", "routed-x16"] if fp8 else
                                                       ["norm+routed", "routed-norm"])
    if args.variants:
        bad = [v for v in args.variants.split(",") if v not in names]
        if bad:
            print(f"tools.moe_route: error: unknown variants {', '.join(bad)} (of {', '.join(names)})",
                  file=sys.stderr)
            return 2
        names = args.variants.split(",")
    if any(extra[e][0] == "routed-x16" for e in extra) and not fp8:
        print("tools.moe_route: error: @x16 needs --dtype fp8-block", file=sys.stderr)
        return 2
    norm = bool({"norm+routed", "routed-norm"} & set(names))  # the add + RMSNorm variants' inputs
    if norm:
        norm_w = (torch.rand(H, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(8)) + 0.5
                  ).to(torch.bfloat16)
        compiled_norm = linear_bench._compiled_norm()
    names += [e for e in extra if e not in names]

    def forget():
        linear_ops.forget_plans()
        ops.forget_plans()
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    n = 16
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        xs = [moe_bench.make_x(T, H, "bf16", DEVICE, gen) for _ in range(n)]
        # the experts' input: the hidden states, or their block-FP8 quantization with its scales
        xq = [moe_bench.quantize_activations_fp8(x, "fp8-block", moe_bench.FP8_BLOCK[1]) if fp8 else (x, None)
              for x in xs]
        sc = [moe_bench.fp8_scales("fp8-block", q[1], s13, s2) if fp8 else None for q in xq]
        logits = [torch.empty((T, E), dtype=torch.bfloat16, device=DEVICE) for _ in range(n)]
        outs = [torch.empty((T, H), dtype=torch.bfloat16, device=DEVICE) for _ in range(n)]
        ws = torch.empty(1 << 24, dtype=torch.uint8, device=DEVICE)
        for i in range(n):
            linear_ops.linear_into(logits[i], xs[i], gate)
        given = [torch_topk(xs[i], logits[i]) for i in range(n)]

        def routing(lg):
            """The renormalized top-k of softmax(lg) in fp64 (ties to the lower expert)."""
            v = lg.double()
            order = torch.sort(-v, dim=-1, stable=True).indices[:, :k]
            p = torch.softmax(v, -1).gather(1, order)
            return (p / p.sum(-1, keepdim=True)).float(), order.to(torch.int32)

        pw, pid = routing(logits[0])
        ref = (moe_bench.reference_fp8(xq[0][0], sc[0], w13, w2, pw, pid) if fp8
               else moe_bench.reference(xs[0], w13, w2, pw, pid))
        if norm:  # xs as the previous layer's output, a residual, the normalized rows the variant
            # makes, the router logits of those rows
            res = [(4 * moe_bench.make_x(T, H, "bf16", DEVICE, gen)) for _ in range(n)]
            r_out, hn = ([torch.empty((T, H), dtype=torch.bfloat16, device=DEVICE) for _ in range(n)]
                         for _ in range(2))
            lgn = [torch.empty((T, E), dtype=torch.bfloat16, device=DEVICE) for _ in range(n)]
            h0 = linear_ops.add_rms_norm_reference(xs[0], res[0], norm_w, linear_bench.NORM_EPS)[0]
        if fp8:
            sx16 = moe_bench.fp8_scales("fp8-block", None, s13, s2)
            q16 = moe_bench.quantize_as_the_kernel(xs[0], moe_bench.FP8_BLOCK[1])
            ref16 = moe_bench.reference_fp8(q16[0], moe_bench.fp8_scales("fp8-block", q16[1], s13, s2), w13, w2, pw, pid)
        for name in names:
            kind, cfg = extra.get(name, (name, {}))
            with bench.tunables(cfg, forget):
                if "routed" in kind:
                    x0, f0 = (xs[0], sx16) if kind == "routed-x16" else (xq[0][0], sc[0])
                    plan = ops.plan_for_routed(x0, w13, w2, logits[0], k, True, outs[0], fp8=f0)
                    if plan.handle is None:  # the guard keeps vLLM's routing here
                        print(f"T={T:<3} {name:<11} handed back: {plan.reason}", flush=True)
                        continue

                def call(i, _, kind=kind):
                    if kind == "norm+routed":
                        h = compiled_norm(xs[i], res[i], norm_w, linear_bench.NORM_EPS)[0]
                        linear_ops.linear_into(lgn[i], h, gate)
                        ops.moe_routed_into(outs[i], h, w13, w2, lgn[i], k, True, workspace=ws)
                        return
                    if kind == "routed-norm":
                        linear_ops.add_rms_norm_linear_into(lgn[i], r_out[i], xs[i], res[i], norm_w,
                                                            linear_bench.NORM_EPS, gate, None, hn[i])
                        ops.moe_routed_into(outs[i], hn[i], w13, w2, lgn[i], k, True, workspace=ws)
                        return
                    linear_ops.linear_into(logits[i], xs[i], gate)
                    if kind == "routed":
                        ops.moe_routed_into(outs[i], xq[i][0], w13, w2, logits[i], k, True, workspace=ws, fp8=sc[i])
                    elif kind == "routed+quant":
                        q, qs = moe_bench.quantize_activations_fp8(xs[i], "fp8-block", moe_bench.FP8_BLOCK[1])
                        ops.moe_routed_into(outs[i], q, w13, w2, logits[i], k, True, workspace=ws,
                                            fp8=moe_bench.fp8_scales("fp8-block", qs, s13, s2))
                    elif kind == "routed-x16":
                        ops.moe_routed_into(outs[i], xs[i], w13, w2, logits[i], k, True, workspace=ws, fp8=sx16)
                    else:
                        tw, ids = given[i] if kind == "given" else routers[kind](xs[i], logits[i])
                        ops.moe_experts_into(outs[i], xq[i][0], w13, w2, tw, ids, workspace=ws, fp8=sc[i])

                call(0, None)
                torch.cuda.synchronize()
                want = ref16 if kind == "routed-x16" else ref
                if kind in ("norm+routed", "routed-norm"):  # from the normalized rows, routed by their logits
                    want = moe_bench.reference(h0, w13, w2, *routing(lgn[0]))
                err = bench.rel_err(outs[0], want)
                us = bench.time_calls_span(call, [(i, None) for i in range(n)], between)
                # the graph replays wrote outs[0] again (a PDL race would show here, not in the eager call)
                err = max(err, bench.rel_err(outs[0], want))
                tol = 1e-2 if fp8 else bench.TOLERANCE["bf16"]  # FP8: tools.checks.moe's FP8 tolerance
                rows.append({"op": "moe+route", "model": args.model, "dtype": args.dtype, "variant": name,
                             "tunables": cfg, "tokens": T, "median_us": round(us, 2), "rel_err": float(f"{err:.3g}"),
                             "ok": err <= tol})
                print(f"T={T:<3} {name:<11} {us:8.2f} us  rel_err {err:.2e}", flush=True)
    bench.print_variants(rows, ("tokens",), names, "routed" if "routed" in names else names[0], ceiling)
    if args.json:
        bench.write_rows(args.json, ceiling, rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
