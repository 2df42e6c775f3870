"""The outcome reward lands on each row's last real response token, and nowhere else."""

import pytest
import torch

from prmppo.rewards.orm import OutcomeReward, last_token_index, outcome_rewards


def test_last_token_index_of_right_padded_rows():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    assert last_token_index(mask).tolist() == [2, 0, 3]


def test_empty_row_is_refused():
    with pytest.raises(ValueError, match="no tokens"):
        last_token_index(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))


def test_outcome_reward_placement_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    outcome = torch.tensor([1.0, 0.0])
    # row 0 correct -> +1 at index 2; row 1 wrong -> -0.5 at index 1
    expected = torch.tensor([[0, 0, 1.0, 0], [0, -0.5, 0, 0]])
    assert torch.equal(outcome_rewards(outcome, mask, 1.0, -0.5), expected)


class _Batch:
    def __init__(self, outcome, mask):
        self.outcome, self.response_mask = outcome, mask


def test_outcome_reward_weight_scales_and_reports_mean():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    rewards, metrics = OutcomeReward(correct_reward=1.0, wrong_reward=0.0, w_outcome=2.0)(
        _Batch(torch.tensor([1.0, 1.0]), mask))
    assert rewards.total.tolist() == [[0, 2.0, 0], [0, 0, 2.0]]
    assert rewards.terms["outcome"].events.tolist() == [[False, True, False], [False, False, True]]
    assert metrics["reward/outcome_mean"] == 2.0


def test_outcome_reward_has_no_state_to_checkpoint():
    reward = OutcomeReward(seed=5)  # the runner passes every reward the run's seed; this one draws nothing
    assert reward.state_dict() == {}
    reward.load_state_dict({})
    with pytest.raises(ValueError, match=r"holds \['noise_generator'\] but the outcome reward has none"):
        reward.load_state_dict({"noise_generator": torch.zeros(3, dtype=torch.uint8)})
