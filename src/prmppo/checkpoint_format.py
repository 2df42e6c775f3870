"""What every resumable PPO checkpoint shares, written by one process (`ppo/checkpoint.py`) or by N
ranks (`distributed/checkpoint.py`): its name, the marker written last, listing and pruning, the
value head's file and the run state a resume restores beside the weights.

    it<NNNNNN>/                    NNNNNN = the next iteration to run
    it<NNNNNN>/checkpoint.json     counters and `extra`; written LAST, so its presence marks a complete
                                   checkpoint (and it lists every other file with its size)
    it<NNNNNN>.partial/            a checkpoint being written: never read, pruned at the next save

It sits below both writers so that neither the PPO package nor the ranks package builds on the other.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from prmppo.errors import PrmppoError
from prmppo.logger import write_json_atomic

MARKER = "checkpoint.json"
FORMAT_VERSION = 2  # 2: fp32 master weights in optim.pt, the critic optional
VALUE_HEAD_FILE = "value_head.safetensors"


class CheckpointError(PrmppoError):
    """A checkpoint that does not fit the run resuming from it."""


def checkpoint_name(next_iteration: int) -> str:
    return f"it{next_iteration:06d}"


def save_value_head(policy, path: Path) -> None:
    """The critic's weights as safetensors at `path`; nothing under a group baseline (no critic)."""
    if policy.value_head is None:
        return
    save_file({k: v.detach().cpu().contiguous() for k, v in policy.value_head.state_dict().items()}, str(path))


def write_marker(tmp: Path, next_iteration: int, trainer, extra: dict, world_size: int | None = None) -> None:
    """`checkpoint.json` of the checkpoint being written in `tmp`, after every other file: counters,
    `extra`, each file's size, and `world_size` for a checkpoint of N ranks."""
    ranks = {} if world_size is None else {"world_size": world_size}
    budget = trainer.skip_budget
    write_json_atomic(tmp / MARKER, {
        "format": FORMAT_VERSION, "next_iteration": next_iteration, **ranks,
        "policy_steps_taken": trainer.policy_steps_taken, "skipped_steps": trainer.skipped_steps,
        "planned_policy_steps": trainer.shape.policy_steps,
        "skip_budget": {"skipped": budget.skipped, "consecutive": budget.consecutive, "steps": budget.steps},
        "files": {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()},
        "extra": extra})


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


def read_meta(ckpt_dir: Path) -> dict:
    """`checkpoint.json` of a complete checkpoint (counters, `next_iteration`, `extra`), after checking
    that every file it lists is present at its recorded size."""
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
