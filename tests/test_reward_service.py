"""The reward service (serve_rewards.py on Ray Serve) and the trainer as its client: one service
for the module, started here on localhost and stopped by its process id. Served scores equal
in-process ones, a run scored through it trains the same weights, two trainer processes share
it, and each fault is bounded: a service that does not answer at start, a wrong count, NaN,
another reward's scores, a service that dies mid-run."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file

from _local_server import start_server, stop_server
from conftest import (
    ROOT, free_port, kill_launch, launch_command, run_script, script_env, script_errors, trainer_exit_in_process,
)
from test_pickscore import folders  # noqa: F401  (the tiny PickScore folders, a module fixture)
from test_train_script import base_args

from genrl.rewards import build_reward_fn, check_reward_options
from genrl.rewards.registry import RewardError
from genrl.toy_scenes import parse_caption, render_scene

pytest.importorskip("ray.serve")

SERVED = "toy_geneval,jpeg_compressibility,pickscore,tests._served_rewards:wrong_count,tests._served_rewards:nan_scores"
TOY_PROMPTS = ["a red circle", "two blue squares", "a green triangle above a red circle"]


class Service(str):
    """The service's URL, and its process (``.proc``)."""

    proc: subprocess.Popen


@pytest.fixture(scope="module")
def service(folders, tmp_path_factory):  # noqa: F811
    """A reward service serving SERVED (PickScore on the tiny CLIP) on a CPU replica: its URL."""
    port = free_port()
    options = json.dumps({"pickscore": {"checkpoint": folders[0], "processor": folders[1]}})
    log = open(tmp_path_factory.mktemp("service") / "service.log", "w+")
    command = [sys.executable, os.path.join(ROOT, "serve_rewards.py"), "--reward_fn", SERVED, "--reward_options", options,
               "--port", str(port), "--num_cpus_per_replica", "1", "--num_cpus", "2", "--batch_wait_s", "0.05"]
    url = Service(f"http://127.0.0.1:{port}")
    url.proc = start_server(command, f"{url}/health", log, cwd=ROOT, env=script_env())
    try:
        yield url
    finally:
        stop_server(url.proc)
        log.close()


def served(url: str, names: str, **client) -> dict:
    return {name: {"service": url, **client} for name in names.split(",")}


def toy_samples(n: int) -> torch.Tensor:
    """float ``(n, 3, 1, 32, 32)`` in [0, 1]: the toy scenes of TOY_PROMPTS, noised off the uint8 grid."""
    images = [render_scene(parse_caption(TOY_PROMPTS[i % 3]), np.random.default_rng(i), 32) for i in range(n)]
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)[:, :, None].float() / 255.0
    return (x + 0.002 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)


