"""Plumbing every stage shares: the training device and ranks, making or reusing an artifact
(`make_or_reuse`), the metrics logger, `run_info.json` and `stage_result.json`, and the evaluation of
a checkpoint (or of SFT and PPO side by side) on the test split. Stages read the config; what they
call takes values."""

from __future__ import annotations

import logging
import os
import platform
import socket
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from prmppo import artifacts
from prmppo.config.validate import inert_keys, wandb_key_configured
from prmppo.distributed.launch import init_ranks
from prmppo.errors import PrmppoError
from prmppo.evaluation import score
from prmppo.logger import MetricsLogger, write_json_atomic
from prmppo.models.loading import load_model, load_tokenizer
from prmppo.rollout.vllm_engine import model_head_dim

log = logging.getLogger("prmppo")

BAND_FILE = "band.jsonl"  # the band artifact's file of kept prompts (stages/band.py)
# a reused artifact as its log line and its stage's summary name it: (what, summary key, file inside the dir)
REUSED = {"sft": ("SFT checkpoint", "checkpoint", ""), "prm": ("PRM", "prm_dir", ""),
          "band": ("band", "band_file", BAND_FILE)}


def train_device(cfg: DictConfig) -> torch.device:
    device = torch.device(cfg.topology.train_device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PrmppoError(f"topology.train_device={cfg.topology.train_device!r} but no CUDA device is visible; "
                          "use topology=cpu")
    return device


def engine_in_process(cfg: DictConfig) -> bool:
    """Whether the rollout engine `cfg.rollout` names samples with a model this process holds
    (`rollout=inprocess`, asked of its `_target_`), which the stage then loads or trains and hands it,
    rather than in a worker process that loads its own copy."""
    return bool(getattr(get_object(cfg.rollout._target_), "in_process", False))


def open_ranks(cfg: DictConfig, run_dir: Path):
    """The training ranks of this launch (`distributed/`): one process on `topology.train_device`, or this rank of N
    under torchrun (`topology=fsdp`: joins the process group). Close them with `distributed.launch.close_ranks`."""
    train_device(cfg)  # a CUDA device that is not there is refused here
    return init_ranks(cfg.topology.name, cfg.topology.train_device, run_dir)


class Made(NamedTuple):
    """An artifact just built, not yet published: its summary; `save(full, tmp)`, which writes it into the
    staging dir on rank 0; and `full()`, the trained model with its full weights on rank 0 (a collective
    under several ranks: `ranks.shard`'s), nothing for an artifact of plain files."""

    summary: dict
    save: Callable[[object, Path], None]
    full: Callable[[], object] = lambda: None


def make_or_reuse(cfg: DictConfig, stage: str, ranks, build: Callable[[Path], Made],
                  reuse: bool = True) -> tuple[Path, dict]:
    """(this config's `stage` artifact dir, its summary). 1. lock: rank 0 takes the artifact's build lock,
    so parallel runs that need the same artifact wait for the first to build it; 2. reuse it when `reuse`
    and it exists (rank 0's word, on every rank); else 3. `build(final)` on every rank (data parallel under
    `topology=fsdp`) and 4. publish: the full weights gathered, rank 0 writes and seals the artifact while
    the others wait."""
    final = artifacts.artifact_dir(cfg, stage)
    with artifacts.building_on_main(final, ranks.is_main):
        if ranks.from_main(lambda: reuse and artifacts.artifact_ready(final)):
            what, key, file = REUSED[stage]
            sections = "/".join(name for name in artifacts.ARTIFACT_SECTIONS[stage] if name != "seed")
            log.info("reusing %s %s (same %s config)", what, final, sections)
            return final, {"reused": True, key: str(final / file) if file else str(final)}
        made = build(final)

        def write(full) -> None:
            tmp = artifacts.staging_dir(final)
            made.save(full, tmp)
            artifacts.publish(tmp, final, cfg, stage, made.summary)

        ranks.publish(made.full, write)
    return final, made.summary


def head_dim(architecture: dict | None) -> int | None:
    """The attention head size a transformers config dict implies; None when it does not say."""
    try:
        return None if architecture is None else model_head_dim(architecture)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def open_metrics(cfg: DictConfig, run_dir: Path, stage: str) -> MetricsLogger:
    """The stage's metrics logger: metrics.jsonl always, plus a W&B run when `logger.wandb`."""
    sinks = []
    if cfg.logger.wandb:
        from prmppo.logger.wandb_sink import WandbSink  # imports wandb, an optional package

        mode = cfg.logger.mode if cfg.logger.mode != "auto" else ("online" if wandb_key_configured() else "offline")
        sinks.append(WandbSink(
            run_dir=run_dir, project=cfg.logger.wandb_project, entity=cfg.logger.wandb_entity, mode=mode,
            config=OmegaConf.to_container(cfg, resolve=True), group=cfg.experiment_name, job_type=stage,
            tags=[cfg.arm.name, stage, f"seed={cfg.seed}"], name=f"{Path(run_dir).name}-{stage}"))
    return MetricsLogger(run_dir, stage, console=cfg.logger.console, sinks=sinks)


# the packages whose versions decide a run's numbers, by distribution name
RECORDED_PACKAGES = ("prmppo", "torch", "transformers", "peft", "tokenizers", "hydra-core", "omegaconf")


def code_commit(source_dir: Path | None = None) -> dict | None:
    """`{"commit": HEAD, "dirty": tracked files differ from it}` of the git checkout that holds the running
    prmppo source (`source_dir`, default this package's directory), or None when that source is not a tracked
    file of a checkout (an installed wheel, a copy without git, no git program): never an error."""
    source_dir = Path(source_dir or Path(__file__).resolve().parents[1])

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(source_dir), *args], capture_output=True, text=True, check=True,
                              timeout=20).stdout.strip()

    try:
        # a wheel installed into a virtualenv that sits inside some checkout is not that checkout's source
        git("ls-files", "--error-unmatch", "__init__.py")
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def package_versions() -> dict[str, str | None]:
    """Python's version and each of `RECORDED_PACKAGES`' (None for one that is not installed)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_model() -> str | None:
    """The CPU's model name (`/proc/cpuinfo` on Linux, else what `platform` knows), None when unknown."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or None


