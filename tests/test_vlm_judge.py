"""The VLM-judge reward against a real OpenAI-compatible server: ``transformers serve`` started on
localhost with a tiny random LLaVA (tests/_tiny_vlm.py), whose answers are nonsense, so the
unparsable-answer path is the one a training run exercises (through the reward service); the
parser itself is pinned on written answers."""

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch

from genrl.math.advantages import combine_rewards, fill_abstentions
from genrl.rewards import build_reward_fn, check_reward_options
from genrl.rewards.lifecycle import clear_reward_models, describe_reward_models
from genrl.rewards.vlm_judge import DEFAULT_TEMPLATE, JudgeClient, frame_indices, parse_score, public_url

from conftest import free_port, run_script, script_env


@pytest.mark.parametrize("answer, expected", [
    ("7", 0.7), ("Score: 8.5/10", 0.85), ("10", 1.0), ("0 - it shows nothing of the sort", 0.0),
    ("I cannot rate this image.", None), ("", None), ("11", None), ("-3", None),
])
def test_the_first_number_of_the_answer_is_the_score_and_anything_else_abstains(answer, expected):
    score, reason = parse_score(answer, 0, 10)
    if expected is None:
        assert math.isnan(score) and reason, "an answer without a score in range must abstain with a reason"
    else:
        assert score == pytest.approx(expected) and reason is None


def test_an_abstention_counts_as_its_groups_average_and_carries_no_signal():
    rewards = torch.tensor([0.2, float("nan"), 0.6, float("nan"), float("nan"), 0.9, 0.1])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    filled = fill_abstentions(rewards, groups)
    assert filled.tolist() == pytest.approx([0.2, 0.4, 0.6, 0.0, 0.0, 0.9, 0.1])
    advantages = combine_rewards({"judge": filled}, {"judge": 1.0}, groups, mode="normalize_each")
    assert advantages[[1, 3, 4]].abs().max() < 1e-6  # 0 up to float32 rounding of the mean
    finite = torch.tensor([0.5, 0.25])
    assert fill_abstentions(finite, torch.tensor([0, 0])) is finite  # nothing to fill: untouched


def test_a_video_sends_frames_spread_over_it_and_a_url_is_recorded_without_its_secrets():
    assert frame_indices(81, 4) == [0, 27, 53, 80] and frame_indices(3, 4) == [0, 1, 2] and frame_indices(1, 4) == [0]
    assert public_url("https://user:key@judge.example:8443/v1?token=abc") == "https://judge.example:8443/v1"


