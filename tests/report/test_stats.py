"""prmppo.report.stats, the helpers of a pre-registered comparison: each against numbers worked out by hand
(the derivation beside the assert), and the t-based ones also against scipy's own tests."""

from __future__ import annotations

import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from prmppo.report.stats import (curve_area, holm, outcome_grid, paired_difference, paired_t_p, paired_t_power,
                                 prompt_seed_bootstrap, prompt_seed_means, seeds_needed, tost)


def test_paired_difference_t_is_the_interval_of_the_per_seed_differences():
    # differences by seed: 0.1, 0.2, 0.0 -> mean 0.1, sd 0.1, t(0.975, 2) = 4.302653 -> half width 0.248414
    got = paired_difference({0: 0.5, 1: 0.7, 2: 0.6}, {2: 0.6, 0: 0.4, 1: 0.5})
    assert got.method == "t" and got.n == 3 and got.mean == pytest.approx(0.1)
    assert (got.low, got.high) == (pytest.approx(0.1 - 0.248414, abs=1e-6), pytest.approx(0.1 + 0.248414, abs=1e-6))
    low, high = stats.ttest_rel([0.5, 0.7, 0.6], [0.4, 0.5, 0.6]).confidence_interval(0.95)
    assert (got.low, got.high) == (pytest.approx(low), pytest.approx(high))
    with pytest.raises(ValueError, match=r"same seeds in both arms: only in a \[3\], only in b \[\]"):
        paired_difference({0: 1.0, 3: 1.0}, {0: 1.0})


def test_paired_difference_bootstrap_by_hand():
    # two seeds with differences 0 and 1: a resampled mean is 0 (both draws seed 0, probability 1/4), 0.5 (1/2)
    # or 1 (1/4); the 2.5% and 97.5% quantiles of 10000 draws are therefore 0 and 1
    got = paired_difference({0: 0.5, 1: 1.5}, {0: 0.5, 1: 0.5}, method="bootstrap")
    assert got.mean == 0.5 and (got.low, got.high) == (0.0, 1.0) and got.n == 2
    # the same seed gives the same interval; all differences equal: no spread at all
    assert paired_difference({0: 0.5, 1: 1.5}, {0: 0.5, 1: 0.5}, method="bootstrap") == got
    flat = paired_difference({0: 0.3, 1: 0.5, 2: 0.4}, {0: 0.1, 1: 0.3, 2: 0.2}, method="bootstrap")
    assert (flat.mean, flat.low, flat.high) == pytest.approx((0.2, 0.2, 0.2))
    with pytest.raises(ValueError, match="method must be 't' or 'bootstrap'"):
        paired_difference({0: 1.0}, {0: 1.0}, method="wilcoxon")


def test_prompt_seed_bootstrap_resamples_both_seeds_and_prompts():
    # an additive grid d[s, p] = u[s] + v[p], u = (0, 1), v = (0, 2): the bootstrap mean's variance is
    # var(u) / 2 + var(v) / 2 = 0.25 / 2 + 1 / 2 = 0.625 (population variances); seeds alone would give 0.125,
    # prompts alone 0.5
    u, v = np.array([0.0, 1.0]), np.array([0.0, 2.0])
    grid = u[:, None] + v[None, :]  # [S=2, P=2]
    means = prompt_seed_means(grid, 40_000, np.random.default_rng(1))
    assert means.mean() == pytest.approx(1.5, abs=0.02) and means.var() == pytest.approx(0.625, rel=0.03)
    # a - b on a grid: arm a right on prompt 0 in both seeds, arm b never; 2 prompts -> mean 0.5; the resampled
    # mean is 0, 0.5 or 1 by how many times prompt 0 is drawn (seeds do not matter): quantiles 0 and 1
    a, b = [[1, 0], [1, 0]], [[0, 0], [0, 0]]
    got = prompt_seed_bootstrap(a, b)
    assert (got.mean, got.low, got.high, got.n) == (0.5, 0.0, 1.0, 2)
    assert prompt_seed_bootstrap(a, b) == got  # rng_seed fixed: the same interval every time
    with pytest.raises(ValueError, match=r"same non-empty \[seeds, prompts\] grid"):
        prompt_seed_bootstrap([[1, 0]], [[1, 0, 1]])


