"""PPO from an SFT checkpoint for the chosen arm, shared by the `ppo` and `pipeline` stages
(`train_ppo`): the components built whole, the outer loop run, the final policy saved; then published
as this config's `ppo` artifact (`publish_policy`).

Build (`_build`): the rollout worker is launched first, so its start overlaps the rest; then the
tokenizer (EOS derived), the policy on the SFT weights (the reference = the base with adapters off),
the reward with its step scorer (the learned PRM loads onto the policy's resident base), the
reference gate (the PRM must not move the reference), the in-process engine under
`rollout=inprocess` (no worker: it samples with the policy's model, PRM adapter and all, so it comes
after them), and the pieces that differ between one process and N ranks, asked of the ranks object:
the policy sharded (`ranks.shard_policy`), the weight sync and the checkpoint store
(`ranks.weight_sync`, `ranks.checkpoints`). `banner.json` records the run's shape, reward, gates
and the seconds each part of the start-up took (`startup_s`, `logger/laps.py`). With `ppo.compile`, the compile cache kept in the artifacts dir
(models/compile_cache.py) is loaded before the engine-gap gate's first compiled forward and saved after
the first iteration, so that a later run of the same shapes starts warm. The outer loop is
`ppo/run.py` with the monitors (`guards/monitors.py`) and the checkpoint keeper (`ppo/checkpoint.py`);
rank 0 alone owns the engine, metrics and banner. The final policy is saved as an HF-layout checkpoint
(gathered to rank 0 under several ranks). A coordinated stop saves, closes the worker, writes
`stage_result.json` with `stopped` and raises `StopRequested` (exit 3).

Test accuracy during PPO: before the first iteration, every `eval.every` iterations and after the
last, greedy and sampled accuracy and pass@k (k = `eval.during_ppo_k`) on the first
`eval.during_ppo_problems` test problems, logged as rows with `"stage": "ppo_eval"` (x axis
`eval/ppo_iterations`, the iterations done), with each problem's outcomes in
`ppo_eval/iteration_<n>.json`; canary checks add `canary/` metrics to the iteration's row.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from prmppo.checkpoint_format import VALUE_HEAD_FILE, save_value_head
from prmppo.config.build import build
from prmppo.distributed.ranks import NoEngine, OneProcess
from prmppo.errors import StopRequested
from prmppo.evaluation import score
from prmppo.guards.canary import Canary
from prmppo.guards.gates import check_reference, derive_eos, reference_probe
from prmppo.guards.monitors import Monitors, StopFlag, engine_gap_tripwire
from prmppo.logger import write_json_atomic
from prmppo.logger.laps import Laps
from prmppo.models.compile_cache import CompileCache, cache_counters, compile_cache_key
from prmppo.models.loading import DTYPES, load_tokenizer
from prmppo.models.external_prm import external_step_scorer
from prmppo.models.prm import build_step_scorer
from prmppo.ppo.checkpoint import CheckpointKeeper, LocalCheckpoints, checkpoint_every
from prmppo.ppo.loop import PPOTrainer
from prmppo.ppo.run import PPORun
from prmppo.ppo.sync import WeightSync
from prmppo.rollout.client import RolloutClient
from prmppo.rollout.inprocess import InProcessEngine
from prmppo.stages.band import Band
from prmppo.stages.common import (Made, engine_in_process, make_or_reuse, open_metrics, train_device,
                                  write_stage_result)

log = logging.getLogger("prmppo")


def _engine(cfg: DictConfig, base_dir: Path, run_dir: Path, lora_rank: int,
            **model) -> RolloutClient | InProcessEngine:
    """The rollout engine: a worker client, or (`model`: the policy's model) the in-process engine."""
    return build(cfg.rollout, "rollout engine", spool_dir=run_dir / "spool", base_model_dir=str(base_dir),
                 log_path=run_dir / "worker.log", device=cfg.topology.engine_device, dtype=cfg.model.dtype,
                 lora_rank=lora_rank, seed=cfg.seed, **model)


def banner(cfg: DictConfig, tokenizer, shape, base_dir: Path, policy, gates: dict, band: Band | None) -> dict:
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
        "band": band.summary() if band is not None else None,
        "trainable_policy_parameters": sum(p.numel() for p in policy.policy_parameters()),
        "gates": gates,
    }


def _reward(cfg: DictConfig, task, tokenizer, policy, prm_dir: Path | None):
    """The reward, built whole: a step-level reward gets its scorer (the learned PRM on the policy's
    resident base, the task's checker, or the likelihood control on that base with adapters off) and the
    task at construction."""
    spec = build(cfg.reward, "reward", seed=cfg.seed)
    if not spec.needs_step_scorer:
        return spec
    if spec.scorer == "external":  # reward=prm_external: an off-the-shelf PRM checkpoint of its own
        scorer = external_step_scorer(spec, task, tokenizer, cfg.topology.train_device)
    else:
        scorer = build_step_scorer(scorer=spec.scorer, task=task, tokenizer=tokenizer,
                                   model=policy.prm_host, prm_dir=prm_dir, chunk_rows=cfg.prm_train.chunk_rows)
    return build(cfg.reward, "reward", seed=cfg.seed, step_scorer=scorer, task=task)


