"""Stage `ppo`: PPO on the SFT policy for the chosen arm.

    python -m prmppo stage=ppo arm=orm                     # control arm
    python -m prmppo stage=ppo arm=orm ppo.kl_coef=0.04 rollout.sync=adapter
    python -m prmppo stage=ppo debug=smoke                 # seconds: 2 iterations on tiny shapes
    python -m prmppo stage=ppo band.enabled=true           # prompts from this config's pass-rate band
    python -m prmppo stage=ppo band.file=<band.jsonl> ppo.drop_uniform_groups=true
    torchrun --nproc_per_node=2 -m prmppo stage=ppo topology=fsdp hydra.run.dir=runs/r   # 2 FSDP2 ranks

Composition only: the launch gates (`guards/gates.py`: verifier receipt, topology, engine, step
scores, EOS, reference == base; their findings go into the banner) run before any policy weights
load; then the components are built whole (policy, reward with its step scorer, weight sync,
rollout worker on the SFT checkpoint, trainer; the worker process is launched right after the
policy, so its start overlaps the rest), `banner.json` is written with the seconds each part of
the start-up took (`startup_s`, `logger/laps.py`), and the outer loop
(`ppo/run.py`) runs `ppo.iterations` iterations of `PPOTrainer` with the monitors
(`guards/monitors.py`) and the checkpoint keeper (`ppo/checkpoint.py`). The final policy is saved
as an HF-layout checkpoint (also published as the stage's artifact for `eval`), and
`stage_result.json` is written atomically, with the alarms of the ratio tripwire and the canary
under `summary.alarms`. The SFT checkpoint (and, for a learned-PRM reward, the PRM) for the same
config is reused, or made first when there is none.

RL prompts: every `train` problem, or a pass-rate band of them (`stages/band.py`): `band.file`, or
with `band.enabled` this config's band artifact (measured after SFT when missing). A band that
exists is read and checked with the early gates, before any weights; `banner.json` records its
file, size and pass-rate range under `band`.

Test accuracy during PPO: before the first iteration, every `eval.every` iterations and after the
last, greedy and sampled accuracy and pass@k (k = `eval.during_ppo_k`) on the first
`eval.during_ppo_problems` test problems, logged as rows with `"stage": "ppo_eval"` (x axis
`eval/ppo_iterations`, the iterations done); canary checks add `canary/` metrics to the iteration's row.

Several ranks (`topology=fsdp`, `dist/`): every rank runs this module; a missing SFT checkpoint or PRM
is trained data-parallel on every rank first (`stages/sft.py`, `stages/prm.py`), a missing band is
measured by rank 0 while the others wait; `_RankPieces` holds what differs from one process (the
policy sharded after the PRM loads, the weight sync and the final save through full weights gathered
to rank 0, sharded checkpoints; the engine, metrics and banner on rank 0 only).

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

import logging
import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from prmppo import artifacts
from prmppo.config.build import build
from prmppo.dist.checkpoint import ShardedKeeper
from prmppo.dist.launch import close_ranks, ranks_on_this_node
from prmppo.dist.ranks import OneProcess, TorchRanks
from prmppo.dist.shard import GatheredSync, GatheredWriter, check_identical_init, shard_policy
from prmppo.errors import StopRequested
from prmppo.evaluation import score
from prmppo.guards.canary import Canary
from prmppo.guards.gates import (check_label_source, check_reference, check_rollout_engine, check_step_scorer,
                                 check_topology, check_trainable_modules, derive_eos, reference_probe,
                                 verifier_receipt)
from prmppo.guards.monitors import Monitors, StopFlag, engine_gap_tripwire
from prmppo.logger import DiscardMetrics, write_json_atomic
from prmppo.logger.laps import Laps
from prmppo.models.loading import DTYPES, load_model, load_tokenizer
from prmppo.models.prm import build_step_scorer
from prmppo.ppo.checkpoint import CheckpointKeeper, checkpoint_every
from prmppo.ppo.loop import PPOTrainer, save_value_head
from prmppo.ppo.run import PPORun
from prmppo.ppo.sync import WeightSync
from prmppo.rollout.client import RolloutClient
from prmppo.stages.band import Band, existing_band, ppo_band
from prmppo.stages.common import head_dim, open_metrics, open_ranks, train_device, write_stage_result
from prmppo.stages.sft import ensure_sft
from prmppo.stages.prm import ensure_prm

log = logging.getLogger("prmppo")


def _engine(cfg: DictConfig, base_dir: Path, run_dir: Path, lora_rank: int) -> RolloutClient:
    return build(cfg.rollout, "rollout worker client", spool_dir=run_dir / "spool", base_model_dir=str(base_dir),
                 log_path=run_dir / "worker.log", device=cfg.topology.engine_device, dtype=cfg.model.dtype,
                 lora_rank=lora_rank, seed=cfg.seed)


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
            "trainable_modules": check_trainable_modules(list(cfg.lora.get("modules_to_save") or []),
                                                         architecture, architecture_source)}


def needs_learned_prm(cfg: DictConfig) -> bool:
    """Whether this config's reward scores steps with a trained PRM (asked of the reward itself)."""
    return build(cfg.reward, "reward", seed=cfg.seed).needs_learned_prm


