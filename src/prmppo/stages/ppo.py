"""Stage `ppo`: PPO on the SFT policy for the chosen arm.

    python -m prmppo stage=ppo arm=orm                     # control arm
    python -m prmppo stage=ppo arm=orm ppo.kl_coef=0.04 rollout.sync=adapter
    python -m prmppo stage=ppo debug=smoke                 # seconds: 2 iterations on tiny shapes
    python -m prmppo stage=ppo band.enabled=true           # prompts from this config's pass-rate band
    python -m prmppo stage=ppo band.file=<band.jsonl> ppo.drop_uniform_groups=true
    torchrun --nproc_per_node=2 -m prmppo stage=ppo topology=fsdp hydra.run.dir=runs/r   # 2 FSDP2 ranks

Composition only: the launch gates (`guards/gates.py` via `stages/inputs.py`: verifier receipt,
topology, engine, step scores; their findings go into the banner) and a band that exists already
are checked before any weights; then the PPO inputs (`stages/inputs.py`: the SFT checkpoint and,
for a learned-PRM reward, the PRM of the same config, reused or made first; the band), then PPO
(`stages/ppo_training.py`: components built whole, the outer loop `ppo/run.py`, the final policy
saved as an HF-layout checkpoint), then the policy published as the stage's artifact for `eval`
and `stage_result.json` written atomically, with the alarms of the ratio tripwire and the canary
under `summary.alarms`.

RL prompts: every `train` problem, or a pass-rate band of them (`stages/band.py`): `band.file`, or
with `band.enabled` this config's band artifact (measured after SFT when missing). A band that
exists is read and checked with the early gates, before any weights; `banner.json` records its
file, size and pass-rate range under `band`.

Several ranks (`topology=fsdp`, `distributed/`): every rank runs this module; a missing SFT
checkpoint or PRM is trained data-parallel on every rank first, a missing band is measured by rank
0 while the others wait; the ranks object answers what differs from one process (the policy
sharded after the PRM loads, the weight sync and the final save through full weights gathered to
rank 0, sharded checkpoints; the engine, metrics and banner on rank 0 only).

Stop and resume (`ppo/checkpoint.py`): a resumable checkpoint is saved every
`checkpoint_every(ppo.iterations, rollout.sync_every_iterations)` iterations (about 4 per run, on
sync boundaries), after the last iteration and at a coordinated stop. SIGTERM or `max_wall_seconds`
(root key, seconds since PPO started in this launch; 0 = unlimited) stops after the current
iteration: checkpoint, worker closed, `stage_result.json` with `"stopped"`, exit code 3.
Relaunching the same command with the same run dir resumes from the newest complete checkpoint,
pushes its weights to the engine before the first request, and drops metrics/canary rows of
iterations after it. Keep-N pruning spares the checkpoint of the best canary check so far, and a
canary alarm pins it for good (`extra.pinned` in the checkpoint, `pinned_checkpoints` in the
summary); it exists when `canary.every` is a multiple of the checkpoint period. Simplification: a
stop between sync boundaries (sync_every_iterations > 1) resumes with the engine on the current
weights, where the uninterrupted run would still sample with the last synced ones.

    python -m prmppo stage=ppo debug=smoke ppo.iterations=4 max_wall_seconds=1 hydra.run.dir=runs/r  # exit 3
    python -m prmppo stage=ppo debug=smoke ppo.iterations=4 hydra.run.dir=runs/r                     # resumes
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from prmppo.config.build import build
from prmppo.distributed.launch import close_ranks
from prmppo.logger.laps import Laps
from prmppo.stages.common import open_ranks, write_stage_result
from prmppo.stages.inputs import checks_before_weights, ppo_inputs
from prmppo.stages.ppo_training import publish_policy, train_ppo


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Stage `ppo`: the SFT checkpoint (and PRM, and band) of this config, reused or made, then PPO; publishes
    the policy. Under `topology=fsdp` every rank runs this (torchrun); rank 0 writes the results."""
    start, laps = time.time(), Laps()  # the start-up laps begin here: `before_first_lap` is imports and config
    with laps.lap("task"):
        task = build(cfg.task, "task")
    with laps.lap("early_gates"):
        gates, band = checks_before_weights(cfg, task)  # a band that exists is checked before any weights
    ranks = open_ranks(cfg, run_dir)
    try:
        with laps.lap("inputs"):  # the SFT checkpoint (PRM, band) reused or made
            made = ppo_inputs(cfg, task, run_dir, ranks, band)
        summary = train_ppo(cfg, task, made.sft_dir, run_dir, gates, made.prm_dir, made.band, ranks, laps)
        if ranks.is_main:
            summary["artifact"] = str(publish_policy(cfg, Path(summary["checkpoint"]), summary))
            summary["wall_seconds"] = time.time() - start
            write_stage_result(run_dir, cfg, "ppo", summary)
        return summary
    finally:
        close_ranks(ranks)
