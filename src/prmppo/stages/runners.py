"""Stage runners: the only code besides `app.run` that reads the config.

Each runner builds its components from config nodes (through `app.build`, which logs every
`_target_`), calls the stage's plain functions with values, and writes `stage_result.json`
atomically. `ensure_*` helpers make a stage's artifact or reuse one made with the same config.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from prmppo import artifacts
from prmppo.logger import MetricsLogger, write_json_atomic

log = logging.getLogger("prmppo")


def train_device(cfg: DictConfig) -> torch.device:
    device = torch.device(cfg.topology.train_device)
    if device.type == "cuda" and not torch.cuda.is_available():
        from prmppo.errors import PrmppoError

        raise PrmppoError(f"topology.train_device={cfg.topology.train_device!r} but no CUDA device is visible; "
                          "use topology=cpu")
    return device


def open_metrics(cfg: DictConfig, run_dir: Path, stage: str) -> MetricsLogger:
    """The stage's metrics logger: metrics.jsonl always, plus a W&B run when `logger.wandb`."""
    sinks = []
    if cfg.logger.wandb:
        from omegaconf import OmegaConf

        from prmppo.config.validate import wandb_key_configured
        from prmppo.logger.wandb_sink import WandbSink

        mode = cfg.logger.mode if cfg.logger.mode != "auto" else ("online" if wandb_key_configured() else "offline")
        sinks.append(WandbSink(
            run_dir=run_dir, project=cfg.logger.wandb_project, entity=cfg.logger.wandb_entity, mode=mode,
            config=OmegaConf.to_container(cfg, resolve=True), group=cfg.experiment_name, job_type=stage,
            tags=[cfg.arm.name, stage, f"seed={cfg.seed}"], name=f"{Path(run_dir).name}-{stage}"))
    return MetricsLogger(run_dir, stage, console=cfg.logger.console, sinks=sinks)


def _score(model, tokenizer, task, problems, cfg: DictConfig, k: int) -> dict:
    from prmppo.evaluation import score

    return score(model, tokenizer, task, problems, k=k, temperature=cfg.eval.temperature,
                 max_new_tokens=cfg.sft.max_new_tokens, batch_rows=cfg.eval.batch_rows, seed=cfg.seed,
                 show_progress=cfg.logger.console)


def ensure_sft(cfg: DictConfig, task, run_dir: Path, reuse: bool) -> tuple[Path, dict]:
    """The SFT checkpoint for this config: reused when `reuse` and it exists, else trained."""
    from prmppo.app import build
    from prmppo.models.loading import load_model, load_tokenizer
    from prmppo.stages.sft import SFTBatchSource, train_sft

    final = artifacts.artifact_dir(cfg, "sft")
    if reuse and artifacts.artifact_ready(final):
        log.info("reusing SFT checkpoint %s (same task/model/sft config)", final)
        return final, {"reused": True, "checkpoint": str(final)}
    source = build(cfg.model, "model source")
    init_dir = source.materialize(task, run_dir / "init_model")
    device = train_device(cfg)
    tokenizer = load_tokenizer(init_dir)
    model = load_model(init_dir, cfg.model.dtype, device)
    summary: dict = {"checkpoint": str(final), "init": str(init_dir),
                     "parameters": sum(p.numel() for p in model.parameters())}
    with open_metrics(cfg, run_dir, "sft") as logger:
        if cfg.sft.steps > 0:
            batches = SFTBatchSource.build(task, task.problems("sft"), tokenizer,
                                           model.config.max_position_embeddings)
            summary.update(train_sft(
                model, batches, steps=cfg.sft.steps, batch_rows=cfg.sft.batch_rows, lr=cfg.sft.lr,
                warmup_steps=cfg.sft.warmup_steps, min_lr_ratio=cfg.sft.min_lr_ratio,
                weight_decay=cfg.sft.weight_decay, grad_clip=cfg.sft.grad_clip,
                pad_token_id=tokenizer.pad_token_id, device=device, seed=cfg.seed, logger=logger))
        if cfg.sft.eval_problems > 0:
            start = time.time()
            test = task.problems("test")[: cfg.sft.eval_problems]
            held_out_sft = task.problems("sft")[-cfg.sft.eval_problems:]
            summary["test"] = _score(model, tokenizer, task, test, cfg, k=0)
            summary["sft_distribution"] = _score(model, tokenizer, task, held_out_sft, cfg, k=0)
            summary["eval_seconds"] = time.time() - start
            logger.log(cfg.sft.steps, {"eval/test_greedy_accuracy": summary["test"]["greedy_accuracy"],
                                       "eval/sft_greedy_accuracy": summary["sft_distribution"]["greedy_accuracy"]},
                       echo=True)
    tmp = artifacts.staging_dir(final)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    artifacts.publish(tmp, final, cfg, "sft", summary)
    return final, summary


def run_sft(cfg: DictConfig, run_dir: Path) -> dict:
    from prmppo.app import build

    start = time.time()
    task = build(cfg.task, "task")
    _, summary = ensure_sft(cfg, task, run_dir, reuse=False)
    summary["wall_seconds"] = time.time() - start
    write_stage_result(run_dir, cfg, "sft", summary)
    return summary


def write_stage_result(run_dir: Path, cfg: DictConfig, stage: str, summary: dict, status: str | None = None,
                       error: dict | None = None) -> None:
    """`stage_result.json`: status (`ok`, `stopped`, `failed`), who ran (arm, experiment, seed), the keys
    this config never reads (`inert_keys`), the summary and, for a failed run, the error."""
    from prmppo.config.validate import inert_keys

    status = status or ("stopped" if "stopped" in summary else "ok")
    result = {"status": status, "stage": stage, "arm": cfg.arm.name, "experiment": cfg.experiment_name,
              "seed": cfg.seed, "inert_keys": inert_keys(cfg), "summary": summary}
    if error is not None:
        result["error"] = error
    write_json_atomic(run_dir / "stage_result.json", result)


