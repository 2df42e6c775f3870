#!/usr/bin/env bash
# PPO on the pass-rate band vs on every train prompt, both arms, on the embedded default (seed 0).
# Phase 0 trains the SFT checkpoint (stage=sft always trains, replacing the artifact for this
# config); phase 1 makes the PRM and the band side by side on it; phase 2 runs six pipelines side
# by side, each reusing SFT, PRM and band:
# arm x {all prompts, band, all prompts with ppo.drop_uniform_groups}. Results: runs/band_vs_all/.
#   bash experiments/band_vs_all/run.sh                 # on the CPU
#   bash experiments/band_vs_all/run.sh topology=gpu    # on one GPU
set -u
OUT_DIR=${OUT_DIR:-runs/band_vs_all}
ARTIFACTS=${ARTIFACTS:-artifacts}
# the PRM and PPO length of the recorded results (the defaults before the 12-minute embedded default)
common=(artifacts_dir="$ARTIFACTS" logger.console=false prm_train.head=classifier prm_train.steps=3000
        prm_train.train_problems=10000 ppo.iterations=200 "$@")
mkdir -p "$OUT_DIR"
python -m prmppo stage=sft hydra.run.dir="$OUT_DIR/sft" "${common[@]}" > "$OUT_DIR/sft.log" 2>&1
python -m prmppo stage=prm hydra.run.dir="$OUT_DIR/prm" "${common[@]}" > "$OUT_DIR/prm.log" 2>&1 &
python -m prmppo stage=band hydra.run.dir="$OUT_DIR/band" "${common[@]}" > "$OUT_DIR/band.log" 2>&1 &
wait
for arm in prm orm; do
  python -m prmppo arm=$arm hydra.run.dir="$OUT_DIR/$arm-all" "${common[@]}" > "$OUT_DIR/$arm-all.log" 2>&1 &
  python -m prmppo arm=$arm band.enabled=true hydra.run.dir="$OUT_DIR/$arm-band" "${common[@]}" \
    > "$OUT_DIR/$arm-band.log" 2>&1 &
  python -m prmppo arm=$arm ppo.drop_uniform_groups=true hydra.run.dir="$OUT_DIR/$arm-drop" "${common[@]}" \
    > "$OUT_DIR/$arm-drop.log" 2>&1 &
done
wait
echo done > "$OUT_DIR/DONE"
