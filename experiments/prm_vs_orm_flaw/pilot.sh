#!/usr/bin/env bash
# The pilot of experiments/prm_vs_orm_flaw on one machine with a GPU and 16 cores: SFT of each seed on the
# GPU, then 8 pipeline jobs (arm=orm, topology=cpu, 2 cores each, reusing that SFT checkpoint), then the small
# files of every run (no checkpoints) into OUT_DIR/pilot.tar.gz. See README.md here.
#   BUDGET=350 bash experiments/prm_vs_orm_flaw/pilot.sh OUT_DIR
# BUDGET: seconds from the start after which unfinished pipeline jobs are stopped (SIGTERM, then SIGKILL 30 s
# later). ROOT: the checkout whose src/, conf/ and scripts/ run (default: this one); runs go to
# ROOT/runs/prm_vs_orm_flaw/pilot. EXTRA: overrides added to every job (e.g. debug=smoke); SFT_TOPOLOGY: the SFT
# jobs' topology (default topology=gpu; the artifact key has no topology, so the CPU pipeline reuses it).
# With prmppo's dependencies installed under /tmp/site (the GPU machine lacks hydra-core and omegaconf).
set -u
OUT=$1
T0=$(date +%s)
ROOT=${ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}
cd "$ROOT"
export PYTHONPATH=/tmp/site:$ROOT/src PYTHONUNBUFFERED=1
R=$ROOT/runs/prm_vs_orm_flaw/pilot
mkdir -p "$R"
{ nproc; lscpu | grep -E "Model name|Thread|Core"; python3 -c "import torch,transformers,peft,hydra;print(torch.__version__,transformers.__version__,peft.__version__,hydra.__version__)"; } > "$R/machine.txt" 2>&1
EXP="experiment=prm_vs_orm_flaw logger.console=false ${EXTRA:-}"
N=$(nproc)
stamp() { echo "$1 $(( $(date +%s) - T0 ))" >> "$R/timing.txt"; }
stamp start
# 1. SFT of each seed on the GPU (its artifact key is seed, task, model, sft: the CPU pipeline below reuses it)
for s in 0 1 2 3 4; do
  OMP_NUM_THREADS=3 taskset -c $(((3*s) % N)),$(((3*s+1) % N)),$(((3*s+2) % N)) timeout -k 10 240 \
    python3 -m prmppo stage=sft $EXP seed=$s ${SFT_TOPOLOGY:-topology=gpu} hydra.run.dir="$R/sft_s$s" > "$R/sft_s$s.log" 2>&1 &
done
wait
stamp sft_done
# 2. the ORM pipeline on CPU, 8 jobs x 2 cores: 5 seeds at the experiment's settings, 3 at ppo.lr=5e-3
LEFT=$(( T0 + ${BUDGET:-500} - $(date +%s) ))
j=0
launch() {
  local name=$1; shift
  OMP_NUM_THREADS=2 taskset -c $(((2*j) % N)),$(((2*j+1) % N)) timeout -k 30 -s TERM $LEFT \
    python3 -m prmppo $EXP arm=orm topology=cpu "$@" hydra.run.dir="$R/$name" > "$R/$name.log" 2>&1 &
  j=$((j+1))
}
for s in 0 1 2 3 4; do launch orm_s$s seed=$s; done
for s in 0 1 2; do launch orm_lr5e-3_s$s seed=$s ppo.lr=5e-3; done
wait
stamp ppo_done
python3 scripts/accuracy_by_difficulty.py "$R"/orm_*/ --json "$R/by_difficulty.json" > "$R/by_difficulty.txt" 2>&1
stamp tables_done
cd "$R" && find . \( -name eval.json -o -name stage_result.json -o -name metrics.jsonl -o -name banner.json \
  -o -name run_info.json -o -path '*/.hydra/*' -o -name '*.log' -o -name '*.txt' -o -name 'by_difficulty.json' \) \
  -not -path '*/checkpoints/*' -not -path '*/spool/*' -not -path '*/sync/*' -not -path '*/init_model/*' -print0 \
  | tar czf "$OUT/pilot.tar.gz" --null -T -
cp "$R/timing.txt" "$R/by_difficulty.txt" "$OUT/" 2>/dev/null
