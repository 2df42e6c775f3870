"""ProcessReward: step rewards land on step ends, the outcome on the last token; noise and monitors."""

from __future__ import annotations

import pytest
import torch

from prmppo.models.prm import OracleStepScorer
from prmppo.models.tiny import build_char_tokenizer
from prmppo.ppo.batch import RolloutBatch, collate
from prmppo.rewards.prm import ProcessReward
from prmppo.rewards.steps import StepBoundaries
from prmppo.tasks import ArithTask
from prmppo.tasks.arith import make_problem


class _StubScorer:
    """Fixed scores at fixed step ends (rows of length 4 and 3)."""

    def __init__(self, tok):
        self.boundaries = StepBoundaries.from_tokenizer(tok, "\n")
        self.ends = torch.tensor([[False, True, False, True], [False, False, True, False]])
        self.scores = torch.tensor([[0.0, 0.8, 0.0, 0.4], [0.0, 0.0, 0.9, 0.0]])

    def score(self, batch):
        return self.scores.clone(), self.ends.clone()


TASK = ArithTask(sft_size=10, train_size=10, test_size=4)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(TASK.alphabet())


def _batch(tok, problems, texts, eos=True):
    prompts = [tok("1+2\n")["input_ids"] for _ in texts]
    rows = [tok(t, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else []) for t in texts]
    ids, att, pos, resp, mask, plen = collate(prompts, rows, tok.pad_token_id)
    outcome = torch.tensor([float(p is not None and p.answer == TASK.extract_answer(t)) for p, t in zip(problems, texts)])
    return RolloutBatch(problems, texts, ["stop"] * len(texts), ids, att, pos, resp, mask,
                        torch.zeros(resp.shape), outcome, plen)


def _hand_batch(tok):
    # response mask: row 0 has 4 tokens, row 1 has 3; row 0 wrong, row 1 right
    batch = _batch(tok, [None, None], ["123", "12"])
    batch.outcome = torch.tensor([0.0, 1.0])
    return batch


def test_plain_placement_and_weights_by_hand(tok):
    reward = ProcessReward(transform="plain", w_prm=0.5, w_outcome=2.0, correct_reward=1.0, wrong_reward=-1.0,
                           step_scorer=_StubScorer(tok))
    rewards, metrics = reward(_hand_batch(tok))
    # row 0: 0.5 * 0.8 = 0.4 at 1; 0.5 * 0.4 + 2.0 * (-1) = -1.8 at 3 (last token: step end + outcome)
    # row 1: 0.5 * 0.9 + 2.0 * 1 = 2.45 at 2
    assert torch.allclose(rewards.total, torch.tensor([[0.0, 0.4, 0.0, -1.8], [0.0, 0.0, 2.45, 0.0]]))
    # the two terms apart, each with the tokens where it pays: step ends, and the last token
    process, outcome = rewards.terms["process"], rewards.terms["outcome"]
    assert torch.allclose(process.values, torch.tensor([[0.0, 0.4, 0.0, 0.2], [0.0, 0.0, 0.45, 0.0]]))
    assert process.events.tolist() == [[False, True, False, True], [False, False, True, False]]
    assert torch.allclose(outcome.values, torch.tensor([[0.0, 0.0, 0.0, -2.0], [0.0, 0.0, 2.0, 0.0]]))
    assert outcome.events.tolist() == [[False, False, False, True], [False, False, True, False]]
    assert metrics["prm/score_mean"] == pytest.approx((0.8 + 0.4 + 0.9) / 3)  # 0.7
    assert metrics["reward/prm_mean"] == pytest.approx(((0.4 + 0.2) + 0.45) / 2)  # 0.525
    assert metrics["reward/outcome_mean"] == pytest.approx((-2.0 + 2.0) / 2)  # 0
    assert metrics["hack/prm_score_minus_accuracy"] == pytest.approx(0.7 - 0.5)


def test_delta_transform_is_placed_step_by_step(tok):
    reward = ProcessReward(transform="delta", w_prm=1.0, w_outcome=0.0, step_scorer=_StubScorer(tok))
    rewards, _ = reward(_hand_batch(tok))
    # row 0: 0.8 - 0 at 1, 0.4 - 0.8 = -0.4 at 3; row 1: 0.9 - 0 at 2
    assert torch.allclose(rewards.total, torch.tensor([[0.0, 0.8, 0.0, -0.4], [0.0, 0.0, 0.9, 0.0]]))


def test_label_noise_flips_seeded(tok):
    always = ProcessReward(w_outcome=0.0, label_noise=1.0, step_scorer=_StubScorer(tok))
    rewards, metrics = always(_hand_batch(tok))
    # every score flipped: 1 - 0.8 = 0.2, 1 - 0.4 = 0.6, 1 - 0.9 = 0.1
    assert torch.allclose(rewards.total, torch.tensor([[0.0, 0.2, 0.0, 0.6], [0.0, 0.0, 0.1, 0.0]]))
    assert metrics["prm/flipped_fraction"] == 1.0
    runs = [ProcessReward(w_outcome=0.0, label_noise=0.5, step_scorer=_StubScorer(tok), seed=s)(_hand_batch(tok))[0].total
            for s in (3, 3)]
    assert torch.equal(runs[0], runs[1])


def _noisy(tok, seed: int) -> ProcessReward:
    return ProcessReward(w_outcome=0.0, label_noise=0.5, step_scorer=_StubScorer(tok), seed=seed)


