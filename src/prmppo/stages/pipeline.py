"""Stage `pipeline` (the default): sft -> prm (when the reward needs a learned PRM) -> ppo -> eval.

    python -m prmppo                    # the embedded default, every stage
    python -m prmppo arm=orm            # the control arm: no PRM stage

Each stage reuses its artifact when one exists for the same config (`artifacts.py`), so a second
arm, or a second PPO setting, starts from the same SFT checkpoint and PRM. The order below is the
order the stages run in.
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from prmppo.config.build import build
from prmppo.stages import eval as eval_stage, ppo, prm, sft
from prmppo.stages.common import write_stage_result


def run(cfg: DictConfig, run_dir: Path) -> dict:
    start = time.time()
    task = build(cfg.task, "task")
    gates = ppo.early_gates(cfg, task)  # refuse in seconds, before any weights
    sft_dir, sft_summary = sft.ensure_sft(cfg, task, run_dir, reuse=True)  # 1. warm start
    prm_dir = None
    if ppo.needs_learned_prm(cfg):  # 2. PRM, only when the reward asks for one
        prm_dir, _ = prm.ensure_prm(cfg, task, run_dir, sft_dir, reuse=True)
    ppo_summary = ppo.train_ppo(cfg, task, sft_dir, run_dir, gates, prm_dir)  # 3. PPO
    ppo.publish_policy(cfg, Path(ppo_summary["checkpoint"]), ppo_summary)
    compared = eval_stage.side_by_side(cfg, task, run_dir, sft_dir, Path(ppo_summary["checkpoint"]))  # 4. eval
    summary = {"sft": sft_summary, "ppo": ppo_summary, **compared, "wall_seconds": time.time() - start}
    write_stage_result(run_dir, cfg, "pipeline", summary)
    return summary