def _canary(cfg: DictConfig, task, tokenizer, policy, path: Path) -> Canary:
    """The canary on the policy being trained: greedy accuracy on the first `canary.n_problems` test problems."""
    def greedy_accuracy(problems) -> float:
        return score(policy.model, tokenizer, task, problems, k=0, temperature=1.0,
                     max_new_tokens=cfg.ppo.max_new_tokens, batch_rows=cfg.eval.batch_rows,
                     seed=cfg.seed)["greedy_accuracy"]

    return Canary(task.problems("test")[: cfg.canary.n_problems], cfg.canary.every, cfg.canary.max_drop,
                  path, greedy_accuracy)


def _test_eval(cfg: DictConfig, task, tokenizer, policy, out_dir: Path | None):
    """`evaluate(iterations_done) -> eval/ metrics` of the policy on the first `eval.during_ppo_problems`
    test problems (the same ones each time): greedy accuracy, and sampled accuracy and pass@k over
    `k = eval.during_ppo_k` samples at `eval.temperature`. With `out_dir` (the main rank's), each
    evaluation's per-problem outcomes also go to `out_dir/iteration_<n>.json` (`ppo_eval_path`), the rows a
    prompt x seed bootstrap at that iteration resamples; a resumed run that evaluates an iteration again
    rewrites its file."""
    problems = task.problems("test")[: cfg.eval.during_ppo_problems]

    def evaluate(iterations_done: int) -> dict:
        result = score(policy.model, tokenizer, task, problems, k=cfg.eval.during_ppo_k,
                       temperature=cfg.eval.temperature, max_new_tokens=cfg.eval.max_new_tokens,
                       batch_rows=cfg.eval.batch_rows, seed=cfg.seed, show_progress=cfg.logger.console,
                       per_problem=out_dir is not None)
        if out_dir is not None:
            write_json_atomic(ppo_eval_path(out_dir, iterations_done),
                              {"ppo_iterations": iterations_done, "k": cfg.eval.during_ppo_k,
                               "temperature": cfg.eval.temperature, "problems": result.pop("problems")})
        metrics = {"eval/ppo_iterations": iterations_done, "eval/test_greedy_accuracy": result["greedy_accuracy"],
                   "eval/n_problems": len(problems)}
        if cfg.eval.during_ppo_k > 0:
            metrics["eval/test_sampled_accuracy"] = result["sampled_accuracy"]
            # from the same samples: nothing else changes
            metrics[f"eval/test_pass@{cfg.eval.during_ppo_k}"] = result[f"pass@{cfg.eval.during_ppo_k}"]
        return metrics

    return evaluate


def ppo_eval_path(out_dir: Path, iterations_done: int) -> Path:
    """Where the test evaluation after `iterations_done` PPO iterations keeps its per-problem outcomes."""
    return out_dir / f"iteration_{iterations_done:05d}.json"


def _summary(trainer, ppo, history: list[dict], alarms: list[dict], pinned: list[str], start: float) -> dict:
    summary = {"iterations": ppo.iterations, "train_seconds": time.time() - start,
               "policy_steps": trainer.policy_steps_taken, "planned_policy_steps": trainer.shape.policy_steps,
               "skipped_steps": trainer.skipped_steps, "alarms": alarms, "pinned_checkpoints": pinned,
               "last_rollout_accuracy": history[-1]["rollout/accuracy"] if history else None,
               "max_engine_logprob_abs_diff": max((h["rollout/engine_logprob_abs_diff"] for h in history),
                                                  default=None)}
    if ppo.drop_uniform_groups:  # over this launch's iterations
        summary["dropped_groups"] = sum(h["ppo/dropped_groups"] for h in history)
        summary["updates_skipped"] = sum(h["ppo/update_skipped"] for h in history)
    return summary


def _policy(cfg: DictConfig, task, tokenizer, base_dir: Path, ranks):
    """The base model wrapped as the policy (reference = base), and the base's logits on a probe batch. Under
    several ranks the weights load in fp32: FSDP2 computes in `model.dtype` over fp32 sharded weights."""
    model = ranks.load_for_training(base_dir, cfg.model.dtype)
    # the base's logits on two formatted prompts, before the policy wraps the model: the KL reference must keep them
    probe = reference_probe(model, tokenizer, [task.format_prompt(p) for p in task.problems("train")[:2]])
    policy = build(cfg.lora, "policy", base_model=model, detach_value_hidden=cfg.ppo.detach_value_hidden,
                   critic=cfg.ppo.advantage_estimator == "gae")  # a group baseline needs no critic
    return policy, probe


