"""`reward=prm_external`: an off-the-shelf PRM's step scores on the policy's step-end tokens.

A scripted PRM (known score per step tag) shows the k-th step's score landing on the policy's k-th step
end, at token positions counted by hand, with a policy tokenizer unlike the PRM's; a tiny random
Math-Shepherd-format checkpoint built here is loaded, checked and scored as a real one would be.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import compose_config, tiny_mistral
from prmppo.app import run
from prmppo.config.build import build
from prmppo.errors import PrmppoError
from prmppo.guards.gates import check_step_scorer
from prmppo.models.external_prm import (ExternalPRMError, ExternalStepScorer, MathShepherdFormat, QwenPRMFormat,
                                        check_external_prm, load_external_scorer)
from prmppo.models.tiny import build_char_tokenizer
from prmppo.tasks.base import Problem
from prmppo.validate import validate_config

POLICY_ALPHABET = "0123456789+-=:\n Aenrsw"
# the PRM's own tokenizer: other characters, other ids, and Math-Shepherd's step tag as one added token
PRM_ALPHABET = "!#$%&()*,./qQ ?:Aenrsw+-=\n0123456789abcdefghijklmnopt"
RESPONSES = ["1+2=3\n3+4=7\nAnswer: 7", "5-1=4\nAnswer: 4"]
# hand-counted: "1+2=3" is 5 characters, so the first "\n" is token 5; "3+4=7" ends with "\n" at 11;
# "Answer: 7" is tokens 12..20 and EOS is token 21, which closes the last step. Row 2: "\n" at 5, EOS at 15.
STEP_ENDS = [[5, 11, 21], [5, 15]]
SCRIPT = [[0.9, 0.2, 0.6], [0.3, 0.8]]  # the scripted PRM's P(good) at each step tag of each row


def policy_tokenizer():
    return build_char_tokenizer(POLICY_ALPHABET)


def prm_tokenizer():
    tokenizer = build_char_tokenizer(PRM_ALPHABET)
    tokenizer.add_tokens(["ки"])
    return tokenizer


def policy_batch(tokenizer):
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in RESPONSES]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # [B, T]
    mask = torch.zeros(len(rows), width)  # [B, T]
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1.0
    problems = [Problem(question=q, solution="", answer="") for q in ("q1?", "q2?")]
    return SimpleNamespace(problems=problems, response_ids=ids, response_mask=mask)


QWEN_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"


def qwen_tokenizer():
    tokenizer = build_char_tokenizer(PRM_ALPHABET)
    tokenizer.add_tokens(["<extra_0>"])
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


class ScriptedPRM(nn.Module):
    """Logits [b, L, width] that put P(good) = SCRIPT[row][k] at the k-th step marker of each row, as log-odds of
    the (good, bad) pair: the LM's `+` / `-` ids for math_shepherd, the head's classes 1 / 0 for qwen_prm."""

    def __init__(self, tag_id: int, good: int, bad: int, width: int, script: list[list[float]]):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the scorer a device to read
        self.tag_id, self.good, self.bad, self.width, self.script = tag_id, good, bad, width, script
        self.rows_seen: list[list[int]] = []

    def forward(self, input_ids, attention_mask):
        logits = torch.zeros(*input_ids.shape, self.width)  # [b, L, width]
        for b, row in enumerate(input_ids.tolist()):
            self.rows_seen.append(row)
            scores = iter(self.script[len(self.rows_seen) - 1])
            for position, token in enumerate(row):
                if token == self.tag_id and attention_mask[b, position]:
                    p = next(scores)
                    logits[b, position, self.good] = math.log(p)
                    logits[b, position, self.bad] = math.log(1 - p)
        return SimpleNamespace(logits=logits)


def scripted(kind: str):
    """(PRM tokenizer, format, scripted model, the PRM text each row must become) of one step format."""
    if kind == "math_shepherd":
        prm = prm_tokenizer()
        tag, good, bad = (prm(t, add_special_tokens=False)["input_ids"][0] for t in ("ки", "+", "-"))
        texts = ["q1? 1+2=3 ки\n3+4=7 ки\nAnswer: 7 ки\n", "q2? 5-1=4 ки\nAnswer: 4 ки\n"]
        return prm, MathShepherdFormat(), ScriptedPRM(tag, good, bad, len(prm), SCRIPT), texts
    prm = qwen_tokenizer()
    tag = prm("<extra_0>", add_special_tokens=False)["input_ids"][0]
    system = QwenPRMFormat().system_prompt
    texts = [f"<|system|>\n{system}\n<|user|>\nq1?\n<|assistant|>\n1+2=3<extra_0>3+4=7<extra_0>Answer: 7<extra_0>\n",
             f"<|system|>\n{system}\n<|user|>\nq2?\n<|assistant|>\n5-1=4<extra_0>Answer: 4<extra_0>\n"]
    return prm, QwenPRMFormat(), ScriptedPRM(tag, 1, 0, 2, SCRIPT), texts


@pytest.mark.parametrize("kind", ["math_shepherd", "qwen_prm"])
@pytest.mark.parametrize("micro_batch_rows", [1, 2])
def test_scripted_step_scores_land_on_hand_counted_policy_tokens(kind, micro_batch_rows):
    policy = policy_tokenizer()
    prm, fmt, model, texts = scripted(kind)
    assert policy("7")["input_ids"] != prm("7")["input_ids"]  # unlike tokenizers: steps travel as text
    scorer = ExternalStepScorer(model, prm, fmt, policy, "\n", micro_batch_rows)
    batch = policy_batch(policy)
    scores, ends = scorer.score(batch)
    assert [row.nonzero().squeeze(-1).tolist() for row in ends] == STEP_ENDS
    expected = torch.zeros(scores.shape)
    for row, (positions, values) in enumerate(zip(STEP_ENDS, SCRIPT)):
        expected[row, positions] = torch.tensor(values)
    torch.testing.assert_close(scores, expected)
    # what the PRM read: each response rebuilt in the format (characters outside its alphabet read as <unk>)
    for row, text in zip(model.rows_seen, texts):
        ids = prm(text)["input_ids"]
        assert row[:len(ids)] == ids and all(t == prm.pad_token_id for t in row[len(ids):])


def test_a_step_holding_the_tag_is_refused():
    policy, prm = policy_tokenizer(), prm_tokenizer()
    scorer = ExternalStepScorer(ScriptedPRM(0, 1, 2, len(prm), SCRIPT), prm, MathShepherdFormat(), policy, "\n", 2)
    with pytest.raises(ExternalPRMError, match="holds 3 step tags for 2 steps"):
        scorer._encode("q", ["a ки", "b"])


@pytest.fixture(scope="module")
def shepherd_dir(tmp_path_factory):
    """A tiny random causal LM with the PRM tokenizer, saved as a Math-Shepherd-format checkpoint."""
    out = tmp_path_factory.mktemp("shepherd") / "prm"
    prm = prm_tokenizer()
    tiny_mistral(len(prm), seed=3).save_pretrained(out)
    prm.save_pretrained(out)
    return out


def test_a_tiny_math_shepherd_checkpoint_scores_like_its_own_forward(shepherd_dir):
    policy = policy_tokenizer()
    scorer = load_external_scorer(str(shepherd_dir), "math_shepherd", "cpu", "float32", policy, "\n", 1)
    batch = policy_batch(policy)
    scores, ends = scorer.score(batch)
    prm = scorer.tokenizer
    tag, good, bad = (prm(t, add_special_tokens=False)["input_ids"][0] for t in ("ки", "+", "-"))
    for row, steps in enumerate([["1+2=3", "3+4=7", "Answer: 7"], ["5-1=4", "Answer: 4"]]):
        ids = prm(f"{batch.problems[row].question} " + "".join(f"{s} ки\n" for s in steps), return_tensors="pt")
        with torch.no_grad():
            logits = scorer.model(**ids).logits[0]  # [L, V]
        at_tags = ids["input_ids"][0] == tag
        by_hand = logits[at_tags][:, [good, bad]].softmax(-1)[:, 0]  # [steps]
        torch.testing.assert_close(scores[row, STEP_ENDS[row]], by_hand)
        assert (scores[row][~ends[row]] == 0).all() and ((by_hand > 0) & (by_hand < 1)).all()
    # micro-batches of two rows (right padding) give the same scores
    two = load_external_scorer(str(shepherd_dir), "math_shepherd", "cpu", "float32", policy, "\n", 2)
    torch.testing.assert_close(two.score(batch)[0], scores, atol=1e-5, rtol=1e-5)


def save_tiny_qwen_prm(out, head_classes: int = 2, template: bool = True):
    """A tiny random Qwen2 base and a Linear-ReLU-Linear score head, saved in Qwen2.5-Math-PRM's layout
    (`model.*` and `score.*` tensors, architectures Qwen2ForProcessRewardModel)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2Model

    prm = qwen_tokenizer()
    if not template:
        prm.chat_template = None
    config = Qwen2Config(vocab_size=len(prm), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         architectures=["Qwen2ForProcessRewardModel"], pad_token_id=prm.pad_token_id,
                         eos_token_id=prm.eos_token_id)
    torch.manual_seed(5)
    base = Qwen2Model(config)
    head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, head_classes))
    tensors = {f"model.{k}": v.contiguous() for k, v in base.state_dict().items()}
    tensors.update({f"score.{k}": v.contiguous() for k, v in head.state_dict().items()})
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    prm.save_pretrained(out)
    return out, base.eval(), head.eval()


