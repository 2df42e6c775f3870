"""Stage `sft`: supervised warm-start of the policy on the task's worked solutions, trained afresh and
published as this config's SFT artifact (how: `stages/sft_training.py`).

    python -m prmppo stage=sft                      # embedded default: tiny model, arith task
    python -m prmppo stage=sft sft.steps=3000       # longer
    python -m prmppo stage=sft model=hf model.path=/ckpt/mistral-7b sft.steps=0   # accept as is
    torchrun --nproc_per_node=2 -m prmppo stage=sft topology=fsdp hydra.run.dir=runs/sft2   # 2 FSDP2 ranks
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from prmppo.config.build import build
from prmppo.distributed.launch import close_ranks
from prmppo.stages.common import open_ranks, write_stage_result
from prmppo.stages.sft_training import ensure_sft


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Stage `sft`: a freshly trained SFT checkpoint (published as this config's artifact). Under
    `topology=fsdp` every rank runs this (torchrun); rank 0 writes the results."""
    start = time.time()
    task = build(cfg.task, "task")
    ranks = open_ranks(cfg, run_dir)
    try:
        _, summary = ensure_sft(cfg, task, run_dir, reuse=False, ranks=ranks)
        summary["wall_seconds"] = time.time() - start
        if ranks.is_main:
            write_stage_result(run_dir, cfg, "sft", summary)
        return summary
    finally:
        close_ranks(ranks)
