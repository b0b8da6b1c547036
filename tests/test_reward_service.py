"""The reward service (serve_rewards.py on Ray Serve) and the trainer as its client: one service
for the module, started here on localhost and stopped by its process id. Served scores equal
in-process ones, an abstaining reward abstains through it as in-process, a run scored through it
trains the same weights, two trainer processes share it, and each fault is bounded: a service
that does not answer at start, a wrong count, NaN, another reward's scores, a service that
restarts mid-run (the run waits for it) and one that dies (the run stops)."""

import json
import os
import re
import subprocess
import threading
import time

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file
from test_pickscore import folders  # noqa: F401  (the tiny PickScore folders, a module fixture)
from test_train_script import base_args

from genrl.data.toy_scenes import parse_caption, render_scene
from genrl.rewards import build_reward_fn, check_reward_options
from genrl.rewards.registry import RewardError
from genrl.rewards.service import ServedReward, check_service_options, pause_before_try

from _local_server import RewardService
from _tiny_qwen2vl import save_tiny_hpsv3, save_tiny_videoalign, smooth_images
from conftest import (
    ROOT,
    free_port,
    kill_launch,
    launch_command,
    run_python,
    run_script,
    script_env,
    script_errors,
    trainer_exit_in_process,
)

pytest.importorskip("ray.serve")

HELD = "tests._served_rewards:held_jpeg"
ABSTAINS = "tests._served_rewards:abstains"
SERVED = (f"toy_geneval,jpeg_compressibility,pickscore,hpsv3,videoalign_mq,videoalign_ta,tests._served_rewards:wrong_count,"
          f"tests._served_rewards:nan_scores,{ABSTAINS},{HELD}")
TOY_PROMPTS = ["a red circle", "two blue squares", "a green triangle above a red circle"]


@pytest.fixture(scope="module")
def qwen2vl_options(tmp_path_factory) -> dict:
    """``--reward_options`` of HPSv3 and VideoAlign on tiny Qwen2-VL checkpoints (small pixel budgets)."""
    hpsv3 = save_tiny_hpsv3(tmp_path_factory.mktemp("hpsv3"))
    videoalign = {"checkpoint": save_tiny_videoalign(tmp_path_factory.mktemp("videoalign"))["ckpt"],
                  "min_pixels": 56 * 84, "max_pixels": 56 * 84}
    return {"hpsv3": {"checkpoint": hpsv3["ckpt"], "base_model": hpsv3["base"], "template_path": hpsv3["template"],
                      "pixels": 112 * 112},
            "videoalign_mq": videoalign, "videoalign_ta": videoalign}


@pytest.fixture(scope="module")
def service(folders, qwen2vl_options, tmp_path_factory):  # noqa: F811
    """A reward service serving SERVED (PickScore, HPSv3 and VideoAlign on tiny models) on a CPU
    replica: its URL; ``.hold``: the file that holds HELD's answers while it exists."""
    folder = tmp_path_factory.mktemp("service")
    hold = str(folder / "hold")
    options = {"pickscore": {"checkpoint": folders[0], "processor": folders[1]}, HELD: {"hold": hold}, **qwen2vl_options}
    with open(folder / "service.log", "w+") as log:
        url = RewardService(SERVED, options, log, env=script_env()).start()
        url.hold = hold
        try:
            yield url
        finally:
            url.stop()


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
def test_served_hpsv3_and_videoalign_scores_equal_in_process_scores(service, qwen2vl_options):
    names = "hpsv3,videoalign_mq,videoalign_ta"
    local = build_reward_fn(names, options=qwen2vl_options)
    remote = build_reward_fn(names, options=served(service, names))
    # Two clips of 4 smooth frames at VideoAlign's pixel budget, float (N, C, F, H, W) in [0, 1].
    clips = smooth_images(8, 56, 84, seed=3).reshape(2, 4, 56, 84, 3).permute(0, 4, 1, 2, 3).float() / 255
    prompts = ["a slow pan over hills", "a cat jumps"]
    expected, got = local(clips, prompts), remote(clips, prompts)
    for name in names.split(","):
        assert (got[name] - expected[name]).abs().max() <= 1e-6, (name, got[name], expected[name])
        assert got[name].std() > 0, f"{name}: scores too trivial to compare"


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
def test_an_abstaining_reward_abstains_through_the_service_as_in_process(service):
    """The service reports that the reward may abstain: its NaN reaches training as the
    in-process reward's does (a NaN of any other reward is refused, test above)."""
    samples, prompts = toy_samples(4), TOY_PROMPTS + TOY_PROMPTS[:1]
    local = build_reward_fn(ABSTAINS)(samples, prompts)[ABSTAINS]  # training's strictness: NaN only by abstaining
    remote = build_reward_fn(ABSTAINS, options=served(service, ABSTAINS))(samples, prompts)[ABSTAINS]
    assert local[1::2].isnan().all() and not local[::2].isnan().any() and local[::2].min() > 0, local
    assert remote[1::2].isnan().all() and (remote[::2] - local[::2]).abs().max() <= 1e-6, (remote, local)


