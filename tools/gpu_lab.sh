#!/usr/bin/env bash
# One GPU call for the ops' own checks, without vLLM (a development tool): build libopgraft, warm
# the kernel cache with the compile tests on every core, run every op's GPU correctness cases,
# compute-sanitizer on a few of them, then the timings that need no vLLM. Results land in $OUT.
#
#   OUT=DIR bash tools/gpu_lab.sh [STEP ...]      steps: build warm check sanitize host before moe fp8 linear attention
#                                                        fusions fusions-sanitize prologue vpf round early qk
#
# With no steps, all of them but warm (which compiles every op's variants for both archs in
# parallel; the checks and benches compile what they use on demand). BEFORE_TREE (default .before) is an older tree's python/, src/,
# kernels/, include/, cmake/ and CMakeLists.txt: `host` and `before` time it next to this one.
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python:$PWD PYTHONUNBUFFERED=1 OPGRAFT_CACHE_DIR=/tmp/og-kernels
export OPGRAFT_TEST_KERNEL_CACHE=/tmp/og-kernels OPGRAFT_TEST_JOBS=$(nproc)
BEFORE_TREE=${BEFORE_TREE:-.before}
steps=${*:-build check sanitize host linear attention before moe}
BUDGET=${BUDGET:-540}  # seconds: a step that would start later is skipped (and said so)
[ -f /tmp/og-build/libopgraft.so ] && export OPGRAFT_LIBRARY=/tmp/og-build/libopgraft.so
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0)) s] $*"; }
summary=()
note() { summary+=("$*"); say "$*"; }

for step in $steps; do
  if [ $(($(date +%s) - t0)) -gt "$BUDGET" ]; then
    note "skipped $step: past the ${BUDGET} s budget"
    continue
  fi
  case $step in
  build)
    cmake -S . -B /tmp/og-build -DOPGRAFT_BUILD_TESTS=OFF >/tmp/og-build.log 2>&1 &&
      cmake --build /tmp/og-build -j "$(nproc)" >>/tmp/og-build.log 2>&1 || { tail -30 /tmp/og-build.log; exit 1; }
    export OPGRAFT_LIBRARY=/tmp/og-build/libopgraft.so
    if [ -d "$BEFORE_TREE" ]; then
      cmake -S "$BEFORE_TREE" -B /tmp/og-before -DOPGRAFT_BUILD_TESTS=OFF >/tmp/og-before.log 2>&1 &&
        cmake --build /tmp/og-before -j "$(nproc)" >>/tmp/og-before.log 2>&1 || tail -5 /tmp/og-before.log
    fi
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
    note "built"
    ;;
  warm)  # every op's shipped and tunable variants, compiled in parallel into the kernel cache
    (cd /tmp/og-build && ctest -R compile --output-on-failure -j 3) >"$OUT/compile.log" 2>&1
    note "compile tests: $(grep -c 'Passed' "$OUT/compile.log") passed, $(grep -c 'Failed' "$OUT/compile.log") failed"
    ;;
  check)  # each op's cases in its own process, at once (correctness only: the GPU is shared)
    for op in $(cd tools/checks && ls [a-z]*.py | sed "s/\.py$//"); do
      python3 -m tools.gpucheck --quick --ops "$op" --out "$OUT" >"$OUT/check-$op.log" 2>&1 &
    done
    wait
    for f in "$OUT"/check-*.log; do
      grep -E "FAIL|Traceback|Error" "$f" | head -20
      note "$(grep 'cases pass' "$f" | tr '\n' ' ') $(grep -q 'cases pass' "$f" || tail -3 "$f")"
    done
    ;;
  sanitize)
    # The new kernels on small cases (the MoE kernels were clean before and are unchanged).
    for spec in "memcheck:attention:ragged with padded rows, GQA 8" "memcheck:linear:strided x and out N=129" \
                "racecheck:linear:M=3 [129" "racecheck:attention:max_splits 17"; do
      tool=${spec%%:*} rest=${spec#*:} op=${rest%%:*} only=${rest#*:}
      timeout 150 compute-sanitizer --tool "$tool" --print-limit 20 python3 -m tools.gpucheck --quick --ops "$op" \
        --only "$only" --out /tmp/og-san >"$OUT/$tool-$op.log" 2>&1
      note "$tool $op ($only): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool-$op.log" | tail -1) $(grep -cE '^  PASS' "$OUT/$tool-$op.log") pass"
    done
    ;;
  host)  # host us per eager MoE call, this tree and the older one
    python3 -m tools.host_time --label after --tokens 1,8 --json "$OUT/host-after.json" | tail -4
    if [ -d /tmp/og-before ]; then
      PYTHONPATH=$PWD/$BEFORE_TREE/python:$PWD OPGRAFT_LIBRARY=/tmp/og-before/libopgraft.so.0 \
        python3 -m tools.host_time --label before --tokens 1,8 --json "$OUT/host-before.json" | tail -4
    fi
    note "host time: $(python3 -c "
