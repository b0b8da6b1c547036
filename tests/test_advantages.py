import math

import pytest
import torch

from genrl.math.advantages import (
    balanced_keep_mask,
    clip_advantages,
    combine_rewards,
    group_advantages,
    max_variance_subset,
    zero_std_ratio,
)

EPS = 1e-4
# Two groups: {1, 3} has mean 2 and population std 1; {0, 1} has mean 0.5 and std 0.5.
REWARDS = torch.tensor([1.0, 3.0, 0.0, 1.0])
GROUPS = torch.tensor([0, 0, 1, 1])


def test_group_std_mode_by_hand():
    adv = group_advantages(REWARDS, GROUPS, std_mode="group", eps=EPS)
    expected = [-1 / (1 + EPS), 1 / (1 + EPS), -0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)]
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_global_std_mode_by_hand():
    # Global mean 1.25; squared deviations 0.0625 + 3.0625 + 1.5625 + 0.0625 = 4.75; var 4.75 / 4.
    std = math.sqrt(4.75 / 4)
    adv = group_advantages(REWARDS, GROUPS, std_mode="global", eps=EPS)
    expected = [-1 / (std + EPS), 1 / (std + EPS), -0.5 / (std + EPS), 0.5 / (std + EPS)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_max_group_std_mode_by_hand():
    adv = group_advantages(REWARDS, GROUPS, std_mode="max_group", eps=EPS)
    expected = [-1 / (1 + EPS), 1 / (1 + EPS), -0.5 / (1 + EPS), 0.5 / (1 + EPS)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_group_ids_need_not_be_contiguous_or_sorted():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    groups = torch.tensor([9, 2, 9, 2])
    adv = group_advantages(rewards, groups)
    expected = [-1 / (1 + EPS), -0.5 / (0.5 + EPS), 1 / (1 + EPS), 0.5 / (0.5 + EPS)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_combine_sum_normalises_the_weighted_sum():
    rewards = {"a": REWARDS, "b": torch.tensor([2.0, 2.0, 4.0, 0.0])}
    weights = {"a": 1.0, "b": 0.5}
    # a + 0.5 b = [2, 4, 2, 1]: group {2, 4} mean 3 std 1; group {2, 1} mean 1.5 std 0.5.
    adv = combine_rewards(rewards, weights, GROUPS, mode="sum", std_mode="group", eps=EPS)
    expected = [-1 / (1 + EPS), 1 / (1 + EPS), 0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_combine_normalize_each_sums_weighted_advantages():
    rewards = {"a": REWARDS, "b": torch.tensor([2.0, 2.0, 4.0, 0.0])}
    weights = {"a": 1.0, "b": 0.5}
    # adv(a) as in the group test; adv(b): {2, 2} -> 0, 0; {4, 0} mean 2 std 2 -> +-2 / (2 + eps).
    adv = combine_rewards(rewards, weights, GROUPS, mode="normalize_each", std_mode="group", eps=EPS)
    expected = [
        -1 / (1 + EPS),
        1 / (1 + EPS),
        -0.5 / (0.5 + EPS) + 0.5 * 2 / (2 + EPS),
        0.5 / (0.5 + EPS) - 0.5 * 2 / (2 + EPS),
    ]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_combine_refuses_unknown_mode_and_mismatched_weights():
    with pytest.raises(ValueError, match=r"Unknown reward combine mode 'mean'.*\('sum', 'normalize_each'\)"):
        combine_rewards({"a": REWARDS}, {"a": 1.0}, GROUPS, mode="mean")
    with pytest.raises(ValueError, match=r"weights are given for \['a'\] but the rewards are \['a', 'b'\]"):
        combine_rewards({"a": REWARDS, "b": REWARDS}, {"a": 1.0}, GROUPS, mode="sum")


def test_unknown_std_mode_and_bad_rewards_are_refused():
    with pytest.raises(ValueError, match=r"Unknown std_mode 'batch'"):
        group_advantages(REWARDS, GROUPS, std_mode="batch")
    with pytest.raises(ValueError, match="1 of 4 rewards are NaN"):
        group_advantages(torch.tensor([1.0, float("nan"), 0.0, 1.0]), GROUPS)
    with pytest.raises(ValueError, match=r"must both be \(N,\)"):
        group_advantages(REWARDS, GROUPS[:3])


def test_clip_advantages():
    adv = torch.tensor([-7.0, -1.0, 0.5, 6.0])
    assert clip_advantages(adv, 5.0).tolist() == [-5.0, -1.0, 0.5, 5.0]
    with pytest.raises(ValueError, match="adv_clip_max must be > 0, got 0"):
        clip_advantages(adv, 0)


@pytest.mark.parametrize("std_mode", ["group", "global", "max_group"])
def test_zero_std_groups_give_zero_advantage_and_are_counted(std_mode):
    # 0.1 is not exact in binary: in float64 the mean of three 0.1s is 0.1 + 2e-17, so a
    # plain (r - mean) / (std + eps) would give small nonzero advantages.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 2.0, 3.0, 5.0, 5.0, 5.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    adv = group_advantages(rewards, groups, std_mode=std_mode)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[6:].tolist() == [0.0, 0.0, 0.0]
    assert (adv[3:6] != 0).sum() == 2  # the middle sample of {1, 2, 3} sits on the mean
    assert zero_std_ratio(rewards, groups) == pytest.approx(2 / 3)
    assert zero_std_ratio(REWARDS, GROUPS) == 0.0


def test_all_equal_rewards_give_zero_advantages_without_nan():
    adv = group_advantages(torch.full((6,), 0.3), torch.tensor([0, 0, 0, 1, 1, 1]), std_mode="global", eps=0.0)
    assert adv.tolist() == [0.0] * 6


def test_keep_mask_keeps_informative_and_pads_with_lowest_index_zeros():
    adv = torch.tensor(
        [
            [0.5, 0.0, -0.2, 0.0, 0.0, 0.9, 0.0, 0.0],  # 3 informative
            [0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # 1 informative
        ]
    )
    keep = balanced_keep_mask(adv, micro_batch_size=2)
    # max informative 3 -> rounded up to 4 on every rank.
    assert keep[0].nonzero().flatten().tolist() == [0, 1, 2, 5]
    assert keep[1].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_keep_mask_drops_smallest_magnitudes_at_the_cap():
    adv = torch.tensor(
        [
            [0.5, -0.1, 0.9, 0.3, -0.7],
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    # 5 informative on rank 0 -> 6, capped at 4 (5 rounded down to a multiple of 2).
    keep = balanced_keep_mask(adv, micro_batch_size=2)
    assert keep[0].tolist() == [True, False, True, True, True]
    assert keep[1].tolist() == [True, True, True, True, False]


def test_keep_mask_keeps_one_micro_batch_when_nothing_is_informative():
    keep = balanced_keep_mask(torch.zeros(3, 7), micro_batch_size=3)
    assert keep.tolist() == [[True] * 3 + [False] * 4] * 3


def test_keep_mask_counts_are_equal_multiples_on_random_input():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        adv = torch.randn(4, 12, generator=gen)
        adv[torch.rand(4, 12, generator=gen) < 0.6] = 0.0
        keep = balanced_keep_mask(adv, micro_batch_size=3)
        counts = keep.sum(dim=1)
        assert (counts == counts[0]).all()
        assert counts[0] % 3 == 0 and counts[0] > 0
        assert keep[adv != 0].all(), "an informative sample was dropped below the cap"


def test_keep_mask_refuses_micro_batch_larger_than_rank_rows():
    with pytest.raises(ValueError, match=r"micro_batch_size must be in \[1, 4\].*got 5"):
        balanced_keep_mask(torch.ones(2, 4), micro_batch_size=5)


def test_max_variance_subset_by_hand():
    """{2, 0, 10, 1}, keep 3: the splits are {0, 1, 2} (variance 0.67), {0, 1, 10} (20.2), {0, 2, 10}
    (18.7) and {1, 2, 10} (16.2), so the two lowest and the highest; keep 2: {0, 10}."""
    scores, one_group = torch.tensor([2.0, 0.0, 10.0, 1.0]), torch.zeros(4, dtype=torch.long)
    assert max_variance_subset(scores, one_group, 3).tolist() == [False, True, True, True]
    assert max_variance_subset(scores, one_group, 2).tolist() == [False, True, True, False]
    assert max_variance_subset(scores, one_group, 4).all()


def test_max_variance_subset_is_the_largest_variance_subset_of_every_group():
    """Against every subset, on interleaved groups of random scores (ties included): each group
    keeps exactly m samples, and no other m of it vary more."""
    import itertools

    generator = torch.Generator().manual_seed(0)
    for trial in range(60):
        n, m = 6, 2 + trial % 5
        scores = torch.rand(3 * n, generator=generator)
        if trial % 2:  # few distinct values: ties
            scores = (scores * 3).floor()
        group_ids = torch.arange(3 * n) % 3
        keep = max_variance_subset(scores, group_ids, m)
        for g in range(3):
            members = (group_ids == g).nonzero().squeeze(1)
            assert int(keep[members].sum()) == m
            best = max(float(scores[list(c)].var(unbiased=False)) for c in itertools.combinations(members.tolist(), m))
            assert float(scores[members][keep[members]].var(unbiased=False)) == pytest.approx(best, abs=1e-12)


def test_max_variance_subset_breaks_ties_evenly_and_refuses_bad_sizes():
    equal = torch.ones(5)
    # Every split has variance 0: the most even one, the lower j of the two (1 lowest, 2 highest).
    assert max_variance_subset(equal, torch.zeros(5, dtype=torch.long), 3).tolist() == [True, False, False, True, True]
    with pytest.raises(ValueError, match="Cannot keep 6 samples of a group of 5"):
        max_variance_subset(equal, torch.zeros(5, dtype=torch.long), 6)
    with pytest.raises(ValueError, match="size must be >= 1"):
        max_variance_subset(equal, torch.zeros(5, dtype=torch.long), 0)
