#!/usr/bin/env bash
# On a GPU host without network: install a vLLM wheelhouse staged with stage_wheelhouse.py
# (docs/AIRGAP.md) and opgraft from this checkout, then run the end-to-end study (stock vLLM vs
# opgraft, python -m tools.e2e) and the op-level bench with vLLM's builtin MoE as the baseline.
#
#   tools/gpu_vllm_study.sh PARTS_DIR OUT_DIR [tools.e2e study options ...]
#
# Everything lands in OUT_DIR: setup.log (staging and install, timed), e2e-*.json and
# e2e-summary.json, bench-<model>.json, e2e-logs.txt (each setting's whole vLLM log, a progress bar
# kept at its last state: the phases' timestamps place start-up costs).
# OPGRAFT_SITE (default /tmp/opgraft-site) is the install folder (tools/gpu_setup.sh); a second
# run reuses it.
# OPGRAFT_BENCH_MODELS (default Qwen3-30B-A3B) and OPGRAFT_BENCH_TOKENS pick the bench rows;
# OPGRAFT_SKIP_E2E=1 / OPGRAFT_SKIP_BENCH=1 skip a part. OPGRAFT_SWEEP="MODEL:T,T ..." adds
# python -m tools.sweep runs (options in OPGRAFT_SWEEP_ARGS, e.g. --w2pf) -> sweep-<model>.json.
set -uo pipefail
[ $# -ge 2 ] || { sed -n '2,15p' "$0"; exit 2; }
parts=$1 out=$2; shift 2
. "$(dirname "$0")/gpu_setup.sh"  # the wheelhouse and opgraft into OPGRAFT_SITE; PYTHONPATH; stamp

if [ "${OPGRAFT_SKIP_E2E:-0}" != 1 ]; then
  python3 -m tools.e2e study --out-dir "$out" --log-dir /tmp/opgraft-e2e-logs "$@"
  stamp "e2e study"
  for f in /tmp/opgraft-e2e-logs/e2e-*.log; do
    [ -f "$f" ] && { echo "==== $f"; sed 's/.*\r//' "$f" | grep -v "^$"; }
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
