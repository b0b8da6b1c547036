"""One run per output folder: the second run into a folder stops in one sentence naming the
holder (host and PID) before any model loads, and a killed holder blocks nobody."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from genrl.checkpoints.output_lock import LOCK_FILE, OutputDirLock, read_holder
from genrl.errors import SetupError

from conftest import ROOT, launch_command, script_env, trainer_exit_in_process

# A holder in a process of its own: prints "held" once it holds the folder, then waits.
HOLDER = ("import sys, time; from genrl.checkpoints.output_lock import OutputDirLock; OutputDirLock(sys.argv[1]).acquire(); "
          "print('held', flush=True); time.sleep(300)")


def start_holder(folder) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], cwd=ROOT, env=script_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def refusal_with_holder(folder, pid: int) -> str:
    """The sentence that refuses a run into ``folder`` while process ``pid`` of this host holds it."""
    return (f"{folder} is in use by another run (PID {pid} on {socket.gethostname()} holds its lock "
            f"{folder / LOCK_FILE}): wait for that run to end or stop it, or pick another --output_dir.")


def refusal(folder) -> str:
    with pytest.raises(SetupError) as refused:
        OutputDirLock(str(folder)).acquire()
    return str(refused.value)


def test_a_second_holder_is_refused_naming_the_first_one_host_and_pid(tmp_path):
    holder = start_holder(tmp_path / "out")
    try:
        message = refusal(tmp_path / "out")
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert message == refusal_with_holder(tmp_path / "out", holder.pid)


def test_a_killed_holder_releases_the_folder(tmp_path):
    holder = start_holder(tmp_path)
    refusal(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    lock = OutputDirLock(str(tmp_path))
    lock.acquire()  # the kernel released the dead holder's lock; its file is still there
    assert read_holder(lock.path) == {"host": socket.gethostname(), "pid": os.getpid()}
    lock.release()


def test_release_and_a_with_block_give_the_folder_back(tmp_path):
    with OutputDirLock(str(tmp_path)) as lock:
        lock.acquire()
        assert str(os.getpid()) in refusal(tmp_path)
    second = OutputDirLock(str(tmp_path))
    second.acquire()
    second.release()


def test_a_forked_child_does_not_keep_the_folder_locked(tmp_path):
    """A worker forked by the run and left behind by a kill must not hold the folder: the child
    closes its copy of the lock's descriptor."""
    lock = OutputDirLock(str(tmp_path))
    lock.acquire()
    forked, ready = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(ready, b"1")  # the fork handlers have run
        time.sleep(60)
        os._exit(0)
    try:
        assert os.read(forked, 1) == b"1"
        lock.release()
        OutputDirLock(str(tmp_path)).acquire()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_holder_that_has_not_written_itself_yet_is_another_process(tmp_path):
    from genrl.checkpoints.output_lock import busy_sentence

    (tmp_path / LOCK_FILE).write_text("")
    assert read_holder(str(tmp_path / LOCK_FILE), patience_s=0.1) is None
    assert "(another process holds its lock" in busy_sentence(str(tmp_path), str(tmp_path / LOCK_FILE), None)


def test_a_second_training_run_is_refused_before_any_model_loads(tiny_sd3, prompt_file, tmp_path, monkeypatch):
    """The folder held by another process (here this one): the trainer stops in one sentence
    naming it, on every rank, before any model loads and without touching the folder."""
    out = tmp_path / "out"
    holder = OutputDirLock(str(out))
    holder.acquire()
    (out / "checkpoint-1").mkdir()
    args = ["--pretrained_model_name_or_path", tiny_sd3, "--prompt_dataset", prompt_file, "--output_dir", str(out),
            "--reward_fn", "jpeg_compressibility", "--overwrite_output_dir", "--report_to", "none"]
    try:
        message = trainer_exit_in_process(args, monkeypatch)
    finally:
        holder.release()
    assert message == f"train_genrl.py: error: {refusal_with_holder(out, os.getpid())}"
    assert (out / "checkpoint-1").is_dir(), "--overwrite_output_dir cleared a folder another run holds"
    # Given back when the trainer stops in this process: the next run into the folder may start.
    lock = OutputDirLock(str(out))
    lock.acquire()
    lock.release()


def test_an_evaluation_into_a_held_folder_is_refused(tmp_path):
    import eval_genrl

    out = tmp_path / "eval"
    with OutputDirLock(str(out)) as holder:
        holder.acquire()
        with pytest.raises(SystemExit) as refused:
            eval_genrl.run(["--model", str(tmp_path / "no-model-needed"), "--output_dir", str(out)])
    assert refused.value.code == f"eval_genrl.py: error: {refusal_with_holder(out, os.getpid())}"
    assert os.listdir(out) == [LOCK_FILE]


@pytest.mark.slow
def test_a_running_training_run_holds_its_folder_against_a_second_one(tiny_sd3, prompt_file, tmp_path, monkeypatch):
    """A real run holds the folder from before its models load until it ends; a second run into
    it meanwhile stops at once, naming it."""
    out = tmp_path / "out"
    args = ["--pretrained_model_name_or_path", tiny_sd3, "--prompt_dataset", prompt_file, "--output_dir", str(out),
            "--reward_fn", "jpeg_compressibility", "--group_size", "4", "--rollout_batch_size", "4",
            "--rollout_batches_per_epoch", "1", "--train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--num_inference_steps", "2", "--num_epochs", "1000", "--report_to", "none"]
    first = subprocess.Popen(launch_command("train_genrl.py", args), cwd=ROOT, env=script_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while (read_holder(str(out / LOCK_FILE), patience_s=0) or {}).get("pid") != first.pid:
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.time() < deadline, "the first run did not take its folder within 120 s"
            time.sleep(0.2)
        message = trainer_exit_in_process(args, monkeypatch)
        assert message == f"train_genrl.py: error: {refusal_with_holder(out, first.pid)}"
        assert first.poll() is None, "the first run stopped"
    finally:
        first.kill()
        first.wait()
    assert json.load(open(out / LOCK_FILE))["pid"] == first.pid, "the refused run wrote over the holder"
