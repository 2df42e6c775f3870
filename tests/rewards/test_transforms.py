"""Every step-score transform on hand-worked scores; `delta` telescopes, `min_form` is a soft minimum."""

from __future__ import annotations

import math

import pytest
import torch

from prmppo.rewards.transforms import LOG_EPSILON, TRANSFORM_NAMES, apply_transform

# row 0: three steps 0.9, 0.2, 0.6; row 1: two steps 0.5, 1.0 and one padded slot (value 7 must vanish)
SCORES = torch.tensor([[0.9, 0.2, 0.6], [0.5, 1.0, 7.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def _close(got, expected):
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6), got


def test_plain_and_centered():
    _close(apply_transform("plain", SCORES, MASK), [[0.9, 0.2, 0.6], [0.5, 1.0, 0.0]])
    # s - 0.5
    _close(apply_transform("centered", SCORES, MASK), [[0.4, -0.3, 0.1], [0.0, 0.5, 0.0]])


def test_log_is_clamped_at_epsilon():
    got = apply_transform("log", torch.tensor([[0.5, 0.0, 1.0]]), torch.tensor([[True, True, True]]))
    # log 0.5 = -0.693147; log 0 would be -inf: clamped to log(1e-6) = -13.815511; log 1 = 0
    _close(got, [[math.log(0.5), math.log(LOG_EPSILON), 0.0]])
    assert math.log(LOG_EPSILON) == pytest.approx(-13.815511, abs=1e-6)


def test_clip_only_penalises_below_eta():
    # eta = 0.7: min(s - 0.7, 0) -> 0.9: 0, 0.2: -0.5, 0.6: -0.1, 0.5: -0.2, 1.0: 0
    _close(apply_transform("clip", SCORES, MASK, eta=0.7), [[0.0, -0.5, -0.1], [-0.2, 0.0, 0.0]])
    # eta = 1 (the default): every step s - 1
    _close(apply_transform("clip", SCORES, MASK, eta=1.0), [[-0.1, -0.8, -0.4], [-0.5, 0.0, 0.0]])


def test_delta_telescopes_to_the_last_score():
    got = apply_transform("delta", SCORES, MASK)
    # s_0 := 0: row 0: 0.9 - 0, 0.2 - 0.9, 0.6 - 0.2; row 1: 0.5 - 0, 1.0 - 0.5
    _close(got, [[0.9, -0.7, 0.4], [0.5, 0.5, 0.0]])
    # sum over steps = s_K - s_0 = last real score - 0 (row 0: 0.6, row 1: 1.0)
    assert got.sum(-1).tolist() == pytest.approx([0.6, 1.0])
    # inserting a repeated step changes nothing in the return: 0.9, 0.9, 0.2, 0.6 still sums to 0.6
    padded = apply_transform("delta", torch.tensor([[0.9, 0.9, 0.2, 0.6]]), torch.ones(1, 4, dtype=torch.bool))
    assert float(padded.sum()) == pytest.approx(0.6)


def test_min_form_by_hand():
    got = apply_transform("min_form", SCORES, MASK, temperature=0.1)
    # row 1: w = softmax(-[0.5, 1.0] / 0.1) = softmax([-5, -10]) = [1, e^-5] / (1 + e^-5)
    w1 = [1 / (1 + math.exp(-5)), math.exp(-5) / (1 + math.exp(-5))]  # [0.993307, 0.006693]
    # row 0: softmax([-9, -2, -6]) = [e^-7, 1, e^-4] / (1 + e^-7 + e^-4) = [0.000895, 0.981135, 0.017970]
    z = 1 + math.exp(-7) + math.exp(-4)
    w0 = [math.exp(-7) / z, 1 / z, math.exp(-4) / z]
    _close(got, [[w0[0] * 0.9, w0[1] * 0.2, w0[2] * 0.6], [w1[0] * 0.5, w1[1] * 1.0, 0.0]])
    # the return is a soft minimum: row 0 sums to 0.2078 (min 0.2), row 1 to 0.5033 (min 0.5)
    assert got.sum(-1).tolist() == pytest.approx([0.207814, 0.503347], abs=1e-5)
    sharp = apply_transform("min_form", SCORES, MASK, temperature=0.001)
    assert sharp.sum(-1).tolist() == pytest.approx([0.2, 0.5], abs=1e-6)


def test_padded_steps_are_zero_for_every_transform():
    for name in TRANSFORM_NAMES:
        assert float(apply_transform(name, SCORES, MASK, eta=0.5)[1, 2]) == 0.0, name


def test_unknown_transform_names_the_valid_ones():
    with pytest.raises(ValueError, match="reward.transform='sum'.*plain, centered, log, clip, delta, min_form"):
        apply_transform("sum", SCORES, MASK)
