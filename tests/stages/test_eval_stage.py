"""Stage `eval` end to end on a policy that is right part of the time: eval.json holds the numbers an
independent recount gives.

Greedy answers are recounted with transformers' own `generate` (one prompt at a time, no padding), not
prmppo's sampler; sampled answers can only be reproduced through the same seeded sampler, so they are
regenerated with it (`generate_texts`) and only their counting (verify, mean, pass@k) is redone here.
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import pytest
import torch

from conftest import RIGHT_SOMETIMES
from prmppo.app import run
from prmppo.config.build import build
from prmppo.evaluation import generate_texts
from prmppo.models.loading import load_model, load_tokenizer


def _greedy_texts(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    texts = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])  # [1, P]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


def _pass_at(k: int, right: list[bool]) -> float:
    """The fraction of k-subsets of one problem's samples that hold a right one (brute force)."""
    subsets = list(combinations(right, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


@pytest.mark.slow  # the right-sometimes SFT policy (150 steps)
def test_eval_stage_numbers_equal_an_independent_recount(smoke_cfg, right_sometimes_sft, tmp_path):
    # a checkpoint made elsewhere, named on the command line: `python -m prmppo stage=eval eval.checkpoint=...`
    (checkpoint,) = right_sometimes_sft(tmp_path / "elsewhere", 0).values()
    cfg = smoke_cfg("stage=eval", *RIGHT_SOMETIMES, f"eval.checkpoint={checkpoint}", "eval.n_problems=16",
                    "eval.k=4")
    summary = run(cfg)
    run_dir = Path(cfg.run_dir)
    written = json.loads((run_dir / "eval.json").read_text())["checkpoint"]
    assert {k: v for k, v in written.items() if k != "problems"} == summary["checkpoint"]
    assert written["checkpoint"] == str(checkpoint)
    assert json.loads((run_dir / "stage_result.json").read_text())["status"] == "ok"

    task = build(cfg.task, "task")
    problems = task.problems("test")[:16]
    prompts = [task.format_prompt(p) for p in problems]
    model, tokenizer = load_model(checkpoint), load_tokenizer(checkpoint)
    greedy = [task.verify(p, t) for p, t in zip(problems, _greedy_texts(model, tokenizer, prompts,
                                                                         cfg.eval.max_new_tokens))]
    texts = generate_texts(model, tokenizer, prompts, n=4, temperature=cfg.eval.temperature,
                           max_new_tokens=cfg.eval.max_new_tokens, batch_rows=cfg.eval.batch_rows, seed=cfg.seed)
    right = [[task.verify(p, texts[4 * i + j]) for j in range(4)] for i, p in enumerate(problems)]  # prompt-major

    assert written["n_problems"] == 16
    assert written["greedy_accuracy"] == sum(greedy) / 16
    assert written["sampled_accuracy"] == sum(map(sum, right)) / 64
    assert written["pass@4"] == sum(any(row) for row in right) / 16
    assert abs(written["pass@2"] - sum(_pass_at(2, row) for row in right) / 16) < 1e-12
    # each problem's outcomes, in test order, for a bootstrap over prompts; the stage summary leaves them out
    outcomes = written["problems"]
    assert [o["index"] for o in outcomes] == list(range(16)) and len({o["id"] for o in outcomes}) == 16
    assert [o["greedy_correct"] for o in outcomes] == greedy
    assert [o["correct_of_k"] for o in outcomes] == [sum(row) for row in right] and {o["k"] for o in outcomes} == {4}
    assert [o["difficulty"] for o in outcomes] == [task.difficulty(p) for p in problems]
    assert "problems" not in json.loads((run_dir / "stage_result.json").read_text())["summary"]["checkpoint"]
    # right part of the time, so none of the equalities above is 0 == 0 or 1 == 1
    for key in ("greedy_accuracy", "sampled_accuracy", "pass@2", "pass@4"):
        assert 0 < written[key] < 1, key
    # the eval stage logs the same numbers as metrics
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["stage"] == "eval" and row["eval/checkpoint/greedy_accuracy"] == written["greedy_accuracy"]
