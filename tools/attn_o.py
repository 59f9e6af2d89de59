"""Decode attention and the output projection back to back, as a decode step runs them (GPU only).

    PYTHONPATH=python python3 -m tools.attn_o [--model Qwen3-30B-A3B] [--batch 1,8]
        [--context 256,1024,8192] [--variants NAME,...] [--attention-only] [--qkv] [--json FILE]

A call is what a layer does from the query to the projected output (with --attention-only, to
attention's output, checked against fp64 attention): a kernel writing the query
(the stand-in for the rotary/KV-write kernels before attention), opgraft's decode attention over a
shuffled paged cache (the context as the length hint, as a graph captured at max_model_len just
above it), then the o projection [hidden, heads x head size] on opgraft's linear op or
torch's (cuBLAS). Timed like every op here: rotated weight copies, 64 MiB of other reads before
each call, the span from the end of those reads to the end of the projection (bench.time_calls_span),
so an overlap between the two kernels counts. Each variant sets tunables only (VARIANTS), so the
kernels are the shipped ones; the projection's output is checked against fp64 in every variant.
The write variants add the layer's KV-cache write of the new key and value (views of the same
fused qkv row the query kernel writes): vLLM's reshape_and_cache_flash before attention
(vllm-write, needs vLLM), or opgraft's attention storing them itself (kernel-write). With --qkv the
fused row comes from the layer's qkv projection on opgraft's linear op (a random hidden row times
rotated weight copies) instead of a copy, so the span is qkv + attention + o and a variant that
lets attention start while qkv streams (linear.trigger with attention.pdl 2) shows what it saves.
"""
import argparse
import sys

from opgraft._entry import check_outputs, require_gpu
from tools import tunable_variants

