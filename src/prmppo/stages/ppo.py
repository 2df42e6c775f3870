"""Stage `ppo`: PPO on the SFT policy for the chosen arm.

    python -m prmppo stage=ppo arm=orm                     # control arm
    python -m prmppo stage=ppo arm=orm ppo.kl_coef=0.04 rollout.sync=adapter
    python -m prmppo stage=ppo debug=smoke                 # seconds: 2 iterations on tiny shapes

Builds (and logs) the components, starts the rollout worker process on the SFT checkpoint,
writes `banner.json`, runs `ppo.iterations` iterations of `PPOTrainer`, saves the final policy
as an HF-layout checkpoint (also published as the stage's artifact for `eval`), and writes
`stage_result.json` atomically. The SFT checkpoint for the same config is reused, or trained
first when there is none.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from prmppo import artifacts
from prmppo.logger import MetricsLogger, write_json_atomic

log = logging.getLogger("prmppo")


def _engine(cfg: DictConfig, base_dir: Path, run_dir: Path):
    from prmppo.rollout.client import RolloutClient

    return RolloutClient(
        spool_dir=run_dir / "spool", engine=cfg.rollout.engine, base_model_dir=str(base_dir),
        log_path=run_dir / "worker.log", device=cfg.topology.engine_device, dtype=cfg.model.dtype,
        python=cfg.rollout.python or sys.executable, startup_timeout_s=cfg.rollout.startup_timeout_s,
        request_timeout_s=cfg.rollout.request_timeout_s, heartbeat_timeout_s=cfg.rollout.heartbeat_timeout_s)


def banner(cfg: DictConfig, tokenizer, shape, base_dir: Path, policy) -> dict:
    return {
        "arm": cfg.arm.name, "experiment": cfg.experiment_name, "seed": cfg.seed,
        "shape": {**shape.__dict__, "prompts_per_iteration": cfg.ppo.prompts_per_iteration,
                  "n_samples_per_prompt": cfg.ppo.n_samples_per_prompt, "iterations": cfg.ppo.iterations},
        "reward": OmegaConf.to_container(cfg.reward, resolve=True),
        "kl": {"coef": cfg.ppo.kl_coef, "estimator": cfg.ppo.kl_estimator, "placement": cfg.ppo.kl_placement},
        "lora": OmegaConf.to_container(cfg.lora, resolve=True),
        "topology": OmegaConf.to_container(cfg.topology, resolve=True),
        "rollout": {"engine": cfg.rollout.engine, "sync": cfg.rollout.sync,
                    "sync_every_iterations": cfg.rollout.sync_every_iterations},
        "derived_ids": {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                        "bos_token_id": tokenizer.bos_token_id},
        "base_checkpoint": str(base_dir),
        "trainable_policy_parameters": sum(p.numel() for p in policy.policy_parameters()),
    }


def _attach_step_scorer(cfg: DictConfig, reward, task, tokenizer, policy, base_dir: Path, run_dir: Path) -> None:
    """Give a step-level reward its scorer: the learned PRM on the policy's resident base, or the checker."""
    from prmppo.models.prm import build_step_scorer
    from prmppo.stages.prm import ensure_prm

    prm_dir = ensure_prm(cfg, task, run_dir, base_dir, reuse=True)[0] if reward.needs_learned_prm else None
    scorer = build_step_scorer(cfg.reward.scorer, task=task, tokenizer=tokenizer, model=policy.prm_host, prm_dir=prm_dir,
                               chunk_rows=cfg.prm_train.chunk_rows)
    reward.attach(scorer, task)


def train_ppo(cfg: DictConfig, task, base_dir: Path, run_dir: Path) -> dict:
    """Run PPO from `base_dir`; returns the summary (final checkpoint path included)."""
    from prmppo.app import build
    from prmppo.models.loading import load_model, load_tokenizer
    from prmppo.ppo.loop import PPOTrainer, save_value_head
    from prmppo.ppo.sync import WeightSync
    from prmppo.stages.runners import train_device

    device = train_device(cfg)
    tokenizer = load_tokenizer(base_dir)
    reward = build(cfg.reward, "reward")
    model = load_model(base_dir, cfg.model.dtype, device)
    policy = build(cfg.lora, "policy", base_model=model, detach_value_hidden=cfg.ppo.detach_value_hidden)
    if reward.needs_step_scorer:
        _attach_step_scorer(cfg, reward, task, tokenizer, policy, base_dir, run_dir)
    ppo = OmegaConf.to_object(cfg.ppo)
    sync = WeightSync(cfg.rollout.sync, cfg.rollout.sync_every_iterations, run_dir / "sync", tokenizer)
    start = time.time()
    history: list[dict] = []
    with _engine(cfg, base_dir, run_dir) as engine, MetricsLogger(run_dir, "ppo", cfg.logger.console) as logger:
        trainer = PPOTrainer(policy=policy, tokenizer=tokenizer, task=task, reward=reward, engine=engine, sync=sync,
                             ppo=ppo, logger=logger, device=device, seed=cfg.seed)
        write_json_atomic(run_dir / "banner.json", banner(cfg, tokenizer, trainer.shape, base_dir, policy))
        for iteration in tqdm(range(ppo.iterations), desc=f"ppo[{cfg.arm.name}]", unit="it", mininterval=5.0):
            metrics = trainer.iteration(iteration)
            metrics["perf/wall_s"] = time.time() - start
            logger.log(iteration, metrics)
            history.append(metrics)
            if iteration % 10 == 0 or iteration == ppo.iterations - 1:
                log.info("ppo it %d: accuracy %.3f reward %.3f kl %.4f engine-gap %.2e", iteration,
                         metrics["rollout/accuracy"], metrics["reward/total_mean"], metrics["ppo/kl_ref"],
                         metrics["rollout/engine_logprob_abs_diff"])
    final = run_dir / "checkpoints" / "final"
    policy.save_merged(final, tokenizer)
    save_value_head(policy, final / "value_head.safetensors")
    return {"checkpoint": str(final), "iterations": ppo.iterations, "train_seconds": time.time() - start,
            "policy_steps": trainer.policy_steps_taken, "planned_policy_steps": trainer.shape.policy_steps,
            "skipped_steps": trainer.skipped_steps,
            "last_rollout_accuracy": history[-1]["rollout/accuracy"],
            "max_engine_logprob_abs_diff": max(h["rollout/engine_logprob_abs_diff"] for h in history)}


def publish_policy(cfg: DictConfig, checkpoint: Path, summary: dict) -> Path:
    """Copy the final policy to the `ppo` artifact dir for this config (for `eval`/pipeline)."""
    import shutil

    final = artifacts.artifact_dir(cfg, "ppo")
    tmp = artifacts.staging_dir(final)
    shutil.copytree(checkpoint, tmp, dirs_exist_ok=True)
    return artifacts.publish(tmp, final, cfg, "ppo", summary)

