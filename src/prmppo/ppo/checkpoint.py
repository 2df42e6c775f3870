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
functions of the seed and the iteration index (`ppo/loop.py`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file, load_model, save_file, save_model

from prmppo.errors import PrmppoError
from prmppo.logger import write_json_atomic
from prmppo.models.policy import POLICY_ADAPTER

MARKER = "checkpoint.json"
FORMAT_VERSION = 2  # 2: fp32 master weights in optim.pt, the critic optional


class CheckpointError(PrmppoError):
    """A checkpoint that does not fit the run resuming from it."""


def checkpoint_name(next_iteration: int) -> str:
    return f"it{next_iteration:06d}"


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
    if policy.value_head is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in policy.value_head.state_dict().items()},
                  str(tmp / "value_head.safetensors"))
    torch.save({"policy_optimizer": trainer.policy_optimizer.state_dict(),
                "value_optimizer": None if trainer.value_optimizer is None else trainer.value_optimizer.state_dict(),
                "master_weights": trainer.masters.state_dict(),
                "scheduler": trainer.scheduler.state_dict()}, tmp / "optim.pt")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / "rng.pt")
    torch.save(trainer.reward.state_dict(), tmp / "reward.pt")
    budget = trainer.skip_budget
    write_json_atomic(tmp / MARKER, {
        "format": FORMAT_VERSION, "next_iteration": next_iteration,
        "policy_steps_taken": trainer.policy_steps_taken, "skipped_steps": trainer.skipped_steps,
        "planned_policy_steps": trainer.shape.policy_steps,
        "skip_budget": {"skipped": budget.skipped, "consecutive": budget.consecutive, "steps": budget.steps},
        "files": {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()},
        "extra": extra or {}})
    shutil.rmtree(final, ignore_errors=True)  # a re-save of the same iteration after a resume
    tmp.rename(final)
    return final


def _is_complete(path: Path) -> bool:
    return path.is_dir() and not path.name.endswith(".partial") and (path / MARKER).is_file()


def list_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (the zero-padded name sorts by iteration)."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    return sorted(p for p in checkpoints_dir.glob("it*") if _is_complete(p))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint under `<run_dir>/checkpoints`, or None."""
    found = list_checkpoints(Path(run_dir) / "checkpoints")
    return found[-1] if found else None


def prune_checkpoints(checkpoints_dir: Path, keep: int, pinned: tuple[Path, ...] = ()) -> list[Path]:
    """Delete all but the newest `keep` (>= 1) complete checkpoints and any pinned; returns those deleted.

    Leftover `.partial` dirs (a save killed midway) are deleted too.
    """
    complete = list_checkpoints(checkpoints_dir)
    keep_set = set(complete[-max(keep, 1):]) | {Path(p) for p in pinned}
    doomed = [p for p in complete if p not in keep_set]
    doomed += sorted(Path(checkpoints_dir).glob("it*.partial"))
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _read_marker(ckpt_dir: Path) -> dict:
    marker = Path(ckpt_dir) / MARKER
    try:
        meta = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{marker} is unreadable ({err}): not a complete checkpoint") from err
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{marker} is checkpoint format {meta.get('format')}, this prmppo reads format "
                              f"{FORMAT_VERSION}: resume it with the prmppo that wrote it, or use a new run dir")
    for name, size in meta["files"].items():
        path = Path(ckpt_dir) / name
        if not path.is_file() or path.stat().st_size != size:
            raise CheckpointError(f"{path} is missing or truncated (expected {size} bytes): the checkpoint "
                                  f"{ckpt_dir} is damaged; delete it to resume from the one before")
    return meta


def read_meta(ckpt_dir: Path) -> dict:
    """`checkpoint.json` of a complete checkpoint (counters, `next_iteration`, `extra`), after checking
    that every file it lists is present at its recorded size."""
    return _read_marker(ckpt_dir)