def _eval_checkpoint(cfg: DictConfig, task, checkpoint: Path) -> dict:
    """Greedy accuracy, sampled accuracy (k samples at eval.temperature) and pass@k on `test`."""
    from prmppo.evaluation import score
    from prmppo.models.loading import load_model, load_tokenizer

    model = load_model(checkpoint, cfg.model.dtype, train_device(cfg))
    tokenizer = load_tokenizer(checkpoint)
    problems = task.problems("test")[: cfg.eval.n_problems]
    start = time.time()
    result = score(model, tokenizer, task, problems, k=cfg.eval.k, temperature=cfg.eval.temperature,
                   max_new_tokens=cfg.eval.max_new_tokens, batch_rows=cfg.eval.batch_rows, seed=cfg.seed,
                   show_progress=cfg.logger.console)
    return {"checkpoint": str(checkpoint), **result, "eval_seconds": time.time() - start}


def run_eval(cfg: DictConfig, run_dir: Path) -> dict:
    """Evaluate `eval.checkpoint`, or this config's SFT and PPO artifacts when it is empty."""
    from prmppo.app import build
    from prmppo.models.loading import check_model_dir

    task = build(cfg.task, "task")
    if cfg.eval.checkpoint:
        targets = {"checkpoint": Path(cfg.eval.checkpoint)}
    else:
        targets = {stage: artifacts.artifact_dir(cfg, stage) for stage in ("sft", "ppo")
                   if artifacts.artifact_ready(artifacts.artifact_dir(cfg, stage))}
        if not targets:
            from prmppo.errors import PrmppoError

            raise PrmppoError(f"eval.checkpoint is empty and no SFT/PPO artifact for this config exists under "
                              f"{Path(cfg.artifacts_dir).resolve()}; pass eval.checkpoint=<HF-layout dir>")
    for path in targets.values():
        check_model_dir(path)
    summary = {}
    with open_metrics(cfg, run_dir, "eval") as logger:
        for name, path in targets.items():
            summary[name] = _eval_checkpoint(cfg, task, path)
            logger.log(0, {f"eval/{name}/{k}": v for k, v in summary[name].items() if isinstance(v, float)},
                       echo=True)
    write_json_atomic(run_dir / "eval.json", summary)
    write_stage_result(run_dir, cfg, "eval", summary)
    return summary


def run_ppo(cfg: DictConfig, run_dir: Path) -> dict:
    from prmppo.app import build
    from prmppo.stages.ppo import early_gates, publish_policy, train_ppo

    start = time.time()
    task = build(cfg.task, "task")
    gates = early_gates(cfg, task)
    sft_checkpoint, _ = ensure_sft(cfg, task, run_dir, reuse=True)
    summary = train_ppo(cfg, task, sft_checkpoint, run_dir, gates)
    summary["artifact"] = str(publish_policy(cfg, Path(summary["checkpoint"]), summary))
    summary["wall_seconds"] = time.time() - start
    write_stage_result(run_dir, cfg, "ppo", summary)
    return summary


def run_pipeline(cfg: DictConfig, run_dir: Path) -> dict:
    """sft -> (prm, when the reward needs one) -> ppo -> eval of SFT and PPO side by side.

    Each stage reuses its artifact when one exists for the same config; the PRM is trained
    inside `train_ppo` when the arm's reward asks for a learned PRM.
    """
    from prmppo.app import build
    from prmppo.stages.ppo import early_gates, publish_policy, train_ppo

    start = time.time()
    task = build(cfg.task, "task")
    gates = early_gates(cfg, task)
    sft_checkpoint, sft_summary = ensure_sft(cfg, task, run_dir, reuse=True)
    ppo_summary = train_ppo(cfg, task, sft_checkpoint, run_dir, gates)
    publish_policy(cfg, Path(ppo_summary["checkpoint"]), ppo_summary)
    evaluation = {"sft": _eval_checkpoint(cfg, task, sft_checkpoint),
                  "ppo": _eval_checkpoint(cfg, task, Path(ppo_summary["checkpoint"]))}
    delta = {key: evaluation["ppo"][key] - evaluation["sft"][key]
             for key in evaluation["sft"] if key.endswith("accuracy") or key.startswith("pass@")}
    with open_metrics(cfg, run_dir, "eval") as logger:
        for name, result in evaluation.items():
            logger.log(0, {f"eval/{name}/{k}": v for k, v in result.items() if isinstance(v, float)}, echo=True)
        logger.log(0, {f"eval/delta/{k}": v for k, v in delta.items()}, echo=True)
    write_json_atomic(run_dir / "eval.json", {**evaluation, "delta": delta})
    summary = {"sft": sft_summary, "ppo": ppo_summary, "eval": evaluation, "delta": delta,
               "wall_seconds": time.time() - start}
    write_stage_result(run_dir, cfg, "pipeline", summary)
    return summary


def run_prm(cfg: DictConfig, run_dir: Path) -> dict:
    from prmppo.stages.prm import run_prm_stage

    return run_prm_stage(cfg, run_dir)


STAGE_RUNNERS = {"sft": run_sft, "prm": run_prm, "ppo": run_ppo, "eval": run_eval, "pipeline": run_pipeline}

__all__ = ["STAGE_RUNNERS", "ensure_sft", "train_device"]
