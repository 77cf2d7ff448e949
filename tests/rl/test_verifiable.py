"""pass@k and balanced resampling."""

import random
import warnings
from math import comb, sqrt

import numpy as np
import pytest

from srm_max.rl.groups import balanced_group, group_advantages, mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n,c,k", [(10, 0, 1), (10, 10, 3), (10, 3, 1), (10, 3, 5), (50, 7, 10), (200, 1, 100), (5, 2, 4)])
def test_pass_at_k_matches_closed_form(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), rel=1e-12, abs=1e-15)


def test_pass_at_k_known_cases():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(10, 8, 3) == 1.0  # fewer than k wrong ones: any k contain a correct one
    assert mean_pass_at_k([0, 10], 10, 1) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="need 1 <= k <= n"):
        pass_at_k(5, 1, 6)
    with pytest.raises(ValueError, match="need 0 <= c <= n"):
        pass_at_k(5, 6, 1)


def test_pass_at_k_monotone_in_k():
    values = [pass_at_k(100, 5, k) for k in range(1, 101)]
    assert all(a <= b for a, b in zip(values, values[1:]))


def kinds(rewards, group):
    return sum(rewards[i] > 0 for i in group), sum(rewards[i] <= 0 for i in group)


def test_balanced_group_mixes_half_and_half():
    rewards = [1] * 20 + [0] * 30
    group = balanced_group(rewards, 16, random.Random(1))
    assert len(group) == len(set(group)) == 16
    assert kinds(rewards, group) == (8, 8)


@pytest.mark.parametrize("rewards,expected", [
    ([1] * 50, (16, 0)),  # all correct
    ([0] * 50, (0, 16)),  # all wrong
    ([1] * 3 + [0] * 47, (3, 13)),  # too few correct: fill with wrong
    ([1] * 47 + [0] * 3, (13, 3)),  # too few wrong: fill with more correct
    ([1] * 5 + [0] * 4, (5, 4)),  # fewer than G in all: use every one
])
def test_balanced_group_edge_cases(rewards, expected):
    group = balanced_group(rewards, 16, random.Random(2))
    assert len(group) == len(set(group))
    assert kinds(rewards, group) == expected


def test_group_advantages():
    adv = group_advantages([1, 0, 1, 0])
    assert adv.mean() == pytest.approx(0)
    assert adv[0] > 0 > adv[1]
    assert np.allclose(group_advantages([1, 1, 1]), 0)


def test_group_advantages_use_the_unbiased_std():
    """As the reference GRPO code does, with torch's default (unbiased, ddof=1) std."""
    rewards = [1.0, 0.0, 0.0, 0.0]
    mean = 0.25
    std = sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    expected = [(r - mean) / (std + 1e-4) for r in rewards]
    assert group_advantages(rewards) == pytest.approx(expected, rel=1e-12)
    torch = pytest.importorskip("torch")
    t = torch.tensor(rewards, dtype=torch.float64)
    assert group_advantages(rewards) == pytest.approx(((t - t.mean()) / (t.std() + 1e-4)).tolist(), rel=1e-12)


@pytest.mark.parametrize("rewards", [[1.0] * 5, [0.0] * 8, [1.0], [0.0], [0.5]])
def test_group_advantages_of_degenerate_groups_are_zero(rewards):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division by zero, no degrees-of-freedom warning
        adv = group_advantages(rewards)
    assert adv.tolist() == [0.0] * len(rewards)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1", None])
def test_a_reward_that_is_not_a_finite_number_is_named(bad):
    rewards = [1.0, 0.0, bad]
    with pytest.raises(ValueError, match=r"balanced_group: reward 2 is .*, not a finite number"):
        balanced_group(rewards, 2)
    with pytest.raises(ValueError, match=r"group_advantages: reward 2 is .*, not a finite number"):
        group_advantages(rewards)
    assert sorted(balanced_group([True, False, np.float32(0.5)], 3)) == [0, 1, 2]  # a verifier's bools count


@pytest.mark.parametrize("n, c, k", [(10.0, 3, 1), (10, 2.5, 1), (10, 3, True), (10, 3, "1")])
def test_pass_at_k_wants_integers(n, c, k):
    with pytest.raises(ValueError, match="must be an integer"):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError, match="group_size must be an integer"):
        balanced_group([1.0, 0.0], 2.0)
