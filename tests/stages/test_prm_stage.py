"""Stage `prm`: hand-checked step labels (checker and Monte-Carlo), evaluation maths, a smoke run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from prmppo.validate import ConfigError, validate_config
from prmppo.models.prm import OracleStepScorer
from prmppo.models.tiny import build_char_tokenizer
from prmppo.rewards.steps import StepBoundaries
from prmppo.stages.prm import (train_batch, aggregate, best_of_n_eval, ensure_prm, first_error_f1,
                               reference_cache, run, step_bce, step_level_eval)
from prmppo.models.prm_labels import make_step_labels
from prmppo.tasks import ArithTask
from prmppo.tasks.arith import make_problem

TASK = ArithTask(sft_size=10, train_size=10, test_size=4)
PROBLEM = make_problem([17, 5, 23], ["+", "-"])  # gold "17+5=22\n22-23=-1\nAnswer: -1"
RIGHT = "17+5=22\n22-23=-1\nAnswer: -1"
WRONG_2ND = "17+5=22\n22-23=-2\nAnswer: -2"  # second step wrong


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(TASK.alphabet())


def _stub_sampler(tok, table: dict[str, list[str]]):
    """A sampler whose completions of each prompt text are fixed: table[text] lists n completions."""
    def sample(prompt_rows, n):
        out = []
        for row in prompt_rows:
            completions = table[tok.decode(row, skip_special_tokens=True)]
            assert len(completions) == n
            out.extend(tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in completions)
        return out
    return sample


def _text(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def test_checker_labels_by_hand(tok):
    sampler = _stub_sampler(tok, {"17+5-23\n": [WRONG_2ND]})
    examples = make_step_labels("checker", task=TASK, tokenizer=tok, problems=[PROBLEM], sampler=sampler,
                                samples_per_problem=1, mc_completions=1, estimation="hard",
                                boundaries=StepBoundaries.from_tokenizer(tok, "\n"), rng=random.Random(0))
    sampled, corrupted, gold = examples
    # sampled: "17+5=22\n" (ends at 7) right, "22-23=-2\n" (8..16, ends at 16) wrong -> cut after it
    assert sampled.labels == [1.0, 0.0] and sampled.step_end_positions == [7, 16]
    assert _text(tok, sampled.response_ids) == "17+5=22\n22-23=-2\n"
    assert sampled.prompt_ids == tok("17+5-23\n")["input_ids"]
    # the corrupted gold solution: right steps before the corrupted one (the rng's first draw over the
    # 2 arithmetic steps), which is the last label; the kept text matches gold up to that step
    position = random.Random(0).randrange(2)
    assert corrupted.labels == [1.0] * position + [0.0]
    kept = _text(tok, corrupted.response_ids).split("\n")
    assert kept[:position] == RIGHT.split("\n")[:position] and kept[position] != RIGHT.split("\n")[position]
    # gold: all three steps right, EOS (at 27) closes the answer line
    assert gold.labels == [1.0, 1.0, 1.0] and gold.step_end_positions == [7, 16, 27]


@pytest.mark.parametrize("estimation, right_labels", [("hard", [1.0, 1.0, 1.0]), ("soft", [1.0, 0.5, 1.0])])
def test_monte_carlo_labels_by_hand(tok, estimation, right_labels):
    table = {
        "17+5-23\n": [WRONG_2ND, RIGHT],  # the two sampled responses
        # prefixes after the first step: both completions of it reach -1 (2 of 2)
        "17+5-23\n17+5=22\n": ["22-23=-1\nAnswer: -1", "22-23=-1\nAnswer: -1"],
        # after the wrong second step neither completion reaches -1 (0 of 2): hard 0, soft 0
        "17+5-23\n17+5=22\n22-23=-2\n": ["Answer: -2", "Answer: 5"],
        # after the right second step one of two does (1 of 2): hard 1, soft 0.5
        "17+5-23\n17+5=22\n22-23=-1\n": ["Answer: -1", "Answer: 7"],
    }
    examples = make_step_labels("monte_carlo", task=TASK, tokenizer=tok, problems=[PROBLEM],
                                sampler=_stub_sampler(tok, table), samples_per_problem=2, mc_completions=2,
                                estimation=estimation, boundaries=StepBoundaries.from_tokenizer(tok, "\n"),
                                rng=random.Random(0))
    wrong, right = examples
    # wrong response: step 1 value 2/2 -> 1, step 2 value 0 -> wrong, labels stop there
    assert wrong.labels == [1.0, 0.0] and _text(tok, wrong.response_ids) == "17+5=22\n22-23=-2\n"
    # right response: 1 (2/2), 1 or 0.5 (1/2), and the EOS step is the verifier on the response itself: 1
    assert right.labels == right_labels and right.step_end_positions == [7, 16, 27]


def test_label_source_without_checker_is_refused(tok):
    class NoChecker(ArithTask):
        def check_steps(self, problem, response):
            return None

    with pytest.raises(ValueError, match="label_source=checker.*monte_carlo"):
        make_step_labels("checker", task=NoChecker(sft_size=10, train_size=10, test_size=4), tokenizer=tok,
                         problems=[PROBLEM], sampler=None, samples_per_problem=1, mc_completions=1,
                         estimation="hard", boundaries=StepBoundaries.from_tokenizer(tok, "\n"), rng=random.Random(0))


def test_first_error_f1_and_aggregations_by_hand():
    # erroneous samples (true 2, 3, 1): predicted 2 (hit), 1 (miss), None (miss) -> 1/3; the correct
    # sample (true None) predicted None -> 1.0; F1 = 2 * (1/3) * 1 / (1/3 + 1) = 0.5
    got = first_error_f1([None, 2, 1, None], [None, 2, 3, 1])
    assert got == pytest.approx({"error_accuracy": 1 / 3, "correct_accuracy": 1.0, "first_error_f1": 0.5})
    assert first_error_f1([0], [None])["first_error_f1"] == 0.0
    steps = [0.9, 0.5, 0.8]
    assert [aggregate(steps, how) for how in ("min", "product", "mean", "last")] == pytest.approx(
        [0.5, 0.36, 2.2 / 3, 0.8])


def test_step_bce_weights_wrong_steps_by_hand():
    import torch

    logits, labels = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])
    # terms: ln(1 + e^-2) = 0.126928 (right step, logit 2), ln 2 = 0.693147 (wrong step, logit 0)
    assert float(step_bce(logits, labels)) == pytest.approx((0.126928 + 0.693147) / 2, abs=1e-6)
    # negative_weight 3: weights 1 and 3 -> (0.126928 + 3 * 0.693147) / 4 = 0.551592
    assert float(step_bce(logits, labels, 3.0)) == pytest.approx(0.551592, abs=1e-6)
    # a soft label 0.5 gets weight 1 + 2 * 0.5 = 2; its term at logit 0 is ln 2
    soft = step_bce(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.5]), 3.0)
    assert float(soft) == pytest.approx((0.126928 + 2 * 0.693147) / 3, abs=1e-6)


def _oracle(tok):
    b = StepBoundaries.from_tokenizer(tok, "\n")
    return OracleStepScorer(TASK, tok, b.delimiter_ids, b.eos_token_id, b.blank_ids)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_best_of_n_beats_majority_with_a_perfect_prm(tok):
    wrong_1st = "17+5=21\n21-23=-2\nAnswer: -2"
    # three candidates: one right, two agreeing on the wrong answer -2. Majority vote picks -2
    # (wrong); the oracle PRM's min picks the right one. mean sample accuracy 1/3; oracle 1
    candidates = [[_ids(tok, RIGHT), _ids(tok, wrong_1st), _ids(tok, WRONG_2ND)]]
    got = best_of_n_eval(_oracle(tok), TASK, tok, [PROBLEM], candidates)
    assert got["majority_accuracy"] == 0.0 and got["min_accuracy"] == 1.0 and got["product_accuracy"] == 1.0
    assert got["mean_sample_accuracy"] == pytest.approx(1 / 3) and got["oracle_accuracy"] == 1.0


def test_step_level_eval_perfect_and_constant_scorers(tok):
    problems = TASK.problems("test")[:4]  # problems 1 and 3 are corrupted
    perfect = step_level_eval(_oracle(tok), TASK, tok, problems, random.Random(0))
    assert perfect["step_accuracy"] == 1.0 and perfect["first_error_f1"] == 1.0

    class AlwaysRight:  # scores every step 0.9: right on right steps, wrong on the two wrong ones
        boundaries = StepBoundaries.from_tokenizer(tok, "\n")

        def score(self, batch):
            ends = self.boundaries.mask(batch.response_ids, batch.response_mask)
            return 0.9 * ends.float(), ends

    got = step_level_eval(AlwaysRight(), TASK, tok, problems, random.Random(0))
    assert got["step_accuracy_right_steps"] == 1.0 and got["step_accuracy_wrong_steps"] == 0.0
    assert got["correct_accuracy"] == 1.0 and got["error_accuracy"] == 0.0 and got["first_error_f1"] == 0.0
    assert got["step_accuracy"] == pytest.approx(1 - 2 / got["labelled_steps"])


def test_cached_reference_logprobs_give_the_log_ratio_heads_own_logits(tok):
    """The stage computes the reference's (adapters off) logprobs of every example once, in chunks of other
    widths than a training batch's; the head's logits from them equal those of a reference pass per batch."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from prmppo.models.prm import make_head, new_prm, prm_step_logits
    from prmppo.models.prm_labels import StepExample
    from prmppo.ppo.batch import pad_floats

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128)).eval()
    texts = [RIGHT, WRONG_2ND, "17+5=22\nAnswer: 22", "1+2=3"]
    examples = []
    for text in texts:
        response = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ends = [i for i, t in enumerate(response) if t == tok.convert_tokens_to_ids("\n")] + [len(response) - 1]
        examples.append(StepExample(tok("17+5-23\n")["input_ids"], response, ends, [1.0] * len(ends)))
    peft_model = new_prm(model, r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():
        for q in peft_model.parameters():
            if q.requires_grad:
                q.add_(0.1 * torch.randn(q.shape))  # the adapter has moved: the PRM's LM is not the reference
    cache = reference_cache(peft_model, examples, tok.pad_token_id, torch.device("cpu"), rows=3)
    assert [len(row) for row in cache] == [len(e.response_ids) for e in examples]
    head = make_head("log_ratio", 32, tok)
    picked = [3, 1, 0]
    ids, att, pos, plen, _, mask = train_batch([examples[i] for i in picked], tok.pad_token_id, torch.device("cpu"))
    ref = pad_floats([cache[i] for i in picked], mask.shape[1])
    with torch.no_grad():
        cached = prm_step_logits(peft_model, head, ids, att, pos, plen, mask, ref)[mask]
        fresh = prm_step_logits(peft_model, head, ids, att, pos, plen, mask)[mask]
    assert torch.allclose(cached, fresh, atol=1e-4)
    assert (fresh - fresh.mean()).abs().max() > 1e-2  # the steps differ: equal constants would pass anything


def test_prm_train_keys_are_validated(smoke_cfg):
    cfg = smoke_cfg("prm_train.head=mlp", "prm_train.label_source=human", "prm_train.steps=0")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    message = str(err.value)
    assert "prm_train.head='mlp' is not one of mode_gap, log_ratio, classifier, label_tokens, step_logprobs" in message
    assert "prm_train.label_source='human' is not one of checker, monte_carlo" in message
    assert "prm_train.steps=0 must be > 0" in message
    validate_config(smoke_cfg())  # the shipped smoke preset is valid


def test_prm_stage_smoke_trains_evaluates_publishes_and_reuses(smoke_cfg):
    cfg = smoke_cfg("stage=prm")
    validate_config(cfg)
    summary = run(cfg, Path(cfg.run_dir))
    prm_dir = Path(summary["prm_dir"])
    for name in ("artifact.json", "prm_meta.json", "prm_head.safetensors", "prm/adapter_model.safetensors"):
        assert (prm_dir / name).is_file(), name
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["prm/loss"] for r in rows if "prm/loss" in r]
    assert len(losses) >= 2 and all(loss > 0 for loss in losses)
    result = json.loads((Path(cfg.run_dir) / "stage_result.json").read_text())
    assert result["stage"] == "prm"
    evaluation = result["summary"]["eval"]
    for key in ("step_accuracy", "first_error_f1", "bon/min_accuracy", "bon/majority_accuracy"):
        assert 0.0 <= evaluation[key] <= 1.0, key
    # 6 problems x (2 samples + 1 corrupted + 1 gold)
    assert result["summary"]["labels"]["examples"] == 24
    again, reused = ensure_prm(cfg, None, Path(cfg.run_dir), Path(result["summary"]["sft_checkpoint"]), reuse=True)
    assert again == prm_dir and reused["reused"] is True