def test_a_tiny_qwen_prm_checkpoint_scores_like_its_own_head(tmp_path):
    out, base, head = save_tiny_qwen_prm(tmp_path / "qwen_prm")
    policy = policy_tokenizer()
    scorer = load_external_scorer(str(out), "qwen_prm", "cpu", "float32", policy, "\n", 2)
    batch = policy_batch(policy)
    scores, ends = scorer.score(batch)
    prm, fmt = scorer.tokenizer, scorer.format
    separator = prm("<extra_0>", add_special_tokens=False)["input_ids"][0]
    for row, steps in enumerate([["1+2=3", "3+4=7", "Answer: 7"], ["5-1=4", "Answer: 4"]]):
        ids = prm(fmt.text(prm, batch.problems[row].question, steps), return_tensors="pt")
        with torch.no_grad():
            logits = head(base(**ids).last_hidden_state)[0]  # [L, 2]
        by_hand = logits[ids["input_ids"][0] == separator].softmax(-1)[:, 1]  # [steps]
        torch.testing.assert_close(scores[row, STEP_ENDS[row]], by_hand)
        assert (scores[row][~ends[row]] == 0).all()
    wrong_head, _, _ = save_tiny_qwen_prm(tmp_path / "three_classes", head_classes=3)
    with pytest.raises(ExternalPRMError, match=r"qwen_prm needs a two-class score head .* the checkpoint holds"):
        check_external_prm(str(wrong_head), "qwen_prm")
    no_template, _, _ = save_tiny_qwen_prm(tmp_path / "no_template", template=False)
    with pytest.raises(ExternalPRMError, match=r"qwen_prm needs the PRM tokenizer's chat template"):
        check_external_prm(str(no_template), "qwen_prm")


