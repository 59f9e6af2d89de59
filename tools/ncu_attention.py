"""Warmed-up decode-attention calls at a preset's heads, for Nsight Compute:
    ncu --clock-control none --kernel-name regex:attention_decode --launch-skip 2 --launch-count 1 \\
        python3 -m tools.ncu_attention Qwen3-30B-A3B 1 8192 [bf16|fp16]
Three calls over one batch of equal lengths (batch, context), each after the bench's traffic between
calls (64 MiB of other reads), so that the profiled kernel finds the L2 as a decode step leaves it.
Keep ncu's default --cache-control all: with none, its replay passes after the first find the K and V
in L2 (bench/NOTES.md v66).
"""
import sys

import torch

from opgraft.bench import BETWEEN_MIB, between_traffic
from opgraft.bench.attention import make_problem, run_ours
from opgraft.presets import ATTENTION_PRESETS

shape, batch, context = ATTENTION_PRESETS[sys.argv[1]], int(sys.argv[2]), int(sys.argv[3])
p = make_problem([context] * batch, shape.heads_q, shape.heads_kv, shape.head_size,
                 sys.argv[4] if len(sys.argv) > 4 else "bf16")
out = torch.empty_like(p.query)
between = between_traffic(BETWEEN_MIB, "cuda")
for _ in range(3):
    between()
    run_ours(p, out)
torch.cuda.synchronize()
