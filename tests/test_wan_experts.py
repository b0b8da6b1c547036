"""Wan 2.2 A14B (two experts): one of them trained, only on its own steps, the other frozen;
the export holds the trained one in its own subfolder and loads back into a pipeline."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from genrl.checkpoints.checkpointing import load_trained_policy
from genrl.testing.tiny_pipelines import save_tiny_pipeline

from conftest import run_python, run_script, script_errors

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    return save_tiny_pipeline("wan2.2-a14b", tmp_path_factory.mktemp("a14b"))


def args(model, prompts, output_dir, *extra):
    return ["--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--reward_fn", "jpeg_compressibility",
            "--output_dir", output_dir, "--group_size", "2", "--rollout_batch_size", "2", "--rollout_batches_per_epoch", "1",
            "--train_batch_size", "2", "--num_inference_steps", "4", "--max_train_steps", "1", "--report_to", "none",
            "--learning_rate", "1e-2", "--adam_epsilon", "1e-4", *extra]


def weights(folder):
    return load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))


def moved(a, b):
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_nft_trains_the_low_noise_expert_alone_under_zero3_and_eval_reproduces_its_evaluation(a14b, prompt_file, tmp_path):
    # zero3.yaml builds the trained expert partitioned (each rank holds about half of it); the
    # frozen one is loaded whole in the weight dtype on every rank.
    out = str(tmp_path / "low")
    proc = run_script("train_genrl.py", args(a14b, prompt_file, out, "--wan_expert", "low", "--objective", "nft",
                                             "--noise_level", "0", "--timestep_fraction", "0.5", "--guidance_scale", "1",
                                             "--eval_steps", "1", "--eval_prompt_dataset", prompt_file, "--eval_max_batches", "1",
                                             "--eval_batch_size", "2"),
                      config="zero3", num_processes=2)
    held = re.findall(r"\[RANK (\d)\] Transformer built under zero.Init: this rank holds ([\d,]+) of its ([\d,]+)",
                      proc.stdout + proc.stderr)
    assert sorted(rank for rank, _, _ in held) == ["0", "1"], proc.stderr[-3000:]
    for _, part, total in held:
        assert int(part.replace(",", "")) <= 0.55 * int(total.replace(",", ""))
        assert int(total.replace(",", "")) == sum(t.numel() for t in weights(os.path.join(a14b, "transformer_2")).values())
    assert sorted(n for n in os.listdir(out) if n.startswith("transformer")) == ["transformer_2"]
    trained = weights(os.path.join(out, "transformer_2"))
    assert moved(trained, weights(os.path.join(a14b, "transformer_2")))
    policy = load_trained_policy(out)
    assert policy.expert == "low" and policy.transformer is policy.pipeline.transformer_2
    assert all(torch.equal(policy.pipeline.transformer_2.state_dict()[k], trained[k]) for k in trained)
    base = weights(os.path.join(a14b, "transformer"))
    assert not moved(policy.pipeline.transformer.state_dict(), base), "the frozen expert moved"
    # eval_genrl.py on the export, with the settings it reads from it, scores what the run's
    # last evaluation scored.
    evaluations = [json.loads(l) for l in open(os.path.join(out, "logs", "metrics.jsonl")) if '"eval/' in l]
    run_script("eval_genrl.py", ["--model", out, "--output_dir", str(tmp_path / "eval")])
    scores = json.load(open(tmp_path / "eval" / "metrics.json"))
    assert evaluations and "eval/jpeg_compressibility_mean" in evaluations[-1], evaluations
    assert scores["metrics"]["jpeg_compressibility"]["mean"] == pytest.approx(
        evaluations[-1]["eval/jpeg_compressibility_mean"], abs=1e-6), (scores["metrics"], evaluations[-1])


def test_grpo_with_lora_trains_the_high_noise_expert_within_its_steps_under_zero2(a14b, prompt_file, tmp_path):
    out = str(tmp_path / "high")
    run_script("train_genrl.py", args(a14b, prompt_file, out, "--wan_expert", "high", "--use_lora", "--rank", "4",
                                      "--sde_window_size", "1", "--sde_window_range", "0", "1", "--guidance_scale", "2",
                                      "--guidance_scale_2", "1.5"), config="zero2", num_processes=2)
    policy = load_trained_policy(out)
    assert policy.expert == "high" and policy.guidance_scale_2 == 1.5
    assert moved(weights(os.path.join(a14b, "transformer")), policy.pipeline.transformer.state_dict())
    assert not moved(weights(os.path.join(a14b, "transformer_2")), policy.pipeline.transformer_2.state_dict())


def test_a_two_expert_model_needs_its_expert_and_grpo_its_own_steps(a14b, prompt_file, tmp_path):
    proc = run_python("train_genrl.py", args(a14b, prompt_file, str(tmp_path / "none")))
    assert ("is a two-expert Wan 2.2 pipeline (transformer for timesteps from 0.875 x 1000 up, transformer_2 below): choose "
            "the expert to train with --wan_expert high or --wan_expert low" in script_errors(proc.stderr)[0]), proc.stderr[-2000:]
    proc = run_python("train_genrl.py", args(a14b, prompt_file, str(tmp_path / "low"), "--wan_expert", "low"))
    assert script_errors(proc.stderr) == [
        "train_genrl.py: error: --wan_expert low denoises steps 1 to 3 of 4, so GRPO's recorded steps must lie among "
        "them: give --sde_window_size at most 2 and --sde_window_range 1 3 (now 0 and 0 3)."
    ], proc.stderr[-2000:]
