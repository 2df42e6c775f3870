"""Best-of-N of the oracle PRM and the noisy oracles on the SFT policy's samples, beside the learned PRMs.

    python experiments/prm_vs_orm_flaw/oracle_best_of_n.py ARTIFACTS_DIR \
        --out experiments/prm_vs_orm_flaw/oracle_best_of_n.json

The PRM stage evaluates each learned PRM (held-out step accuracy, best-of-N reranking of the SFT policy's
samples); the study's oracle arms (`reward=prm_oracle`, with `reward.label_noise` 0, 0.1 and 0.3) have no PRM
stage, so nothing measured them the same way. Per seed (`--seeds`, default 0-4), on the CPU:

  1. inputs    compose `experiment=prm_vs_orm_flaw seed=S` (the study's task: carry-flaw arithmetic, 200 test
               prompts) and find, in ARTIFACTS_DIR, the artifacts whose `artifact.json` key is that config's:
               the SFT checkpoint, the checker-labelled PRM and the Monte-Carlo-labelled one
               (`prm_train.label_source=monte_carlo`); every seed's are checked before any sampling;
  2. sample    N = `prm_train.best_of_n` candidates per test prompt from the SFT policy with the PRM stage's
               sampler (`PolicySampler`, temperature 1, `prm_train.max_new_tokens`), seeded from the run seed
               under a name of its own (`sample_seed`);
  3. rerank    the same candidates with each scorer through the PRM stage's `best_of_n_eval` (every
               aggregation, majority vote, any of N) and `step_level_eval` (held-out gold and corrupted
               solutions): the two learned PRMs, the exact oracle (`OracleStepScorer`, the checker's verdicts
               as step scores) and the oracle with each step verdict flipped with probability p
               (`NoisyStepScorer`, the rule of `reward.label_noise`), averaged over `--noise-draws` draws.

Simplification: the PRM stage ran on the GPU, whose sampler drew from a CUDA generator after the labelling
samples, so its candidates cannot be drawn again on the CPU; these are fresh candidates from the same policy
and sampler. The checker-labelled PRM's best-of-N here is therefore close to, not equal to, the stage's
recorded `bon/min_accuracy`; both are written. Prints a markdown table (mean ± 95% t half-width over seeds).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import open_dict

from prmppo.__main__ import CONF_DIR
from prmppo.artifacts import MANIFEST, artifact_key
from prmppo.config.build import build
from prmppo.config.store import register_schemas
from prmppo.errors import PrmppoError
from prmppo.models.loading import load_model, load_tokenizer
from prmppo.models.prm import build_step_scorer
from prmppo.models.prm_labels import PolicySampler
from prmppo.report.stats import mean_ci
from prmppo.rewards.steps import to_steps, to_tokens
from prmppo.stages.prm import AGGREGATIONS, best_of_n_eval, step_level_eval

EXPERIMENT = "prm_vs_orm_flaw"
# the PRM artifacts, by the name the study's tables give them, and the overrides that key them
PRMS = {"default": [], "mc": ["prm_train.label_source=monte_carlo"]}
NOISES = (0.1, 0.3)
COLUMNS = (("step_accuracy", "step accuracy"), ("step_accuracy_right_steps", "on right steps"),
           ("step_accuracy_wrong_steps", "on wrong steps"), ("first_error_f1", "first-error F1"),
           *((f"bon/{how}_accuracy", f"best-of-N, {how}") for how in AGGREGATIONS),
           ("bon/majority_accuracy", "majority vote"), ("bon/oracle_accuracy", "any of N right"))
WHAT = {"oracle": "exact step checker", "oracle_noise0.1": "checker, 10% of verdicts flipped",
        "oracle_noise0.3": "checker, 30% of verdicts flipped", "default": "learned PRM, checker labels",
        "mc": "learned PRM, Monte-Carlo labels"}


class InputError(PrmppoError):
    """The artifacts dir or a seed's artifacts are missing or do not match the study's config."""


class MemoStepScorer:
    """`base`'s step scores, each batch of rows scored once: the noisy oracle's draws re-read the checker's
    verdicts of the same held-out solutions and candidates many times over."""

    def __init__(self, base):
        self.base, self.boundaries = base, base.boundaries
        self._seen: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def score(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        key = (tuple(id(p) for p in batch.problems), batch.response_ids.numpy().tobytes(),
               batch.response_mask.numpy().tobytes(), tuple(batch.response_ids.shape))
        if key not in self._seen:
            self._seen[key] = self.base.score(batch)  # [B, T], [B, T] bool
        return self._seen[key]


class NoisyStepScorer:
    """`base`'s step scores with each step's score flipped s -> 1 - s with probability `label_noise`,
    independently per step, from `generator`: the rule of `reward.label_noise` (rewards/prm.py
    `ProcessReward._noise`)."""

    def __init__(self, base, label_noise: float, generator: torch.Generator):
        if not 0.0 <= label_noise <= 1.0:
            raise ValueError(f"label_noise={label_noise} must be in [0, 1]")
        self.base, self.label_noise, self.generator = base, label_noise, generator
        self.boundaries = base.boundaries

    def score(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        scores, ends = self.base.score(batch)  # [B, T], [B, T] bool
        steps, step_mask = to_steps(scores.float(), ends)  # [B, K]
        flip = (torch.rand(steps.shape, generator=self.generator) < self.label_noise) & step_mask  # [B, K]
        return to_tokens(torch.where(flip, 1.0 - steps, steps), step_mask, ends), ends


def compose_study(seed: int, artifacts_dir: Path, extra: list[str] = ()):
    """The study's config for `seed`, as `python -m prmppo experiment=prm_vs_orm_flaw seed=S` composes it."""
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"experiment={EXPERIMENT}", f"seed={seed}", *extra])
    with open_dict(cfg):
        cfg.artifacts_dir = str(artifacts_dir)
    return cfg


