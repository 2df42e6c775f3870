#!/usr/bin/env bash
# One call of the study's runs on the GPU machine (one H200, 16 cores): `final.py` runs as many jobs as fit
# in BUDGET seconds from this script's start, then the small files of every finished run and the SFT and PRM
# artifacts that unfinished jobs still need go to OUT_DIR, so that a later call (on this machine while it is
# still held, else on a fresh one given them back as CARRY_DIR) goes on where this one stopped.
#   BUDGET=545 bash experiments/prm_vs_orm_flaw/final_device.sh OUT_DIR [CARRY_DIR]
# Runs from the checkout it sits in (its src/ first on PYTHONPATH), with prmppo's dependencies installed under
# /tmp/site (the GPU machine lacks hydra-core and omegaconf). The runs live in STUDY_ROOT (default /tmp/prm_vs_orm_flaw).
set -u
T0=$(date +%s)
OUT=$1
CARRY=${2:-}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
ROOT=${STUDY_ROOT:-/tmp/prm_vs_orm_flaw}
export PYTHONPATH=/tmp/site:$HERE/src PYTHONUNBUFFERED=1
mkdir -p "$ROOT"
if [ ! -f "$ROOT/status.json" ] && [ -n "$CARRY" ] && [ -f "$CARRY/results.tar.gz" ]; then
  tar xzf "$CARRY/results.tar.gz" -C "$ROOT"
  if ls "$CARRY"/artifacts.tar.part-* > /dev/null 2>&1; then cat "$CARRY"/artifacts.tar.part-* | tar x -C "$ROOT"; fi
fi
{ date -u; nproc; lscpu | grep -E "Model name"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import torch,transformers,peft,hydra;print(torch.__version__,transformers.__version__,peft.__version__,hydra.__version__)";
  git -C "$HERE" rev-parse HEAD; } >> "$ROOT/machine.txt" 2>&1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 15 >> "$ROOT/gpu.csv" 2>&1 &
SMI=$!
LEFT=$(( ${BUDGET:-545} - ($(date +%s) - T0) ))
python3 "$HERE/experiments/prm_vs_orm_flaw/final.py" "$ROOT" --budget "$LEFT" --slots "${SLOTS:-16}" ${FINAL_ARGS:-}
kill $SMI 2> /dev/null
cd "$ROOT"
# every run's records (no checkpoints, spools, weight buffers or copies of the initial model)
find final \( -name checkpoints -o -name spool -o -name sync -o -name init_model \) -prune -o -type f -print0 \
  | tar czf "$OUT/results.tar.gz" --null -T - status.json events.log machine.txt gpu.csv $(ls matched.json 2> /dev/null)
# the SFT and PRM artifacts of the seeds that still have a job to run, in pieces the device tool returns
python3 "$HERE/experiments/prm_vs_orm_flaw/final.py" "$ROOT" --needed > needed.txt
if [ -s needed.txt ]; then tar cf - -T needed.txt | split -b 15M - "$OUT/artifacts.tar.part-"; fi
echo "call: $(( $(date +%s) - T0 )) s" >> "$ROOT/events.log"
