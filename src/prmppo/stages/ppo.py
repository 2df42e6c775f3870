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

Test accuracy during PPO: before the first iteration, every `eval.every` iterations and after the
last, greedy and sampled accuracy on the first `eval.during_ppo_problems` test problems, logged as
rows with `"stage": "ppo_eval"` (x axis `eval/ppo_iterations`, the iterations done); canary checks
add `canary/` metrics to the iteration's row.

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

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from prmppo import artifacts
from prmppo.errors import StopRequested
from prmppo.logger import write_json_atomic
from prmppo.logger.console import print_summary, progress

log = logging.getLogger("prmppo")


def engine_options(cfg: DictConfig) -> dict:
    """The engine's own keyword arguments: vLLM's memory share, LoRA rank (0: no LoRA) and seed."""
    if cfg.rollout.engine != "vllm":
        return {}
    rank = cfg.lora.r if cfg.rollout.sync == "adapter" else 0
    return {"gpu_memory_utilization": cfg.rollout.gpu_memory_utilization, "max_lora_rank": rank, "seed": cfg.seed}


def _engine(cfg: DictConfig, base_dir: Path, run_dir: Path):
    from prmppo.rollout.client import RolloutClient, resolve_python

    return RolloutClient(
        spool_dir=run_dir / "spool", engine=cfg.rollout.engine, base_model_dir=str(base_dir),
        log_path=run_dir / "worker.log", device=cfg.topology.engine_device, dtype=cfg.model.dtype,
        python=resolve_python(cfg.rollout.python), startup_timeout_s=cfg.rollout.startup_timeout_s,
        request_timeout_s=cfg.rollout.request_timeout_s, heartbeat_timeout_s=cfg.rollout.heartbeat_timeout_s,
        engine_options=engine_options(cfg))


def _model_head_dim(model: DictConfig) -> tuple[int | None, str]:
    """The attention head size the model config implies, and where it came from; None when unknown yet."""
    if "num_attention_heads" in model:  # built from code (model=tiny)
        return model.hidden_size // model.num_attention_heads, (
            f"model.hidden_size={model.hidden_size} / model.num_attention_heads={model.num_attention_heads}")
    config = Path(model.path) / "config.json" if "path" in model else None
    if config is None or not config.is_file():
        return None, ""  # the model dir is checked (and refused by name) when it loads
    from prmppo.rollout.vllm_engine import model_head_dim

    try:
        return model_head_dim(json.loads(config.read_text())), str(config)
    except (json.JSONDecodeError, KeyError, TypeError, ZeroDivisionError):
        return None, ""


