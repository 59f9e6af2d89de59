# The qkv projection of Qwen3-30B-A3B alone, with and without the q/k epilogue, over a few tunables
# (span timing with 64 MiB of other traffic between calls; run from the repository root with the
# library built, OUT set). This is call 5's variant list; calls 3 and 4 ran others, named in their JSON.
import json, os, sys, torch
from opgraft import _lib, bench
from opgraft.bench import linear as lb
from opgraft.ops import linear as ops, attention as attn
from opgraft.presets import LINEAR_PRESETS
lb.measure_whole_row_range()
q = next(s for s in LINEAR_PRESETS["Qwen3-30B-A3B"] if s.proj == "qkv")
copies = lb.copies_for(q)
ws = [lb.make_weight(q, "bf16", "cuda", seed=i) for i in range(copies)]
between = bench.between_traffic(bench.BETWEEN_MIB, "cuda")
rows = []
for M in (1, 8):
    x = torch.randn(M, q.in_features, device="cuda").to(torch.bfloat16)
    out = torch.empty(M, q.out_features, device="cuda", dtype=torch.bfloat16)
    nw = (torch.rand(128, device="cuda") + .5).to(torch.bfloat16)
    cs = (2 * torch.rand(4096, 128, device="cuda") - 1).to(torch.bfloat16)
    pos = torch.full((M,), 100, dtype=torch.int64, device="cuda")
    pros = {"norm+neox": attn.QKPrologue(nw, nw, 1e-6, cs, pos, _lib.ROPE_NEOX),
            "neither": attn.QKPrologue(None, None, 1e-6, None, None, _lib.ROPE_NONE),
            "norm": attn.QKPrologue(nw, nw, 1e-6, None, None, _lib.ROPE_NONE)}
    V = [("plain", None, {}), ("plain w4", None, {"linear.warps": 4}), ("plain t2 w4", None, {"linear.tiles": 2, "linear.warps": 4}),
         ("qk", "norm+neox", {}), ("qk t4", "norm+neox", {"linear.tiles": 4}), ("qk norm", "norm", {}),
         ("qk w2", "norm+neox", {"linear.warps": 2}), ("qk u2", "norm+neox", {"linear.unroll": 2}),
         ("qk mb4", "norm+neox", {"linear.min_blocks": 4})]
    for name, pk, cfg in V:
        with bench.tunables(cfg, ops.forget_plans):
            if pk is None:
                call = lambda i, _: ops.linear_into(out, x, ws[i])
            else:
                pro = pros[pk]
                call = lambda i, _: ops.linear_qk_into(out, x, ws[i], None, 128, 32, 36, pro)
            try:
                call(0, None); torch.cuda.synchronize()
                us = bench.time_calls_span(call, [(i, None) for i in range(copies)], between)
            except Exception as e:
                us = float("nan"); print(name, e)
        rows.append({"M": M, "variant": name, "us": round(us, 2)})
        print(f"M={M} {name:<12} {us:7.2f} us", flush=True)
json.dump(rows, open(os.environ["OUT"] + "/qkprobe.json", "w"))
