#!/usr/bin/env bash
# The H200 figures of benchmarks/RESULTS.md ("One copy of the weights, no recompiles, start-up"), in one call
# on a GPU machine, most important first; a step that would not finish in the time left is skipped and
# says so in suite.log.
#   bash benchmarks/gpu_suite.sh OUT_DIR GSM8K_DIR [BUDGET_S] [STEPS]   # default budget 570 s, every step
# STEPS: a comma-separated list of the steps below to run (e.g. models05,imports,trl05,warm05); models makes
# both shapes, models05 the 0.5B one alone.
# Steps:
#   models   the Qwen2-0.5B and Qwen2-7B shapes (scripts/make_shape_model.py; 7B initialised on the GPU)
#   imports  the bare import of torch, transformers and peft, three fresh processes
#   trl05    0.5B: prmppo (compiled layers, rollout=inprocess with the adapter merged and the decode step
#            compiled, micro-batches of 64) against TRL's
#            GRPOTrainer, both gradient-checkpointed, 5 iterations each (the median of iterations 2-5),
#            TORCH_LOGS=$CACHE_LOGS, so that a compile after the first iteration, and each graph's cache
#            outcome, show in the log
#   gen05    0.5B generation at 256 rows against the decode step's memory-bandwidth bound (gpu_bench.py),
#            the static loop eager and with its decode step compiled
#   gen7b    the same at the 7B shape
#   genprof05 gen05's sides (and the static loop without CUDA graphs), one call each, then one more of each
#            static side under torch.profiler (gpu_bench.py --profile): the kernels of the decode step, by
#            device time, in genprof05/gpu_bench_profile.txt
#   warm05   the prmppo side of trl05 again, 2 iterations, with empty local inductor and triton caches and
#            trl05's artifacts dir: the start-up when the compile cache kept with the artifacts is warm
#   eager05  the prmppo side with nothing compiled (layers, decode step), 2 iterations: the start-up without compile
#   nomerge05 the prmppo side of trl05 with rollout.merge_adapter=false (the default: the LoRA branches run in
#            every decode step; the 0.5B steps above merge), 5 iterations, the local compile caches trl05 left
#   mfu05    the update alone (gpu_update_bench.py: LoRA r 16 on every linear, compiled layers): its MFU
#   prof05   the prmppo side of trl05, 4 iterations, under benchmarks/iteration_profile.py: each phase's seconds
#            and allocator peaks, torch.profiler's ops of the third iteration (the local compile caches trl05 left)
#   p7b      7B: the prmppo side alone (rollout=inprocess, eager, micro-batches of 32, checkpointed), 3 iterations
# Writes OUT_DIR/suite.log and OUT_DIR/suite.tar.gz (each step's log, figures.json / gpu_bench.json, and the
# small files of every run dir: no weights, no compile caches).
set -u
T0=$(date +%s)
OUT=$1
DATA=$(cd "$2" && pwd)
BUDGET=${3:-570}
STEPS=${4:-models,imports,trl05,gen05,gen7b,warm05,eager05,nomerge05,prof05,mfu05,p7b,genprof05}
HERE=$(cd "$(dirname "$0")/.." && pwd)
WORK=${SUITE_WORK:-/tmp/gpu_suite}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$HERE/src PYTHONUNBUFFERED=1
mkdir -p "$WORK" "$OUT"
cd "$HERE"

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/suite.log"; }
# step NAME SECONDS_IT_NEEDS COMMAND...: run it if that many seconds are left, its output in WORK/NAME.log
step() {
  local name=$1 need=$2
  shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
  if [ "$(left)" -lt "$need" ]; then
    log "$name: skipped ($(left) s left, it needs about $need)"
    return 1
  fi
  log "$name: start"
  if declare -F "$1" > /dev/null; then
    "$@" > "$WORK/$name.log" 2>&1  # a function of this script (short: no time limit of its own)
  else
    timeout --signal=TERM --kill-after=10 $(( $(left) - 15 )) "$@" > "$WORK/$name.log" 2>&1
  fi
  local rc=$?
  log "$name: rc=$rc"
  return $rc
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc;
  python3 -c "import torch,transformers,peft;print('torch',torch.__version__,'transformers',transformers.__version__,'peft',peft.__version__)";
  python3 -c "import trl;print('trl',trl.__version__)"; git -C "$HERE" rev-parse HEAD 2> /dev/null; } >> "$OUT/suite.log" 2>&1

