"""The update loop's visiting order and what it logs (genrl/training/update.py, genrl/training/train_logging.py),
without a model: the loop itself runs in the script tests (test_train_*.py, test_nan_guard.py)."""

from collections import Counter

import pytest
import torch

from genrl.training.train_logging import crossed
from genrl.training.update import UpdateConfig, UpdateResult, micro_steps, micro_steps_before_the_weights_move


def update_config(objective: str, **overrides) -> UpdateConfig:
    settings = dict(objective=objective, micro_batch_size=2, num_timesteps=3, num_inference_steps=10, guidance_scale=4.5,
                    max_grad_norm=1.0, clip_range=1e-3, adv_clip_max=5.0)
    return UpdateConfig(**{**settings, **overrides})


def visits(objective: str, kept: torch.Tensor, recorded_steps: int = 4, seed: int = 0, **overrides):
    config = update_config(objective, **overrides)
    return list(micro_steps(kept, recorded_steps, config, torch.Generator().manual_seed(seed)))


def test_only_on_policy_nft_takes_the_first_optimizer_steps_old_velocities_from_its_own_forward():
    """The passes of the first optimizer step (Accelerate's accumulation count, here 2 micro
    batches x 3 timesteps) run on the sampling weights, if the update starts at an accumulation
    boundary; with a soft-updated sampling policy, for AWM and GRPO, none."""
    from types import SimpleNamespace

    config = update_config("nft")
    assert micro_steps_before_the_weights_move(SimpleNamespace(gradient_accumulation_steps=6, step=12), config, True) == 6
    assert micro_steps_before_the_weights_move(SimpleNamespace(gradient_accumulation_steps=6, step=8), config, True) == 0
    assert micro_steps_before_the_weights_move(SimpleNamespace(gradient_accumulation_steps=6, step=0), config, False) == 0
    assert micro_steps_before_the_weights_move(SimpleNamespace(gradient_accumulation_steps=4, step=0), config, True) == 0
    for objective in ("awm", "grpo"):
        accelerator = SimpleNamespace(gradient_accumulation_steps=6, step=0)
        assert micro_steps_before_the_weights_move(accelerator, update_config(objective), True) == 0


@pytest.mark.parametrize("objective", ["grpo", "nft", "awm"])
def test_each_inner_epoch_trains_every_kept_sample_at_each_trained_timestep(objective):
    kept = torch.tensor([0, 2, 3, 5, 6])
    steps = visits(objective, kept, num_inner_epochs=2)
    per_epoch = len(steps) // 2
    assert per_epoch == 3 * 3  # ceil(5 / 2) micro batches x 3 timesteps
    for epoch in (steps[:per_epoch], steps[per_epoch:]):
        counts = Counter(int(i) for idx, _ in epoch for i in idx)
        assert counts == {i: 3 for i in kept.tolist()}
        assert all(len(idx) <= 2 for idx, _ in epoch)


def test_grpo_trains_each_sample_at_distinct_recorded_steps_and_nft_at_the_drawn_columns_in_order():
    kept = torch.arange(4)
    grpo = visits("grpo", kept, recorded_steps=4)
    for start in range(0, len(grpo), 3):  # the 3 timesteps of one micro batch
        columns = torch.stack([step for _, step in grpo[start : start + 3]], dim=1)  # (b, 3)
        assert all(len(set(row.tolist())) == 3 and max(row.tolist()) < 4 for row in columns)
    assert [step for _, step in visits("nft", kept)] == [0, 1, 2, 0, 1, 2]


def test_the_visiting_order_is_a_function_of_the_generator_seed():
    kept = torch.arange(6)
    same = [visits("grpo", kept, seed=3), visits("grpo", kept, seed=3)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(*same))
    other = visits("grpo", kept, seed=4)
    assert any(not torch.equal(a[0], b[0]) or not torch.equal(a[1], b[1]) for a, b in zip(same[0], other))


def test_update_logs_are_the_means_over_the_applied_steps():
    result = UpdateResult(global_step=2, step_stats=[{"loss": 1.0, "kl": 0.0}, {"loss": 3.0, "kl": 1.0}],
                          grad_norms=[0.5, 1.5])
    assert result.logs() == {"train/loss": 2.0, "train/kl": 0.5, "train/grad_norm": 1.0}
    assert UpdateResult(global_step=0).logs() == {}  # every step skipped: nothing to average


def test_crossed_says_when_the_step_count_passed_a_multiple():
    assert crossed(20, 18, 20) and crossed(20, 19, 41) and not crossed(20, 20, 39)
    assert not crossed(None, 0, 100) and not crossed(0, 0, 100)
