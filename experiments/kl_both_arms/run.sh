#!/bin/bash
# Both arms of the default config on one GPU (SFT shared), then grpo's identical-group share at the PRM
# arm's final policy. Usage: bash experiments/kl_both_arms/run.sh OUT_DIR (absolute path)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
O=$1; mkdir -p $O
start=$(date +%s)
python -m prmppo stage=sft topology=gpu hydra.run.dir=$O/sft logger.console=false > $O/sft.log 2>&1
echo "sft done $(( $(date +%s) - start ))s"
python -m prmppo topology=gpu hydra.run.dir=$O/prm logger.console=false > $O/prm.log 2>&1 &
python -m prmppo topology=gpu arm=orm hydra.run.dir=$O/orm logger.console=false > $O/orm.log 2>&1 &
wait
echo "arms done $(( $(date +%s) - start ))s"
python scripts/grpo_identical_groups.py $O/prm --prompts 64 --samples 4 > $O/grpo_identical.txt 2>&1
echo "script done $(( $(date +%s) - start ))s"
cd $O && tar czf $O/runs_small.tar.gz --exclude='checkpoints' --exclude='spool' --exclude='sync' --exclude='init_model' prm orm sft grpo_identical.txt *.log 2>/dev/null
ls -la $O
