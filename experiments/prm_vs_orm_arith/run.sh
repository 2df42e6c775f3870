#!/usr/bin/env bash
# The four sweeps of RESULTS.md on one machine, in two chains side by side, each sweep running its jobs
# several at a time (sweep=parallel, Hydra's joblib launcher; pip install -e ".[sweeps]"):
#   chain 1: rloo (orm, prm x 5 seeds), then gae (lam 1.0 then 0.95 x orm, prm x 5 seeds)
#   chain 2: rloo_oracle (5 seeds), then gae_oracle (lam 1.0 then 0.95 x 5 seeds)
# The first job of each seed trains its SFT checkpoint and PRM; the others wait on the artifact lock.
#   bash experiments/prm_vs_orm_arith/run.sh                    # CPU: give each job a core (OMP_NUM_THREADS=1)
#   bash experiments/prm_vs_orm_arith/run.sh topology=gpu       # one GPU: tiny-model jobs share it
# JOBS1 / JOBS2: jobs at a time in chain 1 / 2 (default 10 / 5); SEEDS (default 0,1,2,3,4); MULTIRUN: the sweeps'
# parent dir (default multirun/$EXPERIMENT); EXPERIMENT (default prm_vs_orm_arith; prm_vs_orm_sparse runs the same four).
# Then pack the runs and write the report from the archive (README.md has the --threshold of each study):
#   python -m prmppo.report.archive multirun/$EXPERIMENT --out experiments/$EXPERIMENT/runs.tar.xz
#   python -m prmppo.report experiments/$EXPERIMENT/runs.tar.xz --out experiments/$EXPERIMENT --name RESULTS.md --threshold T
set -u
JOBS1=${JOBS1:-10}
JOBS2=${JOBS2:-5}
EXPERIMENT=${EXPERIMENT:-prm_vs_orm_arith}
ROOT=${MULTIRUN:-multirun/$EXPERIMENT}
SEEDS=seed=${SEEDS:-0,1,2,3,4}
mkdir -p "$ROOT"
sweep() {  # sweep <name> <jobs at a time> <overrides...>
  local name=$1 jobs=$2
  shift 2
  python -m prmppo -m sweep=parallel experiment="$EXPERIMENT" logger.console=false hydra.launcher.n_jobs="$jobs" \
    "$@" hydra.sweep.dir="$ROOT/$name" > "$ROOT/$name.log" 2>&1
  echo "$(date -u +%H:%M:%S) $name exit $?" >> "$ROOT/progress.log"
}
GAE="ppo.advantage_estimator=gae ppo.lam_actor=1.0,0.95"
( sweep rloo "$JOBS1" arm=orm,prm $SEEDS "${@}"
  sweep gae "$JOBS1" $GAE arm=orm,prm $SEEDS "${@}" ) &
( sweep rloo_oracle "$JOBS2" arm=prm reward=prm_oracle $SEEDS "${@}"
  sweep gae_oracle "$JOBS2" $GAE arm=prm reward=prm_oracle $SEEDS "${@}" ) &
wait
