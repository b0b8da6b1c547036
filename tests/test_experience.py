"""Phase 5 of an epoch (``genrl.training.experience.epoch_advantages``) on a real single-process
Accelerator: which samples the update trains on, and with which advantages."""

import pytest
import torch
from accelerate import Accelerator

from genrl.math.advantages import group_advantages
from genrl.training.experience import AdvantageConfig, epoch_advantages

# Two groups of 8: group 0 spread evenly, group 1 one outlier high above seven close rewards.
REWARDS = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 7, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 9.0])
GROUPS = torch.tensor([0] * 8 + [1] * 8)


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def advantages(accelerator, rewards=REWARDS, **kwargs):
    options = dict(reward_combine="sum", std_mode="group", adv_clip_max=5.0, filter_zero_advantage=False,
                   micro_batch_size=4)
    options.update(kwargs)
    return epoch_advantages(accelerator, {"r": rewards}, {"r": 1.0}, GROUPS, AdvantageConfig(**options))


def test_every_sample_is_trained_by_default(accelerator):
    out = advantages(accelerator)
    assert out.kept.tolist() == list(range(16)) and out.logs["train/kept_fraction"] == 1.0
    assert torch.allclose(out.advantages, group_advantages(REWARDS, GROUPS))


def test_train_samples_per_group_keeps_the_max_variance_samples_normalised_among_themselves(accelerator):
    """Group 0 (evenly spread) keeps its 2 lowest and 2 highest; group 1 keeps the outlier and its 3
    lowest (a lopsided split varies more there). Their advantages are normalised over the kept
    samples, so each group's sum to 0 (over the whole group, group 1's kept four would sum to
    +1.27); the others get 0."""
    out = advantages(accelerator, train_samples_per_group=4)
    kept = [0, 1, 6, 7, 8, 9, 10, 15]
    assert out.kept.tolist() == kept
    assert out.logs["train/kept_fraction"] == 0.5
    expected = torch.zeros(16)
    expected[kept] = group_advantages(REWARDS[kept], GROUPS[kept])
    assert torch.allclose(out.advantages, expected)
    assert float(group_advantages(REWARDS, GROUPS)[kept[4:]].sum()) == pytest.approx(1.27, abs=0.01)


def test_zero_advantage_filter_chooses_among_the_selected_samples(accelerator):
    """Group 1 all equal (zero advantage): the filter drops its selected samples and pads, up to a
    whole micro batch, only with selected ones, never with samples the selection left out."""
    rewards = torch.cat([REWARDS[:8], torch.full((8,), 0.5)])
    out = advantages(accelerator, rewards=rewards, train_samples_per_group=4, filter_zero_advantage=True,
                     micro_batch_size=4)
    assert out.kept.tolist() == [0, 1, 6, 7]
    out = advantages(accelerator, rewards=rewards, train_samples_per_group=3, filter_zero_advantage=True,
                     micro_batch_size=6)
    # Group 0 keeps 0, 6, 7 (lowest one, highest two: the lower j of two equal-variance splits);
    # the whole micro batch of 6 is padded with group 1's selected samples (its first and last two),
    # not with the samples group 0 left out.
    assert out.kept.tolist() == [0, 6, 7, 8, 14, 15]
