"""What PPO starts from, made in the pipeline's order by one function that the `ppo` and `pipeline`
stages both call: the launch gates first (seconds, before any weights), then 1. the SFT checkpoint,
2. the PRM when the reward scores steps with a learned one, 3. the band of prompts when one is used.
Each is reused when its artifact exists for the same config (`stages/common.py make_or_reuse`).

Several ranks (`topology=fsdp`): the SFT checkpoint and the PRM are trained data-parallel on every
rank; a missing band is measured by rank 0 while the others wait, then read by them.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf

from prmppo.config.build import build
from prmppo.config.schema import LoraAdapterConfig
from prmppo.distributed.launch import ranks_on_this_node
from prmppo.guards.gates import (check_label_source, check_rollout_engine, check_step_scorer, check_topology,
                                 check_trainable_modules, verifier_receipt)
from prmppo.stages.band import Band, existing_band, ppo_band
from prmppo.stages.common import head_dim
from prmppo.stages.prm import ensure_prm
from prmppo.stages.sft_training import ensure_sft


def early_gates(cfg: DictConfig, task) -> dict:
    """The gates that need no model: verifier receipt, topology, the rollout engine's interpreter and the
    source of step scores (a step-level reward with `scorer=oracle` needs the task's checker). Stages
    call this right after the task is built, before SFT or any weights, so a broken setup fails in seconds.

    Config validation ran in `app.run`; horizon consistency runs when `PPOTrainer` is built.
    """
    topology, reward = cfg.topology, build(cfg.reward, "reward", seed=cfg.seed)
    architecture, architecture_source = build(cfg.model, "model source").architecture()
    return {"verifier_receipt": verifier_receipt(task, seed=cfg.seed),
            "topology": check_topology(topology.train_device, topology.engine_device,
                                       ranks_on_this_node(topology.train_world_size), topology.colocated),
            "rollout_engine": check_rollout_engine(cfg.rollout.engine, cfg.rollout.python,
                                                   head_dim(architecture), architecture_source),
            "step_scorer": check_step_scorer(task, reward),
            "prm_labels": check_label_source(task, cfg.prm_train.label_source, needed=reward.needs_learned_prm),
            "trainable_modules": check_trainable_modules(_modules_to_save(cfg.lora),
                                                         architecture, architecture_source)}


def checks_before_weights(cfg: DictConfig, task) -> tuple[dict, Band | None]:
    """`early_gates`, and the band PPO will read when it exists already (`band.file`, or this config's band
    artifact with `band.enabled`): read and checked now, so a bad band fails before SFT or any weights."""
    return early_gates(cfg, task), existing_band(cfg, task)


def needs_learned_prm(cfg: DictConfig) -> bool:
    """Whether this config's reward scores steps with a trained PRM (asked of the reward itself)."""
    return build(cfg.reward, "reward", seed=cfg.seed).needs_learned_prm


class PPOInputs(NamedTuple):
    """What PPO starts from: the SFT checkpoint, the PRM when the reward needs one, the band when used."""

    sft_dir: Path
    sft: dict  # ensure_sft's summary
    prm_dir: Path | None
    prm: dict | None  # ensure_prm's summary
    band: Band | None


def ppo_inputs(cfg: DictConfig, task, run_dir: Path, ranks, known_band: Band | None) -> PPOInputs:
    """1. the SFT checkpoint and 2. (when the reward needs one) the PRM of this config, reused or trained on
    every rank (data parallel under `topology=fsdp`); 3. the band (`known_band`, or measured by rank 0
    first while the others wait, then read by them)."""
    sft_dir, sft_summary = ensure_sft(cfg, task, run_dir, reuse=True, ranks=ranks)
    prm_dir, prm_summary = None, None
    if needs_learned_prm(cfg):
        prm_dir, prm_summary = ensure_prm(cfg, task, run_dir, sft_dir, reuse=True, ranks=ranks)
    band = ranks.main_first(lambda: ppo_band(cfg, task, run_dir, sft_dir, known_band))
    return PPOInputs(sft_dir, sft_summary, prm_dir, prm_summary, band)


def _modules_to_save(lora) -> list[str]:
    """The modules trained in full beside the adapter: `lora.modules_to_save` under `lora=adapter`; none under
    `lora=none` (full fine-tuning trains every module, and its schema has no such key)."""
    return list(lora.modules_to_save) if issubclass(OmegaConf.get_type(lora), LoraAdapterConfig) else []
