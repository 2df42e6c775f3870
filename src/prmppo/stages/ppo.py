"""Stage `ppo`: PPO on the SFT policy for the chosen arm.

    python -m prmppo stage=ppo arm=orm                     # control arm
    python -m prmppo stage=ppo arm=orm ppo.kl_coef=0.04 rollout.sync=adapter
    python -m prmppo stage=ppo debug=smoke                 # seconds: 2 iterations on tiny shapes

Runs the launch gates first (`guards/gates.py`: verifier receipt, topology, EOS; their findings
go into the banner) before any policy weights load, builds (and logs) the components, starts the
rollout worker process on the SFT checkpoint, writes `banner.json`, runs `ppo.iterations`
iterations of `PPOTrainer`, saves the final policy as an HF-layout checkpoint (also published as
the stage's artifact for `eval`), and writes `stage_result.json` atomically, with the alarms of
the ratio tripwire and the canary (`guards/tripwires.py`, `guards/canary.py`) under
`summary.alarms`. The SFT checkpoint for the same config is reused, or trained first when there
is none.
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


def banner(cfg: DictConfig, tokenizer, shape, base_dir: Path, policy, gates: dict) -> dict:
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
        "gates": gates,
    }


def early_gates(cfg: DictConfig, task) -> dict:
    """The gates that need no model: verifier receipt and topology. Runners call this right after
    the task is built, before SFT or any weights, so a broken setup fails in seconds.

    Config validation ran in `app.run`; horizon consistency runs when `PPOTrainer` is built.
    """
    from prmppo.guards import check_topology, verifier_receipt

    topology = cfg.topology
    return {"verifier_receipt": verifier_receipt(task, seed=cfg.seed),
            "topology": check_topology(topology.train_device, topology.engine_device, topology.train_world_size,
                                       topology.colocated)}


def _launch_gates(cfg: DictConfig, base_dir: Path, gates: dict):
    """The gates that need the checkpoint's files but no weights; returns (tokenizer, tripwire, gates)."""
    from prmppo.guards import RatioTripwire, derive_eos
    from prmppo.models.loading import load_tokenizer

    gates = dict(gates)
    tokenizer = load_tokenizer(base_dir)
    gates["eos"] = derive_eos(base_dir, tokenizer)
    tripwire = RatioTripwire(cfg.ppo.max_first_ratio_dev, cfg.ppo.max_engine_logprob_gap)
    gates["ratio_tripwire"] = tripwire.self_test()
    return tokenizer, tripwire, gates


def _attach_step_scorer(cfg: DictConfig, reward, task, tokenizer, policy, base_dir: Path, run_dir: Path) -> None:
    """Give a step-level reward its scorer: the learned PRM on the policy's resident base, or the checker."""
    from prmppo.models.prm import build_step_scorer
    from prmppo.stages.prm import ensure_prm

    prm_dir = ensure_prm(cfg, task, run_dir, base_dir, reuse=True)[0] if reward.needs_learned_prm else None
    scorer = build_step_scorer(cfg.reward.scorer, task=task, tokenizer=tokenizer, model=policy.prm_host, prm_dir=prm_dir,
                               chunk_rows=cfg.prm_train.chunk_rows)
    reward.attach(scorer, task)


def _canary(cfg: DictConfig, task, tokenizer, policy, run_dir: Path):
    """The canary on the policy being trained: greedy accuracy on the first `canary.n_problems` test problems."""
    from prmppo.evaluation import score
    from prmppo.guards.canary import Canary

    def greedy_accuracy(problems) -> float:
        return score(policy.model, tokenizer, task, problems, k=0, temperature=1.0,
                     max_new_tokens=cfg.ppo.max_new_tokens, batch_rows=cfg.eval.batch_rows,
                     seed=cfg.seed)["greedy_accuracy"]

    return Canary(task.problems("test")[: cfg.canary.n_problems], cfg.canary.every, cfg.canary.max_drop,
                  run_dir / "canary.jsonl", greedy_accuracy)


