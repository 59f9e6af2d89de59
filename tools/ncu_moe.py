"""One warmed-up MoE call at a preset's dims, for Nsight Compute:
    ncu --clock-control none --kernel-name regex:moe_ --launch-skip 2 --launch-count 2 \\
        python3 bench/ncu_moe.py Mixtral-8x7B 1
"""
import sys

import torch

from opgraft.bench import moe as bench
from opgraft.ops import moe as ops
from opgraft.presets import resolve

shape, T = resolve(sys.argv[1]), int(sys.argv[2])
w13, w2 = bench.make_weights(shape, "bf16", "cuda")
gen = torch.Generator(device="cuda").manual_seed(5)
x = bench.make_x(T, shape.hidden, "bf16", "cuda", gen)
tw, ids = bench.make_routing(T, shape.num_experts, shape.top_k, "cuda", gen)
out = torch.empty_like(x)
for _ in range(2):
    ops.moe_experts_into(out, x, w13, w2, tw, ids)
torch.cuda.synchronize()