def test_a_checkpoint_without_the_format_markers_is_refused(tmp_path):
    out = tmp_path / "not_shepherd"
    plain = build_char_tokenizer(PRM_ALPHABET)  # no "ки" token: the tag would be two characters
    tiny_mistral(len(plain)).save_pretrained(out)
    plain.save_pretrained(out)
    with pytest.raises(ExternalPRMError, match=r"the step tag 'ки' is 2 tokens of this PRM's tokenizer"):
        check_external_prm(str(out), "math_shepherd")
    with pytest.raises(ExternalPRMError, match=r"reward.format='qwen' is not one of math_shepherd, qwen_prm"):
        check_external_prm(str(out), "qwen")
    with pytest.raises(PrmppoError, match="does not exist"):
        check_external_prm(str(tmp_path / "nowhere"), "math_shepherd")


def test_reward_prm_external_composes_and_its_gate_reads_the_checkpoint(shepherd_dir):
    cfg = compose_config(["arm=prm", "reward=prm_external", f"reward.path={shepherd_dir}", "reward.dtype=float32"])
    validate_config(cfg)
    reward = build(cfg.reward, "reward", seed=0)
    assert reward.needs_step_scorer and not reward.needs_learned_prm and not reward.needs_step_checker
    gate = check_step_scorer(None, reward)
    assert gate == {"step_scores": "external PRM", "path": str(shepherd_dir), "format": "math_shepherd"}
    missing = compose_config(["arm=prm", "reward=prm_external"])
    with pytest.raises(PrmppoError, match="reward.path is not set"):
        validate_config(missing)
    bad = compose_config(["arm=prm", "reward=prm_external", f"reward.path={shepherd_dir}", "reward.format=qwen",
                          "reward.dtype=fp8"])
    with pytest.raises(PrmppoError, match=r"reward.format='qwen' is not one of math_shepherd.*"
                                          r"reward.dtype='fp8' is not one of"):
        validate_config(bad)  # at launch, from the lists of models/external_prm.py and models/loading.py


