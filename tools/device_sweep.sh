#!/usr/bin/env bash
# Device-side: build, sweep the MoE tunables at a few shapes, and profile one call with ncu.
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
cmake -S . -B build -DOPGRAFT_BUILD_TESTS=OFF >/dev/null && cmake --build build -j16 >/dev/null || exit 1
export PYTHONPATH=python PYTHONUNBUFFERED=1 OPGRAFT_CACHE_DIR=/tmp/ogcache
for spec in "$@"; do
  model=${spec%%:*}; tokens=${spec#*:}
  python3 -m tools.sweep --model "$model" --tokens "$tokens" ${SWEEP_ARGS:---grid} --json "$OUT/sweep-$model.json" 2>&1 | tee -a "$OUT/sweep.log" | grep -vE "^\s*$|round"
done
if command -v ncu >/dev/null && [ -n "${NCU_SPEC:-}" ]; then
  ncu --clock-control none --kernel-name regex:moe_ --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      python3 -m tools.ncu_moe ${NCU_SPEC//:/ } > "$OUT/ncu.txt" 2>&1
  grep -E "moe_|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|L2 Hit|Registers|Stall|Warp Cycles|Issued Warp" "$OUT/ncu.txt" | head -60
fi
