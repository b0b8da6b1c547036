"""A stopped rank does not hang the run: with --collective_timeout the rank left
waiting fails within the timeout, naming itself and the collective it waited in."""

import contextlib
import os
import signal
import subprocess
import time

import psutil
import pytest

from conftest import launch_command, script_env, script_errors

TIMEOUT_S = 15


def rank_process(launcher_pid: int, rank: int) -> psutil.Process | None:
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if "train_genrl.py" in " ".join(child.cmdline()) and child.environ().get("RANK") == str(rank):
                return child
        except psutil.Error:
            continue
    return None


@pytest.mark.slow
def test_a_stopped_rank_under_zero2_ends_the_run_within_the_timeout(tiny_sd3, prompt_file, tmp_path):
    out = str(tmp_path / "out")
    args = [
        "--pretrained_model_name_or_path", tiny_sd3, "--prompt_dataset", prompt_file, "--reward_fn", "jpeg_compressibility",
        "--output_dir", out, "--group_size", "4", "--rollout_batch_size", "4", "--rollout_batches_per_epoch", "1",
        "--train_batch_size", "2", "--num_inference_steps", "3", "--num_epochs", "1000", "--report_to", "none",
        "--collective_timeout", str(TIMEOUT_S),
    ]
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(launch_command("train_genrl.py", args, config="zero2", num_processes=2), env=script_env(),
                                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    stopped = None
    try:
        metrics, deadline = os.path.join(out, "logs", "metrics.jsonl"), time.time() + 300
        while not os.path.exists(metrics):  # both ranks are past set-up and in the training loop
            assert proc.poll() is None, stderr_path.read_text()[-3000:]
            assert time.time() < deadline, "no epoch finished within 300 s"
            time.sleep(0.2)
        stopped = rank_process(proc.pid, 1)
        assert stopped is not None
        stopped.send_signal(signal.SIGSTOP)
        start = time.time()
        # Rank 0 says its sentence and exits; the launcher would then give the stopped rank 30 s
        # to take SIGTERM (it cannot while stopped) before killing it, so the test ends it itself.
        while "Rank 0 waited more than" not in stderr_path.read_text() and proc.poll() is None:
            assert time.time() < start + TIMEOUT_S + 150, "rank 0 still waits long after the timeout"
            time.sleep(0.2)
        waited = time.time() - start
        stopped.kill()
        proc.wait(timeout=120)
    finally:  # the ranks run in their own process groups: end each one (a stopped one included)
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if stopped is not None:
            with contextlib.suppress(psutil.Error):
                stopped.kill()
    text = stderr_path.read_text()
    assert proc.returncode != 0
    errors = [e for e in script_errors(text) if e.startswith("train_genrl.py: error: Rank 0 waited more than")]
    assert errors, text[-3000:]
    assert errors[0].startswith(f"train_genrl.py: error: Rank 0 waited more than --collective_timeout {TIMEOUT_S} s in ")
    assert "one of them is hung, stopped or dead" in errors[0]
    assert TIMEOUT_S <= waited < TIMEOUT_S + 150


def test_the_timeout_sentence_names_the_rank_and_the_operation(monkeypatch):
    from genrl.distributed.launch import describe_timeout
    namespace = {}
    exec(compile("def all_gather_into_tensor():\n    raise RuntimeError('[gloo/pair.cc:534] Timed out waiting 20000ms for recv operation')\n",
                 "/site-packages/torch/distributed/distributed_c10d.py", "exec"), namespace)
    monkeypatch.setenv("RANK", "3")
    try:
        namespace["all_gather_into_tensor"]()
    except RuntimeError as err:
        message = describe_timeout(err, 20)
    assert message == (
        "Rank 3 waited more than --collective_timeout 20 s in all_gather_into_tensor for the other processes "
        "([gloo/pair.cc:534] Timed out waiting 20000ms for recv operation): one of them is hung, stopped or dead, "
        "so the run was ended."
    )
    assert describe_timeout(RuntimeError("CUDA out of memory"), 20) is None
    assert describe_timeout(ValueError("timed out"), 20) is None
