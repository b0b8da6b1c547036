"""More processes than GPUs on one machine: the scripts refuse with one sentence
before NCCL fails with "invalid usage"; the test suite runs its 2-process launches on the
CPU (gloo) on a machine with fewer GPUs than processes."""

import pytest
import torch

from genrl.distributed.launch import build_accelerator, gpu_shortage
from genrl.errors import SetupError

from conftest import launch_command


@pytest.mark.parametrize("processes, gpus", [(1, 0), (2, 0), (1, 1), (2, 2), (8, 8), (4, 8)])
def test_enough_gpus_or_none_at_all_is_fine(processes, gpus):
    assert gpu_shortage(processes, gpus) is None


def test_two_processes_on_one_gpu_name_the_count_that_works():
    assert gpu_shortage(2, 1) == (
        "2 processes were launched on this machine but only 1 GPU(s) are visible, and NCCL needs one GPU per "
        "process: launch with --num_processes 1, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run every process on "
        "the CPU with gloo."
    )


def test_the_accelerator_refuses_before_any_process_group_starts(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SetupError, match=r"^2 processes were launched on this machine but only 1 GPU"):
        build_accelerator(output_dir=str(tmp_path))
    assert not torch.distributed.is_initialized()


def test_multi_process_launches_in_the_tests_hide_gpus_they_cannot_place(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    command = launch_command("train_genrl.py", [], config="zero2", num_processes=2)
    assert command[:2] == ["env", "CUDA_VISIBLE_DEVICES="]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch_command("train_genrl.py", [], config="zero2", num_processes=2)[0] != "env"
    assert launch_command("train_genrl.py", [], config="single_gpu")[0] != "env"
