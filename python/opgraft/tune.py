"""Correctness-gated coordinate descent over the MoE kernel's tunables.

The search itself (coordinate_descent) is pure Python and takes any cost function, so it is tested
without a GPU; the GPU cost function sets a configuration through the tunables' environment
variables, checks the result against the fp64 oracle (an incorrect configuration can never win)
and times both kernels with CUDA-graph replays.
"""

from __future__ import annotations

import math
from typing import Callable

# Candidate values per tunable key; the kernel clamps what would not fit (src/moe.c).
MOE_SPACE = {
    "moe.gate_up.warps": [1, 2, 4, 8, 16],
    "moe.gate_up.unroll": [1, 2, 4],
    "moe.down.warps": [2, 4, 8, 16],
    "moe.down.unroll": [1, 2, 4, 8],
    "moe.l2_fetch": [0, 128, 256],
    "moe.prefetch": [0, 1, 2, 4],
    "moe.pdl": [0, 1],
}


def coordinate_descent(cost: Callable[[dict], float], space: dict, start: dict, rounds: int = 2,
                       min_gain: float = 0.01, progress: Callable[[str], None] | None = None):
    """Minimises cost(config) one key at a time. cost returns math.inf for a rejected (incorrect or
    failing) configuration. A move must gain at least min_gain (relative) to be taken, so noise
    does not wander. Returns (best_config, best_cost, history)."""
    best = dict(start)
    best_cost = cost(best)
    history = [(dict(best), best_cost)]
    seen = {tuple(sorted(best.items())): best_cost}
    for r in range(rounds):
        improved = False
        for key, values in space.items():
            for v in values:
                if best.get(key) == v:
                    continue
                cand = dict(best, **{key: v})
                sig = tuple(sorted(cand.items()))
                if sig in seen:
                    c = seen[sig]
                else:
                    c = cost(cand)
                    seen[sig] = c
                    history.append((dict(cand), c))
                if progress:
                    progress(f"round {r + 1} {key}={v}: {c:.2f} (best {best_cost:.2f})")
                if c < best_cost * (1.0 - min_gain):
                    best, best_cost, improved = cand, c, True
        if not improved:
            break
    if not math.isfinite(best_cost):
        raise RuntimeError("no configuration passed the correctness check")
    return best, best_cost, history
