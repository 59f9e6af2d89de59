"""Warmed-up MoE calls at a preset's dims, for Nsight Compute:
    ncu --clock-control none --kernel-name regex:moe_ --launch-skip 2 --launch-count 2 \\
        python3 -m tools.ncu_moe Mixtral-8x7B 1 [bf16|fp16|fp8-block|fp8-tensor]
Three calls, each after the bench's traffic between calls (64 MiB of other reads), so that the
profiled kernels find the L2 as a decode step leaves it. Keep ncu's default --cache-control all: with
none, its replay passes after the first find the weights in L2.
"""
import sys

import torch

from opgraft.bench.moe import FP8_KINDS, Fixture, Fp8Fixture
from opgraft.ops import moe as ops
from opgraft.presets import resolve

shape, T = resolve(sys.argv[1]), int(sys.argv[2])
dtype = sys.argv[3] if len(sys.argv) > 3 else "bf16"
fx = (Fp8Fixture if dtype in FP8_KINDS else Fixture)(shape, T, dtype, n_routings=1)
for _ in range(3):
    if fx.between:
        fx.between()
    ops.moe_experts_into(fx.outs[0], fx.xs[0], fx.w13, fx.w2, *fx.routings[0], workspace=fx.ws, fp8=fx.scales[0])
torch.cuda.synchronize()