class _Built(NamedTuple):
    """The components of a PPO run, built whole before the trainer."""

    engine: object  # the rollout worker client (`NoEngine` on ranks other than 0)
    tokenizer: object
    policy: object
    reward: object
    canary: Canary
    sync: object  # WeightSync, or its N-rank version
    keeper: CheckpointKeeper
    full_policy: object  # () -> the policy with its full weights on rank 0 (a collective under N ranks)
    start: float  # the run's wall clock (max_wall_seconds, the summary) starts with the policy loaded


def _build(cfg: DictConfig, task, base_dir: Path, run_dir: Path, gates: dict, prm_dir: Path | None, ranks, ppo,
           laps: Laps) -> _Built:
    """Every component of the run, in the order that lets the worker start while the rest is built; the
    worker is closed when any of it fails."""
    lora_rank = cfg.lora.r if get_class(cfg.lora._target_).ships_adapter else 0
    in_process = engine_in_process(cfg)  # then built on the policy's model, once the PRM has joined it
    engine = NoEngine() if in_process else ranks.main_engine(lambda: _engine(cfg, base_dir, run_dir, lora_rank))
    engine.launch()  # the worker starts (imports, loads) while the trainer sets up; `wait_ready` below waits for it
    try:
        with laps.lap("tokenizer"):
            tokenizer = load_tokenizer(base_dir)
            gates["eos"] = derive_eos(base_dir, tokenizer)
        with laps.lap("policy"):
            policy, probe = _policy(cfg, task, tokenizer, base_dir, ranks)
        if policy.lora_rank != lora_rank:
            raise RuntimeError(f"the policy's LoRA rank {policy.lora_rank} is not lora.r={lora_rank}")
        start = time.time()
        with laps.lap("reward"):
            reward = _reward(cfg, task, tokenizer, policy, prm_dir)
        with laps.lap("reference_gate"):  # after the PRM loads: it must not move the reference
            gates["reference"] = check_reference(policy, temperature=cfg.ppo.temperature,
                                                 chunk_tokens=cfg.ppo.logit_chunk_tokens, **probe)
        # every rank runs the canary (its generation goes through the sharded model); rank 0 keeps the rows
        canary = _canary(cfg, task, tokenizer, policy, run_dir / "canary.jsonl" if ranks.is_main else Path(os.devnull))
        if in_process:
            engine = ranks.main_engine(lambda: _engine(cfg, base_dir, run_dir, lora_rank, model=policy.model))
        full_policy = ranks.shard_policy(policy, DTYPES[cfg.model.dtype])  # N ranks: checked, then sharded
        every = cfg.rollout.sync_every_iterations
        sync = ranks.weight_sync(lambda: WeightSync(cfg.rollout.sync, every, run_dir / "sync", tokenizer),
                                 full_policy, every)
        keeper = CheckpointKeeper(run_dir, checkpoint_every(ppo.iterations, every), ppo.keep_checkpoints, canary,
                                  ranks.checkpoints(LocalCheckpoints()))
        keeper.trim_run_files()
        with laps.lap("worker_ready"):  # what is left of the worker's start after the set-up above
            engine.wait_ready()
    except BaseException:
        engine.close()
        raise
    return _Built(engine, tokenizer, policy, reward, canary, sync, keeper, full_policy, start)