def record_start(run_dir: Path, train_device: str) -> None:
    """`run_info.json`: when the run started (unix seconds) and on what (host name, CPU count, the training
    device's name, the CPU's model), with which code (`code`: git commit and dirty flag of the source
    checkout, null for an installed wheel) and which versions of Python and the packages that decide its
    numbers, for reports' runtimes and hardware and for telling why two machines' numbers differ. A relaunch
    (resume) keeps the first launch's record."""
    path = run_dir / "run_info.json"
    if path.exists():
        return
    device = torch.device(train_device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else "cpu"
    write_json_atomic(path, {"started_at": time.time(), "hostname": socket.gethostname(),
                             "cpu_count": os.cpu_count(), "device": name, "cpu_model": cpu_model(),
                             "code": code_commit(), "versions": package_versions()})


def write_stage_result(run_dir: Path, cfg: DictConfig, stage: str, summary: dict, status: str | None = None,
                       error: dict | None = None) -> None:
    """`stage_result.json`: status (`ok`, `stopped`, `failed`), who ran (arm, experiment, seed), when it
    ended (`finished_at`, unix seconds), the keys this config never reads (`inert_keys`), the summary and,
    for a failed run, the error."""
    status = status or ("stopped" if "stopped" in summary else "ok")
    result = {"status": status, "stage": stage, "arm": cfg.arm.name, "experiment": cfg.experiment_name,
              "seed": cfg.seed, "finished_at": time.time(), "inert_keys": inert_keys(cfg), "summary": summary}
    if error is not None:
        result["error"] = error
    write_json_atomic(run_dir / "stage_result.json", result)


def evaluate_checkpoint(cfg: DictConfig, task, checkpoint: Path) -> dict:
    """Greedy accuracy, sampled accuracy (eval.k samples at eval.temperature) and pass@k on `test`, and
    `problems`: each test problem's outcomes (`evaluation.score`'s `per_problem`)."""
    model = load_model(checkpoint, cfg.model.dtype, train_device(cfg))
    tokenizer = load_tokenizer(checkpoint)
    problems = task.problems("test")[: cfg.eval.n_problems]
    start = time.time()
    result = score(model, tokenizer, task, problems, k=cfg.eval.k, temperature=cfg.eval.temperature,
                   max_new_tokens=cfg.eval.max_new_tokens, batch_rows=cfg.eval.batch_rows, seed=cfg.seed,
                   show_progress=cfg.logger.console, per_problem=True)
    return {"checkpoint": str(checkpoint), **result, "eval_seconds": time.time() - start}


def without_problems(result: dict) -> dict:
    """An evaluation without its per-problem outcomes: those live in eval.json alone, not in every summary."""
    return {key: value for key, value in result.items() if key != "problems"}


def side_by_side(cfg: DictConfig, task, run_dir: Path, sft_checkpoint: Path, ppo_checkpoint: Path) -> dict:
    """Both policies evaluated on the test split and `delta` = PPO - SFT; written to eval.json."""
    evaluation = {"sft": evaluate_checkpoint(cfg, task, sft_checkpoint),
                  "ppo": evaluate_checkpoint(cfg, task, ppo_checkpoint)}
    delta = {key: evaluation["ppo"][key] - evaluation["sft"][key]
             for key in evaluation["sft"] if key.endswith("accuracy") or key.startswith("pass@")}
    with open_metrics(cfg, run_dir, "eval") as logger:
        for name, result in evaluation.items():
            logger.log(0, {f"eval/{name}/{k}": v for k, v in result.items() if isinstance(v, float)}, echo=True)
        logger.log(0, {f"eval/delta/{k}": v for k, v in delta.items()}, echo=True)
    write_json_atomic(run_dir / "eval.json", {**evaluation, "delta": delta})
    return {"eval": {name: without_problems(result) for name, result in evaluation.items()}, "delta": delta}