def _alarms(iteration: int, metrics: dict, tripwire, canary) -> list[dict]:
    """This iteration's alarms from the ratio tripwire and the canary, each logged as a warning."""
    found = [{"iteration": iteration, "tripwire": "ratio", "message": m} for m in tripwire.check(metrics)]
    found += [{"iteration": iteration, "tripwire": "canary", "message": m} for m in canary.check(iteration)]
    for alarm in found:
        log.warning("alarm at ppo it %d: %s", iteration, alarm["message"])
    return found


def train_ppo(cfg: DictConfig, task, base_dir: Path, run_dir: Path, gates: dict) -> dict:
    """Run PPO from `base_dir`; returns the summary (final checkpoint path included)."""
    from prmppo.app import build
    from prmppo.models.loading import load_model
    from prmppo.ppo.loop import PPOTrainer, save_value_head
    from prmppo.ppo.sync import WeightSync
    from prmppo.stages.runners import train_device

    tokenizer, tripwire, gates = _launch_gates(cfg, base_dir, gates)
    device = train_device(cfg)
    reward = build(cfg.reward, "reward")
    model = load_model(base_dir, cfg.model.dtype, device)
    policy = build(cfg.lora, "policy", base_model=model, detach_value_hidden=cfg.ppo.detach_value_hidden)
    if reward.needs_step_scorer:
        _attach_step_scorer(cfg, reward, task, tokenizer, policy, base_dir, run_dir)
    ppo = OmegaConf.to_object(cfg.ppo)
    sync = WeightSync(cfg.rollout.sync, cfg.rollout.sync_every_iterations, run_dir / "sync", tokenizer)
    start = time.time()
    history: list[dict] = []
    alarms: list[dict] = []
    canary = _canary(cfg, task, tokenizer, policy, run_dir)
    with _engine(cfg, base_dir, run_dir) as engine, MetricsLogger(run_dir, "ppo", cfg.logger.console) as logger:
        trainer = PPOTrainer(policy=policy, tokenizer=tokenizer, task=task, reward=reward, engine=engine, sync=sync,
                             ppo=ppo, logger=logger, device=device, seed=cfg.seed)
        gates["horizon"] = {"policy_optimizer_steps": trainer.shape.policy_steps}  # checked by PPOTrainer
        write_json_atomic(run_dir / "banner.json", banner(cfg, tokenizer, trainer.shape, base_dir, policy, gates))
        for iteration in tqdm(range(ppo.iterations), desc=f"ppo[{cfg.arm.name}]", unit="it", mininterval=5.0):
            metrics = trainer.iteration(iteration)
            metrics["perf/wall_s"] = time.time() - start
            logger.log(iteration, metrics)
            history.append(metrics)
            alarms += _alarms(iteration, metrics, tripwire, canary)
            if iteration % 10 == 0 or iteration == ppo.iterations - 1:
                log.info("ppo it %d: accuracy %.3f reward %.3f kl %.4f engine-gap %.2e", iteration,
                         metrics["rollout/accuracy"], metrics["reward/total_mean"], metrics["ppo/kl_ref"],
                         metrics["rollout/engine_logprob_abs_diff"])
    final = run_dir / "checkpoints" / "final"
    policy.save_merged(final, tokenizer)
    save_value_head(policy, final / "value_head.safetensors")
    return {"checkpoint": str(final), "iterations": ppo.iterations, "train_seconds": time.time() - start,
            "policy_steps": trainer.policy_steps_taken, "planned_policy_steps": trainer.shape.policy_steps,
            "skipped_steps": trainer.skipped_steps, "alarms": alarms,
            "last_rollout_accuracy": history[-1]["rollout/accuracy"],
            "max_engine_logprob_abs_diff": max(h["rollout/engine_logprob_abs_diff"] for h in history)}


def publish_policy(cfg: DictConfig, checkpoint: Path, summary: dict) -> Path:
    """Copy the final policy to the `ppo` artifact dir for this config (for `eval`/pipeline)."""
    import shutil

    final = artifacts.artifact_dir(cfg, "ppo")
    tmp = artifacts.staging_dir(final)
    shutil.copytree(checkpoint, tmp, dirs_exist_ok=True)
    return artifacts.publish(tmp, final, cfg, "ppo", summary)