def load_checkpoint(ckpt_dir: Path, policy, trainer) -> int:
    """Restore weights, value head, optimizers, scheduler, counters, RNG and the reward's state; returns the
    next iteration."""
    ckpt_dir = Path(ckpt_dir)
    meta = _read_marker(ckpt_dir)
    if "world_size" in meta:
        raise CheckpointError(f"{ckpt_dir} was written by {meta['world_size']} ranks under topology=fsdp; resume it "
                              "with that topology and world size, or use a new run dir")
    if meta["planned_policy_steps"] != trainer.shape.policy_steps:
        raise CheckpointError(
            f"{ckpt_dir} was written by a run of {meta['planned_policy_steps']} planned policy optimizer steps; "
            f"this config plans {trainer.shape.policy_steps}: resume with the same ppo settings or use a new run dir")
    _load_weights(ckpt_dir, policy)
    critic_file = ckpt_dir / "value_head.safetensors"
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


def restore_run_state(ckpt_dir: Path, meta: dict, trainer, optim: dict) -> int:
    """What a resume restores besides the policy's weights and optimizer, for one process or N ranks:
    the value optimizer, the LR scheduler, the RNG states, the reward's state and the step counters;
    returns the next iteration."""
    if trainer.value_optimizer is not None:
        trainer.value_optimizer.load_state_dict(optim["value_optimizer"])
    trainer.scheduler.load_state_dict(optim["scheduler"])
    rng = torch.load(ckpt_dir / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    _load_reward_state(ckpt_dir, trainer.reward)
    trainer.policy_steps_taken = meta["policy_steps_taken"]
    trainer.skipped_steps = meta["skipped_steps"]
    for key, value in meta["skip_budget"].items():
        setattr(trainer.skip_budget, key, value)
    return int(meta["next_iteration"])


def _load_reward_state(ckpt_dir: Path, reward) -> None:
    """Restore the reward's random state. A checkpoint from before `reward.pt` existed resumes only a
    reward with no state (no label noise); otherwise its flips would differ from the uninterrupted run's."""
    path = ckpt_dir / "reward.pt"
    state = torch.load(path, weights_only=True) if path.is_file() else {}
    try:
        reward.load_state_dict(state)
    except ValueError as err:
        fix = ("the checkpoint predates reward.pt, so a resume would flip other steps than the uninterrupted "
               "run: start a new run dir" if not path.is_file() else
               "resume with the reward settings it was written with, or start a new run dir")
        raise CheckpointError(f"{ckpt_dir} cannot restore this run's reward ({err}): {fix}") from err


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


class CheckpointKeeper:
    """The run's checkpoint policy: resume from the newest, save every `every` iterations (and at the last
    iteration or a stop), keep the newest `keep`, and never prune a pinned checkpoint nor the checkpoint of
    the best canary check so far (the one a later canary alarm pins)."""

    def __init__(self, run_dir: Path, every: int, keep: int, canary):
        self.run_dir, self.every, self.keep, self.canary = Path(run_dir), every, keep, canary
        self.checkpoint = latest_checkpoint(self.run_dir)
        self.first = read_meta(self.checkpoint)["next_iteration"] if self.checkpoint else 0
        self.alarms: list[dict] = []
        self.pinned: list[str] = []

    def trim_run_files(self) -> list[dict]:
        """Drop PPO and test-evaluation (`ppo_eval`) rows of iterations >= the resume point (logged after the
        checkpoint, before a kill) from metrics.jsonl and canary.jsonl, so each reads as one run; returns the
        kept PPO metrics rows."""
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
        next_iteration = self._load(self.checkpoint, policy, trainer)
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
        self.checkpoint = self._save(self.run_dir / "checkpoints", iteration + 1, policy, trainer, extra)
        best = self.best()
        self._prune(self.run_dir / "checkpoints", self.keep,
                    pinned=tuple(Path(p) for p in self.pinned) + ((best,) if best is not None else ()))
        return self.checkpoint

    # how a checkpoint is written, read and pruned: one process here, N ranks in `distributed/checkpoint.py`
    def _save(self, checkpoints_dir: Path, next_iteration: int, policy, trainer, extra: dict) -> Path:
        return save_checkpoint(checkpoints_dir, next_iteration, policy, trainer, extra)

    def _load(self, ckpt_dir: Path, policy, trainer) -> int:
        return load_checkpoint(ckpt_dir, policy, trainer)

    def _prune(self, checkpoints_dir: Path, keep: int, pinned: tuple[Path, ...]) -> None:
        prune_checkpoints(checkpoints_dir, keep, pinned)