@pytest.mark.slow  # starts the service
def test_another_rewards_service_is_refused_at_start_and_mid_run(service):
    with pytest.raises(ValueError, match=r"serves \[.*\], not 'temporal_smoothness'"):
        check_reward_options(served(service, "temporal_smoothness"), ["temporal_smoothness"])
    with pytest.raises(RewardError, match=r"serves \[.*\], not 'temporal_smoothness'"):
        build_reward_fn("temporal_smoothness", options=served(service, "temporal_smoothness"))
    # Mid-run (the service at that address was replaced by another): its answer is refused.
    with pytest.raises(RewardError, match=r"serves \[.*\], not 'temporal_smoothness'"):
        ServedReward("temporal_smoothness", service)(toy_samples(2), TOY_PROMPTS[:2])


def test_a_service_that_does_not_answer_is_one_sentence_before_any_model_loads(tiny_sd3, prompt_file, tmp_path, monkeypatch,
                                                                                 capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert trainer_exit_in_process([
        "--pretrained_model_name_or_path", tiny_sd3, "--prompt_dataset", prompt_file, "--output_dir", str(tmp_path),
        "--reward_fn", "hpsv3", "--reward_options", json.dumps(served(url, "hpsv3"))], monkeypatch) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith(f"train_genrl.py: error: The reward service for 'hpsv3' at {url} does not answer ("), message
    assert "serve_rewards.py" in message and len(message.splitlines()) == 1


def test_a_wait_for_a_service_is_bounded_and_its_pauses_double_then_poll():
    assert [pause_before_try(k, retries=3) for k in (1, 2, 3, 4, 5)] == [1, 2, 4, 5, 5]
    assert pause_before_try(7, retries=10) == 30  # doubling stops at 30 s
    with pytest.raises(ValueError, match="'wait_s' must be a number of seconds >= 0, got -1"):
        check_service_options("hpsv3", {"service": "http://127.0.0.1:1", "wait_s": -1})
    client = ServedReward("hpsv3", f"http://127.0.0.1:{free_port()}", retries=0, wait_s=1.5)  # nothing listens there
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"did not answer [2-9] tries in \d s \(ConnectionRefusedError.*checkpoint intact\.$"):
        client(toy_samples(1), TOY_PROMPTS[:1])
    assert 1.5 <= time.monotonic() - started < 5


def train_args(model: str, prompts: str, output_dir: str, *extra: str) -> list[str]:
    """test_train_script's short run (jpeg_compressibility), one epoch."""
    return base_args(model, prompts, output_dir, "--num_epochs", "1", *extra)


def trained_weights(output_dir) -> dict:
    return load_file(os.path.join(output_dir, "transformer", "diffusion_pytorch_model.safetensors"))


