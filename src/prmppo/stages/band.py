"""Stage `band`: each RL prompt's pass rate under the SFT policy, and the band of prompts PPO trains on.

    python -m prmppo stage=band                                   # 2000 train prompts x 8 samples
    python -m prmppo stage=band band.k=16 band.low=0.1 band.high=0.9
    python -m prmppo stage=band debug=smoke                       # seconds
    python -m prmppo band.enabled=true                            # pipeline: sft -> prm -> band -> ppo -> eval
    python -m prmppo stage=ppo band.file=artifacts/band-<key>/band.jsonl   # PPO on a given band

Steps (`ensure_band`):
  1. prompts   the first `band.problems` distinct questions of the task's `train` split, the prompts
               PPO draws from (`ppo/loop.py`);
  2. sample    `band.k` responses per prompt from the SFT checkpoint through the rollout worker
               (`rollout/client.py`, either engine), at PPO's temperature / top_p / max_new_tokens
               unless `band.*` says otherwise: the band is measured with the sampler PPO samples with,
               so its pass rates are the ones PPO's groups will see at iteration 0;
  3. verify    each response with the task's outcome verifier; pass rate = passes / k;
  4. keep      the prompts whose pass rate lies in [band.low, band.high] (default 0.2-0.8, PRIME's
               filter: Cui et al. 2025, "Process Reinforcement through Implicit Rewards"). An
               always-solved prompt gives no signal under a group baseline (every sample scores
               alike), a never-solved one none under an outcome reward;
  5. publish   `pass_rates.jsonl` (every measured prompt) and `band.jsonl` (the kept ones) as the
               `band` artifact, keyed by the SFT checkpoint's config sections and the band's
               measurement keys (`artifacts.py`), with the pass-rate histogram in its summary.

A row: {"problem": the task's question text (its identity in the `train` split), "passes": int,
"k": int, "pass_rate": passes / k, "seed": the run's seed, "checkpoint": the SFT checkpoint dir}.

PPO reads a band (`read_band`) from `band.file` or, with `band.enabled`, from this config's band
artifact (made first when missing); every row is checked against the task (missing field, wrong
type, unknown problem: the file and line named), and a band smaller than one iteration's prompts
(`ppo.prompts_per_iteration`) is refused, before any weights load when the file exists.

Simplifications: the worker serves the SFT checkpoint as its base weights (no LoRA); a question
that appears more than once in the `train` split is measured once and trained on once.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from prmppo import artifacts
from prmppo.config.build import build
from prmppo.distributed.ranks import OneProcess
from prmppo.errors import DataError, DataFileMissing
from prmppo.guards.gates import check_rollout_engine, verifier_receipt
from prmppo.logger.console import progress
from prmppo.models.loading import load_model, load_tokenizer
from prmppo.rollout.protocol import RolloutRequest, WeightsSpec
from prmppo.stages.common import (BAND_FILE, Made, engine_in_process, head_dim, make_or_reuse, open_metrics,
                                  write_stage_result)
from prmppo.stages.sft_training import ensure_sft

log = logging.getLogger("prmppo")

PASS_RATES_FILE = "pass_rates.jsonl"
ROW_TYPES: dict[str, tuple[type, ...]] = {"problem": (str,), "passes": (int,), "k": (int,),
                                          "pass_rate": (int, float), "seed": (int,), "checkpoint": (str,)}
RATE_TOLERANCE = 1e-6  # a pass rate written with fewer digits still matches passes / k
SEED_STREAM = 500_009  # band requests sample with seed * 1_000_003 + SEED_STREAM + i, apart from PPO's iterations

# (prompt token rows, samples per prompt, request index) -> decoded responses, prompt-major
Sampler = Callable[[list[list[int]], int, int], list[str]]


@dataclass(frozen=True)
class BandRow:
    problem: str  # the question text: a problem's identity in the task's `train` split
    passes: int
    k: int
    pass_rate: float  # passes / k
    seed: int
    checkpoint: str


# ------------------------------------------------------------------------------ 1-4. measure


def distinct_train_problems(task, limit: int | None = None) -> list:
    """The first `limit` (default: all) problems of the `train` split with distinct questions, in split order."""
    seen: dict[str, object] = {}
    for problem in task.problems("train"):
        if len(seen) == limit:
            break
        seen.setdefault(problem.question, problem)
    return list(seen.values())


def worker_sampler(engine, tokenizer, *, temperature: float, top_p: float, max_new_tokens: int,
                   seed: int) -> Sampler:
    """A `Sampler` on a started rollout worker client serving its base weights (the checkpoint it loaded)."""
    weights = WeightsSpec(kind="base", path=None, version=0)

    def sample(prompt_ids: list[list[int]], n: int, index: int) -> list[str]:
        result = engine.generate(RolloutRequest(
            request_id=f"band{index:06d}", weights=weights, prompt_token_ids=prompt_ids, n_samples_per_prompt=n,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            seed=seed * 1_000_003 + SEED_STREAM + index, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))
        return [tokenizer.decode(ids, skip_special_tokens=True) for ids in result.token_ids]

    return sample


def measure_pass_rates(task, problems: list, prompt_ids: list[list[int]], sample: Sampler, *, k: int,
                       request_rows: int, seed: int, checkpoint: str, show_progress: bool = False) -> list[BandRow]:
    """One row per problem: how many of `k` sampled responses the task's verifier accepts."""
    per_request = max(1, request_rows // k)
    rows: list[BandRow] = []
    starts = range(0, len(problems), per_request)
    for index, start in enumerate(progress(starts, desc=f"band x{k}", unit="request", enabled=show_progress)):
        chunk = problems[start:start + per_request]
        texts = sample(prompt_ids[start:start + per_request], k, index)  # [len(chunk) * k]
        for i, problem in enumerate(chunk):
            passes = sum(task.verify(problem, text) for text in texts[i * k:(i + 1) * k])
            rows.append(BandRow(problem.question, passes, k, passes / k, seed, checkpoint))
    return rows


def in_band(rows: list[BandRow], low: float, high: float) -> list[BandRow]:
    """The rows whose pass rate lies in [low, high] (both ends kept)."""
    return [row for row in rows if low - RATE_TOLERANCE <= row.pass_rate <= high + RATE_TOLERANCE]


def pass_rate_histogram(rows: list[BandRow], bins: int = 10) -> dict:
    """Prompts per pass-rate bin of width 1 / bins (the last bin holds 1.0), per pass count
    ("passes/k"), and the never- and always-solved counts."""
    counts = [0] * bins
    for row in rows:
        counts[min(int(row.pass_rate * bins + RATE_TOLERANCE), bins - 1)] += 1
    edges = [f"{i / bins:.1f}-{(i + 1) / bins:.1f}" for i in range(bins)]
    by_passes = Counter((row.passes, row.k) for row in rows)
    return {"bins": dict(zip(edges, counts)),
            "by_passes": {f"{passes}/{k}": n for (passes, k), n in sorted(by_passes.items())},
            "never_solved": sum(row.passes == 0 for row in rows),
            "always_solved": sum(row.passes == row.k for row in rows)}


def write_rows(path: Path, rows: list[BandRow]) -> None:
    path.write_text("".join(json.dumps(asdict(row)) + "\n" for row in rows), encoding="utf-8")


# ------------------------------------------------------------------------------ reading a band


@dataclass(frozen=True)
class Band:
    """A validated band file: its rows and their `train` problems, in split order."""

    path: Path
    rows: list[BandRow]
    problems: list

    def summary(self) -> dict:
        """What the PPO banner records: the file, its size, its pass-rate range and where it was measured."""
        rates = [row.pass_rate for row in self.rows]
        return {"file": str(self.path), "size": len(self.rows), "pass_rate_min": min(rates),
                "pass_rate_max": max(rates), "k": sorted({row.k for row in self.rows}),
                "checkpoints": sorted({row.checkpoint for row in self.rows})}


def _row_error(path: Path, line_no: int, what: str) -> DataError:
    return DataError(f"band file {path}: line {line_no}: {what}")


def parse_row(obj: object, path: Path, line_no: int, known: set[str]) -> BandRow:
    """One decoded line as a `BandRow`, or a `DataError` naming the file, the line and what is wrong."""
    if not isinstance(obj, dict):
        raise _row_error(path, line_no, f"expected a JSON object with {sorted(ROW_TYPES)}, got {type(obj).__name__}")
    for key, types in ROW_TYPES.items():
        if key not in obj:
            raise _row_error(path, line_no, f"missing field {key!r} (a row has {', '.join(ROW_TYPES)})")
        if isinstance(obj[key], bool) or not isinstance(obj[key], types):
            raise _row_error(path, line_no, f"field {key!r} must be {' or '.join(t.__name__ for t in types)}, "
                                            f"got {type(obj[key]).__name__} {obj[key]!r}")
    row = BandRow(**{key: obj[key] for key in ROW_TYPES})
    if row.problem not in known:
        raise _row_error(path, line_no, f"problem {row.problem!r} is not a `train` problem of this task")
    if row.k < 1 or not 0 <= row.passes <= row.k or abs(row.pass_rate - row.passes / row.k) > RATE_TOLERANCE:
        raise _row_error(path, line_no, f"passes={row.passes}, k={row.k}, pass_rate={row.pass_rate}: need "
                                        "k >= 1, 0 <= passes <= k and pass_rate = passes / k")
    return row


def read_band(path: Path, task, min_prompts: int) -> Band:
    """Every row of a band file, validated against `task`'s `train` split; refused when it holds fewer
    than `min_prompts` prompts (one PPO iteration's)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise DataFileMissing(f"band file not found: {path} (band.file, or this config's band artifact)")
    train = distinct_train_problems(task)
    known = {p.question for p in train}
    rows, lines = [], {}
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            raise _row_error(path, line_no, f"bad JSON ({error.msg} at column {error.colno})") from None
        row = parse_row(obj, path, line_no, known)
        if row.problem in lines:
            raise _row_error(path, line_no, f"problem {row.problem!r} repeats line {lines[row.problem]}")
        lines[row.problem] = line_no
        rows.append(row)
    if len(rows) < min_prompts:
        raise DataError(f"band file {path} holds {len(rows)} prompts, fewer than ppo.prompts_per_iteration="
                        f"{min_prompts} (one iteration's); widen band.low/band.high or measure more prompts "
                        "(band.problems)")
    return Band(path, rows, [p for p in train if p.question in lines])


def existing_band(cfg: DictConfig, task) -> Band | None:
    """The band PPO will read, when it exists already (`band.file`, or with `band.enabled` this config's
    artifact): read and checked now, before SFT or any weights. None when there is none yet."""
    if cfg.band.file:
        band = read_band(Path(cfg.band.file), task, cfg.ppo.prompts_per_iteration)
        low, high = band.summary()["pass_rate_min"], band.summary()["pass_rate_max"]
        if low < cfg.band.low - RATE_TOLERANCE or high > cfg.band.high + RATE_TOLERANCE:
            log.warning("band file %s holds pass rates %.3g-%.3g, outside band.low=%s .. band.high=%s; PPO draws "
                        "from every row of it", band.path, low, high, cfg.band.low, cfg.band.high)
        return band
    final = artifacts.artifact_dir(cfg, "band")
    if cfg.band.enabled and artifacts.artifact_ready(final):
        return read_band(final / BAND_FILE, task, cfg.ppo.prompts_per_iteration)
    return None


def ppo_band(cfg: DictConfig, task, run_dir: Path, sft_checkpoint: Path, known: Band | None) -> Band | None:
    """The band PPO draws its prompts from: `known` (from `existing_band`), else with `band.enabled` this
    config's band artifact, measured now on `sft_checkpoint`; None means every train prompt."""
    if known is not None:
        measured_on = known.summary()["checkpoints"]
        if str(sft_checkpoint) not in measured_on:
            log.warning("band %s was measured on %s, not on the policy PPO starts from (%s)", known.path,
                        ", ".join(measured_on), sft_checkpoint)
        return known
    if not cfg.band.enabled:
        return None
    path, _ = ensure_band(cfg, task, run_dir, sft_checkpoint, reuse=True)
    return read_band(path, task, cfg.ppo.prompts_per_iteration)


# ------------------------------------------------------------------------------ the stage


def band_gates(cfg: DictConfig, task) -> dict:
    """Before SFT or any weights: the verifier receipt (pass rates are the verifier's word) and the
    rollout engine's interpreter."""
    architecture, source = build(cfg.model, "model source").architecture()
    return {"verifier_receipt": verifier_receipt(task, seed=cfg.seed),
            "rollout_engine": check_rollout_engine(cfg.rollout.engine, cfg.rollout.python, head_dim(architecture),
                                                   source)}


def _measure(cfg: DictConfig, task, run_dir: Path, sft_checkpoint: Path) -> list[BandRow]:
    """Steps 1-3 through the rollout engine on `sft_checkpoint` (a worker, or in process on the model loaded here)."""
    b, tokenizer = cfg.band, load_tokenizer(sft_checkpoint)
    problems = distinct_train_problems(task, b.problems)
    prompt_ids = [tokenizer(task.format_prompt(p))["input_ids"] for p in problems]
    # the in-process engine samples with a model this process holds: the SFT checkpoint, loaded here once
    model = {"model": load_model(sft_checkpoint, cfg.model.dtype, cfg.topology.train_device)} \
        if engine_in_process(cfg) else {}
    client = build(cfg.rollout, "rollout engine", spool_dir=run_dir / "spool",
                   base_model_dir=str(sft_checkpoint), log_path=run_dir / "worker.log",
                   device=cfg.topology.engine_device, dtype=cfg.model.dtype, lora_rank=0, seed=cfg.seed, **model)
    with client as engine:
        sample = worker_sampler(engine, tokenizer, temperature=b.temperature, top_p=b.top_p,
                                max_new_tokens=b.max_new_tokens, seed=cfg.seed)
        return measure_pass_rates(task, problems, prompt_ids, sample, k=b.k, request_rows=b.request_rows,
                                  seed=cfg.seed, checkpoint=str(sft_checkpoint), show_progress=cfg.logger.console)


def band_summary(rows: list[BandRow], kept: list[BandRow], low: float, high: float) -> dict:
    """The measurement's numbers for `stage_result.json`: sizes, mean pass rate, histogram."""
    return {"measured": len(rows), "band_size": len(kept), "band_fraction": len(kept) / max(len(rows), 1),
            "low": low, "high": high, "mean_pass_rate": sum(r.pass_rate for r in rows) / max(len(rows), 1),
            "histogram": pass_rate_histogram(rows)}


def ensure_band(cfg: DictConfig, task, run_dir: Path, sft_checkpoint: Path, reuse: bool) -> tuple[Path, dict]:
    """(this config's band file, summary): reused when `reuse` and the artifact exists, else measured on
    `sft_checkpoint` and published (`make_or_reuse`: under the artifact's build lock, so parallel runs that
    need the same one wait for the first to build it). One process measures it (rank 0 under several ranks,
    while the others wait)."""
    alone = OneProcess(torch.device(cfg.topology.train_device))
    measure = lambda out: _measure_band(cfg, task, run_dir, sft_checkpoint, out)  # noqa: E731
    final, summary = make_or_reuse(cfg, "band", alone, measure, reuse)
    return final / BAND_FILE, summary


def _measure_band(cfg: DictConfig, task, run_dir: Path, sft_checkpoint: Path, final: Path) -> Made:
    """Steps 1-4 on `sft_checkpoint`, logged; `save` writes step 5's files."""
    b = cfg.band
    log.info("measuring pass rates on %s: %d train prompts x %d samples via the %s engine", sft_checkpoint,
             b.problems, b.k, cfg.rollout.engine)
    start = time.time()
    rows = _measure(cfg, task, run_dir, sft_checkpoint)
    kept = in_band(rows, b.low, b.high)
    summary = {"band_file": str(final / BAND_FILE), "sft_checkpoint": str(sft_checkpoint), "k": b.k,
               "engine": cfg.rollout.engine, **band_summary(rows, kept, b.low, b.high),
               "sample_seconds": time.time() - start}
    with open_metrics(cfg, run_dir, "band") as logger:
        histogram = summary["histogram"]
        logger.log(0, {"band/measured": len(rows), "band/size": len(kept), "band/fraction": summary["band_fraction"],
                       "band/mean_pass_rate": summary["mean_pass_rate"],
                       "band/never_solved": histogram["never_solved"], "band/always_solved": histogram["always_solved"],
                       **{f"band/hist_{edge}": n for edge, n in histogram["bins"].items()}}, echo=True)
    if len(kept) < cfg.ppo.prompts_per_iteration:
        log.warning("the band holds %d prompts, fewer than ppo.prompts_per_iteration=%d: PPO will refuse it",
                    len(kept), cfg.ppo.prompts_per_iteration)

    def save(_, tmp: Path) -> None:
        write_rows(tmp / PASS_RATES_FILE, rows)
        write_rows(tmp / BAND_FILE, kept)

    return Made(summary, save)


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Stage `band`: the SFT checkpoint of this config (reused or trained), then a fresh band measurement."""
    start = time.time()
    task = build(cfg.task, "task")
    gates = band_gates(cfg, task)  # refuse in seconds, before SFT or any weights
    sft_checkpoint, _ = ensure_sft(cfg, task, run_dir, reuse=True)
    _, summary = ensure_band(cfg, task, run_dir, sft_checkpoint, reuse=False)
    summary.update(gates=gates, wall_seconds=time.time() - start)
    write_stage_result(run_dir, cfg, "band", summary)
    return summary