def _reward(cfg: DictConfig, task, tokenizer, policy, prm_dir: Path | None):
    """The reward, built whole: a step-level reward gets its scorer (the learned PRM on the policy's
    resident base, the task's checker, or the likelihood control on that base with adapters off) and the
    task at construction."""
    spec = build(cfg.reward, "reward", seed=cfg.seed)
    if not spec.needs_step_scorer:
        return spec
    if spec.scorer == "external":  # reward=prm_external: an off-the-shelf PRM checkpoint of its own
        scorer = spec.make_step_scorer(task, tokenizer, cfg.topology.train_device)
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


def _test_eval(cfg: DictConfig, task, tokenizer, policy):
    """`evaluate(iterations_done) -> eval/ metrics` of the policy on the first `eval.during_ppo_problems`
    test problems (the same ones each time): greedy accuracy, and sampled accuracy and pass@k over
    `k = eval.during_ppo_k` samples at `eval.temperature`."""
    problems = task.problems("test")[: cfg.eval.during_ppo_problems]

    def evaluate(iterations_done: int) -> dict:
        result = score(policy.model, tokenizer, task, problems, k=cfg.eval.during_ppo_k,
                       temperature=cfg.eval.temperature, max_new_tokens=cfg.eval.max_new_tokens,
                       batch_rows=cfg.eval.batch_rows, seed=cfg.seed, show_progress=cfg.logger.console)
        metrics = {"eval/ppo_iterations": iterations_done, "eval/test_greedy_accuracy": result["greedy_accuracy"],
                   "eval/n_problems": len(problems)}
        if cfg.eval.during_ppo_k > 0:
            metrics["eval/test_sampled_accuracy"] = result["sampled_accuracy"]
            # from the same samples: nothing else changes
            metrics[f"eval/test_pass@{cfg.eval.during_ppo_k}"] = result[f"pass@{cfg.eval.during_ppo_k}"]
        return metrics

    return evaluate


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
    dtype = "float32" if isinstance(ranks, TorchRanks) else cfg.model.dtype
    model = load_model(base_dir, dtype, ranks.device)
    # the base's logits on two formatted prompts, before the policy wraps the model: the KL reference must keep them
    probe = reference_probe(model, tokenizer, [task.format_prompt(p) for p in task.problems("train")[:2]])
    policy = build(cfg.lora, "policy", base_model=model, detach_value_hidden=cfg.ppo.detach_value_hidden,
                   critic=cfg.ppo.advantage_estimator == "gae")  # a group baseline needs no critic
    return policy, probe


class _NoEngine:
    """The rollout worker as the ranks other than 0 see it: rank 0 alone starts it and asks it for batches."""

    def launch(self) -> None:
        return None

    def wait_ready(self) -> None:
        return None

    def close(self) -> None:
        return None

    def __enter__(self) -> "_NoEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        return None