import json
r = [x for f in ('$OUT/host-before.json', '$OUT/host-after.json') for x in json.load(open(f))['rows']]
print(', '.join(f\"{x['label']} T={x['tokens']} {x['path']} {x['host_us_per_call']}\" for x in r))" 2>/dev/null)"
    ;;
  before)  # the same MoE calls under the older tree and this one (no vLLM here: ours only)
    for m in Qwen3-30B-A3B:1 Qwen3-30B-A3B:2 Mixtral-8x7B:1; do
      model=${m%%:*} tp=${m#*:}
      python3 -m opgraft.cli bench moe --model "$model" --tp "$tp" --tokens 1,2,4,8 --no-baseline \
        --json "$OUT/moe-after-$model-tp$tp.json" 2>/dev/null | grep -E "opgraft" | head -4
      if [ -d /tmp/og-before ]; then
        PYTHONPATH=$PWD/$BEFORE_TREE/python OPGRAFT_LIBRARY=/tmp/og-before/libopgraft.so.0 \
          python3 -m opgraft.cli bench moe --model "$model" --tp "$tp" --tokens 1,2,4,8 --no-baseline \
          --json "$OUT/moe-before-$model-tp$tp.json" 2>/dev/null | grep -E "opgraft" | head -4
      fi
    done
    note "moe before/after benched"
    ;;
  moe)  # the rule on shapes that are not presets (ours only here; vLLM's kernel in the vLLM call)
    for f in bench/configs/*.json; do
      python3 -m opgraft.cli bench moe --model "$f" --tokens 1,8 --no-baseline --json "$OUT/moe-$(basename "$f")" \
        2>/dev/null | grep -E " opgraft " | head -2
    done
    note "moe configs benched"
    ;;
  fp8)  # the FP8 MoE stages alone and together, then Nsight Compute on each stage at 1 and 8 tokens
    for m in Qwen3-30B-A3B:1 DeepSeek-V3:8; do
      python3 -m opgraft.cli profile moe --model "${m%%:*}" --tp "${m#*:}" --dtype fp8-block --tokens 1,2,4,8 \
        --json "$OUT/fp8-profile-${m%%:*}.json" 2>&1 | tail -13
    done
    if command -v ncu >/dev/null; then
      for T in 1 8; do
        timeout 120 ncu --clock-control none --kernel-name regex:moe_ --launch-skip 4 --launch-count 2 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
          --section LaunchStats --section InstructionStats --section ComputeWorkloadAnalysis \
          python3 -m tools.ncu_moe Qwen3-30B-A3B "$T" fp8-block >"$OUT/ncu-fp8-T$T.txt" 2>&1
        grep -E "moe_|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Issue Slots Busy|Executed Ipc A|L2 Hit" \
          "$OUT/ncu-fp8-T$T.txt" | head -30
      done
    fi
    note "fp8 profiled"
    ;;
  linear)
    python3 -m opgraft.cli bench linear --rows 1,4,8 --json "$OUT/linear_bench.json" 2>&1 | tail -40
    note "linear benched"
    ;;
  attention)
    python3 -m opgraft.cli bench attention --impls opgraft --json "$OUT/attention_bench.json" 2>&1 | tail -20
    note "attention benched"
    ;;
  fusions)  # the kernel-boundary fusions not measured yet (NOTES v43, v44): checks, benches
    python3 -m tools.gpucheck --quick --ops attention --only prologue --out "$OUT/fusions" >"$OUT/check-prologue.log" 2>&1
    python3 -m tools.gpucheck --quick --ops linear --only normed --out "$OUT/fusions" >"$OUT/check-normed.log" 2>&1
    note "prologue: $(grep 'cases pass' "$OUT/check-prologue.log"); normed rows: $(grep 'cases pass' "$OUT/check-normed.log")"
    python3 -m opgraft.cli bench attention --prologue --model Qwen3-30B-A3B --batch 1,8 --context 256,1024,8192 \
      --json "$OUT/attention_prologue.json" 2>&1 | tail -20
    python3 -m opgraft.cli bench linear --norm --models Qwen3-30B-A3B --rows 1,2,4,8 --timing span \
      --json "$OUT/linear_norm.json" 2>&1 | tail -12
    python3 -m tools.moe_route --tokens 1,2 --variants routed,norm+routed,routed-norm --json "$OUT/moe_route_norm.json" \
      2>&1 | tail -8
    note "fusions benched"
    ;;
  fusions-sanitize)  # compute-sanitizer on the fusions' cases (a call of its own: up to 150 s a tool)
    for spec in "memcheck:attention:prologue: ragged" "racecheck:attention:prologue: ragged" \
                "memcheck:linear:norm normed: M=2" "racecheck:linear:norm normed: M=2"; do
      tool=${spec%%:*} rest=${spec#*:} op=${rest%%:*} only=${rest#*:}
      timeout 150 compute-sanitizer --tool "$tool" --print-limit 20 python3 -m tools.gpucheck --quick --ops "$op" \
        --only "$only" --out /tmp/og-san >"$OUT/$tool-$op-fusion.log" 2>&1
      note "$tool $op ($only): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool-$op-fusion.log" | tail -1) $(grep -cE '^  PASS' "$OUT/$tool-$op-fusion.log") pass"
    done
    ;;
  prologue)  # the attention prologue alone (NOTES v46): its cases, the decode prologue's, its bench, memcheck
    python3 -m tools.gpucheck --quick --ops attention --only prologue --out "$OUT/prologue" >"$OUT/check-prologue.log" 2>&1
    note "prologue (decode and alone): $(grep 'cases pass' "$OUT/check-prologue.log")"
    python3 -m opgraft.cli bench attention --prologue-rows 1,128,512,1024,4096 --model Qwen3-30B-A3B \
      --json "$OUT/attention_prologue_alone.json" 2>&1 | tail -18
    timeout 150 compute-sanitizer --tool memcheck --print-limit 20 python3 -m tools.gpucheck --quick --ops attention \
      --only "prologue alone: head 64, GPT-J, 5" --out /tmp/og-san >"$OUT/memcheck-prologue-alone.log" 2>&1
    note "memcheck prologue alone: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-prologue-alone.log" | tail -1)"
    ;;
  vpf)  # the V prefetch and the one-split rule (NOTES v55, v56): cases, ours with and without, attn_o with
        # and without the projection, memcheck
    python3 -m tools.gpucheck --quick --ops attention --only "V prefetch" --out "$OUT/vpf" >"$OUT/check-vpf.log" 2>&1
    python3 -m tools.gpucheck --quick --ops attention --only "129..256" --out "$OUT/vpf" >"$OUT/check-split.log" 2>&1
    note "V prefetch: $(grep 'cases pass' "$OUT/check-vpf.log"); one split: $(grep 'cases pass' "$OUT/check-split.log")"
    for v in 0 1; do
      OPGRAFT_TUNE_ATTENTION_VPF=$v python3 -m opgraft.cli bench attention --impls opgraft --model Qwen3-30B-A3B \
        --batch 1,8 --context 192,256,1024,8192,32768 --json "$OUT/attention-vpf$v.json" 2>&1 | grep " opgraft "
    done
    # 12 warps at one sequence: spans to 192 tokens in one split and one tile round (v56's Triton gap)
    OPGRAFT_TUNE_ATTENTION_WARPS=12 python3 -m opgraft.cli bench attention --impls opgraft --model Qwen3-30B-A3B \
      --batch 1 --context 192,256,1024,8192 --json "$OUT/attention-w12.json" 2>&1 | grep " opgraft " | sed "s/^/w12 /"
    python3 -m tools.attn_o --batch 1,2,8 --context 144,192,256,1024 --variants kernel-write \
      --extra vpf=attention.vpf:1@kernel --extra vpf-mc256=attention.vpf:1,attention.min_chunk:256@kernel \
      --json "$OUT/attn_o_vpf.json" 2>&1 | tail -16
    python3 -m tools.attn_o --attention-only --batch 1,8 --context 144,1024,8192 \
      --variants kernel-write,shipped --extra vpf=attention.vpf:1@kernel --extra vpf-nowrite=attention.vpf:1 \
      --json "$OUT/attn_only_vpf.json" 2>&1 | tail -8
    timeout 150 compute-sanitizer --tool memcheck --print-limit 20 python3 -m tools.gpucheck --quick --ops attention \
      --only "update: V prefetch, CUDA graph" --out /tmp/og-san >"$OUT/memcheck-vpf.log" 2>&1
    note "vpf benched; memcheck: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-vpf.log" | tail -1)"
    ;;
  round)  # two tiles a round (NOTES v57): cases, ours with one and two tiles a round beside the older tree, attn_o,
          # memcheck
    python3 -m tools.gpucheck --quick --ops attention --only "two tiles a round" --out "$OUT/round" \
      >"$OUT/check-round.log" 2>&1
    note "two tiles a round: $(grep 'cases pass' "$OUT/check-round.log")"
    ctx=128,192,256,512,1024,2048,8192,32768
    for setting in "round1:OPGRAFT_TUNE_ATTENTION_ROUND=1" "round2:OPGRAFT_TUNE_ATTENTION_ROUND=2" \
      "round2-mc256:OPGRAFT_TUNE_ATTENTION_ROUND=2 OPGRAFT_TUNE_ATTENTION_MIN_CHUNK=256" \
      "w8-round2:OPGRAFT_TUNE_ATTENTION_ROUND=2 OPGRAFT_TUNE_ATTENTION_WARPS=8" "w8:OPGRAFT_TUNE_ATTENTION_WARPS=8 OPGRAFT_TUNE_ATTENTION_ROUND=1"; do
      name=${setting%%:*}
      env ${setting#*:} python3 -m opgraft.cli bench attention --impls opgraft --model Qwen3-30B-A3B --batch 1,8 \
        --context "$ctx" --json "$OUT/attention-$name.json" 2>&1 | grep " opgraft " | sed "s/^/$name /"
    done
    if [ -d /tmp/og-before ]; then
      PYTHONPATH=$PWD/$BEFORE_TREE/python OPGRAFT_LIBRARY=/tmp/og-before/libopgraft.so.0 \
        python3 -m opgraft.cli bench attention --impls opgraft --model Qwen3-30B-A3B --batch 1,8 --context "$ctx" \
        --json "$OUT/attention-before.json" 2>&1 | grep " opgraft " | sed "s/^/before /"
    fi
    python3 -m tools.attn_o --batch 1,8 --context 144,192,256,1024,8192 --variants kernel-write \
      --extra round2=attention.round:2@kernel --extra w8-round2=attention.round:2,attention.warps:8@kernel \
      --json "$OUT/attn_o_round.json" 2>&1 | tail -12
    timeout 150 compute-sanitizer --tool memcheck --print-limit 20 python3 -m tools.gpucheck --quick --ops attention \
      --only "two tiles a round, warps 8" --out /tmp/og-san >"$OUT/memcheck-round.log" 2>&1
    note "round benched; memcheck: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-round.log" | tail -1)"
    ;;
  qk)  # the q/k norm and rotary embedding in the qkv projection's epilogue (NOTES v60): cases, memcheck, spans
    python3 -m tools.gpucheck --quick --ops linear --only "qk " --out "$OUT/qk" >"$OUT/check-qk.log" 2>&1
    note "q/k epilogue: $(grep 'cases pass' "$OUT/check-qk.log")"
    timeout 150 compute-sanitizer --tool memcheck --print-limit 20 python3 -m tools.gpucheck --quick --ops linear \
      --only "qk M=3" --out /tmp/og-san >"$OUT/memcheck-qk.log" 2>&1
    note "q/k epilogue memcheck: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-qk.log" | tail -1)"
    python3 -m tools.attn_o --qkv --batch 1,8 --context 144,1024,8192 --variants kernel-write,qk,qk-early,qk-shipped \
      --extra early=linear.trigger:1,attention.pdl:2@kernel --json "$OUT/qkv_attn_o_qk.json" 2>&1 | tail -10
    note "q/k epilogue benched"
    ;;
  early)  # attention started early by the qkv projection (NOTES v58): cases, memcheck, qkv + attention + o
    python3 -m tools.gpucheck --quick --ops attention --only "first round before the wait" --out "$OUT/early" \
      >"$OUT/check-early.log" 2>&1
    note "first round before the wait: $(grep 'cases pass' "$OUT/check-early.log")"
    timeout 150 compute-sanitizer --tool memcheck --print-limit 20 python3 -m tools.gpucheck --quick --ops attention \
      --only "first round before the wait: CUDA graph, q by a linear with its trigger, ragged" --out /tmp/og-san \
      >"$OUT/memcheck-early.log" 2>&1
    note "early memcheck: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-early.log" | tail -1)"
    python3 -m tools.attn_o --qkv --batch 1,8 --context 144,192,256,1024,8192 --variants kernel-write \
      --extra early=linear.trigger:1,attention.pdl:2@kernel --extra pdl2=attention.pdl:2@kernel \
      --extra qtrig=linear.trigger:1@kernel --json "$OUT/qkv_attn_o_early.json" 2>&1 | tail -12
    note "early benched"
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "==== summary"
printf '%s\n' "${summary[@]}"
