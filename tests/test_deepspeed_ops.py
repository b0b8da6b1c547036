"""DeepSpeed's run-time-built ops: the trainer keeps its CPU backend from building the shared-
memory op at every start, and a build lock in the way of an op a run needs stops the run in one
sentence naming the file instead of a launch that waits forever (test_train_distributed runs
ZeRO-2 and ZeRO-3 past a stale lock of the shared-memory op)."""

import os
import subprocess
import threading

import pytest

from genrl.distributed import deepspeed_ops
from genrl.distributed.deepspeed_ops import build_lock_path, check_build_locks, needed_jit_ops, wait_for_build_lock
from genrl.errors import SetupError

from conftest import ROOT, launch_command, script_env, script_errors


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    """A fresh TORCH_EXTENSIONS_DIR."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    return tmp_path / "torch_extensions"


def stale_lock(op: str) -> str:
    path = build_lock_path(op)
    open(path, "w").close()
    return path


def stale_sentence(path: str, op: str) -> str:
    return (f"DeepSpeed's build lock {path} is stale (no process on this machine holds it: a build of its {op} op was "
            f"killed while holding it) and every DeepSpeed launch here would wait on it forever: delete it, unless a "
            f"machine that shares this folder is building {op} right now.")


def test_the_shared_memory_op_is_kept_unbuilt(extensions):
    from deepspeed.comm.torch import build_shm_op

    deepspeed_ops.skip_shm_comm_op()
    assert build_shm_op() is None  # what DeepSpeed's CPU backend calls at its start
    assert not extensions.exists()


def test_ops_built_at_run_time_follow_the_offload_config():
    assert needed_jit_ops({"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}) == []
    assert needed_jit_ops({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}) == ["cpu_adam"]
    assert needed_jit_ops({"offload_optimizer": {"device": "nvme"}}) == ["cpu_adam", "async_io"]
    assert needed_jit_ops({"offload_param": {"device": "nvme"}}) == ["async_io"]


def test_a_lock_no_process_holds_is_stale_at_once(extensions):
    path = stale_lock("cpu_adam")
    assert path == str(extensions / "cpu_adam" / "lock")
    assert wait_for_build_lock(path, "cpu_adam", timeout_s=60) == stale_sentence(path, "cpu_adam")
    assert wait_for_build_lock(str(extensions / "fused_adam" / "lock"), "fused_adam") is None  # no lock at all


def test_a_build_in_progress_is_waited_for(extensions):
    """torch's builder keeps its lock file open while it holds it: this process stands in for it."""
    path = stale_lock("cpu_adam")
    held = os.open(path, os.O_RDONLY)

    def finish():
        os.close(held)
        os.remove(path)

    finishing = threading.Timer(0.5, finish)
    finishing.start()
    try:
        assert wait_for_build_lock(path, "cpu_adam", timeout_s=60, poll_s=0.05) is None
    finally:
        finishing.join()


def test_a_build_that_holds_the_lock_too_long_is_named(extensions):
    path = stale_lock("cpu_adam")
    held = os.open(path, os.O_RDONLY)
    try:
        sentence = wait_for_build_lock(path, "cpu_adam", timeout_s=0.3, poll_s=0.05)
    finally:
        os.close(held)
    assert sentence == (f"PID {os.getpid()} on this machine has held DeepSpeed's build lock {path} for more than 0.3 s "
                        f"building its cpu_adam op: let it finish or stop it, then launch again.")


def test_where_proc_cannot_tell_the_lock_is_waited_for_then_named(extensions, monkeypatch):
    monkeypatch.setattr(deepspeed_ops, "lock_holders", lambda path: None)
    path = stale_lock("cpu_adam")
    sentence = wait_for_build_lock(path, "cpu_adam", timeout_s=0.3, poll_s=0.05)
    assert sentence.startswith(f"DeepSpeed's build lock {path} did not go within 0.3 s: delete it if no process")
    with pytest.raises(SetupError, match="did not go within"):
        check_build_locks({"offload_optimizer": {"device": "cpu"}}, timeout_s=0.1)
    check_build_locks({"offload_optimizer": {"device": "none"}}, timeout_s=0.1)  # an op this run does not need


@pytest.mark.slow
def test_a_stale_lock_of_an_op_the_run_needs_stops_a_launch_in_one_sentence(extensions, tmp_path):
    """zero3_offload.yaml's offloaded optimizer needs cpu_adam, loaded under its lock once the
    model is prepared: each rank, before the process group exists, stops in one sentence naming
    the lock instead (13 s here; building cpu_adam takes minutes, so nothing here builds it)."""
    path = stale_lock("cpu_adam")
    shm = stale_lock("deepspeed_shm_comm")  # left alone: no run builds or loads that op
    out = tmp_path / "out"
    done = subprocess.run(launch_command("train_genrl.py", ["--output_dir", str(out), "--report_to", "none"],
                                         config="zero3_offload", num_processes=2),
                          cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert script_errors(done.stderr) == [f"train_genrl.py: error: {stale_sentence(path, 'cpu_adam')}"] * 2, \
        done.stderr[-3000:]
    assert not out.exists(), "the run got as far as its output folder"
    assert os.path.exists(path) and os.path.exists(shm)