def train_ppo(cfg: DictConfig, task, base_dir: Path, run_dir: Path, gates: dict, prm_dir: Path | None,
              band: Band | None = None, ranks=None, laps: Laps | None = None) -> dict:
    """Run PPO from `base_dir` (with the PRM at `prm_dir` when the reward needs one, on the prompts of `band`
    when given), or resume from the newest complete checkpoint in `run_dir`; returns the summary (final
    checkpoint path included). `ranks`: the training ranks (`distributed/`), one process if None."""
    gates, laps = dict(gates), laps if laps is not None else Laps()
    ranks = ranks if ranks is not None else OneProcess(train_device(cfg))
    ppo = OmegaConf.to_object(cfg.ppo)
    built = _build(cfg, task, base_dir, run_dir, gates, prm_dir, ranks, ppo, laps)
    with (built.engine, ranks.main_metrics(lambda: open_metrics(cfg, run_dir, "ppo")) as logger,
          StopFlag(cfg.max_wall_seconds, built.start) as stop):
        with laps.lap("trainer"):
            trainer = PPOTrainer(policy=built.policy, tokenizer=built.tokenizer, task=task, reward=built.reward,
                                 engine=built.engine, sync=built.sync, ppo=ppo, logger=logger, seed=cfg.seed,
                                 show_progress=cfg.logger.console and ranks.is_main,
                                 prompts=None if band is None else band.problems, ranks=ranks)
        cache = _compile_cache(cfg, built.policy, ranks, laps)  # before the gate's first compiled forward
        save_cache = cache.save if cache is not None and ranks.is_main else lambda: None  # rank 0 writes it
        first, monitors = _start(cfg, task, base_dir, run_dir, gates, band, ranks, laps, built, trainer)
        history, stopped = PPORun(trainer, built.keeper, monitors, logger, ppo.iterations, f"ppo[{cfg.arm.name}]",
                                  cfg.logger.console and ranks.is_main, save_cache).run(first, stop, built.start)
    keeper = built.keeper
    summary = _summary(trainer, ppo, history, keeper.alarms, keeper.pinned, built.start)
    if ppo.compile:  # what this launch's compiles found: the artifacts' cache file, what it loaded, hits and misses
        summary["compile_cache"] = {"file": None if cache is None else str(cache.path),
                                    "loaded": {} if cache is None else cache.loaded, **cache_counters()}
        log.info("compile seconds by phase, summed over graphs (torch._dynamo.utils.compile_times):\n%s",
                 torch._dynamo.utils.compile_times(repr="str", aggregate=True))
    summary["band"] = band.summary() if band is not None else None
    if stopped:  # the worker is closed; the checkpoint just saved is where a relaunch continues
        summary.update(stopped=stopped, checkpoint=str(keeper.checkpoint))
        if ranks.is_main:
            write_stage_result(run_dir, cfg, "ppo", summary)
        raise StopRequested(stopped, str(keeper.checkpoint))
    final = run_dir / "checkpoints" / "final"

    def save(full) -> None:
        full.save_merged(final, built.tokenizer)
        save_value_head(built.policy, final / VALUE_HEAD_FILE)  # replicated on every rank

    ranks.publish(built.full_policy, save)
    return {"checkpoint": str(final), **summary}


def _compile_cache(cfg: DictConfig, policy, ranks, laps: Laps) -> CompileCache | None:
    """With `ppo.compile` and `ppo.compile_cache`: this run's compile cache in the artifacts dir, keyed by what
    decides its graphs and loaded (on every rank) into this process's compile caches."""
    if not (cfg.ppo.compile and cfg.ppo.compile_cache):
        return None
    with laps.lap("compile_cache"):
        key = compile_cache_key(policy.model, ranks.device, autocast=cfg.ppo.autocast,
                                gradient_checkpointing=cfg.ppo.gradient_checkpointing, world_size=ranks.world_size)
        cache = CompileCache(Path(cfg.artifacts_dir).resolve() / "compile_cache", key)
        cache.load()
    return cache


def _start(cfg: DictConfig, task, base_dir: Path, run_dir: Path, gates: dict, band: Band | None, ranks,
           laps: Laps, built: _Built, trainer) -> tuple[int, Monitors]:
    """Resume (the engine then serves the resumed weights), the ratio tripwire's launch check, the banner;
    returns the first iteration to run and the monitors."""
    gates["horizon"] = {"policy_optimizer_steps": trainer.shape.policy_steps}  # checked by PPOTrainer
    with laps.lap("resume"):
        first = built.keeper.resume(built.policy, trainer, built.sync)
    if first:
        log.info("resumed from %s at ppo iteration %d (%d policy steps taken)", built.keeper.checkpoint, first,
                 trainer.policy_steps_taken)
    with laps.lap("engine_gap_gate"):
        tripwire, gates["ratio_tripwire"] = engine_gap_tripwire(trainer, trainer.ppo.max_first_ratio_dev,
                                                                trainer.ppo.max_engine_logprob_gap)
    record = banner(cfg, built.tokenizer, trainer.shape, base_dir, built.policy, gates, band)
    record["startup_s"] = laps.as_dict()
    if ranks.is_main:
        write_json_atomic(run_dir / "banner.json", record)
    log.info("start-up (s): %s", record["startup_s"])
    return first, Monitors(tripwire, built.canary, _test_eval(cfg, task, built.tokenizer, built.policy,
                                                              run_dir / "ppo_eval" if ranks.is_main else None),
                           cfg.eval.every, trainer.ppo.iterations)


def publish_policy(cfg: DictConfig, checkpoint: Path, summary: dict) -> Path:
    """Copy the final policy to the `ppo` artifact dir for this config (for `eval`/pipeline), by one process
    (rank 0 under several ranks)."""
    alone = OneProcess(torch.device(cfg.topology.train_device))
    copy = Made(summary, lambda _, tmp: shutil.copytree(checkpoint, tmp, dirs_exist_ok=True))
    final, _ = make_or_reuse(cfg, "ppo", alone, lambda final: copy, reuse=False)
    return final