@pytest.fixture(scope="module")
def in_process_weights(tiny_sd3, prompt_file, tmp_path_factory) -> dict:
    """The weights of train_args' run scored in-process."""
    output_dir = str(tmp_path_factory.mktemp("in-process"))
    run_script("train_genrl.py", train_args(tiny_sd3, prompt_file, output_dir))
    weights = trained_weights(output_dir)
    base = load_file(os.path.join(tiny_sd3, "transformer", "diffusion_pytorch_model.safetensors"))
    assert any(not torch.equal(weights[k], v) for k, v in base.items()), "nothing trained"
    return weights


@pytest.mark.slow  # starts the service
def test_a_run_through_the_service_trains_the_same_weights(service, in_process_weights, tiny_sd3, prompt_file, tmp_path):
    remote = str(tmp_path / "served")
    run_script("train_genrl.py", train_args(tiny_sd3, prompt_file, remote, "--reward_options",
                                            json.dumps(served(service, "jpeg_compressibility"))))
    got = trained_weights(remote)
    assert all(torch.equal(in_process_weights[k], got[k]) for k in in_process_weights), "served scores trained other weights"


@pytest.mark.slow  # starts the service, restarts it
def test_a_run_waits_for_a_service_that_restarts_mid_run_and_trains_the_same_weights(
        service, in_process_weights, tiny_sd3, prompt_file, tmp_path):
    """HELD (jpeg_compressibility's scores) keeps the run's first request on the service until the
    service is stopped under it; the run waits (wait_s) while it starts again on the same port,
    then finishes as if nothing had happened."""
    open(service.hold, "w").close()
    output_dir = str(tmp_path / "run")
    options = {HELD: {"service": service, "timeout": 60, "retries": 0, "wait_s": 300}}
    args = train_args(tiny_sd3, prompt_file, output_dir, "--reward_fn", HELD, "--reward_options", json.dumps(options))
    result = {}
    run = threading.Thread(target=lambda: result.update(proc=run_python("train_genrl.py", args, timeout=540)))
    run.start()
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(service.hold + ".reached") and run.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.exists(service.hold + ".reached"), "the run's first request never reached the service"
        service.stop()  # the run's request is still on it
    finally:
        os.remove(service.hold)
        if service.proc.poll() is not None:
            service.start()  # on the same port, for the run and the tests after this one
    run.join(timeout=600)
    proc = result["proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "does not answer" in proc.stderr and "waiting up to" in proc.stderr and "answers again after" in proc.stderr, \
        proc.stderr[-3000:]
    got = trained_weights(output_dir)
    assert all(torch.equal(in_process_weights[k], got[k]) for k in in_process_weights), "the restart changed the weights"


@pytest.mark.slow  # starts the service
def test_two_processes_share_the_service_and_its_death_stops_them_in_one_sentence_with_the_checkpoint_intact(
        service, tiny_sd3, prompt_file, tmp_path):
    """A 2-process run, each rank sending its own batches, scores an epoch through the service; then
    the service dies (last in this module: it is the module's service) and does not come back
    within the run's wait: the run stops."""
    out = tmp_path / "run"
    options = json.dumps(served(service, "jpeg_compressibility", timeout=5, retries=1, wait_s=3))
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
        returncode = run.wait(timeout=120)  # tries of at most 5 s each for 3 s past the first failure, per rank
    finally:
        if run.poll() is None:
            kill_launch(run)
    stderr = log.read_text()
    assert returncode == 1, stderr[-3000:]
    errors = script_errors(stderr)
    assert errors and all(e.startswith("train_genrl.py: error: The reward service for 'jpeg_compressibility' at ")
                          and re.search(r"did not answer [2-9] tries in \d+ s \(.*its last checkpoint intact", e)
                          for e in errors), stderr[-3000:]
    checkpoints = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert checkpoints and not any(name.endswith(".tmp") for name in checkpoints), checkpoints
    assert os.listdir(out / checkpoints[-1]), "the last checkpoint is empty"