def test_ppo_stage_takes_its_step_rewards_from_the_external_prm(smoke_cfg, shepherd_dir):
    # the embedded default (arith, a char-tokenizer tiny policy) with the tiny Math-Shepherd checkpoint as the PRM
    cfg = smoke_cfg("stage=ppo", "arm=prm", "reward=prm_external", f"reward.path={shepherd_dir}", "reward.dtype=float32",
                    "reward.micro_batch_rows=3")
    summary = run(cfg)
    run_dir, artifacts_dir = Path(cfg.run_dir), Path(cfg.artifacts_dir)
    assert json.loads((run_dir / "stage_result.json").read_text())["status"] == "ok" and summary
    banner = json.loads((run_dir / "banner.json").read_text())
    assert banner["gates"]["step_scorer"] == {"step_scores": "external PRM", "path": str(shepherd_dir),
                                              "format": "math_shepherd"}
    assert banner["gates"]["prm_labels"] == {"prm_labels": "none (no learned PRM)"}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ppo = [row for row in rows if row["stage"] == "ppo"]
    assert [r["step"] for r in ppo] == [0, 1]
    # a random PRM's P(good) is strictly inside (0, 1) at every step end
    assert all(0 < r["prm/score_mean"] < 1 and "reward/prm_mean" in r for r in ppo)
    assert not list(artifacts_dir.glob("prm-*"))  # no PRM was trained


def test_math_shepherd_experiment_takes_a_public_prm_instead_of_training_one(shepherd_dir):
    cfg = compose_config(["experiment=math_shepherd_gsm8k", "model.path=/nonexistent/checkpoint", "arm=prm",
                          "reward=prm_external", f"reward.path={shepherd_dir}"])
    validate_config(cfg)
    assert cfg.task._target_.endswith("GSM8KTask") and cfg.reward.format == "math_shepherd"
    assert not build(cfg.reward, "reward", seed=0).needs_learned_prm  # the pipeline trains no PRM


def test_stage_prm_evaluates_an_external_prm_like_a_trained_one(smoke_cfg, shepherd_dir):
    cfg = smoke_cfg("stage=prm", "reward=prm_external", f"reward.path={shepherd_dir}", "reward.dtype=float32")
    summary = run(cfg)
    result = summary["eval"]
    assert summary["external_prm"] == {"path": str(shepherd_dir), "format": "math_shepherd"}
    # arith has an exact step checker: step accuracy against true labels, and best-of-N against majority vote
    assert result["labelled_steps"] > 0 and 0 <= result["step_accuracy"] <= 1 and "first_error_f1" in result
    assert result["bon/best_of_n"] == cfg.prm_train.best_of_n
    assert {"bon/min_accuracy", "bon/product_accuracy", "bon/majority_accuracy"} <= set(result)
    assert not list(Path(cfg.artifacts_dir).glob("prm-*"))  # nothing trained, nothing published
    assert json.loads((Path(cfg.run_dir) / "stage_result.json").read_text())["stage"] == "prm"