def test_bad_judge_options_are_one_sentence_before_any_model_loads():
    port = free_port()  # nothing listens there
    base = {"base_url": f"http://127.0.0.1:{port}/v1", "model": "m"}
    cases = [
        ({**base, "temperature": 1}, "does not take option"),
        ({"model": "m"}, 'needs the option "base_url"'),
        ({**base, "template": "Rate it."}, "must contain {prompt}"),
        (base, f"the endpoint http://127.0.0.1:{port}/v1 does not answer"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
            check_reward_options({"vlm_judge": options}, ["vlm_judge"])


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    """``transformers serve`` on a free port with the tiny LLaVA preloaded; stopped by its pid."""
    for module in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(module, reason="transformers serve needs transformers[serving] (requirements-serve.txt)")
    from _tiny_vlm import save_tiny_llava

    folder = save_tiny_llava(str(tmp_path_factory.mktemp("tiny-llava")))
    port = free_port()
    command = [shutil.which("transformers") or os.path.join(os.path.dirname(sys.executable), "transformers"), "serve",
               folder, "--device", "cpu", "--port", str(port)]
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w")
    server = subprocess.Popen(command, env=script_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://localhost:{port}"
    try:
        deadline = time.time() + 240
        while True:
            assert server.poll() is None, open(log.name).read()[-3000:]
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                assert time.time() < deadline, "transformers serve did not start within 240 s"
                time.sleep(0.5)
        yield {"base_url": url + "/v1", "model": folder, "max_tokens": 6}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def samples(n: int, frames: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * 10 + frames)
    return torch.rand(n, 3, frames, 32, 32, generator=g)  # the rollout's (N, C, F, H, W) in [0, 1]


@pytest.mark.slow
def test_the_judge_scores_what_its_answer_says_and_the_run_records_its_endpoint_model_and_template(judge, caplog):
    clear_reward_models()
    reward_fn = build_reward_fn("vlm_judge", options={"vlm_judge": judge})  # training's strictness: NaN only by abstaining
    prompts = ["a red circle", "two blue squares", "a green triangle"]
    with caplog.at_level(logging.WARNING, logger="genrl.rewards.vlm_judge"):
        scores = reward_fn(samples(3), prompts)["vlm_judge"]
    client = JudgeClient(**judge)
    from genrl.rewards.layouts import prepare_images
    from genrl.rewards.vlm_judge import judge_request

    for i, frames in enumerate(prepare_images(samples(3))):  # greedy decoding: the same answer when asked again
        answer = client._post(judge_request(frames, prompts[i], model=judge["model"], template=DEFAULT_TEMPLATE, max_tokens=6))
        expected, reason = parse_score(answer, 0, 10)
        assert (math.isnan(expected) and math.isnan(scores[i])) or scores[i] == pytest.approx(expected), (answer, scores[i])
        if reason is not None:
            assert "VLM judge abstained" in caplog.text
    video = reward_fn(samples(2, frames=9), prompts[:2])["vlm_judge"]
    assert video.shape == (2,) and all(math.isnan(v) or 0 <= v <= 1 for v in video.tolist())
    recorded = describe_reward_models()["vlm_judge"]
    assert recorded["model"] == judge["model"] and recorded["template"] == DEFAULT_TEMPLATE
    assert recorded["endpoint"] == judge["base_url"]
    clear_reward_models()


@pytest.mark.slow
def test_a_training_run_judged_by_a_served_vlm_counts_its_abstentions_and_records_the_judge(judge, tiny_sd3, prompt_file,
                                                                                              tmp_path):
    """The judge behind the reward service (serve_rewards.py), as a judge shared by runs is: the
    service reports that it may abstain and what it is, so the run treats it as an in-process
    judge (whose scores and record the test above checks)."""
    pytest.importorskip("ray.serve")
    from _local_server import RewardService

    # Scores in [0, 1]: almost every nonsense answer abstains (a digit above 1, or none).
    with open(tmp_path / "service.log", "w+") as log:
        service = RewardService("vlm_judge", {"vlm_judge": {**judge, "max_score": 1}}, log, env=script_env()).start()
        try:
            output_dir = str(tmp_path / "run")
            run_script("train_genrl.py", [
                "--pretrained_model_name_or_path", tiny_sd3, "--prompt_dataset", prompt_file, "--reward_fn", "vlm_judge",
                "--reward_options", json.dumps({"vlm_judge": {"service": service}}), "--output_dir", output_dir,
                "--group_size", "4", "--rollout_batch_size", "4", "--rollout_batches_per_epoch", "1",
                "--train_batch_size", "4", "--num_inference_steps", "3", "--max_train_steps", "1", "--report_to", "none",
            ])
        finally:
            service.stop()
    line = [json.loads(l) for l in open(os.path.join(output_dir, "logs", "metrics.jsonl"))][-1]
    assert line["reward/vlm_judge_abstained"] > 0
    assert np.isfinite(line["train/grad_norm"])
    recorded = json.load(open(os.path.join(output_dir, "genrl_config.json")))["reward_models"]["vlm_judge"]
    assert recorded["model"] == judge["model"] and "{prompt}" in recorded["template"]
    assert recorded["endpoint"] == judge["base_url"] and recorded["service"] == service
