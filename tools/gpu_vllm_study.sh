#!/usr/bin/env bash
# On a GPU host without network: install a vLLM wheelhouse staged with stage_wheelhouse.py
# (docs/AIRGAP.md) and opgraft from this checkout, then run the end-to-end study (stock vLLM vs
# opgraft, python -m tools.e2e) and the op-level bench with vLLM's builtin MoE as the baseline.
#
#   tools/gpu_vllm_study.sh PARTS_DIR OUT_DIR [tools.e2e study options ...]
#
# Everything lands in OUT_DIR: setup.log (staging and install, timed), e2e-*.json and
# e2e-summary.json, bench-<model>.json, e2e-logs.txt (the tail of each setting's vLLM log).
# OPGRAFT_SITE (default /tmp/opgraft-site) is the install folder; a second run reuses it.
# OPGRAFT_BENCH_MODELS (default Qwen3-30B-A3B) and OPGRAFT_BENCH_TOKENS pick the bench rows;
# OPGRAFT_SKIP_E2E=1 / OPGRAFT_SKIP_BENCH=1 skip a part. OPGRAFT_SWEEP="MODEL:T,T ..." adds
# python -m tools.sweep runs (options in OPGRAFT_SWEEP_ARGS, e.g. --w2pf) -> sweep-<model>.json.
set -uo pipefail
[ $# -ge 2 ] || { sed -n '2,13p' "$0"; exit 2; }
parts=$1 out=$2; shift 2
site=${OPGRAFT_SITE:-/tmp/opgraft-site}
mkdir -p "$out" "$site"
log=$out/setup.log
t0=$(date +%s.%N)
stamp() { awk -v a="$t0" -v b="$(date +%s.%N)" -v n="$1" 'BEGIN { printf "[%-22s] %7.1f s since start\n", n, b - a }' | tee -a "$log"; }

if PYTHONPATH=$site python3 -c "import vllm" >/dev/null 2>&1; then
  echo "vLLM already installed in $site" | tee -a "$log"
else
  bash tools/unstage_wheelhouse.sh --target "$site" --work /tmp/opgraft-unstage \
    --pip-arg=--no-compile "$parts" >>"$log" 2>&1 || { tail -40 "$log"; exit 1; }
  rm -rf /tmp/opgraft-unstage/wheels
fi
stamp "vLLM wheelhouse installed"
export PYTHONPATH=$site
if ! python3 -m pip install -q --no-index --no-build-isolation --no-deps --upgrade --target "$site" . \
    >>"$log" 2>&1; then
  # No usable build backend here: build with CMake and lay the package out by hand, with the
  # entry point vLLM looks for.
  echo "pip could not build opgraft; CMake build + manual layout" | tee -a "$log"
  { cmake -S . -B /tmp/opgraft-build -DOPGRAFT_BUILD_TESTS=OFF && cmake --build /tmp/opgraft-build -j; } \
    >>"$log" 2>&1 || { tail -40 "$log"; exit 1; }
  rm -rf "$site/opgraft" "$site"/opgraft-*.dist-info
  cp -r python/opgraft "$site/" && cp -P /tmp/opgraft-build/libopgraft.so* "$site/opgraft/"
  ver=$(python3 -c "import sys; sys.path.insert(0, 'python'); import opgraft; print(opgraft.__version__)")
  di=$site/opgraft-$ver.dist-info
  mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: opgraft\nVersion: %s\n' "$ver" >"$di/METADATA"
  python3 - "$di/entry_points.txt" <<'PY'  # the entry points pyproject.toml declares
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
groups = dict(p.get("entry-points", {}), console_scripts=p.get("scripts", {}))
with open(sys.argv[1], "w") as f:
    for g, eps in groups.items():
        f.write(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n")
PY
fi
stamp "opgraft installed"
python3 - <<'PY' 2>&1 | grep -v "^INFO\|^WARNING" | tee -a "$log"
from importlib.metadata import entry_points, version
import torch
print("vllm", version("vllm"), "| torch", torch.__version__, "| opgraft", version("opgraft"),
      "| GPU", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
print("vllm.general_plugins:", [f"{e.name} = {e.value}" for e in entry_points(group="vllm.general_plugins")])
PY
stamp "checked"

if [ "${OPGRAFT_SKIP_E2E:-0}" != 1 ]; then
  python3 -m tools.e2e study --out-dir "$out" --log-dir /tmp/opgraft-e2e-logs "$@"
  stamp "e2e study"
  for f in /tmp/opgraft-e2e-logs/e2e-*.log; do
    [ -f "$f" ] && { echo "==== $f"; grep -v "^$" "$f" | tail -60; }
  done >"$out/e2e-logs.txt" 2>&1
fi
if [ "${OPGRAFT_SKIP_BENCH:-0}" != 1 ]; then
  for m in ${OPGRAFT_BENCH_MODELS:-Qwen3-30B-A3B}; do
    python3 -m opgraft.cli bench moe --model "$m" --tokens "${OPGRAFT_BENCH_TOKENS:-1,2,4,8,16,32,64}" \
      --json "$out/bench-$m.json" 2>&1 | grep -v "^INFO\|^WARNING\|^DEBUG"
    stamp "bench $m"
  done
fi
for spec in ${OPGRAFT_SWEEP:-}; do
  m=${spec%%:*} t=${spec#*:}
  python3 -m tools.sweep --model "$m" --tokens "$t" ${OPGRAFT_SWEEP_ARGS:-} --json "$out/sweep-$m.json" 2>&1 \
    | grep -v "^INFO\|^WARNING\|^DEBUG"
  stamp "sweep $m"
done