class _RankPieces:
    """What differs between one process and N ranks, built once: the weight sync, the checkpoint keeper,
    the writer of full weights, and what rank 0 alone owns (metrics, the canary's file; the engine is
    `_NoEngine` on the other ranks)."""

    def __init__(self, cfg: DictConfig, policy, tokenizer, canary_of, run_dir: Path, ranks, iterations: int,
                 keep: int):
        every = checkpoint_every(iterations, cfg.rollout.sync_every_iterations)
        self.ranks, self.main = ranks, ranks.is_main
        sync = (WeightSync(cfg.rollout.sync, cfg.rollout.sync_every_iterations, run_dir / "sync", tokenizer)
                if self.main else None)
        # every rank runs the canary (its generation goes through the sharded model); rank 0 keeps the rows
        self.canary = canary_of(run_dir / "canary.jsonl" if self.main else Path(os.devnull))
        if not isinstance(ranks, TorchRanks):
            self.writer, self.sync = None, sync
            self.keeper = CheckpointKeeper(run_dir, every, keep, self.canary)
            return
        check_identical_init(policy, ranks)
        self.writer = GatheredWriter(policy, ranks)  # its plain copy is made before sharding
        shard_policy(policy, DTYPES[cfg.model.dtype])  # fp32 weights, compute in model.dtype
        self.sync = GatheredSync(sync, self.writer, cfg.rollout.sync_every_iterations)
        self.keeper = ShardedKeeper(run_dir, every, keep, self.canary, ranks)

    def metrics(self, cfg: DictConfig, run_dir: Path):
        return open_metrics(cfg, run_dir, "ppo") if self.main else DiscardMetrics()

    def save_final(self, policy, tokenizer, final: Path) -> None:
        """Every rank calls this; the HF-layout policy and its value head land in `final` (rank 0 writes)."""
        full = policy if self.writer is None else self.writer.full_policy()
        if self.main:
            full.save_merged(final, tokenizer)
            save_value_head(policy, final / "value_head.safetensors")
        self.ranks.barrier()


def train_ppo(cfg: DictConfig, task, base_dir: Path, run_dir: Path, gates: dict, prm_dir: Path | None,
              band: Band | None = None, ranks=None, laps: Laps | None = None) -> dict:
    """Run PPO from `base_dir` (with the PRM at `prm_dir` when the reward needs one, on the prompts of `band`
    when given), or resume from the newest complete checkpoint in `run_dir`; returns the summary (final
    checkpoint path included). A coordinated stop saves, closes the worker, writes `stage_result.json` with
    `stopped` and raises `StopRequested` (exit 3). `ranks`: the training ranks (`dist/`), one process if None."""
    gates, laps = dict(gates), laps if laps is not None else Laps()
    ranks = ranks if ranks is not None else OneProcess(train_device(cfg))
    lora_rank = cfg.lora.r if get_class(cfg.lora._target_).ships_adapter else 0
    engine = _engine(cfg, base_dir, run_dir, lora_rank) if ranks.is_main else _NoEngine()
    engine.launch()  # the worker starts (imports, loads) while the trainer sets up; `wait_ready` below waits for it
    try:
        with laps.lap("tokenizer"):
            tokenizer = load_tokenizer(base_dir)
            gates["eos"] = derive_eos(base_dir, tokenizer)
        with laps.lap("policy"):
            policy, probe = _policy(cfg, task, tokenizer, base_dir, ranks)
        if policy.lora_rank != lora_rank:
            raise RuntimeError(f"the policy's LoRA rank {policy.lora_rank} is not lora.r={lora_rank}")
        start = time.time()  # the run's wall clock (max_wall_seconds, the summary) starts with the policy loaded
        with laps.lap("reward"):
            reward = _reward(cfg, task, tokenizer, policy, prm_dir)
        with laps.lap("reference_gate"):  # after the PRM loads: it must not move the reference
            gates["reference"] = check_reference(policy, temperature=cfg.ppo.temperature,
                                                 chunk_tokens=cfg.ppo.logit_chunk_tokens, **probe)
        ppo = OmegaConf.to_object(cfg.ppo)
        pieces = _RankPieces(cfg, policy, tokenizer, lambda path: _canary(cfg, task, tokenizer, policy, path), run_dir,
                             ranks, ppo.iterations, ppo.keep_checkpoints)  # N ranks: the check and the sharding
        keeper, sync = pieces.keeper, pieces.sync
        keeper.trim_run_files()
        with laps.lap("worker_ready"):  # what is left of the worker's start after the set-up above
            engine.wait_ready()
    except BaseException:
        engine.close()
        raise
    with engine, pieces.metrics(cfg, run_dir) as logger, StopFlag(cfg.max_wall_seconds, start) as stop:
        with laps.lap("trainer"):
            trainer = PPOTrainer(policy=policy, tokenizer=tokenizer, task=task, reward=reward, engine=engine,
                                 sync=sync, ppo=ppo, logger=logger, device=ranks.device, seed=cfg.seed,
                                 show_progress=cfg.logger.console and ranks.is_main,
                                 prompts=None if band is None else band.problems, ranks=ranks)
        gates["horizon"] = {"policy_optimizer_steps": trainer.shape.policy_steps}  # checked by PPOTrainer
        with laps.lap("resume"):
            first = keeper.resume(policy, trainer, sync)
        if first:
            log.info("resumed from %s at ppo iteration %d (%d policy steps taken)", keeper.checkpoint, first,
                     trainer.policy_steps_taken)
        with laps.lap("engine_gap_gate"):
            tripwire, gates["ratio_tripwire"] = engine_gap_tripwire(trainer, ppo.max_first_ratio_dev,
                                                                    ppo.max_engine_logprob_gap)
        record = banner(cfg, tokenizer, trainer.shape, base_dir, policy, gates, band)
        record["startup_s"] = laps.as_dict()
        if ranks.is_main:
            write_json_atomic(run_dir / "banner.json", record)
        log.info("start-up (s): %s", record["startup_s"])
        monitors = Monitors(tripwire, pieces.canary, _test_eval(cfg, task, tokenizer, policy), cfg.eval.every,
                            ppo.iterations)
        history, stopped = PPORun(trainer, keeper, monitors, logger, ppo.iterations, f"ppo[{cfg.arm.name}]",
                                  cfg.logger.console and ranks.is_main).run(first, stop, start)
    summary = _summary(trainer, ppo, history, keeper.alarms, keeper.pinned, start)
    summary["band"] = band.summary() if band is not None else None
    if stopped:  # the worker is closed; the checkpoint just saved is where a relaunch continues
        summary.update(stopped=stopped, checkpoint=str(keeper.checkpoint))
        if ranks.is_main:
            write_stage_result(run_dir, cfg, "ppo", summary)
        raise StopRequested(stopped, str(keeper.checkpoint))
    final = run_dir / "checkpoints" / "final"
    pieces.save_final(policy, tokenizer, final)
    return {"checkpoint": str(final), **summary}


