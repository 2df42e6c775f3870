"""Greedy, sampled and pass@k test accuracy split by the task's difficulty (e.g. operands, carries).

    python scripts/accuracy_by_difficulty.py CHECKPOINT_DIR [config overrides ...]
    python scripts/accuracy_by_difficulty.py artifacts/sft-<key> experiment=prm_vs_orm_flaw seed=0
    python scripts/accuracy_by_difficulty.py RUN_DIR [RUN_DIR ...]          # from each run's eval.json
    python scripts/accuracy_by_difficulty.py ... --json out.json             # the tables as JSON too

With a checkpoint (an HF-layout dir), the first `eval.n_problems` test problems of the composed config
(the overrides are those of `python -m prmppo`) are scored as the `eval` stage scores them: greedy,
`eval.k` samples at `eval.temperature`, the same generation seed (`seed`), so the overall line equals
eval.json's. With a run dir (or its eval.json), the per-problem outcomes the pipeline's evaluation
wrote there are grouped instead, for every policy in it (`sft`, `ppo`), nothing generated; the task is
rebuilt from the run's `.hydra/config.yaml` to give each problem its difficulty.

For each policy, one line overall and one per value of each difficulty key (`task.difficulty`: for
arith `operands` and `carries`, the carrying addition steps of the true solution). pass@k is the unbiased
estimator with n = k samples, i.e. the fraction of problems with a right sample.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from prmppo.__main__ import CONF_DIR
from prmppo.config.build import build
from prmppo.config.store import register_schemas
from prmppo.evaluation import generate_texts, pass_at_k
from prmppo.models.loading import check_model_dir, load_model, load_tokenizer


def outcomes_of_checkpoint(checkpoint: str, cfg, task) -> list[dict]:
    """Per test problem: `difficulty`, `greedy_correct`, `correct_of_k`, `k` (the eval stage's sampling)."""
    check_model_dir(checkpoint)
    model, tokenizer = load_model(checkpoint).eval(), load_tokenizer(checkpoint)
    problems = task.problems("test")[: cfg.eval.n_problems]
    prompts = [task.format_prompt(p) for p in problems]
    common = dict(max_new_tokens=cfg.eval.max_new_tokens, batch_rows=cfg.eval.batch_rows, seed=cfg.seed)
    with torch.no_grad():
        greedy = generate_texts(model, tokenizer, prompts, n=1, temperature=0.0, **common)
        sampled = generate_texts(model, tokenizer, prompts, n=cfg.eval.k, temperature=cfg.eval.temperature, **common)
    k = cfg.eval.k
    return [{"difficulty": task.difficulty(p), "greedy_correct": task.verify(p, greedy[i]),
             "correct_of_k": sum(task.verify(p, sampled[i * k + j]) for j in range(k)), "k": k}
            for i, p in enumerate(problems)]


def outcomes_of_run(run: Path) -> dict[str, list[dict]]:
    """{policy: per-problem outcomes} from a run's eval.json, each with the rebuilt task's difficulty."""
    run_dir = run.parent if run.is_file() else run
    evaluation = json.loads((run_dir / "eval.json").read_text())
    task = build(OmegaConf.load(run_dir / ".hydra" / "config.yaml").task, "task")
    problems = task.problems("test")
    out = {}
    for policy, result in evaluation.items():
        if not isinstance(result, dict) or "problems" not in result:
            continue
        out[policy] = [{**row, "difficulty": task.difficulty(problems[row["index"]])} for row in result["problems"]]
    if not out:
        raise SystemExit(f"{run_dir / 'eval.json'} has no per-problem outcomes (`problems`); score its "
                         "checkpoints instead: python scripts/accuracy_by_difficulty.py CHECKPOINT_DIR ...")
    return out


def accuracy(rows: list[dict]) -> dict:
    """`problems`, `greedy`, `sampled` (mean right fraction of k) and `pass@k` over `rows`."""
    k = rows[0]["k"]
    return {"problems": len(rows),
            "greedy": sum(r["greedy_correct"] for r in rows) / len(rows),
            "sampled": sum(r["correct_of_k"] for r in rows) / (k * len(rows)),
            f"pass@{k}": sum(pass_at_k(k, r["correct_of_k"], k) for r in rows) / len(rows)}


def by_difficulty(rows: list[dict]) -> dict:
    """{"all": accuracy, "<key>=<value>": accuracy, ...} for each difficulty key and value."""
    table = {"all": accuracy(rows)}
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in rows:
        for key, value in row["difficulty"].items():
            groups[(key, value)].append(row)
    for key, value in sorted(groups):
        table[f"{key}={value}"] = accuracy(groups[(key, value)])
    return table


def print_table(name: str, table: dict) -> None:
    print(f"{name}")
    for group, acc in table.items():
        cells = " ".join(f"{k}={v:.3f}" for k, v in acc.items() if k != "problems")
        print(f"  {group:<12} problems={acc['problems']:<4} {cells}")


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(__doc__)
    json_out = None
    if "--json" in argv:
        at = argv.index("--json")
        json_out, argv = argv[at + 1], argv[:at] + argv[at + 2:]
    targets = [a for a in argv if "=" not in a]
    overrides = [a for a in argv if "=" in a]
    tables = {}
    for target in targets:
        path = Path(target)
        if (path / "config.json").is_file():  # an HF-layout checkpoint
            register_schemas()
            with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
                cfg = compose(config_name="config", overrides=overrides)
            tables[target] = by_difficulty(outcomes_of_checkpoint(target, cfg, build(cfg.task, "task")))
        else:
            for policy, rows in outcomes_of_run(path).items():
                tables[f"{target}:{policy}"] = by_difficulty(rows)
    for name, table in tables.items():
        print_table(name, table)
    if json_out:
        Path(json_out).write_text(json.dumps(tables, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
