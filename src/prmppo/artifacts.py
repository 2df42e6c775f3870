"""Stage artifacts kept across runs, keyed by the config sections that made them.

The pipeline skips a stage whose artifact exists for the same config: the SFT checkpoint is
keyed by (seed, task, model, sft), so changing `ppo.kl_coef` reuses it while changing
`sft.steps` makes a new one. The band file is keyed by the SFT checkpoint's sections and the
band's measurement keys; `band.enabled` and `band.file` say whether and where PPO reads a band,
not how one is made, so they are left out of its key (they stay in PPO's). `ppo.compile_cache` is
left out of PPO's key: it changes how fast a run starts, not what it trains. An artifact directory
is written under a temp name and renamed when complete, with `artifact.json` recording the config
sections it was made from; a directory without that file is an interrupted write and is never reused.
Runs that need the same artifact at once (the jobs of a parallel sweep sharing a seed) take its build
lock (`building`): one builds it while the others wait, then they reuse it. Under `topology=fsdp`
rank 0 alone takes it (`building_on_main`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig, OmegaConf

from prmppo.logger import write_json_atomic

# config sections each stage's artifact depends on (its own and its inputs')
ARTIFACT_SECTIONS: dict[str, tuple[str, ...]] = {
    "sft": ("seed", "task", "model", "sft"),
    "prm": ("seed", "task", "model", "sft", "prm_train"),
    "band": ("seed", "task", "model", "sft", "band"),
    "ppo": ("seed", "task", "model", "sft", "prm_train", "arm", "reward", "lora", "rollout", "ppo", "band"),
}
# keys of a section left out of one stage's key: they do not change how its artifact is made
UNKEYED: dict[str, dict[str, tuple[str, ...]]] = {"band": {"band": ("enabled", "file")},
                                                  "ppo": {"ppo": ("compile_cache",)}}  # start-up time only
MANIFEST = "artifact.json"

log = logging.getLogger("prmppo")


def artifact_key(cfg: DictConfig, stage: str) -> tuple[str, dict]:
    """(12-hex-digit key, the config sections it hashes) for `stage`'s artifact."""
    sections = {name: OmegaConf.to_container(cfg[name], resolve=True) if isinstance(cfg[name], DictConfig)
                else cfg[name] for name in ARTIFACT_SECTIONS[stage]}
    for name, keys in UNKEYED.get(stage, {}).items():
        sections[name] = {k: v for k, v in sections[name].items() if k not in keys}
    blob = json.dumps(sections, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12], sections


def artifact_dir(cfg: DictConfig, stage: str) -> Path:
    key, _ = artifact_key(cfg, stage)
    return Path(cfg.artifacts_dir).resolve() / f"{stage}-{key}"


def artifact_ready(path: Path) -> bool:
    return (path / MANIFEST).is_file()


@contextmanager
def building(final: Path) -> Iterator[None]:
    """Hold `final`'s build lock (an flock on `.locks/<final name>.lock` beside it, released when the
    process ends, however it ends): check `artifact_ready` and build inside it, so that two runs never
    build the same artifact into one staging directory at once."""
    locks = final.parent / ".locks"  # apart from the artifacts, so that `<stage>-*` names only artifacts
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{final.name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another run is building %s: waiting for it", final)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def building_on_main(final: Path, is_main: bool) -> Iterator[None]:
    """`building(final)` on training rank 0 (or the only process); a nothing on the other ranks of
    `topology=fsdp`, which build (train) together with rank 0 and follow its decision to reuse or build.
    One lock per job: N ranks taking it would wait for each other forever while rank 0 waits in a
    collective for them."""
    if not is_main:
        yield
        return
    with building(final):
        yield


def staging_dir(final: Path) -> Path:
    """A fresh temp directory beside `final` to build an artifact in."""
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, final: Path, cfg: DictConfig, stage: str, summary: dict) -> Path:
    """Seal `tmp` with its manifest and move it to `final` (replacing an older artifact)."""
    key, sections = artifact_key(cfg, stage)
    write_json_atomic(tmp / MANIFEST, {"stage": stage, "key": key, "config": sections, "summary": summary})
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    return final