# name: (attention and linear tunables set for the variant, projection on opgraft's op?, KV write)
VARIANTS = {
    "cublas": ({"attention.trigger": 0}, False, None),
    "pdl0": ({"attention.trigger": 0, "linear.pdl": 0}, True, None),
    "pdl1": ({"attention.trigger": 0, "linear.pdl": 1}, True, None),
    "trig-pdl1": ({"attention.trigger": 1, "linear.pdl": 1}, True, None),
    "trig-pdl2": ({"attention.trigger": 1, "linear.pdl": 2}, True, None),
    "apdl-trig-pdl2": ({"attention.pdl": 1, "attention.trigger": 1, "linear.pdl": 2}, True, None),
    "shipped": ({}, True, None),  # the rows and rules as they ship
    "vllm-write": ({}, True, "vllm"),  # vLLM's KV write, then the shipped attention and projection
    "kernel-write": ({}, True, "kernel"),  # the KV write inside the shipped attention
    # with --qkv: the projection's q/k epilogue (the model's q/k RMSNorm and rotary embedding in its
    # kernel), then kernel-write's attention; and the same started early (qkv triggers, attention
    # loads its first round before its wait)
    "qk": ({}, True, "qk"),
    "qk-early": ({"linear.trigger": 1, "attention.pdl": 2}, True, "qk"),
    # the rows as the engine runs them with the epilogue: attention told it follows the projection
    # (_lib.ATTN_AFTER_QKV, attention.pdl_pro)
    "qk-shipped": ({}, True, "qk-hint"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.attn_o")
    ap.add_argument("--model", default="Qwen3-30B-A3B")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", default="256,1024,8192")
    ap.add_argument("--variants", default=",".join(n for n, v in VARIANTS.items() if v[2] not in ("qk", "qk-hint")),
                    help="comma list of " + ", ".join(VARIANTS) + " (qk, qk-early, qk-shipped: with --qkv)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=KEY:VALUE,...[@kernel]",
                    help="one more variant on opgraft's projection, e.g. w16=attention.trigger:1,linear.warps:16; "
                         "@kernel: with the KV write inside attention (as kernel-write)")
    ap.add_argument("--attention-only", action="store_true",
                    help="time each variant's attention (with its KV write) without the projection after it, "
                         "checked against fp64 attention: what the span owes to the projection's overlap")
    ap.add_argument("--qkv", action="store_true",
                    help="the fused q/k/v row written by the qkv projection (opgraft's linear op) instead of a copy")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    extra = tunable_variants(args.extra, "kernel", "tools.attn_o")
    if extra is None:
        return 2
    variants = dict(VARIANTS, **{name: (cfg, True, "kernel" if write else None) for name, cfg, write in extra})
    names = args.variants.split(",") + [name for name, _, _ in extra]
    bad = [n for n in names if n not in variants]
    if bad:
        print(f"tools.attn_o: error: unknown variants {', '.join(bad)}", file=sys.stderr)
        return 2
    if not args.qkv and any(variants[n][2] in ("qk", "qk-hint") for n in names):
        print("tools.attn_o: error: the qk variants need --qkv (the epilogue is the projection's)", file=sys.stderr)
        return 2
    if not check_outputs("tools.attn_o", {"--json": args.json}):
        return 2
    torch = require_gpu("tools.attn_o")
    from opgraft import _lib, bench
    from opgraft.bench import attention as attn_bench
    from opgraft.bench import linear as linear_bench
    from opgraft.ops import attention as attn_ops
    from opgraft.ops import linear as linear_ops
    from opgraft.presets import ATTENTION_PRESETS, LINEAR_PRESETS

    shape = ATTENTION_PRESETS[args.model]
    oshape = next(s for s in LINEAR_PRESETS[args.model] if s.proj == "o")
    qshape = next(s for s in LINEAR_PRESETS[args.model] if s.proj == "qkv")
    linear_bench.measure_whole_row_range()
    ceiling = bench.measure_read_ceiling("cuda")
    between = bench.between_traffic(bench.BETWEEN_MIB, "cuda")
    copies = linear_bench.copies_for(oshape)
    weights = [linear_bench.make_weight(oshape, "bf16", "cuda", seed=i) for i in range(copies)]
    qcopies = copies if args.qkv else 0
    qweights = [linear_bench.make_weight(qshape, "bf16", "cuda", seed=100 + i) for i in range(qcopies)]

    def forget():
        attn_ops.forget_plans()
        linear_ops.forget_plans()

    try:
        from vllm._custom_ops import reshape_and_cache_flash
    except Exception as e:  # no vLLM here: its write's variant is left out
        reshape_and_cache_flash = None
        if any(variants[n][2] == "vllm" for n in names):
            print(f"tools.attn_o: vLLM's reshape_and_cache_flash not importable ({type(e).__name__}): "
                  "vllm-write left out", flush=True)
            names = [n for n in names if variants[n][2] != "vllm"]
    rows = []
    hq, hk, d = shape.heads_q, shape.heads_kv, shape.head_size
    for B in [int(b) for b in args.batch.split(",")]:
        for C in [int(c) for c in args.context.split(",")]:
            p = attn_bench.make_problem([C] * B, hq, hk, d, "bf16", "cuda")
            # q, k and v of the step as one fused row (what the kernel before attention writes)
            fused = torch.randn((B, (hq + 2 * hk) * d), device="cuda").to(torch.bfloat16)
            fused[:, : hq * d] = p.query.reshape(B, -1)
            p.query = fused[:, : hq * d].view(B, hq, d)
            knew = fused[:, hq * d:(hq + hk) * d].view(B, hk, d)
            vnew = fused[:, (hq + hk) * d:].view(B, hk, d)
            bs = p.key_cache.shape[1]
            slots = (p.block_table[:, (C - 1) // bs].long() * bs + (C - 1) % bs).contiguous()
            scale1 = torch.ones((), dtype=torch.float32, device="cuda")
            fsrc = fused.clone()
            hidden = torch.randn((B, qshape.in_features), device="cuda").to(torch.bfloat16) if args.qkv else None
            # the q/k epilogue's inputs: Qwen3-style norm weights, a rotary cache, the step's positions
            pro = attn_ops.QKPrologue((torch.rand(d, device="cuda") + 0.5).to(torch.bfloat16),
                                      (torch.rand(d, device="cuda") + 0.5).to(torch.bfloat16), 1e-6,
                                      (2 * torch.rand((C + 1, d), device="cuda") - 1).to(torch.bfloat16),
                                      torch.full((B,), C - 1, dtype=torch.int64, device="cuda"),
                                      _lib.ROPE_NEOX)
            out = torch.empty((B, hq, d), dtype=torch.bfloat16, device="cuda")
            x = out.view(B, -1)
            ys = [torch.empty((B, oshape.out_features), dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
            last = [None]  # torch's output (it allocates its own, as vLLM's call does)
            for name in names:
                cfg, ours, write = variants[name]
                with bench.tunables(cfg, forget):

                    def call(i, _):
                        if write in ("qk", "qk-hint"):  # the projection normalizes and rotates q and k itself
                            linear_ops.linear_qk_into(fused, hidden, qweights[i], None, d, hq, hq + hk, pro)
                        elif args.qkv:  # q/k/v of the step from the projection, as in a layer
                            linear_ops.linear_into(fused, hidden, qweights[i])
                        else:
                            fused.copy_(fsrc)
                        if write == "vllm":
                            reshape_and_cache_flash(knew, vnew, p.key_cache, p.value_cache, slots, "auto", scale1,
                                                    scale1)
                        if write in ("kernel", "qk", "qk-hint"):
                            attn_bench.run_ours(p, out, C, knew, vnew, slots,
                                                flags=_lib.ATTN_AFTER_QKV if write == "qk-hint" else 0)
                        else:
                            attn_bench.run_ours(p, out, C)
                        if args.attention_only:
                            return
                        if ours:
                            linear_ops.linear_into(ys[i], x, weights[i])
                        else:
                            last[0] = torch.nn.functional.linear(x, weights[i])

                    call(0, None)
                    torch.cuda.synchronize()
                    if args.attention_only:  # over the cache as the call left it (the new rows written)
                        err = bench.rel_err(out, attn_bench.reference(p))
                    else:
                        err = bench.rel_err(ys[0] if ours else last[0], x.double() @ weights[0].double().T)
                    us = bench.time_calls_span(call, [(i, None) for i in range(copies)], between)
                op = ("qkv+" if args.qkv else "") + ("attention" if args.attention_only else "attention+o")
                rows.append({"op": op, "model": args.model,
                             "variant": name, "tunables": cfg, "kv_write": write,
                             "batch": B, "context": C, "median_us": round(us, 2), "rel_err": float(f"{err:.3g}"),
                             "ok": err <= bench.TOLERANCE["bf16"]})
                print(f"B={B:<3} C={C:<6} {name:<15} {us:8.2f} us  rel_err {err:.2e}", flush=True)
    bench.print_variants(rows, ("batch", "context"), names, names[0], ceiling)
    if args.json:
        bench.write_rows(args.json, ceiling, rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
