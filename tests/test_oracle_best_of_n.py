"""experiments/prm_vs_orm_flaw/oracle_best_of_n.py: the oracle's and the noisy oracles' scoring, on hand-made
candidates, and its refusal of missing artifacts."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch

from conftest import REPO
from prmppo.artifacts import artifact_key
from prmppo.models.prm import build_step_scorer
from prmppo.models.tiny import build_char_tokenizer
from prmppo.stages.prm import ScoreRows, best_of_n_eval, step_level_eval
from prmppo.tasks import ArithTask
from prmppo.tasks.arith import make_problem

spec = importlib.util.spec_from_file_location(
    "oracle_best_of_n", REPO / "experiments" / "prm_vs_orm_flaw" / "oracle_best_of_n.py")
oracle_best_of_n = importlib.util.module_from_spec(spec)
spec.loader.exec_module(oracle_best_of_n)

TASK = ArithTask(sft_size=10, train_size=10, test_size=4)
FIRST = make_problem([17, 5, 23], ["+", "-"])  # 17+5=22, 22-23=-1
SECOND = make_problem([8, 9, 4], ["+", "+"])  # 8+9=17, 17+4=21


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(TASK.alphabet())


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def _oracle(tok):
    return build_step_scorer(scorer="oracle", task=TASK, tokenizer=tok, chunk_rows=4)


def _candidates(tok) -> list[list[list[int]]]:
    """Per problem: two candidates agreeing on a wrong answer, then the gold solution (every step right) last, so
    that majority vote and a pick of the first candidate are both wrong on each problem."""
    first = ["17+5=21\n21-23=-2\nAnswer: -2", "17+5=22\n22-23=-2\nAnswer: -2", FIRST.solution]
    second = ["8+9=7\n7+4=11\nAnswer: 11", "8+9=7\n7+4=11\nAnswer: 11", SECOND.solution]
    return [[_ids(tok, t) for t in first], [_ids(tok, t) for t in second]]


def test_exact_oracle_picks_the_all_right_candidate_as_often_as_any_of_n(tok):
    got = best_of_n_eval(oracle_best_of_n.MemoStepScorer(_oracle(tok)), TASK, tok, [FIRST, SECOND], _candidates(tok))
    assert got["oracle_accuracy"] == 1.0 and got["majority_accuracy"] == 0.0
    assert got["min_accuracy"] == got["oracle_accuracy"] and got["product_accuracy"] == 1.0


def _rows(tok) -> ScoreRows:
    problems = [FIRST] * 3 + [SECOND] * 3
    prompts = [tok(TASK.format_prompt(p))["input_ids"] for p in problems]
    return ScoreRows.build(problems, prompts, [c for row in _candidates(tok) for c in row], tok.pad_token_id)


def test_noise_one_flips_every_verdict_and_noise_zero_none(tok):
    rows, oracle = _rows(tok), _oracle(tok)
    exact, ends = oracle.score(rows)  # [6, T]
    for noise, expected in ((1.0, torch.where(ends, 1.0 - exact, exact)), (0.0, exact)):
        noisy = oracle_best_of_n.NoisyStepScorer(oracle, noise, torch.Generator().manual_seed(0))
        scores, noisy_ends = noisy.score(rows)
        assert torch.equal(noisy_ends, ends) and torch.equal(scores, expected)
    # every verdict flipped: no held-out step is judged right, and best-of-N prefers the wrong chains
    flipped = oracle_best_of_n.NoisyStepScorer(oracle, 1.0, torch.Generator().manual_seed(0))
    held_out = step_level_eval(flipped, TASK, tok, TASK.problems("test")[:4], random.Random(0))
    assert held_out["step_accuracy"] == 0.0
    assert best_of_n_eval(flipped, TASK, tok, [FIRST, SECOND], _candidates(tok))["min_accuracy"] == 0.0


def test_memo_scores_each_batch_once(tok):
    calls = []

    class Counting:
        boundaries = _oracle(tok).boundaries

        def score(self, batch):
            calls.append(len(batch.problems))
            return _oracle(tok).score(batch)

    memo = oracle_best_of_n.MemoStepScorer(Counting())
    first = memo.score(_rows(tok))
    second = memo.score(_rows(tok))  # a new ScoreRows of the same rows
    assert calls == [6] and all(torch.equal(a, b) for a, b in zip(first, second))


def test_missing_artifacts_are_named_before_any_sampling(tmp_path):
    with pytest.raises(oracle_best_of_n.InputError, match="does not exist"):
        oracle_best_of_n.find_artifacts(tmp_path / "absent", [0])
    # seed 0's SFT checkpoint alone: both of its PRMs are named missing, the SFT checkpoint is not
    key, sections = artifact_key(oracle_best_of_n.compose_study(0, tmp_path), "sft")
    (tmp_path / f"sft-{key}").mkdir()
    (tmp_path / f"sft-{key}" / "artifact.json").write_text(
        json.dumps({"stage": "sft", "key": key, "config": sections, "summary": {}}))
    with pytest.raises(oracle_best_of_n.InputError) as refused:
        oracle_best_of_n.find_artifacts(tmp_path, [0])
    message = str(refused.value)
    assert "seed 0: default (prm-" in message and "seed 0: mc (prm-" in message and "seed 0: sft" not in message