def read_manifests(artifacts_dir: Path) -> dict[str, tuple[Path, dict]]:
    """{key: (dir, artifact.json)} of every sealed artifact in `artifacts_dir`."""
    if not artifacts_dir.is_dir():
        raise InputError(f"artifacts dir {artifacts_dir} does not exist: pass the dir holding the study's sft-* "
                         "and prm-* artifacts")
    found = {}
    for manifest in sorted(artifacts_dir.glob(f"*/{MANIFEST}")):
        record = json.loads(manifest.read_text())
        found[record["key"]] = (manifest.parent, record)
    return found


def find_artifacts(artifacts_dir: Path, seeds: list[int]) -> dict[int, dict[str, tuple[Path, dict]]]:
    """{seed: {"sft" | PRM name: (dir, artifact.json)}}: the artifact whose recorded key is the one the study's
    config for that seed gives; every missing one is named before anything is loaded."""
    manifests = read_manifests(artifacts_dir)
    out, missing = {}, []
    for seed in seeds:
        wanted = {"sft": ("sft", compose_study(seed, artifacts_dir))}
        wanted.update({name: ("prm", compose_study(seed, artifacts_dir, extra)) for name, extra in PRMS.items()})
        out[seed] = {}
        for name, (stage, cfg) in wanted.items():
            key, _ = artifact_key(cfg, stage)
            record = manifests.get(key)
            if record is None or record[1]["stage"] != stage:
                missing.append(f"seed {seed}: {name} ({stage}-{key})")
            else:
                out[seed][name] = record
    if missing:
        present = ", ".join(f"{r['stage']}-{k} (seed {r['config']['seed']})" for k, (_, r) in manifests.items())
        raise InputError(f"{artifacts_dir} lacks the artifacts the study's config needs: {'; '.join(missing)}. "
                         f"It holds: {present or 'no sealed artifact'}")
    return out


def sample_seed(seed: int) -> int:
    """The candidates' sampler seed, drawn from the run seed under a name of its own."""
    return random.Random(f"{seed}-oracle-best-of-n").getrandbits(63)


def noise_seed(seed: int, label_noise: float, draw: int) -> int:
    return random.Random(f"{seed}-oracle-best-of-n-noise-{label_noise}-{draw}").getrandbits(63)


def evaluate(scorer, task, tokenizer, problems, candidates, seed: int) -> dict[str, float]:
    """`step_level_eval` (on the same held-out solutions for every scorer of a seed) and `best_of_n_eval`."""
    held_out = random.Random(f"{seed}-oracle-best-of-n-held-out")
    result = step_level_eval(scorer, task, tokenizer, problems, held_out)
    result.update({f"bon/{k}": v for k, v in best_of_n_eval(scorer, task, tokenizer, problems, candidates).items()})
    return result


def mean_over_draws(draws: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(d[k] for d in draws) / len(draws) for k in draws[0]}


