"""Greedy and sampled test accuracy of a checkpoint, split by operand count (arith task).

    python scripts/accuracy_by_operands.py CHECKPOINT_DIR [config overrides ...]
    python scripts/accuracy_by_operands.py artifacts/sft-<key> task.rl.min_operands=4 task.rl.max_operands=6

The overrides are those of `python -m prmppo` (the task, `eval.k`, `eval.temperature`, `seed`);
each operand count's test problems go through `prmppo.evaluation.score`, the `eval` stage's
scorer. Prints one line per operand count.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from hydra import compose, initialize_config_dir

from prmppo.__main__ import CONF_DIR
from prmppo.config.build import build
from prmppo.config.store import register_schemas
from prmppo.evaluation import score
from prmppo.models.loading import check_model_dir, load_model, load_tokenizer


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    checkpoint, overrides = argv[0], argv[1:]
    check_model_dir(checkpoint)
    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    task = build(cfg.task, "task")
    by_count = defaultdict(list)
    for problem in task.problems("test"):
        by_count[sum(problem.question.count(op) for op in "+-*") + 1].append(problem)
    model, tokenizer = load_model(checkpoint).eval(), load_tokenizer(checkpoint)
    for count in sorted(by_count):
        result = score(model, tokenizer, task, by_count[count], k=cfg.eval.k, temperature=cfg.eval.temperature,
                       max_new_tokens=cfg.eval.max_new_tokens, batch_rows=cfg.eval.batch_rows, seed=cfg.seed)
        print(f"operands={count} problems={len(by_count[count])} greedy={result['greedy_accuracy']:.3f} "
              f"sampled={result['sampled_accuracy']:.3f} (k={cfg.eval.k}, T={cfg.eval.temperature})")


if __name__ == "__main__":
    main(sys.argv[1:])
