"""Stage `pipeline` (the default): sft -> prm (when the reward needs a learned PRM) -> band (when
`band.enabled`) -> ppo -> eval.

    python -m prmppo                    # the embedded default, every stage
    python -m prmppo arm=orm            # the control arm: no PRM stage
    python -m prmppo band.enabled=true  # PPO on the prompts whose pass rate lies in [band.low, band.high]

Each stage reuses its artifact when one exists for the same config (`artifacts.py`), so a second
arm, or a second PPO setting, starts from the same SFT checkpoint, PRM and band. The order below
is the order the stages run in.
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from prmppo.config.build import build
from prmppo.stages import band as band_stage, eval as eval_stage, ppo, prm, sft
from prmppo.stages.common import write_stage_result


def run(cfg: DictConfig, run_dir: Path) -> dict:
    start = time.time()
    task = build(cfg.task, "task")
    gates = ppo.early_gates(cfg, task)  # refuse in seconds, before any weights
    band = band_stage.existing_band(cfg, task)  # band.file, or this config's band artifact when it exists
    sft_dir, sft_summary = sft.ensure_sft(cfg, task, run_dir, reuse=True)  # 1. warm start
    prm_dir, prm_summary = None, None
    if ppo.needs_learned_prm(cfg):  # 2. PRM, only when the reward asks for one
        prm_dir, prm_summary = prm.ensure_prm(cfg, task, run_dir, sft_dir, reuse=True)
    band = band_stage.ppo_band(cfg, task, run_dir, sft_dir, band)  # 3. band, only with band.enabled
    ppo_summary = ppo.train_ppo(cfg, task, sft_dir, run_dir, gates, prm_dir, band)  # 4. PPO
    ppo.publish_policy(cfg, Path(ppo_summary["checkpoint"]), ppo_summary)
    compared = eval_stage.side_by_side(cfg, task, run_dir, sft_dir, Path(ppo_summary["checkpoint"]))  # 5. eval
    summary = {"sft": sft_summary, "prm": prm_summary, "band": ppo_summary["band"], "ppo": ppo_summary, **compared,
               "wall_seconds": time.time() - start}
    write_stage_result(run_dir, cfg, "pipeline", summary)
    return summary