def publish_policy(cfg: DictConfig, checkpoint: Path, summary: dict) -> Path:
    """Copy the final policy to the `ppo` artifact dir for this config (for `eval`/pipeline)."""
    final = artifacts.artifact_dir(cfg, "ppo")
    with artifacts.building(final):
        tmp = artifacts.staging_dir(final)
        shutil.copytree(checkpoint, tmp, dirs_exist_ok=True)
        return artifacts.publish(tmp, final, cfg, "ppo", summary)


class PPOInputs(NamedTuple):
    """What PPO starts from: the SFT checkpoint, the PRM when the reward needs one, the band when used."""

    sft_dir: Path
    sft: dict  # ensure_sft's summary
    prm_dir: Path | None
    prm: dict | None  # ensure_prm's summary
    band: Band | None


def ppo_inputs(cfg: DictConfig, task, run_dir: Path, ranks, known_band: Band | None) -> PPOInputs:
    """The SFT checkpoint and (when the reward needs one) the PRM of this config, reused or trained on every
    rank (data parallel under `topology=fsdp`), then the band (`known_band`, or measured by rank 0 first
    while the others wait, then read by them)."""
    sft_dir, sft_summary = ensure_sft(cfg, task, run_dir, reuse=True, ranks=ranks)
    prm_dir, prm_summary = None, None
    if needs_learned_prm(cfg):
        prm_dir, prm_summary = ensure_prm(cfg, task, run_dir, sft_dir, reuse=True, ranks=ranks)
    band = ranks.main_first(lambda: ppo_band(cfg, task, run_dir, sft_dir, known_band))
    return PPOInputs(sft_dir, sft_summary, prm_dir, prm_summary, band)


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Stage `ppo`: the SFT checkpoint (and PRM, and band) of this config, reused or made, then PPO; publishes
    the policy. Under `topology=fsdp` every rank runs this (torchrun); rank 0 writes the results."""
    start, laps = time.time(), Laps()  # the start-up laps begin here: `before_first_lap` is imports and config
    with laps.lap("task"):
        task = build(cfg.task, "task")
    with laps.lap("early_gates"):
        gates = early_gates(cfg, task)
        band = existing_band(cfg, task)  # a band that exists is checked before any weights
    ranks = open_ranks(cfg, run_dir)
    try:
        with laps.lap("inputs"):  # the SFT checkpoint (PRM, band) reused or made
            made = ppo_inputs(cfg, task, run_dir, ranks, band)
        summary = train_ppo(cfg, task, made.sft_dir, run_dir, gates, made.prm_dir, made.band, ranks, laps)
        if ranks.is_main:
            summary["artifact"] = str(publish_policy(cfg, Path(summary["checkpoint"]), summary))
            summary["wall_seconds"] = time.time() - start
            write_stage_result(run_dir, cfg, "ppo", summary)
        return summary
    finally:
        close_ranks(ranks)
