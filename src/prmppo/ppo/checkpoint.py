"""Resumable PPO checkpoints: `<run_dir>/checkpoints/it<NNNNNN>/`, NNNNNN = the next iteration to run.

A checkpoint holds everything a relaunch needs to continue as if never stopped:
  adapter/ or model.safetensors   the trainable weights (peft adapter save, or the full model)
  value_head.safetensors          the critic (gae only: rloo / grpo build none)
  optim.pt                        the AdamW state dicts, the fp32 master weights of parameters trained in
                                  half precision (`ppo/optim.py`) and the LR scheduler's state dict
  rng.pt                          torch CPU (and CUDA) generator states
  reward.pt                       the reward's own random state (`trainer.reward.state_dict()`: the PRM
                                  reward's label-noise generator; empty for the outcome reward)
  checkpoint.json                 counters; written LAST, so its presence marks a complete checkpoint

Everything is written under `it<NNNNNN>.partial` and renamed, so a kill during the write leaves
a `.partial` dir that `latest_checkpoint` never picks. `.pt` files hold only tensors and plain
containers and are read back with `torch.load(..., weights_only=True)`: no pickled code runs.
Data order needs no state: prompt order, sampling seeds and minibatch permutations are pure
functions of the seed and the iteration index (`ppo/loop.py`). The marker, names, listing, pruning and
the run state restored beside the weights are shared with the checkpoints of N ranks
(`checkpoint_format.py`); `CheckpointKeeper` decides when to save and what to spare, for either.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file, load_model, save_model

from prmppo.checkpoint_format import (FORMAT_VERSION, MARKER, VALUE_HEAD_FILE, CheckpointError, checkpoint_name,
                                      latest_checkpoint, list_checkpoints, prune_checkpoints, read_meta,
                                      restore_run_state, save_value_head, write_marker)
from prmppo.models.policy import POLICY_ADAPTER

__all__ = ["FORMAT_VERSION", "MARKER", "CheckpointError", "CheckpointKeeper", "LocalCheckpoints", "checkpoint_every",
           "checkpoint_name", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "prune_checkpoints",
           "read_meta", "save_checkpoint"]


def _is_lora(policy) -> bool:
    return hasattr(policy.model, "peft_config")


def _save_weights(out_dir: Path, policy) -> None:
    if _is_lora(policy):
        policy.save_adapter(out_dir / "adapter")
    else:
        save_model(policy.model, str(out_dir / "model.safetensors"))  # handles tied embeddings


def _load_weights(ckpt_dir: Path, policy) -> None:
    if _is_lora(policy):
        files = sorted((ckpt_dir / "adapter").rglob("adapter_model.safetensors"))
        if len(files) != 1:
            raise CheckpointError(f"{ckpt_dir}/adapter holds {len(files)} adapter_model.safetensors files, "
                                  "expected 1: the checkpoint is damaged or from a different lora setting")
        result = set_peft_model_state_dict(policy.model, load_file(str(files[0])), adapter_name=POLICY_ADAPTER)
        missing = [k for k in result.missing_keys if "lora_" in k and f".{POLICY_ADAPTER}." in k]
        if missing:
            raise CheckpointError(f"{files[0]} lacks {len(missing)} adapter tensors, e.g. {missing[0]}")
    else:
        path = ckpt_dir / "model.safetensors"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint is from lora=adapter, this run is lora=none")
        load_model(policy.model, str(path))


def save_checkpoint(checkpoints_dir: Path, next_iteration: int, policy, trainer, extra: dict | None = None) -> Path:
    """Write a complete checkpoint for resuming at `next_iteration`; returns its directory.

    `extra`: JSON-able run state beside the trainer's (alarms, canary best), returned in `read_meta`.
    """
    final = Path(checkpoints_dir) / checkpoint_name(next_iteration)
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _save_weights(tmp, policy)
    save_value_head(policy, tmp / VALUE_HEAD_FILE)
    torch.save({"policy_optimizer": trainer.policy_optimizer.state_dict(),
                "value_optimizer": None if trainer.value_optimizer is None else trainer.value_optimizer.state_dict(),
                "master_weights": trainer.masters.state_dict(),
                "scheduler": trainer.scheduler.state_dict()}, tmp / "optim.pt")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / "rng.pt")
    torch.save(trainer.reward.state_dict(), tmp / "reward.pt")
    write_marker(tmp, next_iteration, trainer, extra or {})
    shutil.rmtree(final, ignore_errors=True)  # a re-save of the same iteration after a resume
    tmp.rename(final)
    return final


def load_checkpoint(ckpt_dir: Path, policy, trainer) -> int:
    """Restore weights, value head, optimizers, scheduler, counters, RNG and the reward's state; returns the
    next iteration."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    if "world_size" in meta:
        raise CheckpointError(f"{ckpt_dir} was written by {meta['world_size']} ranks under topology=fsdp; resume it "
                              "with that topology and world size, or use a new run dir")
    if meta["planned_policy_steps"] != trainer.shape.policy_steps:
        raise CheckpointError(
            f"{ckpt_dir} was written by a run of {meta['planned_policy_steps']} planned policy optimizer steps; "
            f"this config plans {trainer.shape.policy_steps}: resume with the same ppo settings or use a new run dir")
    _load_weights(ckpt_dir, policy)
    critic_file = ckpt_dir / VALUE_HEAD_FILE
    if (policy.value_head is not None) != critic_file.is_file():
        raise CheckpointError(f"{ckpt_dir} {'has' if critic_file.is_file() else 'has no'} critic, this run "
                              f"{'has' if policy.value_head is not None else 'has none'}: resume with the "
                              "ppo.advantage_estimator it was written with, or use a new run dir")
    if policy.value_head is not None:
        policy.value_head.load_state_dict(load_file(str(critic_file),
                                                    device=str(next(policy.value_head.parameters()).device)))
    optim = torch.load(ckpt_dir / "optim.pt", weights_only=True, map_location="cpu")
    trainer.masters.load_state_dict(optim["master_weights"])  # before the optimizer: its params are the masters
    trainer.policy_optimizer.load_state_dict(optim["policy_optimizer"])  # moves state to the params' device
    return restore_run_state(ckpt_dir, meta, trainer, optim)


