"""save_checkpoint: prune only after the new checkpoint is complete; a failed save (a full disk
included) removes its .tmp, keeps the previous checkpoint and says so in one sentence.

A stand-in accelerator writes a small file per state, so these tests pin the order of
writing, renaming and pruning without loading a model.
"""

import errno
import os
from collections import namedtuple
from types import SimpleNamespace

import pytest

import genrl.checkpoints.checkpointing as checkpointing
from genrl.checkpoints.checkpointing import CheckpointSaveError, checkpoint_dirs, save_checkpoint


class FakeAccelerator:
    """One process; ``save_state`` writes one file, or calls ``on_save(path)`` first."""

    is_main_process = is_local_main_process = True
    process_index = 0
    num_processes = 1
    state = namedtuple("state", "deepspeed_plugin")(None)

    def __init__(self, on_save=None):
        self.on_save = on_save

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "model.safetensors"), "w") as f:
            f.write("weights")
        if self.on_save is not None:
            self.on_save(path)


@pytest.fixture(autouse=True)
def fake_export(monkeypatch):
    """The export step writes its config only: the model is a stand-in."""

    def export(accelerator, model, policy, export_dir, **kwargs):
        with open(os.path.join(export_dir, checkpointing.CONFIG_FILE), "w") as f:
            f.write("{}")

    monkeypatch.setattr(checkpointing, "export_model", export)


def save(output_dir, step, accelerator=None, total_limit=1):
    # What save_checkpoint reads of a run, with no model: the stand-in export writes its config only.
    run = SimpleNamespace(accelerator=accelerator or FakeAccelerator(), args=SimpleNamespace(output_dir=str(output_dir),
                          use_lora=False), model=None, policy=None, record={}, ema=None, sampling_policy=None,
                          identity=None, node_local=False)
    return save_checkpoint(run, global_step=step, epoch=step, total_limit=total_limit)


def names(output_dir):
    return sorted(os.listdir(output_dir))


def full_disk(path):
    raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, "optimizer.bin"))


def test_the_previous_checkpoint_still_exists_while_the_next_one_is_written(tmp_path):
    save(tmp_path, 1)
    seen = []
    save(tmp_path, 2, FakeAccelerator(on_save=lambda path: seen.append(names(tmp_path))))
    assert seen == [["checkpoint-1", "checkpoint-2.tmp"]], "pruned before the new checkpoint was complete"
    assert names(tmp_path) == ["checkpoint-2"]


def test_a_full_disk_keeps_the_previous_checkpoint_removes_the_tmp_and_says_so(tmp_path):
    save(tmp_path, 1)
    with pytest.raises(CheckpointSaveError) as failure:
        save(tmp_path, 2, FakeAccelerator(on_save=full_disk))
    assert names(tmp_path) == ["checkpoint-1"], "the last good checkpoint must survive a failed save"
    assert sorted(os.listdir(tmp_path / "checkpoint-1")) == ["genrl_config.json", "genrl_state.json", "model.safetensors"]
    assert checkpoint_dirs(str(tmp_path)) == [str(tmp_path / "checkpoint-1")]
    message = str(failure.value)
    assert "\n" not in message and message.count(". ") == 0 and message.endswith(".")
    assert f"the disk holding {tmp_path} is full" in message and "No space left on device" in message
    assert "checkpoint-2.tmp was removed" in message and "checkpoint-1 is kept" in message
    assert isinstance(failure.value.__cause__, OSError) and failure.value.__cause__.errno == errno.ENOSPC


def test_a_failure_after_the_state_was_written_also_cleans_up(tmp_path, monkeypatch):
    save(tmp_path, 1)

    def broken_export(accelerator, model, policy, export_dir, **kwargs):
        raise OSError(errno.EIO, "Input/output error", os.path.join(export_dir, "transformer"))

    monkeypatch.setattr(checkpointing, "export_model", broken_export)
    with pytest.raises(CheckpointSaveError, match=r"writing to .* failed \(OSError: \[Errno 5\] Input/output error") as failure:
        save(tmp_path, 2)
    assert "full" not in str(failure.value)
    assert names(tmp_path) == ["checkpoint-1"]


def test_a_full_disk_reported_without_an_errno_is_still_named(tmp_path, monkeypatch):
    """torch.save says "file write failed" as a RuntimeError; the disk itself tells."""

    def torch_style(path):
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpointing.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 0))
    with pytest.raises(CheckpointSaveError, match="is full .*there is no earlier checkpoint"):
        save(tmp_path, 1, FakeAccelerator(on_save=torch_style))
    assert names(tmp_path) == []


def test_other_errors_pass_through_after_the_cleanup(tmp_path):
    def bug(path):
        raise TypeError("a bug, not the disk")

    with pytest.raises(TypeError, match="a bug"):
        save(tmp_path, 1, FakeAccelerator(on_save=bug))
    assert names(tmp_path) == []


def test_the_limit_counts_the_new_checkpoint_and_never_removes_it(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, total_limit=2)
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-3"]
    (tmp_path / "checkpoint-5.tmp").mkdir()  # left by a run killed while saving
    save(tmp_path, 5, total_limit=None)
    assert [os.path.basename(p) for p in checkpoint_dirs(str(tmp_path))] == ["checkpoint-2", "checkpoint-3", "checkpoint-5"]
    # A checkpoint saved below a later one in the folder (a resume from an older step) survives.
    save(tmp_path, 4, total_limit=1)
    assert names(tmp_path) == ["checkpoint-4"]


@pytest.mark.parametrize("files, expected", [
    ([], "torch"),
    (["pytorch_model/mp_rank_00_model_states.pt"], "deepspeed_zero2"),
    (["pytorch_model/zero_pp_rank_0_mp_rank_00_model_states.pt"], "deepspeed_zero3"),
])
def test_a_checkpoint_without_a_recorded_format_is_read_from_its_files(tmp_path, files, expected):
    (tmp_path / "genrl_state.json").write_text('{"global_step": 1, "epoch": 0}')
    for name in files:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    assert checkpointing.recorded_format(str(tmp_path)) == expected
