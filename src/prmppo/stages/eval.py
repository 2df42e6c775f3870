"""Stage `eval`: greedy accuracy, sampled accuracy (mean over `eval.k` samples at `eval.temperature`)
and pass@k on the test split.

    python -m prmppo stage=eval eval.checkpoint=runs/default/<time>/checkpoints/final eval.k=16
    python -m prmppo stage=eval                     # this config's SFT and PPO artifacts, when they exist

The pipeline's last step evaluates the SFT and PPO policies side by side on the same problems,
with their difference (`stages/common.py side_by_side`). eval.json also keeps, per policy, every
test problem's outcomes (`problems`: index, id, difficulty, greedy verdict, right samples of k), so
that reports can resample prompts as well as seeds; the stage summaries leave them out.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from prmppo import artifacts
from prmppo.config.build import build
from prmppo.errors import PrmppoError
from prmppo.logger import write_json_atomic
from prmppo.models.loading import check_model_dir
from prmppo.stages.common import evaluate_checkpoint, open_metrics, without_problems, write_stage_result


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Evaluate `eval.checkpoint`, or this config's SFT and PPO artifacts when it is empty."""
    task = build(cfg.task, "task")
    if cfg.eval.checkpoint:
        targets = {"checkpoint": Path(cfg.eval.checkpoint)}
    else:
        targets = {stage: artifacts.artifact_dir(cfg, stage) for stage in ("sft", "ppo")
                   if artifacts.artifact_ready(artifacts.artifact_dir(cfg, stage))}
        if not targets:
            raise PrmppoError(f"eval.checkpoint is empty and no SFT/PPO artifact for this config exists under "
                              f"{Path(cfg.artifacts_dir).resolve()}; pass eval.checkpoint=<HF-layout dir>")
    for path in targets.values():
        check_model_dir(path)
    summary = {}
    with open_metrics(cfg, run_dir, "eval") as logger:
        for name, path in targets.items():
            summary[name] = evaluate_checkpoint(cfg, task, path)
            logger.log(0, {f"eval/{name}/{k}": v for k, v in summary[name].items() if isinstance(v, float)},
                       echo=True)
    write_json_atomic(run_dir / "eval.json", summary)
    summary = {name: without_problems(result) for name, result in summary.items()}
    write_stage_result(run_dir, cfg, "eval", summary)
    return summary
