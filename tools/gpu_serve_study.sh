#!/usr/bin/env bash
# On a GPU host without network: install the staged vLLM wheelhouse and opgraft from this
# checkout (tools/gpu_setup.sh, as tools/gpu_vllm_study.sh does), then measure opgraft under
# `vllm serve` with vLLM's own benchmark clients (python -m tools.serve_bench study, docs/SERVE.md):
# stock vLLM (OPGRAFT_DISABLE=1) and opgraft, vllm bench serve and vllm bench latency, bad requests.
#
#   OPGRAFT_COMMIT=<sha> tools/gpu_serve_study.sh PARTS_DIR OUT_DIR [serve_bench study options ...]
#
# Everything lands in OUT_DIR: setup.log, study.log, serve-summary.json, vllm/ (vLLM's own result
# files), logs/ (each server's, client's and latency run's log), and all of it again as one archive,
# OUT_DIR.tgz, for hosts that hand back few files. OPGRAFT_SERVE_BUDGET_S (default
# 570) is the time of the whole script, install included: the study skips (and reports) the
# phases that no longer fit, so that one 10-minute command comes back with its results. The
# tables are printed last. Exit status: the study's (1 when a setting failed).
set -uo pipefail
[ $# -ge 2 ] || { sed -n '2,14p' "$0"; exit 2; }
parts=$1 out=$2; shift 2
. "$(dirname "$0")/gpu_setup.sh"  # the wheelhouse and opgraft into OPGRAFT_SITE; PYTHONPATH; stamp

left=$(awk -v a="$t0" -v b="$(date +%s.%N)" -v t="${OPGRAFT_SERVE_BUDGET_S:-570}" 'BEGIN { printf "%d", t - (b - a) }')
[ "$left" -ge 1 ] || left=1  # the first phase still runs, its start-up held to what is left
python3 -m tools.serve_bench study --out-dir "$out" --budget-s "$left" --no-table "$@" 2>&1 | tee "$out/study.log"
rc=${PIPESTATUS[0]}
stamp "serve study"
tar czf "${out%/}.tgz" -C "$out" .
python3 -m tools.serve_bench table "$out"
exit "$rc"
