"""Weight sync from the trainer to the rollout engine (`rollout.sync`).

`checkpoint`: the policy is saved as a merged HF-layout directory and the engine reloads it.
`adapter`: only the LoRA `policy` adapter is saved and the engine applies it on its resident
base. `shared`: the merged weights are written into a buffer the built-in engine maps too (a CUDA
IPC handle, or a `/dev/shm` file for CPU weights; `rollout/shared_weights.py`) and copied from
there into its resident tensors: no file is serialised. `none`: the in-process engine
(`rollout=inprocess`) samples with the trainer's own model, so nothing is shipped and a push only
advances the version of the "live" weights the next request names. Every way, a version number
travels with the weights: each request names the version it must be sampled with and the worker
reports what it served, so a stale engine is caught.
Directories are written under a temp name and renamed; versions older than the previous one
are pruned.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from prmppo.rollout.protocol import WeightsSpec
from prmppo.rollout.shared_weights import SharedWeightsWriter

SYNC_MODES = ("checkpoint", "adapter", "shared", "none")


class WeightSync:
    """Decides when to ship weights and what the next rollout request must be sampled with."""

    def __init__(self, mode: str, every_iterations: int, sync_dir: Path, tokenizer):
        if mode not in SYNC_MODES:
            raise ValueError(f"rollout.sync={mode!r} is not one of {', '.join(SYNC_MODES)}")
        self.mode = mode
        self.every_iterations = every_iterations
        self.sync_dir = Path(sync_dir)
        shutil.rmtree(self.sync_dir, ignore_errors=True)  # transient: a relaunch starts from no versions
        self.sync_dir.mkdir(parents=True)
        self.tokenizer = tokenizer
        # the engine starts on its base weights; the in-process engine (`none`) always holds the trainer's
        self.served = WeightsSpec(kind="live" if mode == "none" else "base", path=None, version=0)
        self.shared = SharedWeightsWriter(self.sync_dir / "shared") if mode == "shared" else None

    def push(self, policy) -> WeightsSpec:
        """Save the current policy for the engine; the next request asks for this version."""
        version = self.served.version + 1
        if self.mode == "none":  # the engine reads the trainer's weights where they are
            self.served = WeightsSpec(kind="live", path=None, version=version)
            return self.served
        if self.shared is not None:
            path = self.shared.write(policy.merged_state_dict(), version)
            self.served = WeightsSpec(kind="shared", path=str(path.resolve()), version=version)
            return self.served
        final = self.sync_dir / f"v{version:06d}"
        tmp = final.with_name(final.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        if self.mode == "checkpoint":
            policy.save_merged(tmp, self.tokenizer)
        else:
            policy.save_adapter(tmp)
        tmp.rename(final)
        self.served = WeightsSpec(kind=self.mode, path=str(final.resolve()), version=version)
        for old in self.sync_dir.glob("v*"):
            if old.name < f"v{version - 1:06d}":
                shutil.rmtree(old, ignore_errors=True)
        return self.served

    def maybe_sync(self, policy, iteration: int) -> bool:
        """Push after every `every_iterations`-th iteration (0-based `iteration`)."""
        if (iteration + 1) % self.every_iterations:
            return False
        self.push(policy)
        return True
