import os, sys, json, torch
from opgraft import bench, ops, _lib
from opgraft.sweep import Fixture, apply_config
from opgraft.presets import resolve
shape = resolve(sys.argv[1]); T = int(sys.argv[2])
fx = Fixture(shape, T)
def run(cfg, name):
    apply_config(cfg)
    ws = fx.ws
    for rep in range(6):
        ws[8 << 20: 11 << 20].zero_()
        fx.between(); 
        ops.moe_experts_into(fx.outs[0], fx.xs[0], fx.w13, fx.w2, *fx.routings[0], workspace=ws)
        torch.cuda.synchronize()
    t = ws[8 << 20: 11 << 20].view(torch.int64).view(3, -1, 8).cpu()
    nz = t[t > 0]; t0 = int(nz.min())
    print(f"== {name} {cfg}")
    for reg, rn in enumerate(["gate_up", "down", "fused"]):
        blk = t[reg]
        used = blk[:, 0] > 0
        if not used.any(): continue
        b = blk[used]
        for i in range(8):
            col = b[:, i]; col = col[col > 0]
            if len(col) == 0: continue
            col = (col - t0).double() / 1000
            print(f"  {rn} slot{i} n={len(col)} min={col.min():.2f} med={col.median():.2f} max={col.max():.2f} us")
run({}, "two kernels")
run({"moe.down.early": 1}, "down early")