def run_seed(seed: int, found: dict[str, tuple[Path, dict]], artifacts_dir: Path, draws: int) -> dict:
    """Steps 2-3 for one seed: {scorer: figures}."""
    cfg = compose_study(seed, artifacts_dir)
    p = cfg.prm_train
    task = build(cfg.task, "task")
    sft_dir = found["sft"][0]
    tokenizer = load_tokenizer(sft_dir)
    problems = task.problems("test")[: p.eval_problems]
    start = time.time()
    sampler = PolicySampler(load_model(sft_dir, cfg.model.dtype), temperature=1.0, max_new_tokens=p.max_new_tokens,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            batch_rows=cfg.eval.batch_rows, seed=sample_seed(seed))
    flat = sampler([tokenizer(task.format_prompt(q))["input_ids"] for q in problems], p.best_of_n)
    candidates = [flat[i * p.best_of_n:(i + 1) * p.best_of_n] for i in range(len(problems))]  # [problems][N]
    print(f"seed {seed}: {len(flat)} candidates sampled in {time.time() - start:.0f} s", file=sys.stderr)
    out = {}
    for name, (prm_dir, _) in ((n, found[n]) for n in PRMS):  # a fresh copy of the SFT model under each PRM
        scorer = build_step_scorer(scorer="learned", task=task, tokenizer=tokenizer,
                                   model=load_model(sft_dir, cfg.model.dtype), prm_dir=prm_dir, chunk_rows=p.chunk_rows)
        out[name] = evaluate(scorer, task, tokenizer, problems, candidates, seed)
        print(f"seed {seed}: PRM {name} scored at {time.time() - start:.0f} s", file=sys.stderr)
    oracle = MemoStepScorer(build_step_scorer(scorer="oracle", task=task, tokenizer=tokenizer, chunk_rows=p.chunk_rows))
    out["oracle"] = evaluate(oracle, task, tokenizer, problems, candidates, seed)
    for noise in NOISES:
        results = []
        for draw in range(draws):
            generator = torch.Generator().manual_seed(noise_seed(seed, noise, draw))
            results.append(evaluate(NoisyStepScorer(oracle, noise, generator), task, tokenizer, problems,
                                    candidates, seed))
        out[f"oracle_noise{noise}"] = {**mean_over_draws(results), "noise_draws": float(draws)}
    print(f"seed {seed}: done in {time.time() - start:.0f} s", file=sys.stderr)
    return out


def table(per_seed: dict[int, dict], recorded: dict[int, dict]) -> str:
    """Markdown: one row per scorer, mean ± 95% t half-width over the seeds; then each learned PRM's best-of-N
    (`min`) here against the one its PRM stage recorded."""
    seeds = sorted(per_seed)
    span = f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))
    lines = ["| scorer | what | seeds | N | " + " | ".join(label for _, label in COLUMNS) + " |",
             "|---|---|---|---|" + "---|" * len(COLUMNS)]
    for name in ("oracle", *(f"oracle_noise{p}" for p in NOISES), *PRMS):
        n = int(per_seed[seeds[0]][name]["bon/best_of_n"])
        cells = [str(mean_ci([per_seed[s][name][key] for s in seeds])) for key, _ in COLUMNS]
        lines.append(f"| `{name}` | {WHAT[name]} | {span} | {n} | " + " | ".join(cells) + " |")
    for name in PRMS:
        here = str(mean_ci([per_seed[s][name]["bon/min_accuracy"] for s in seeds]))
        stage = str(mean_ci([recorded[s][name]["bon/min_accuracy"] for s in seeds]))
        lines.append(f"\n`{name}` best-of-N, min: {here} on these candidates; {stage} as its PRM stage recorded "
                     "(its own candidates)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts_dir", type=Path, help="the study's artifacts dir (sft-* and prm-* artifacts)")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated run seeds")
    parser.add_argument("--noise-draws", type=int, default=20, help="flip draws averaged per noisy oracle")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds={args.seeds!r} is not a comma-separated list of integers")
    if args.noise_draws < 1:
        parser.error(f"--noise-draws={args.noise_draws} must be at least 1")
    return args


def recorded_eval(found: dict[str, tuple[Path, dict]]) -> dict[str, dict[str, float]]:
    """{PRM name: the step accuracies, first-error F1 and best-of-N its PRM stage recorded (artifact.json)}."""
    kept = ("step_accuracy", "step_accuracy_right_steps", "step_accuracy_wrong_steps", "first_error_f1")
    return {name: {k: v for k, v in found[name][1]["summary"]["eval"].items() if k.startswith("bon/") or k in kept}
            for name in PRMS}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    artifacts_dir = args.artifacts_dir.resolve()
    found = find_artifacts(artifacts_dir, args.seeds)  # 1. every seed's inputs, before any sampling
    per_seed = {seed: run_seed(seed, found[seed], artifacts_dir, args.noise_draws) for seed in args.seeds}  # 2-3
    recorded = {seed: recorded_eval(found[seed]) for seed in args.seeds}
    result = {"command": shlex.join(["python", *sys.argv] if argv is None else argv),
              "artifacts": {seed: {name: f"{r['stage']}-{r['key']}" for name, (_, r) in found[seed].items()}
                            for seed in args.seeds},
              "sampling": {"sampler": "PolicySampler", "temperature": 1.0,
                           "seed": "random.Random(f'{seed}-oracle-best-of-n').getrandbits(63)"},
              "noise_draws": args.noise_draws, "recorded_by_prm_stage": recorded, "per_seed": per_seed,
              "table": table(per_seed, recorded)}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(result["table"])
    return result


if __name__ == "__main__":
    main()