def _noise_trace(reward: ProcessReward, tok, calls: int) -> list[tuple[float, float]]:
    """(mean step score after noise, flipped fraction) of `calls` calls on the hand batch, as PPO
    iterations would log them. Its 3 steps score 0.8, 0.4, 0.9: flipping a different set of steps
    changes the mean except for {0.8} vs {0.4, 0.9} (both -0.2)."""
    traced = [reward(_hand_batch(tok))[1] for _ in range(calls)]
    return [(m["prm/score_mean"], m["prm/flipped_fraction"]) for m in traced]


def test_label_noise_flips_differ_by_run_seed(tok):
    seed_0, seed_1 = _noise_trace(_noisy(tok, 0), tok, 8), _noise_trace(_noisy(tok, 1), tok, 8)
    assert 0.0 < sum(flipped for _, flipped in seed_0) / 8 < 1.0  # p = 0.5 flips some steps and keeps others
    assert seed_0 == _noise_trace(_noisy(tok, 0), tok, 8)  # the seed fixes the flips
    # 8 calls x 3 steps: two independent seeds flip the same steps with probability 2^-24
    assert seed_0 != seed_1


def test_label_noise_state_round_trip_continues_the_flips(tok):
    uninterrupted = _noisy(tok, 3)
    _noise_trace(uninterrupted, tok, 2)  # two iterations before the "checkpoint"
    state = uninterrupted.state_dict()
    after = _noise_trace(uninterrupted, tok, 6)
    resumed = _noisy(tok, 3)
    resumed.load_state_dict(state)
    assert _noise_trace(resumed, tok, 6) == after
    # a relaunch without the state restarts the stream and flips other steps
    assert _noise_trace(_noisy(tok, 3), tok, 6) != after


def test_label_noise_state_is_empty_without_noise_and_must_fit(tok):
    assert ProcessReward(label_noise=0.0).state_dict() == {}
    ProcessReward(label_noise=0.0).load_state_dict({})
    with pytest.raises(ValueError, match=r"holds \[\] but reward.label_noise=0.5 needs \['noise_generator'\]"):
        _noisy(tok, 3).load_state_dict({})
    with pytest.raises(ValueError, match=r"reward.label_noise=0.0 needs \[\]"):
        ProcessReward(label_noise=0.0).load_state_dict(_noisy(tok, 3).state_dict())


def test_needs_learned_prm_and_missing_scorer(tok):
    assert ProcessReward(scorer="learned").needs_learned_prm is True
    assert ProcessReward(scorer="oracle").needs_learned_prm is False
    # the likelihood control scores steps with the SFT model itself: no PRM stage, no checker
    control = ProcessReward(scorer="likelihood_control")
    assert (control.needs_step_scorer, control.needs_learned_prm, control.needs_step_checker) == (True, False, False)
    assert ProcessReward(scorer="oracle").needs_step_checker is True
    with pytest.raises(RuntimeError, match="without a step scorer"):
        ProcessReward()(_hand_batch(tok))
    with pytest.raises(ValueError, match="reward.scorer='exact' is not one of learned, oracle, likelihood_control"):
        ProcessReward(scorer="exact")
    with pytest.raises(ValueError, match="reward.label_noise=1.5"):
        ProcessReward(label_noise=1.5)


def test_hacking_monitors_by_hand(tok):
    reward = ProcessReward(w_outcome=0.0, step_scorer=_StubScorer(tok))
    batch = _batch(tok, [None, None], ["1\n1\n2", "5"])
    reward.step_scorer.ends = reward.step_scorer.boundaries.mask(batch.response_ids, batch.response_mask)
    reward.step_scorer.scores = reward.step_scorer.ends.float()
    _, m = reward(batch)
    # row 0 "1\n1\n2</s>": 6 tokens, steps "1" | "1" | "2" (the second "1" repeats); row 1 "5</s>": 2 tokens,
    # one step, no delimiter. 4 steps, 8 tokens.
    assert m["hack/steps_per_response"] == pytest.approx(2.0)
    assert m["hack/tokens_per_step"] == pytest.approx(8 / 4)
    assert m["hack/no_delimiter_fraction"] == pytest.approx(0.5)
    assert m["hack/repeated_line_rate"] == pytest.approx(1 / 4)
    assert "hack/true_step_accuracy" not in m  # no task given: no checker to compare with


def test_oracle_scores_match_the_checker_and_the_gap_is_zero(tok):
    task = TASK
    problem = make_problem([17, 5, 23], ["+", "-"])  # 17+5=22, 22-23=-1
    texts = [problem.solution, "17+5=22\n22-23=-2\nAnswer: -2", "17+5=21\n21-23=-2\nAnswer: -2"]
    batch = _batch(tok, [problem] * 3, texts)
    boundaries = StepBoundaries.from_tokenizer(tok, "\n")
    scorer = OracleStepScorer(task, tok, boundaries.delimiter_ids, tok.eos_token_id, boundaries.blank_ids)
    reward = ProcessReward(scorer="oracle", w_outcome=0.0, step_scorer=scorer, task=task)
    rewards, m = reward(batch)
    ends = boundaries.mask(batch.response_ids, batch.response_mask)
    # check_steps: gold [1, 1, 1]; second step wrong [1, 0, 0]; first step wrong [0, 0, 0]
    assert [rewards.total[b][ends[b]].tolist() for b in range(3)] == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert m["hack/true_step_accuracy"] == pytest.approx(4 / 9)
    assert m["hack/prm_vs_true_step_gap"] == pytest.approx(0.0, abs=1e-6)  # float32 mean vs exact 4/9
    assert m["hack/prm_score_minus_accuracy"] == pytest.approx(4 / 9 - 1 / 3)  # only the gold one verifies