def test_outcome_grid_lines_up_eval_json_problems_by_id():
    def row(pid, greedy, right):
        return {"index": 0, "id": pid, "difficulty": {"operands": 3}, "greedy_correct": greedy, "correct_of_k": right,
                "k": 4}

    # seed 1 lists its problems in another order: the grid's columns follow the ids, not the positions
    seeds, ids, grid = outcome_grid({1: [row("b", False, 1), row("a", True, 4)], 0: [row("a", False, 2),
                                                                                      row("b", True, 3)]})
    assert seeds == [0, 1] and ids == ["a", "b"] and grid.tolist() == [[0.0, 1.0], [1.0, 0.0]]
    assert outcome_grid({0: [row("a", False, 2), row("b", True, 3)]}, "sampled")[2].tolist() == [[0.5, 0.75]]
    # pass: any of the k samples right (pass@k from k samples), 0 right of 4 -> 0
    assert outcome_grid({0: [row("a", True, 0), row("b", False, 1)]}, "pass")[2].tolist() == [[0.0, 1.0]]
    with pytest.raises(ValueError, match="outcome must be one of 'greedy', 'sampled', 'pass', got 'pass@8'"):
        outcome_grid({0: [row("a", True, 0)]}, "pass@8")
    with pytest.raises(ValueError, match="seed 1 evaluated other problems than seed 0"):
        outcome_grid({0: [row("a", True, 1)], 1: [row("c", True, 1)]})
    # from the fixture study's real eval.json files: 2 seeds x 8 test problems, ORM against learned PRM
    with tarfile.open(Path(__file__).parent / "fixtures" / "smoke_study" / "runs.tar.xz") as tar:
        final = {name: json.load(tar.extractfile(f"smoke/{name}/eval.json"))["ppo"]["problems"]
                 for name in ("0_prm_seed0", "1_prm_seed1", "2_orm_seed0", "3_orm_seed1")}
    _, prm_ids, prm = outcome_grid({0: final["0_prm_seed0"], 1: final["1_prm_seed1"]})
    _, orm_ids, orm = outcome_grid({0: final["2_orm_seed0"], 1: final["3_orm_seed1"]})
    assert prm.shape == (2, 8) and prm_ids == orm_ids  # the same test problems in every run
    assert prompt_seed_bootstrap(prm, orm).mean == pytest.approx(prm.mean() - orm.mean())


def test_tost_by_hand_with_closed_form_t_distributions():
    # df = 2: P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2)). Differences -0.1, 0, 0.1: mean 0, sd 0.1, se 0.1 / sqrt(3);
    # margin 0.3: t = 0.3 / se = 3 sqrt(3) = 5.196152 -> p = 1/2 - 5.196152 / (2 sqrt(29)) = 0.017549 on each side
    got = tost([-0.1, 0.0, 0.1], margin=0.3)
    assert got.p_lower == pytest.approx(0.017549, abs=1e-6) and got.p_upper == pytest.approx(0.017549, abs=1e-6)
    assert got.equivalent and got.p == got.p_upper and got.n == 3
    # df = 1 (Cauchy): P(T <= t) = 1/2 + atan(t) / pi. Differences 0, 0.2: mean 0.1, se 0.1; margin 0.2:
    # p_lower = P(T >= 3) = 1/2 - atan(3) / pi = 0.102416, p_upper = P(T <= -1) = 1/4 -> not equivalent
    got = tost([0.0, 0.2], margin=0.2)
    assert got.p_lower == pytest.approx(0.5 - math.atan(3) / math.pi) and got.p_upper == pytest.approx(0.25)
    assert not got.equivalent
    # the same as scipy's one-sided one-sample t tests against -margin and +margin
    diffs = [0.02, -0.01, 0.03, 0.0, 0.01]
    got = tost(diffs, margin=0.05)
    assert got.p_lower == pytest.approx(stats.ttest_1samp(diffs, -0.05, alternative="greater").pvalue)
    assert got.p_upper == pytest.approx(stats.ttest_1samp(diffs, 0.05, alternative="less").pvalue)
    # no spread: decided by which side of each bound the mean lies; one difference: no test
    assert tost([0.01, 0.01], 0.05).equivalent and not tost([0.06, 0.06], 0.05).equivalent
    assert math.isnan(tost([0.0], 0.05).p) and not tost([0.0], 0.05).equivalent
    with pytest.raises(ValueError, match="margin must be > 0"):
        tost(diffs, margin=0.0)


