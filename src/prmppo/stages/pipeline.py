"""Stage `pipeline` (the default): sft -> prm (when the reward needs a learned PRM) -> band (when
`band.enabled`) -> ppo -> eval.

    python -m prmppo                    # the embedded default, every stage
    python -m prmppo arm=orm            # the control arm: no PRM stage
    python -m prmppo band.enabled=true  # PPO on the prompts whose pass rate lies in [band.low, band.high]
    torchrun --nproc_per_node=2 -m prmppo topology=fsdp hydra.run.dir=runs/pipe2   # 2 FSDP2 ranks

Each stage reuses its artifact when one exists for the same config (`artifacts.py`), so a second
arm, or a second PPO setting, starts from the same SFT checkpoint, PRM and band. The order below
is the order the stages run in.

Several ranks (`topology=fsdp`): SFT and PRM train data-parallel on every rank, the band is
measured by rank 0 (the others wait), PPO runs across the ranks as `stage=ppo` does; then rank 0
alone publishes the policy and runs the final evaluation (two plain models loaded from their
checkpoints) while the others wait for its result in a broadcast, so every rank returns the same
summary and rank 0 writes the one `stage_result.json`. That wait is bounded by the process group's
timeout (`distributed/launch.py`); keep `eval.n_problems` to what rank 0 evaluates within it.
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from prmppo.config.build import build
from prmppo.distributed.launch import close_ranks
from prmppo.stages.common import open_ranks, side_by_side, write_stage_result
from prmppo.stages.inputs import PPOInputs, checks_before_weights, ppo_inputs
from prmppo.stages.ppo_training import publish_policy, train_ppo


def _finish(cfg: DictConfig, task, run_dir: Path, made: PPOInputs, ppo_summary: dict, start: float) -> dict:
    """Publish the policy, evaluate SFT and PPO side by side, write `stage_result.json` (one process)."""
    publish_policy(cfg, Path(ppo_summary["checkpoint"]), ppo_summary)
    compared = side_by_side(cfg, task, run_dir, made.sft_dir, Path(ppo_summary["checkpoint"]))  # 5. eval
    summary = {"sft": made.sft, "prm": made.prm, "band": ppo_summary["band"], "ppo": ppo_summary, **compared,
               "wall_seconds": time.time() - start}
    write_stage_result(run_dir, cfg, "pipeline", summary)
    return summary


def run(cfg: DictConfig, run_dir: Path) -> dict:
    start = time.time()
    task = build(cfg.task, "task")
    gates, band = checks_before_weights(cfg, task)  # refuse in seconds, before any weights; a band that exists
    ranks = open_ranks(cfg, run_dir)
    try:
        made = ppo_inputs(cfg, task, run_dir, ranks, band)  # 1. warm start, 2. PRM when needed, 3. band
        ppo_summary = train_ppo(cfg, task, made.sft_dir, run_dir, gates, made.prm_dir, made.band, ranks)  # 4.
        return ranks.from_main(lambda: _finish(cfg, task, run_dir, made, ppo_summary, start))  # 5. on rank 0
    finally:
        close_ranks(ranks)