models() {
  python3 scripts/make_shape_model.py --out "$WORK/q05" --data-dir "$DATA" &
  local small=$!
  python3 scripts/make_shape_model.py --out "$WORK/q7b" --shape qwen2-7b --device cuda --data-dir "$DATA"
  local rc=$?
  wait $small && return $rc
}
imports() {
  for i in 1 2 3; do
    local t=$(date +%s%N)
    python3 -c "import torch, transformers, peft"
    echo "bare import $i: $(( ($(date +%s%N) - t) / 1000000 )) ms"
  done
}
# recompiles, dynamo's tracing steps and restarts, and each graph's AOTAutograd and FX graph cache outcome
CACHE_LOGS=recompiles,dynamo,torch._functorch._aot_autograd.autograd_cache,torch._inductor.codecache
COMPILED=(--prmppo-override ppo.compile=true --prmppo-override ppo.compile_cache=true)
SHAPE05_BRANCHES=(--model "$WORK/q05" --data-dir "$DATA" --gradient-checkpointing on --engine inprocess --sync none
                  --prmppo-override ppo.micro_batch_rows=64)
SHAPE05_EAGER=("${SHAPE05_BRANCHES[@]}" --prmppo-override rollout.merge_adapter=true)  # nothing compiled
SHAPE05=("${SHAPE05_EAGER[@]}" --prmppo-override rollout.compile_decode=true)

models05() { python3 scripts/make_shape_model.py --out "$WORK/q05" --data-dir "$DATA"; }

step models 120 models || { log "models failed"; }
step models05 60 models05 || { log "models05 failed"; }
step imports 40 imports
TORCH_LOGS=$CACHE_LOGS step trl05 280 python3 benchmarks/trl_compare.py "${SHAPE05[@]}" "${COMPILED[@]}" \
  --iterations 5 --sides prmppo,trl --out "$WORK/trl05"
step gen05 110 python3 benchmarks/gpu_bench.py --model "$WORK/q05" --data-dir "$DATA" --rows 256 --decode static \
  --compile-decode --repeats 2 --out "$WORK/gen05"
step gen7b 110 python3 benchmarks/gpu_bench.py --model "$WORK/q7b" --data-dir "$DATA" --rows 256 --decode static \
  --repeats 1 --out "$WORK/gen7b"
mkdir -p "$WORK/warm_inductor" "$WORK/warm_triton"
TORCHINDUCTOR_CACHE_DIR=$WORK/warm_inductor TRITON_CACHE_DIR=$WORK/warm_triton TORCH_LOGS=$CACHE_LOGS \
  step warm05 90 python3 benchmarks/trl_compare.py "${SHAPE05[@]}" "${COMPILED[@]}" --iterations 2 --sides prmppo \
  --prmppo-override "artifacts_dir=$WORK/trl05/prmppo/artifacts" --out "$WORK/warm05"
step eager05 60 python3 benchmarks/trl_compare.py "${SHAPE05_EAGER[@]}" --iterations 2 --sides prmppo --out "$WORK/eager05"
TORCH_LOGS=recompiles step nomerge05 100 python3 benchmarks/trl_compare.py "${SHAPE05_BRANCHES[@]}" "${COMPILED[@]}" \
  --prmppo-override rollout.compile_decode=true \
  --iterations 5 --sides prmppo --out "$WORK/nomerge05"
step prof05 200 python3 benchmarks/iteration_profile.py --out "$WORK/prof05" --profile-iteration 2 -- \
  "${SHAPE05[@]}" "${COMPILED[@]}" --iterations 4
step mfu05 90 python3 benchmarks/gpu_update_bench.py --model "$WORK/q05" --lora --compile
step genprof05 130 python3 benchmarks/gpu_bench.py --model "$WORK/q05" --data-dir "$DATA" --rows 256 \
  --decode static static_eager --compile-decode --repeats 1 --profile --out "$WORK/genprof05"
step p7b 150 python3 benchmarks/trl_compare.py --model "$WORK/q7b" --data-dir "$DATA" --gradient-checkpointing on \
  --engine inprocess --sync none --micro-rows 32 --iterations 3 --sides prmppo --out "$WORK/p7b"

cd "$WORK"
find . \( -name artifacts -o -name 'q05' -o -name 'q7b' -o -name 'warm_*' -o -name checkpoints \) -prune -o \
  -type f -size -5M -print0 | tar czf "$OUT/suite.tar.gz" --null -T -
log "done"