def _model_architecture(model: DictConfig) -> tuple[dict | None, str]:
    """The transformers config dict the model config implies (no weights), and where it came from."""
    if "num_attention_heads" in model:  # built from code (model=tiny): a Mistral
        arch = {k: model[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}
        return {"model_type": "mistral", "vocab_size": 32, "tie_word_embeddings": True, **arch}, "model=tiny"
    config = Path(model.path) / "config.json" if "path" in model else None
    if config is None or not config.is_file():
        return None, ""
    try:
        found = json.loads(config.read_text())
    except json.JSONDecodeError:
        return None, ""
    return (found, str(config)) if "model_type" in found else (None, "")


def banner(cfg: DictConfig, tokenizer, shape, base_dir: Path, policy, gates: dict) -> dict:
    return {
        "arm": cfg.arm.name, "experiment": cfg.experiment_name, "seed": cfg.seed,
        "shape": {**shape.__dict__, "prompts_per_iteration": cfg.ppo.prompts_per_iteration,
                  "n_samples_per_prompt": cfg.ppo.n_samples_per_prompt, "iterations": cfg.ppo.iterations},
        "reward": OmegaConf.to_container(cfg.reward, resolve=True),
        "kl": {"reward_coef": cfg.ppo.kl_coef, "reward_estimator": cfg.ppo.kl_estimator,
               "loss_coef": cfg.ppo.kl_loss_coef, "loss_estimator": cfg.ppo.kl_loss_estimator},
        "advantage_estimator": cfg.ppo.advantage_estimator,
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
    """The gates that need no model: verifier receipt, topology, the rollout engine's interpreter and the
    source of step scores (a step-level reward with `scorer=oracle` needs the task's checker). Runners
    call this right after the task is built, before SFT or any weights, so a broken setup fails in seconds.

    Config validation ran in `app.run`; horizon consistency runs when `PPOTrainer` is built.
    """
    from prmppo.app import build
    from prmppo.guards.gates import (check_rollout_engine, check_step_scorer, check_topology,
                                     check_trainable_modules, verifier_receipt)

    topology = cfg.topology
    return {"verifier_receipt": verifier_receipt(task, seed=cfg.seed),
            "topology": check_topology(topology.train_device, topology.engine_device, topology.train_world_size,
                                       topology.colocated),
            "rollout_engine": check_rollout_engine(cfg.rollout.engine, cfg.rollout.python,
                                                   *_model_head_dim(cfg.model)),
            "step_scorer": check_step_scorer(task, build(cfg.reward, "reward", seed=cfg.seed)),
            "trainable_modules": check_trainable_modules(list(cfg.lora.get("modules_to_save") or []),
                                                         *_model_architecture(cfg.model))}


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


ENGINE_GAP_MARGIN = 3.0  # the stale-sync alarm sits this many times above the measured noise floor


def _engine_gap_limit(trainer, ppo):
    """The ratio tripwire with its engine-gap limit set above this run's noise floor.

    The engine and the trainer compute the same logprobs with different kernels; in fp32 they
    agree to ~1e-6 nats per token, in bf16 to ~1e-2, i.e. at the configured limit. So the gap is
    measured once at launch while both hold the same weights, and the alarm fires only beyond
    max(ppo.max_engine_logprob_gap, ENGINE_GAP_MARGIN x that floor). Returns (tripwire, banner entry)."""
    from prmppo.guards import RatioTripwire

    floor = trainer.engine_gap_at_identical_weights()
    limit = max(ppo.max_engine_logprob_gap, ENGINE_GAP_MARGIN * floor)
    tripwire = RatioTripwire(ppo.max_first_ratio_dev, limit)
    return tripwire, {"measured_at_identical_weights": floor, "limit": limit, **tripwire.self_test()}


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


def _test_eval(cfg: DictConfig, task, tokenizer, policy):
    """`evaluate(iterations_done) -> eval/ metrics` of the policy on the first `eval.during_ppo_problems`
    test problems (the same ones each time): greedy accuracy, and sampled accuracy over
    `eval.during_ppo_k` samples at `eval.temperature`."""
    from prmppo.evaluation import score

    problems = task.problems("test")[: cfg.eval.during_ppo_problems]

    def evaluate(iterations_done: int) -> dict:
        result = score(policy.model, tokenizer, task, problems, k=cfg.eval.during_ppo_k,
                       temperature=cfg.eval.temperature, max_new_tokens=cfg.eval.max_new_tokens,
                       batch_rows=cfg.eval.batch_rows, seed=cfg.seed, show_progress=cfg.logger.console)
        metrics = {"eval/ppo_iterations": iterations_done, "eval/test_greedy_accuracy": result["greedy_accuracy"],
                   "eval/n_problems": len(problems)}
        if cfg.eval.during_ppo_k > 0:
            metrics["eval/test_sampled_accuracy"] = result["sampled_accuracy"]
        return metrics

    return evaluate


def _test_eval_due(every: int, iteration: int, iterations: int) -> bool:
    return every > 0 and ((iteration + 1) % every == 0 or iteration == iterations - 1)


def _canary_metrics(iteration: int, canary, new_alarms: list[dict]) -> dict:
    if not canary.due(iteration):
        return {}
    return {"canary/greedy_accuracy": canary.last, "canary/best": canary.best,
            "canary/alarm": float(any(a["tripwire"] == "canary" for a in new_alarms))}


def _alarms(iteration: int, metrics: dict, tripwire, canary) -> list[dict]:
    """This iteration's alarms from the ratio tripwire and the canary, each logged as a warning."""
    found = [{"iteration": iteration, "tripwire": "ratio", "message": m} for m in tripwire.check(metrics)]
    found += [{"iteration": iteration, "tripwire": "canary", "message": m} for m in canary.check(iteration)]
    for alarm in found:
        log.warning("alarm at ppo it %d: %s", iteration, alarm["message"])
    return found


class _StopFlag:
    """A coordinated stop request, read at iteration boundaries (an optimizer-step boundary).

    SIGTERM only sets the flag (the handler does no work, so a step is never torn); the wall
    clock sets it once `max_wall_seconds` (> 0) have passed since PPO training started in this
    launch. The previous SIGTERM handler is restored on exit.
    """

    def __init__(self, max_wall_seconds: float, start: float):
        self.max_wall_seconds, self.start = max_wall_seconds, start
        self.reason: str | None = None
        self._previous = None

    def _on_sigterm(self, signum, frame) -> None:
        self.reason = self.reason or "sigterm"

    def __enter__(self) -> "_StopFlag":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def check(self) -> str | None:
        if self.reason is None and 0 < self.max_wall_seconds <= time.time() - self.start:
            self.reason = "max_wall_seconds"
        return self.reason


def _trim_jsonl(path: Path, keep) -> list[dict]:
    """Rewrite `path` atomically with only the rows `keep(row)` accepts; returns them."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [row for row in rows if keep(row)]
    if len(kept) != len(rows):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, path)
    return kept


def _trim_run_files(run_dir: Path, start_iteration: int) -> list[dict]:
    """Drop PPO and test-evaluation (`ppo_eval`) rows of iterations >= `start_iteration` (logged after the
    checkpoint, before a kill) from metrics.jsonl and canary.jsonl, so each reads as one run; returns the
    kept PPO metrics rows."""
    rows = _trim_jsonl(run_dir / "metrics.jsonl",
                       lambda r: r["stage"] not in ("ppo", "ppo_eval") or r["step"] < start_iteration)
    _trim_jsonl(run_dir / "canary.jsonl", lambda r: r["iteration"] < start_iteration)
    return [row for row in rows if row["stage"] == "ppo"]


def _best_checkpoint(run_dir: Path, canary) -> Path | None:
    """The checkpoint holding the weights the canary scored best (`it<best_iteration + 1>`), if one was saved.

    It exists when the best check fell on a checkpoint boundary (`canary.every` a multiple of the
    checkpoint period); otherwise there is nothing to pin and None is returned.
    """
    from prmppo.ppo.checkpoint import checkpoint_name, list_checkpoints

    if canary.best_iteration < 0:
        return None
    path = run_dir / "checkpoints" / checkpoint_name(canary.best_iteration + 1)
    return path if path in list_checkpoints(run_dir / "checkpoints") else None


def _pin_on_canary_alarm(run_dir: Path, new_alarms: list[dict], canary, pinned: list[str]) -> None:
    """On a canary alarm, pin the best checkpoint against pruning (for good: recorded in `pinned`)."""
    if not any(alarm["tripwire"] == "canary" for alarm in new_alarms):
        return
    best = _best_checkpoint(run_dir, canary)
    if best is None:
        log.warning("canary alarm: the best canary iteration %d has no checkpoint to pin (canary.every is not a "
                    "multiple of the checkpoint period)", canary.best_iteration)
    elif str(best) not in pinned:
        pinned.append(str(best))
        log.warning("canary alarm: pinned %s (best canary accuracy %.3f) against pruning", best, canary.best)


def _resume(checkpoint: Path | None, policy, trainer, sync, canary) -> tuple[list[dict], list[str]]:
    """Load `checkpoint` (if any) into the policy and trainer and make the engine serve it; returns its
    alarms and pinned checkpoints."""
    from prmppo.ppo.checkpoint import load_checkpoint, read_meta

    if checkpoint is None:
        return [], []
    next_iteration = load_checkpoint(checkpoint, policy, trainer)
    extra = read_meta(checkpoint)["extra"]
    canary.best, canary.best_iteration = extra["canary_best"], extra["canary_best_iteration"]
    sync.push(policy)  # the first request after a resume must name the resumed weights, not the SFT base
    log.info("resumed from %s at ppo iteration %d (%d policy steps taken)", checkpoint, next_iteration,
             trainer.policy_steps_taken)
    return list(extra["alarms"]), list(extra.get("pinned", []))


def _save(run_dir: Path, next_iteration: int, policy, trainer, canary, alarms: list[dict], keep: int,
          pinned: list[str]) -> Path:
    """Save a checkpoint and prune to the newest `keep`, never deleting a pinned one nor the checkpoint
    of the best canary check so far (the one a later canary alarm pins)."""
    from prmppo.ppo.checkpoint import prune_checkpoints, save_checkpoint

    extra = {"alarms": alarms, "canary_best": canary.best, "canary_best_iteration": canary.best_iteration,
             "pinned": pinned}
    saved = save_checkpoint(run_dir / "checkpoints", next_iteration, policy, trainer, extra)
    best = _best_checkpoint(run_dir, canary)
    prune_checkpoints(run_dir / "checkpoints", keep,
                      pinned=tuple(Path(p) for p in pinned) + ((best,) if best is not None else ()))
    return saved


def _summary(trainer, ppo, history: list[dict], alarms: list[dict], start: float) -> dict:
    return {"iterations": ppo.iterations, "train_seconds": time.time() - start,
            "policy_steps": trainer.policy_steps_taken, "planned_policy_steps": trainer.shape.policy_steps,
            "skipped_steps": trainer.skipped_steps, "alarms": alarms,
            "last_rollout_accuracy": history[-1]["rollout/accuracy"] if history else None,
            "max_engine_logprob_abs_diff": max((h["rollout/engine_logprob_abs_diff"] for h in history), default=None)}


def train_ppo(cfg: DictConfig, task, base_dir: Path, run_dir: Path, gates: dict) -> dict:
    """Run PPO from `base_dir`, or resume from the newest complete checkpoint in `run_dir`; returns
    the summary (final checkpoint path included). A coordinated stop saves, closes the worker,
    writes `stage_result.json` with `stopped` and raises `StopRequested` (exit code 3)."""
    from prmppo.app import build
    from prmppo.guards.gates import check_reference, reference_probe
    from prmppo.models.loading import load_model
    from prmppo.ppo.checkpoint import checkpoint_every, latest_checkpoint, read_meta
    from prmppo.ppo.loop import PPOTrainer, save_value_head
    from prmppo.ppo.sync import WeightSync
    from prmppo.stages.runners import open_metrics, train_device, write_stage_result

    tokenizer, tripwire, gates = _launch_gates(cfg, base_dir, gates)
    device = train_device(cfg)
    reward = build(cfg.reward, "reward", seed=cfg.seed)  # seeds the label-noise flips: they differ by run seed
    model = load_model(base_dir, cfg.model.dtype, device)
    # the base's logits on two formatted prompts, before the policy wraps the model: the KL reference must keep them
    probe = reference_probe(model, tokenizer, [task.format_prompt(p) for p in task.problems("train")[:2]])
    policy = build(cfg.lora, "policy", base_model=model, detach_value_hidden=cfg.ppo.detach_value_hidden,
                   critic=cfg.ppo.advantage_estimator == "gae")  # a group baseline needs no critic
    if reward.needs_step_scorer:
        _attach_step_scorer(cfg, reward, task, tokenizer, policy, base_dir, run_dir)
    gates["reference"] = check_reference(policy, **probe)  # after the PRM loads: it must not move the reference
    ppo = OmegaConf.to_object(cfg.ppo)
    sync = WeightSync(cfg.rollout.sync, cfg.rollout.sync_every_iterations, run_dir / "sync", tokenizer)
    every = checkpoint_every(ppo.iterations, cfg.rollout.sync_every_iterations)
    checkpoint = latest_checkpoint(run_dir)
    first = read_meta(checkpoint)["next_iteration"] if checkpoint else 0
    history = _trim_run_files(run_dir, first)
    start = time.time()
    canary = _canary(cfg, task, tokenizer, policy, run_dir)
    test_eval = _test_eval(cfg, task, tokenizer, policy)
    with _engine(cfg, base_dir, run_dir) as engine, open_metrics(cfg, run_dir, "ppo") as logger, \
            _StopFlag(cfg.max_wall_seconds, start) as stop:
        trainer = PPOTrainer(policy=policy, tokenizer=tokenizer, task=task, reward=reward, engine=engine, sync=sync,
                             ppo=ppo, logger=logger, device=device, seed=cfg.seed, show_progress=cfg.logger.console)
        gates["horizon"] = {"policy_optimizer_steps": trainer.shape.policy_steps}  # checked by PPOTrainer
        alarms, pinned = _resume(checkpoint, policy, trainer, sync, canary)
        tripwire, gates["engine_gap"] = _engine_gap_limit(trainer, cfg.ppo)
        write_json_atomic(run_dir / "banner.json", banner(cfg, tokenizer, trainer.shape, base_dir, policy, gates))
        stopped = None
        if first == 0 and cfg.eval.every > 0:  # the SFT policy's test accuracy: the curves' starting point
            logger.log(0, test_eval(0), stage="ppo_eval")
        for iteration in progress(range(first, ppo.iterations), desc=f"ppo[{cfg.arm.name}]", unit="it",
                                  initial=first, total=ppo.iterations, enabled=cfg.logger.console):
            metrics = trainer.iteration(iteration)
            metrics["perf/wall_s"] = time.time() - start
            new_alarms = _alarms(iteration, metrics, tripwire, canary)
            metrics.update(_canary_metrics(iteration, canary, new_alarms))
            logger.log(iteration, metrics)
            history.append(metrics)
            evaluated = test_eval(iteration + 1) if _test_eval_due(cfg.eval.every, iteration, ppo.iterations) else {}
            if evaluated:
                logger.log(iteration, evaluated, stage="ppo_eval")
            alarms += new_alarms
            _pin_on_canary_alarm(run_dir, new_alarms, canary, pinned)  # before the save, so its meta holds the pin
            print_summary(f"ppo[{cfg.arm.name}]", iteration, ppo.iterations, {**metrics, **evaluated},
                          cfg.logger.console)
            last = iteration == ppo.iterations - 1
            if stop.check() or last or (iteration + 1) % every == 0:
                checkpoint = _save(run_dir, iteration + 1, policy, trainer, canary, alarms, ppo.keep_checkpoints,
                                   pinned)
            if stop.reason and not last:
                stopped = stop.reason
                break
    summary = {**_summary(trainer, ppo, history, alarms, start), "pinned_checkpoints": pinned}
    if stopped:  # the worker is closed; the checkpoint just saved is where a relaunch continues
        summary.update(stopped=stopped, checkpoint=str(checkpoint))
        write_stage_result(run_dir, cfg, "ppo", summary)
        raise StopRequested(stopped, str(checkpoint))
    final = run_dir / "checkpoints" / "final"
    policy.save_merged(final, tokenizer)
    save_value_head(policy, final / "value_head.safetensors")
    return {"checkpoint": str(final), **summary}


def publish_policy(cfg: DictConfig, checkpoint: Path, summary: dict) -> Path:
    """Copy the final policy to the `ppo` artifact dir for this config (for `eval`/pipeline)."""
    import shutil

    final = artifacts.artifact_dir(cfg, "ppo")
    tmp = artifacts.staging_dir(final)
    shutil.copytree(checkpoint, tmp, dirs_exist_ok=True)
    return artifacts.publish(tmp, final, cfg, "ppo", summary)