def checkpoint_every(iterations: int, sync_every_iterations: int) -> int:
    """Iterations between periodic checkpoints: about 4 per run, a multiple of the sync period.

    On a multiple of the sync period the engine serves exactly the checkpointed weights, so a
    resume (which pushes the checkpointed weights) samples what the uninterrupted run sampled.
    """
    quarter = -(-iterations // 4)  # ceil
    return -(-max(sync_every_iterations, quarter) // sync_every_iterations) * sync_every_iterations


# --------------------------------------------------------------------------- keeping: what a run saves and spares


def _trim_jsonl(path: Path, keep) -> list[dict]:
    """Rewrite `path` atomically with only the rows `keep(row)` accepts; returns them."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [row for row in rows if keep(row)]
    if len(kept) != len(rows):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        tmp.replace(path)
    return kept


class LocalCheckpoints:
    """How one process writes, reads and prunes its checkpoints; N ranks ask their ranks object for theirs
    (`ranks.checkpoints(LocalCheckpoints())`, `distributed/checkpoint.py`)."""

    writes_run_files = True  # this process owns metrics.jsonl and canary.jsonl

    def save(self, checkpoints_dir: Path, next_iteration: int, policy, trainer, extra: dict) -> Path:
        return save_checkpoint(checkpoints_dir, next_iteration, policy, trainer, extra)

    def load(self, ckpt_dir: Path, policy, trainer) -> int:
        return load_checkpoint(ckpt_dir, policy, trainer)

    def prune(self, checkpoints_dir: Path, keep: int, pinned: tuple[Path, ...]) -> None:
        prune_checkpoints(checkpoints_dir, keep, pinned)


class CheckpointKeeper:
    """The run's checkpoint policy: resume from the newest, save every `every` iterations (and at the last
    iteration or a stop), keep the newest `keep`, and never prune a pinned checkpoint nor the checkpoint of
    the best canary check so far (the one a later canary alarm pins). `store` writes, reads and prunes
    (`LocalCheckpoints`, or the sharded store of N ranks)."""

    def __init__(self, run_dir: Path, every: int, keep: int, canary, store):
        self.run_dir, self.every, self.keep, self.canary, self.store = Path(run_dir), every, keep, canary, store
        self.checkpoint = latest_checkpoint(self.run_dir)
        self.first = read_meta(self.checkpoint)["next_iteration"] if self.checkpoint else 0
        self.alarms: list[dict] = []
        self.pinned: list[str] = []

    def trim_run_files(self) -> list[dict]:
        """Drop PPO and test-evaluation (`ppo_eval`) rows of iterations >= the resume point (logged after the
        checkpoint, before a kill) from metrics.jsonl and canary.jsonl, so each reads as one run; returns the
        kept PPO metrics rows."""
        if not self.store.writes_run_files:
            return []
        start = self.first
        rows = _trim_jsonl(self.run_dir / "metrics.jsonl",
                           lambda r: r["stage"] not in ("ppo", "ppo_eval") or r["step"] < start)
        _trim_jsonl(self.run_dir / "canary.jsonl", lambda r: r["iteration"] < start)
        return [row for row in rows if row["stage"] == "ppo"]

    def resume(self, policy, trainer, sync) -> int:
        """Load the newest checkpoint (if any) into the policy and trainer, make the engine serve it, and
        restore the alarms, pins and canary best; returns the first iteration to run."""
        if self.checkpoint is None:
            return 0
        next_iteration = self.store.load(self.checkpoint, policy, trainer)
        extra = read_meta(self.checkpoint)["extra"]
        self.canary.best, self.canary.best_iteration = extra["canary_best"], extra["canary_best_iteration"]
        self.alarms, self.pinned = list(extra["alarms"]), list(extra["pinned"])
        sync.push(policy)  # the first request after a resume must name the resumed weights, not the SFT base
        return next_iteration

    def best(self) -> Path | None:
        """The checkpoint holding the weights the canary scored best (`it<best_iteration + 1>`), if one was saved."""
        if self.canary.best_iteration < 0:
            return None
        path = self.run_dir / "checkpoints" / checkpoint_name(self.canary.best_iteration + 1)
        return path if path in list_checkpoints(self.run_dir / "checkpoints") else None

    def record(self, new_alarms: list[dict]) -> list[str]:
        """Add this iteration's alarms; on a canary alarm pin the best checkpoint for good. Returns warnings."""
        self.alarms += new_alarms
        if not any(alarm["tripwire"] == "canary" for alarm in new_alarms):
            return []
        best = self.best()
        if best is None:
            return [f"canary alarm: the best canary iteration {self.canary.best_iteration} has no checkpoint to "
                    f"pin (canary.every is not a multiple of the checkpoint period)"]
        if str(best) in self.pinned:
            return []
        self.pinned.append(str(best))
        return [f"canary alarm: pinned {best} (best canary accuracy {self.canary.best:.3f}) against pruning"]

    def maybe_save(self, iteration: int, policy, trainer, force: bool) -> Path | None:
        """Save after `iteration` when the cadence says so or `force` (last iteration, stop); prune."""
        if not (force or (iteration + 1) % self.every == 0):
            return None
        extra = {"alarms": self.alarms, "canary_best": self.canary.best,
                 "canary_best_iteration": self.canary.best_iteration, "pinned": self.pinned}
        self.checkpoint = self.store.save(self.run_dir / "checkpoints", iteration + 1, policy, trainer, extra)
        best = self.best()
        self.store.prune(self.run_dir / "checkpoints", self.keep,
                         pinned=tuple(Path(p) for p in self.pinned) + ((best,) if best is not None else ()))
        return self.checkpoint