def test_paired_t_p_by_hand_and_against_scipy():
    # differences 0.1, 0.2, 0.3: mean 0.2, sd 0.1, se 0.1 / sqrt(3) -> t = 2 sqrt(3) = 3.4641 on 2 df; the t
    # distribution with 2 df has P(T > t) = (1 - t / sqrt(2 + t^2)) / 2, so p = 1 - 3.4641 / sqrt(14) = 0.074180
    assert paired_t_p([0.1, 0.2, 0.3]) == pytest.approx(1 - 2 * math.sqrt(3) / math.sqrt(14), abs=1e-9)
    assert paired_t_p([0.1, 0.2, 0.3]) == pytest.approx(0.074180, abs=1e-6)
    diffs = [0.05, -0.02, 0.11, 0.03, 0.0, 0.07]
    assert paired_t_p(diffs) == pytest.approx(stats.ttest_1samp(diffs, 0.0).pvalue)
    assert paired_t_p([-x for x in diffs]) == pytest.approx(paired_t_p(diffs))  # two-sided
    assert math.isnan(paired_t_p([0.1])) and math.isnan(paired_t_p([]))
    assert paired_t_p([0.0, 0.0]) == 1.0 and paired_t_p([0.1, 0.1]) == 0.0  # no spread


def test_holm_by_hand():
    # sorted: 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04, raised to the running max 0.06)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([0.02, 0.02]) == pytest.approx([0.04, 0.04]) and holm([]) == []
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        holm([0.1, float("nan")])


def test_curve_area_is_the_trapezoid_over_the_span():
    # (0.2 + 0.4) / 2 * 10 + (0.4 + 0.4) / 2 * 20 = 3 + 8 = 11, over the span 30
    assert curve_area({30: 0.4, 0: 0.2, 10: 0.4}) == pytest.approx(11 / 30)
    assert curve_area({5: 0.7, 9: 0.7}) == pytest.approx(0.7)  # a flat curve's area is its height
    assert math.isnan(curve_area({10: 0.5})) and math.isnan(curve_area({}))


def test_seeds_needed_against_the_paired_t_tables():
    # difference / sd = 1: the normal approximation (1.959964 + 0.841621)^2 = 7.85 undercounts; the noncentral t
    # gives power 0.803 at 10 pairs and 0.748 at 9, so 10 (the standard table value for dz = 1, like 34 for 0.5
    # and 199 for 0.2)
    assert paired_t_power(10, 1.0, 1.0) == pytest.approx(0.8031, abs=1e-4)
    assert paired_t_power(9, 1.0, 1.0) == pytest.approx(0.7480, abs=1e-4)
    assert seeds_needed(1.0, 1.0) == 10
    assert seeds_needed(0.01, 0.02) == 34 and seeds_needed(-0.004, 0.02) == 199  # only |d| / sd matters
    assert seeds_needed(3.0, 1.0) == 4 and paired_t_power(3, 3.0, 1.0) < 0.8 <= paired_t_power(4, 3.0, 1.0)
    with pytest.raises(ValueError, match="positive sd"):
        seeds_needed(0.01, 0.0)
