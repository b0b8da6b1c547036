"""What a checkpoint inside an epoch's update keeps: each rank's experience, back bit for bit."""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from genrl.checkpoints.update_checkpoint import (
    PartialUpdate,
    UpdateInProgress,
    experience_path,
    load_update_in_progress,
    save_update_in_progress,
)
from genrl.objectives.forward import ForwardBatch
from genrl.training.experience import EpochAdvantages
from genrl.training.rollout import Rollout


def state(prepared) -> UpdateInProgress:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 3, 2, 8, 8, generator=g)
    rollout = Rollout(
        prompts=["a red circle", "two squares", "a red circle", "two squares"], group_indices=[0, 1, 0, 1],
        latents=base, next_latents=base[:, :, :1],  # views of one tensor, as joined batches are
        timesteps=torch.rand(4, 3, generator=g), sigmas=torch.rand(4, 3, generator=g), sigmas_next=torch.rand(4, 3, generator=g),
        log_probs=torch.randn(4, 3, generator=g, dtype=torch.float64), step_indices=torch.arange(12).view(4, 3),
        sigma_max=0.97, embeds={"prompt_embeds": torch.randn(4, 5, 6, generator=g).bfloat16()},
        final_latents=torch.randn(4, 2, 8, 8, generator=g), samples=torch.rand(4, 3, 1, 16, 16), decode_seconds=1.5,
    )
    advantages = EpochAdvantages(torch.randn(4, generator=g), torch.tensor([0, 2, 3]), {"reward/x_mean": 0.25})
    partial = PartialUpdate(6, prepared, [{"policy_loss": 0.5}], [1.25], skipped_steps=1)
    return UpdateInProgress(3, 12, rollout, advantages, {"time/rollout_s": 2.0}, None, partial)


def forward_batch() -> ForwardBatch:
    g = torch.Generator().manual_seed(1)
    old = torch.randn(4, 2, 2, 8, 8, generator=g)
    old[0] = float("nan")  # not recorded: the first optimizer step's own
    return ForwardBatch(torch.randn(4, 2, 8, 8, generator=g), torch.randn(4, 2, 2, 8, 8, generator=g),
                        torch.randn(4, 2, 2, 8, 8, generator=g), torch.rand(4, 2, generator=g), torch.rand(4, 2, generator=g), old)


def assert_same(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)), f.name
        elif isinstance(x, dict) and x and torch.is_tensor(next(iter(x.values()))):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("prepared", [None, forward_batch()], ids=["grpo", "nft"])
def test_the_experience_of_a_stopped_update_comes_back_bit_for_bit(tmp_path, prepared):
    saved = state(prepared)
    save_update_in_progress(str(tmp_path), 1, saved)
    loaded = load_update_in_progress(str(tmp_path), 1, torch.device("cpu"))
    assert loaded.rollout.samples is None, "decoded samples are not kept (the update does not read them)"
    assert_same(dataclasses.replace(saved.rollout, samples=None), loaded.rollout)
    assert_same(saved.advantages, loaded.advantages)
    assert (loaded.epoch, loaded.step_at_epoch_start, loaded.timings, loaded.rollout_flops) == (3, 12, {"time/rollout_s": 2.0}, None)
    assert (loaded.update.micro_steps, loaded.update.step_stats, loaded.update.grad_norms, loaded.update.skipped_steps) == (
        6, [{"policy_loss": 0.5}], [1.25], 1)
    if prepared is None:
        assert loaded.update.prepared is None
    else:
        assert_same(prepared, loaded.update.prepared)


def test_an_experience_naming_an_unknown_prepared_type_is_refused(tmp_path):
    save_update_in_progress(str(tmp_path), 0, state(forward_batch()))
    path = experience_path(str(tmp_path), 0)
    with safe_open(path, framework="pt") as f:
        values = json.loads(f.metadata()["genrl"])
    values["prepared"] = "os.system"
    save_file(load_file(path), path, metadata={"genrl": json.dumps(values)})
    with pytest.raises(ValueError, match="unknown prepared type 'os.system'"):
        load_update_in_progress(str(tmp_path), 0, torch.device("cpu"))


def test_a_missing_experience_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="rank1.safetensors"):
        load_update_in_progress(str(tmp_path), 1, torch.device("cpu"))