@pytest.mark.slow  # starts the service
def test_served_scores_equal_in_process_scores_also_when_requests_are_batched(service, folders):  # noqa: F811
    names = "toy_geneval,jpeg_compressibility,pickscore"
    local = build_reward_fn(names, options={"pickscore": {"checkpoint": folders[0], "processor": folders[1]}})
    remote = build_reward_fn(names, options=served(service, names))
    batches = [toy_samples(6)[i : i + 3] for i in (0, 3)]
    prompts = [TOY_PROMPTS, TOY_PROMPTS[::-1]]
    results = [None, None]

    def score(i):
        results[i] = remote(batches[i], prompts[i])

    # Two requests at once, as two trainer processes send them: the service joins them into one batch.
    threads = [threading.Thread(target=score, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i in range(2):
        expected = local(batches[i], prompts[i])
        for name in names.split(","):
            assert results[i][name].dtype == torch.float32
            assert (results[i][name] - expected[name]).abs().max() <= 1e-6, (name, results[i][name], expected[name])
    assert results[0]["toy_geneval"].max() > 0 and results[0]["pickscore"].std() > 0, "scores too trivial to compare"


@pytest.mark.slow  # starts the service
def test_a_wrong_count_or_nan_from_the_service_is_refused_as_in_process(service):
    samples, prompts = toy_samples(2), TOY_PROMPTS[:2]
    for name, sentence in [("tests._served_rewards:wrong_count", "returned shape (3,), expected (2,)"),
                           ("tests._served_rewards:nan_scores", "returned non-finite scores [nan, nan]")]:
        with pytest.raises(RewardError) as local:
            build_reward_fn(name)(samples, prompts)
        with pytest.raises(RewardError) as remote:
            build_reward_fn(name, options=served(service, name))(samples, prompts)
        assert sentence in str(local.value) and sentence in str(remote.value), (local.value, remote.value)
        assert len(str(remote.value).splitlines()) == 1


@pytest.mark.slow  # starts the service
def test_another_rewards_service_is_refused_at_start_and_mid_run(service):
    with pytest.raises(ValueError, match=r"serves \[.*\], not 'temporal_smoothness'"):
        check_reward_options(served(service, "temporal_smoothness"), ["temporal_smoothness"])
    with pytest.raises(RewardError, match=r"serves \[.*\], not 'temporal_smoothness'"):
        build_reward_fn("temporal_smoothness", options=served(service, "temporal_smoothness"))(toy_samples(2), TOY_PROMPTS[:2])


def test_a_service_that_does_not_answer_is_one_sentence_before_any_model_loads(tiny_sd3, prompt_file, tmp_path, monkeypatch,
                                                                                 capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert trainer_exit_in_process([
        "--pretrained_model_name_or_path", tiny_sd3, "--prompt_dataset", prompt_file, "--output_dir", str(tmp_path),
        "--reward_fn", "hpsv3", "--reward_options", json.dumps(served(url, "hpsv3"))], monkeypatch) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith(f"train_genrl.py: error: The reward service for 'hpsv3' at {url} does not answer ("), message
    assert "serve_rewards.py" in message and len(message.splitlines()) == 1


def train_args(model: str, prompts: str, output_dir: str, *extra: str) -> list[str]:
    """test_train_script's short run (jpeg_compressibility), one epoch."""
    return base_args(model, prompts, output_dir, "--num_epochs", "1", *extra)


def trained_weights(output_dir) -> dict:
    return load_file(os.path.join(output_dir, "transformer", "diffusion_pytorch_model.safetensors"))


@pytest.mark.slow  # starts the service
def test_a_run_through_the_service_trains_the_same_weights(service, tiny_sd3, prompt_file, tmp_path):
    local, remote = str(tmp_path / "local"), str(tmp_path / "served")
    run_script("train_genrl.py", train_args(tiny_sd3, prompt_file, local))
    run_script("train_genrl.py", train_args(tiny_sd3, prompt_file, remote, "--reward_options",
                                            json.dumps(served(service, "jpeg_compressibility"))))
    expected, got = trained_weights(local), trained_weights(remote)
    assert all(torch.equal(expected[k], got[k]) for k in expected), "served scores trained other weights"
    base = load_file(os.path.join(tiny_sd3, "transformer", "diffusion_pytorch_model.safetensors"))
    assert any(not torch.equal(expected[k], v) for k, v in base.items()), "nothing trained"


@pytest.mark.slow  # starts the service
def test_two_processes_share_the_service_and_its_death_stops_them_in_one_sentence_with_the_checkpoint_intact(
        service, tiny_sd3, prompt_file, tmp_path):
    """A 2-process run, each rank sending its own batches, scores an epoch through the service; then
    the service dies (last in this module: it is the module's service) and the run stops."""
    out = tmp_path / "run"
    options = json.dumps(served(service, "jpeg_compressibility", timeout=5, retries=1))
    args = train_args(tiny_sd3, prompt_file, str(out), "--reward_options", options, "--num_epochs", "500",
                      "--checkpointing_steps", "2")
    log = tmp_path / "stderr.log"
    with open(log, "w") as stderr:
        run = subprocess.Popen(launch_command("train_genrl.py", args, config="multi_gpu", num_processes=2), cwd=ROOT, env=script_env(), stdout=subprocess.DEVNULL,
                               stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint-2").is_dir() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (out / "checkpoint-2").is_dir(), f"the run made no checkpoint: {log.read_text()[-3000:]}"
        logged = [json.loads(line) for line in open(out / "logs" / "metrics.jsonl")]
        assert logged and "reward/jpeg_compressibility_mean" in logged[0]
        root = psutil.Process(service.proc.pid)
        for p in root.children(recursive=True) + [root]:  # the service's whole process tree, at once: a crash
            p.kill()
        returncode = run.wait(timeout=120)  # 2 tries of at most 5 s each, 1 s apart, per rank
    finally:
        if run.poll() is None:
            kill_launch(run)
    stderr = log.read_text()
    assert returncode == 1, stderr[-3000:]
    errors = script_errors(stderr)
    assert errors and all(e.startswith("train_genrl.py: error: The reward service for 'jpeg_compressibility' at ")
                          and "did not answer 2 tries" in e for e in errors), stderr[-3000:]
    checkpoints = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert checkpoints and not any(name.endswith(".tmp") for name in checkpoints), checkpoints
    assert os.listdir(out / checkpoints[-1]), "the last checkpoint is empty"
