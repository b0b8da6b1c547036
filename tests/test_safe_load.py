"""Resuming reads nothing that can run code (genrl.checkpoints.safe_load, genrl.checkpoints.checkpointing.load_checkpoint).

A checkpoint is written here by a real single-process Accelerator (model, optimizer, scheduler,
RNG states: the files DDP writes) plus genrl's EMA and state files; each file in turn is then
poisoned with a payload that writes a marker file when unpickled. The DeepSpeed files are
tested on real ZeRO-2/3 checkpoints in test_train_distributed.py.
"""

import json
import logging
import os
import shutil

import pytest
import torch

from genrl.checkpoints.checkpointing import STATE_FILE, load_checkpoint
from genrl.checkpoints.safe_load import UnsafeCheckpointError, load_weights_only, verify_checkpoint
from genrl.training.ema import EMA

from _poison import Payload, poison, ran


def build(seed: int = 0):
    from accelerate import Accelerator

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler, EMA(model.parameters(), 0.5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A checkpoint of one trained step, as train_genrl.py lays it out."""
    accelerator, model, optimizer, scheduler, ema = build()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    ema.update()
    path = str(tmp_path_factory.mktemp("ckpt") / "checkpoint-1")
    accelerator.save_state(path)
    os.makedirs(os.path.join(path, "ema"))
    torch.save(ema.state_dict(), os.path.join(path, "ema", "rank0.pt"))
    with open(os.path.join(path, STATE_FILE), "w") as f:
        json.dump({"global_step": 1, "epoch": 0, "num_processes": 1}, f)
    return path


POISONABLE = ["optimizer.bin", "scheduler.bin", "random_states_0.pkl", "ema/rank0.pt"]


def test_the_checkpoint_holds_the_files_resume_reads(checkpoint):
    names = sorted(os.path.relpath(os.path.join(r, f), checkpoint) for r, _, fs in os.walk(checkpoint) for f in fs)
    assert names == sorted(["model.safetensors", STATE_FILE] + POISONABLE)


def test_a_clean_checkpoint_resumes_with_everything_restored(checkpoint):
    accelerator, model, optimizer, scheduler, ema = build(seed=1)
    assert load_checkpoint(accelerator, checkpoint, ema) == (1, 0)
    assert optimizer.state_dict()["state"], "optimizer state not restored"
    assert ema.num_updates == 1


@pytest.mark.parametrize("name", POISONABLE)
def test_a_poisoned_file_is_refused_naming_it_and_runs_nothing(checkpoint, tmp_path, name):
    path = str(tmp_path / "checkpoint-1")
    shutil.copytree(checkpoint, path)
    marker = str(tmp_path / "marker")
    poison(os.path.join(path, name), marker)
    accelerator, model, optimizer, scheduler, ema = build(seed=1)
    with pytest.raises(UnsafeCheckpointError) as failure:
        load_checkpoint(accelerator, path, ema)
    assert not ran(marker), f"loading {name} ran the payload"
    message = str(failure.value)
    assert "\n" not in message and message.endswith(".")
    assert message.startswith(f"Refusing to resume from {path}: {os.path.join(path, name)} calls exec when unpickled")
    assert "could run code" in message


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_an_unreadable_rng_state_is_a_warning_and_the_rest_loads(checkpoint, tmp_path, caplog, damage):
    path = str(tmp_path / "checkpoint-1")
    shutil.copytree(checkpoint, path)
    rng = os.path.join(path, "random_states_0.pkl")
    if damage == "truncated":
        data = open(rng, "rb").read()
        open(rng, "wb").write(data[: len(data) // 2])
    else:
        os.remove(rng)
    accelerator, model, optimizer, scheduler, ema = build(seed=1)
    with caplog.at_level(logging.INFO):
        assert load_checkpoint(accelerator, path, ema) == (1, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and rng in r.getMessage()]
    assert len(warnings) == 1 and "fresh random states" in warnings[0]


def test_a_corrupt_optimizer_state_is_one_sentence_naming_it(checkpoint, tmp_path):
    path = str(tmp_path / "checkpoint-1")
    shutil.copytree(checkpoint, path)
    optimizer = os.path.join(path, "optimizer.bin")
    data = open(optimizer, "rb").read()
    open(optimizer, "wb").write(data[: len(data) // 2])
    with pytest.raises(UnsafeCheckpointError, match=r"^Cannot resume from .*optimizer\.bin cannot be read \(RuntimeError"):
        load_checkpoint(build(seed=1)[0], path)
    open(optimizer, "wb").write(b"not a torch file")
    with pytest.raises(UnsafeCheckpointError, match=r"optimizer\.bin is not a pickle a weights-only load can read"):
        load_checkpoint(build(seed=1)[0], path)


def test_a_broken_state_file_is_one_sentence(checkpoint, tmp_path):
    path = str(tmp_path / "checkpoint-1")
    shutil.copytree(checkpoint, path)
    with open(os.path.join(path, STATE_FILE), "w") as f:
        f.write('{"global_step": "1"')
    with pytest.raises(ValueError, match=r"genrl_state\.json is not readable JSON"):
        load_checkpoint(build(seed=1)[0], path)


@pytest.mark.parametrize("form", ["zip", "legacy", "plain pickle"])
def test_every_file_format_is_checked(tmp_path, form):
    import pickle

    marker, path = str(tmp_path / "marker"), str(tmp_path / "state.pt")
    state = {"w": torch.ones(2), "payload": Payload(marker)}
    if form == "plain pickle":
        with open(path, "wb") as f:
            pickle.dump(state, f)
    else:
        torch.save(state, path, _use_new_zipfile_serialization=form == "zip")
    with pytest.raises(UnsafeCheckpointError, match="run code"):
        load_weights_only(path)
    assert not ran(marker)


def test_the_allow_list_admits_deepspeed_and_numpy_state_values(tmp_path):
    """What ZeRO optimizer states and RNG states hold, without loading any code."""
    import random

    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {
        "loss_scaler": LossScaler(1.0), "dynamic": DynamicLossScaler(2.0**16, 1000, 1.0, 2, False), "zero_stage": ZeroStageEnum.gradients,
        "address": fragment_address(numel=4, start=0), "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(), "torch_manual_seed": torch.get_rng_state(),
    }
    torch.save(state, tmp_path / "s.pt")
    loaded = load_weights_only(str(tmp_path / "s.pt"))
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and loaded["loss_scaler"].cur_scale == 1.0
    assert np.array_equal(loaded["numpy_random_seed"][1], state["numpy_random_seed"][1])
    assert verify_checkpoint(str(tmp_path), 0) == [f"{tmp_path}/random_states_0.pkl is missing: resuming with fresh random states."]
