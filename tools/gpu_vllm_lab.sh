#!/usr/bin/env bash
# One GPU call for the op-level comparisons against vLLM's own kernels (a development tool):
# installs the staged vLLM wheelhouse and opgraft (tools/gpu_setup.sh), then every op's bench with
# vLLM's kernels in the same run, the FP8 checks against vLLM's FP8 path, the host time, and the
# older tree's MoE calls beside this one's. Everything lands in one archive, $OUT/vllm-lab.tgz.
#
#   OUT=DIR bash tools/gpu_vllm_lab.sh PARTS_DIR [STEP ...]
#     steps: check attention moe configs fp8 linear host before      (default: all)
#            tune: `opgraft tune` at the decode points of every op (attention, the projections, FP8
#            MoE at 2..8 tokens), winners in tune.json, which the steps after it use
#            (OPGRAFT_TUNE_FILE); tune-fp8: FP8 MoE alone, every key, Qwen3-30B-A3B and
#            DeepSeek-V3/tp8 at 1..8 tokens (OPGRAFT_TUNE_FP8_MODELS="MODEL:TP ...", each within
#            OPGRAFT_TUNE_FP8_TIMEOUT s), likewise; fp8-2: the FP8 bench at 1, 2, 4 and 8 tokens; attention-short:
#            batch 1 and 8 at 1K/2K/8K against FA3 and Triton, then FlashInfer alone (its first call
#            JIT-compiles its decode kernel, so it gets its own time limit; OPGRAFT_LAB_ATTN_CONTEXTS
#            the contexts, OPGRAFT_LAB_ATTN_ALT="VAR=V ..." ours again under those); check-all: every op's
#            GPU cases (tools.gpucheck --quick)
set -uo pipefail
parts=$1 out=/tmp/og-vllm-lab
shift
mkdir -p "$out" "${OUT:-bench/out}"
. "$(dirname "$0")/gpu_setup.sh"
export PYTHONPATH=$PWD:$site PYTHONUNBUFFERED=1 OPGRAFT_CACHE_DIR=/tmp/og-kernels VLLM_USE_FLASHINFER_SAMPLER=0
BUDGET=${BUDGET:-540}
steps=${*:-check attention moe fp8 configs linear host before}
summary=()
note() { summary+=("$*"); stamp "$*"; }
q() { grep -v "^INFO\|^WARNING\|^DEBUG\|^\[W\|Warning:" ; }
entries() { python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['entries']))" "$1" 2>/dev/null || echo 0; }
for step in $steps; do
  if awk -v a="$t0" -v b="$(date +%s.%N)" -v m="$BUDGET" 'BEGIN { exit !(b - a > m) }'; then
    note "skipped $step: past the ${BUDGET} s budget"
    continue
  fi
  case $step in
  check)  # the FP8 cases against vLLM's own FP8 path, and the expert-parallel cases again
    python3 -m tools.gpucheck --quick --ops moe --only "fp8" --out "$out" 2>&1 | q >"$out/check-fp8.log"
    python3 -m tools.gpucheck --quick --ops moe --only "expert_map" --out "$out/ep" 2>&1 | q >"$out/check-ep.log"
    note "$(grep 'cases pass' "$out/check-fp8.log") / expert_map $(grep 'cases pass' "$out/check-ep.log")"
    grep FAIL "$out"/check-*.log | head
    ;;
  attention)
    OPGRAFT_ATTN_BENCH_IMPLS=opgraft,vllm-fa3,vllm-triton \
      python3 -m opgraft.cli bench attention --impls opgraft,vllm-fa3,vllm-triton --json "$out/attention_bench.json" 2>&1 \
      | q | tail -45
    note "attention benched"
    ;;
  check-all)  # every op's GPU cases against their references, reruns bit-identical
    for op in moe attention linear; do
      python3 -m tools.gpucheck --quick --ops "$op" --out "$out/check" 2>&1 | q >"$out/check-$op.log"
    done
    note "$(for op in moe attention linear; do printf '%s: %s; ' "$op" "$(grep -h 'cases pass' "$out/check-$op.log")"; done)"
    grep -h FAIL "$out"/check-*.log | head
    ;;
  attention-short)
    pts=(--model Qwen3-30B-A3B --batch 1,8 --context "${OPGRAFT_LAB_ATTN_CONTEXTS:-1024,2048,8192}")
    python3 -m opgraft.cli bench attention "${pts[@]}" --impls opgraft,vllm-fa3,vllm-triton \
      --json "$out/attention_short.json" 2>&1 | q | tail -22
    FLASHINFER_WORKSPACE_BASE=/tmp/og-flashinfer timeout 240 python3 -m opgraft.cli bench attention "${pts[@]}" \
      --impls vllm-flashinfer --json "$out/attention_flashinfer.json" 2>&1 | q | tail -8
    if [ -n "${OPGRAFT_LAB_ATTN_ALT:-}" ]; then  # ours again under other tunables, e.g. OPGRAFT_TUNE_ATTENTION_CLUSTER=8
      env $OPGRAFT_LAB_ATTN_ALT python3 -m opgraft.cli bench attention "${pts[@]}" --impls opgraft \
        --json "$out/attention_short_alt.json" 2>&1 | q | tail -12
    fi
    note "attention short contexts benched (FlashInfer rc ${PIPESTATUS[0]})"
    ;;
  moe)
    for m in Qwen3-30B-A3B:1 Qwen3-30B-A3B:2 Mixtral-8x7B:1; do
      python3 -m opgraft.cli bench moe --model "${m%%:*}" --tp "${m#*:}" --tokens 1,2,4,8 --no-baseline \
        --json "$out/moe-${m%%:*}-tp${m#*:}.json" 2>&1 | q | grep -E " opgraft | vllm-builtin "
    done
    note "moe presets benched"
    ;;
  configs)
    for f in bench/configs/*.json; do
      python3 -m opgraft.cli bench moe --model "$f" --tokens 1,2,4,8,16 --max-tokens 16 --no-baseline \
        --json "$out/moe-$(basename "$f")" 2>&1 | q | grep -E " opgraft | vllm-builtin "
    done
    note "moe configs benched"
    ;;
  tune)
    tf=$out/tune.json
    tune() { timeout "$1" python3 -m opgraft.cli tune "${@:2}" --out "$tf" 2>&1 | q | grep -v "rows written"; }
    tune 130 attention --batch 1,8 --context 1024,8192 --rounds 1 --report "$out/tune-attention.json"
    tune 80 linear --proj qkv,o --rows 1,8 --rounds 1 --report "$out/tune-linear.json"
    tune 180 moe --dtype fp8-block --tokens 2,4,8 --rounds 1 --report "$out/tune-moe-fp8.json" \
      --keys moe.gate_up.warps,moe.gate_up.unroll,moe.gate_up.min_blocks,moe.down.warps,moe.down.unroll,moe.down.min_blocks,moe.pdl,moe.load
    [ -s "$tf" ] && export OPGRAFT_TUNE_FILE=$tf
    note "tuned: $(entries "$tf") entries"
    ;;
  tune-fp8)  # FP8 MoE on every key, Qwen3-30B-A3B and DeepSeek-V3/tp8 at 1, 2, 4, 8 tokens (for fp8-2 next)
    tf=$out/tune.json
    for spec in ${OPGRAFT_TUNE_FP8_MODELS:-Qwen3-30B-A3B:1 DeepSeek-V3:8}; do
      timeout "${OPGRAFT_TUNE_FP8_TIMEOUT:-200}" python3 -m opgraft.cli tune moe --model "${spec%%:*}" --tp "${spec#*:}" --dtype fp8-block \
        --tokens 1,2,4,8 --rounds 1 --out "$tf" --report "$out/tune-fp8-${spec%%:*}.json" 2>&1 | q | grep -E -- "->"
    done
    [ -s "$tf" ] && export OPGRAFT_TUNE_FILE=$tf
    note "fp8 tuned: $(entries "$tf") entries"
    ;;
  fp8-2)
    for spec in Qwen3-30B-A3B:fp8-block:1 DeepSeek-V3:fp8-block:8; do
      IFS=: read -r m d tp <<<"$spec"
      timeout 150 python3 -m opgraft.cli bench moe --model "$m" --dtype "$d" --tp "$tp" --tokens 1,2,4,8 \
        --json "$out/fp8-$m-$d-tp$tp.json" 2>&1 | q | grep -E "opgraft|vllm-triton|ceiling"
    done
    note "fp8 benched at 1, 2, 4, 8 tokens"
    ;;
  fp8)
    for spec in Qwen3-30B-A3B:fp8-block:1 DeepSeek-V3:fp8-block:8 Mixtral-8x7B:fp8-tensor:1; do
      IFS=: read -r m d tp <<<"$spec"
      timeout 150 python3 -m opgraft.cli bench moe --model "$m" --dtype "$d" --tp "$tp" --tokens 1,4,8 \
        --json "$out/fp8-$m-$d-tp$tp.json" 2>&1 | q | tail -14
    done
    note "fp8 benched"
    ;;
  linear)
    python3 -m opgraft.cli bench linear --models Qwen3-30B-A3B,Llama-3-70B/tp8 --rows 1,4,8 --timing span \
      --json "$out/linear_bench_span.json" 2>&1 | q | tail -30
    note "linear benched (span)"
    ;;
  host)
    python3 -m tools.host_time --label after --tokens 1,8 --json "$out/host-after.json" 2>&1 | q | tail -4
    note "host time measured"
    ;;
  before)  # the older tree's MoE calls, for the same shapes as the moe step
    if [ -d .before ]; then
      cmake -S .before -B /tmp/og-before -DOPGRAFT_BUILD_TESTS=OFF >/dev/null 2>&1 &&
        cmake --build /tmp/og-before -j >/dev/null 2>&1
      for m in Qwen3-30B-A3B:1 Qwen3-30B-A3B:2 Mixtral-8x7B:1; do
        PYTHONPATH=$PWD/.before/python:$site OPGRAFT_LIBRARY=/tmp/og-before/libopgraft.so.0 \
          python3 -m opgraft.cli bench moe --model "${m%%:*}" --tp "${m#*:}" --tokens 1,2,4,8 --no-baseline \
          --json "$out/before-moe-${m%%:*}-tp${m#*:}.json" 2>&1 | q | grep -E " opgraft "
      done
      PYTHONPATH=$PWD/.before/python:$PWD:$site OPGRAFT_LIBRARY=/tmp/og-before/libopgraft.so.0 \
        python3 -m tools.host_time --label before --tokens 1,8 --json "$out/host-before.json" 2>&1 | q | tail -4
      note "older tree benched"
    fi
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
cp "$log" "$out/" 2>/dev/null
tar czf "${OUT:-bench/out}/vllm-lab.tgz" -C "$out" .
echo "==== summary"
printf '%s\n' "${summary[@]}"
