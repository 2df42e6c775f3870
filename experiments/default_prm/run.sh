#!/bin/bash
# The default PRM (prm_train.head=mode_gap) beside the likelihood-based step_logprobs head, on one SFT
# checkpoint, and grpo's identical-group share at the default PRM arm's final policy. CPU, about 15 minutes
# on 2 cores. Usage: bash experiments/default_prm/run.sh OUT_DIR (absolute path), in the repo's venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
O=$1; mkdir -p "$O"
A="artifacts_dir=$O/artifacts"
start=$(date +%s)
python -m prmppo hydra.run.dir="$O/default" "$A" > "$O/default.log" 2>&1  # the quickstart: SFT, PRM, PPO, eval
echo "default pipeline done $(( $(date +%s) - start ))s"
python -m prmppo stage=prm prm_train.head=step_logprobs hydra.run.dir="$O/prm_step_logprobs" "$A" > "$O/prm_step_logprobs.log" 2>&1
python benchmarks/cpu_pipeline.py --run-dir "$O/default" > "$O/cpu_pipeline.txt" 2>&1
sft=$(ls -d "$O"/artifacts/sft-*); default_prm=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['summary']['prm']['prm_dir'])" "$O/default/stage_result.json")
old_prm=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['summary']['prm_dir'])" "$O/prm_step_logprobs/stage_result.json")
python experiments/prm_likelihood/prm_likelihood.py --checkpoint "$sft" --prm "$default_prm" "$old_prm" 2>/dev/null | grep -v Loading > "$O/prm_likelihood.txt"
for n in 64 256; do
  python scripts/grpo_identical_groups.py "$O/default" --prompts "$n" 2>/dev/null | grep group_std > "$O/grpo_identical_$n.txt"
done
echo "all done $(( $(date +%s) - start ))s"
