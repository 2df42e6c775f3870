"""Hand-worked checks of the shared LR schedule (prmppo.optim): warmup then cosine to a floor."""

from __future__ import annotations

import pytest
import torch

from prmppo.optim import make_scheduler, warmup_cosine


def test_warmup_cosine_by_hand():
    # total 11, warmup 4, min 0.1: warmup (s+1)/4, cosine over steps 4..10 (6 intervals)
    assert warmup_cosine(0, 11, 4, 0.1) == pytest.approx(0.25)  # 1/4
    assert warmup_cosine(3, 11, 4, 0.1) == pytest.approx(1.0)  # 4/4
    assert warmup_cosine(4, 11, 4, 0.1) == pytest.approx(1.0)  # cos(0) -> 1
    # step 7: progress 3/6 = 0.5 -> 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert warmup_cosine(7, 11, 4, 0.1) == pytest.approx(0.55)
    assert warmup_cosine(10, 11, 4, 0.1) == pytest.approx(0.1)  # progress 1 -> min_ratio
    assert warmup_cosine(11, 11, 4, 0.1) == pytest.approx(0.1)  # past the end
    assert warmup_cosine(3, 4, 4, 0.1) == pytest.approx(1.0)  # total == warmup: no cosine
    assert warmup_cosine(0, 5, 0, 0.0) == pytest.approx(1.0)  # no warmup starts at 1


@pytest.mark.parametrize("args, name", [
    ((0, 0, 0, 0.1), "total_steps=0"),
    ((0, 10, 11, 0.1), "warmup_steps=11"),
    ((0, 10, 2, 1.5), "min_ratio=1.5"),
    ((-1, 10, 2, 0.1), "step=-1"),
])
def test_warmup_cosine_refuses_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        warmup_cosine(*args)


def test_make_scheduler_follows_warmup_cosine():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    scheduler = make_scheduler(optimizer, total_steps=11, warmup_steps=4, min_ratio=0.1)
    lrs = []
    for _ in range(11):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.5)  # 2 * 1/4
    assert lrs[7] == pytest.approx(1.1)  # 2 * 0.55
    assert lrs[10] == pytest.approx(0.2)  # 2 * 0.1
    with pytest.raises(ValueError, match="warmup_steps=20"):
        make_scheduler(optimizer, total_steps=10, warmup_steps=20, min_ratio=0.1)
