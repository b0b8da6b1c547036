"""The likelihood-free objectives (--objective nft / awm) through the real train_genrl.py:
one process with LoRA and a KL term (through the shipped single_gpu config), and two
processes: NFT under the shipped ZeRO-2 config, AWM under DDP. (That sharding leaves the
weights unchanged is checked for GRPO in test_train_distributed; the forward-process draws
depend on the sample alone, test_objectives.)"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_script

pytestmark = pytest.mark.slow


def objective_args(model: str, prompts: str, output_dir: str, objective: str, *extra: str) -> list[str]:
    return [
        "--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--reward_fn", "jpeg_compressibility",
        "--output_dir", output_dir, "--objective", objective, "--noise_level", "0", "--no-same_latent",
        "--group_size", "4", "--rollout_batch_size", "4", "--rollout_batches_per_epoch", "1",
        "--train_batch_size", "2", "--gradient_accumulation_steps", "1", "--num_inference_steps", "4",
        "--timestep_fraction", "0.5", "--guidance_scale", "2.0", "--num_epochs", "2", "--report_to", "none",
        "--seed", "3", "--learning_rate", "1e-2", "--adam_epsilon", "1e-4",
        "--eval_prompt_dataset", prompts, "--eval_steps", "2", "--eval_batch_size", "2", "--eval_max_batches", "1",
        *extra,
    ]


def train_lines(output_dir: str) -> list[dict]:
    lines = [json.loads(l) for l in open(os.path.join(output_dir, "logs", "metrics.jsonl"))]
    return [l for l in lines if "train/policy_loss" in l]


def test_nft_with_lora_and_kl_trains_in_one_process(tiny_sd3, prompt_file, tmp_path):
    out = str(tmp_path / "nft-lora")
    # The noisier 3 of the 4 sampling steps (sigmas 1, 0.75, 0.5, 0.25) as the no-argument run's range does.
    run_script("train_genrl.py", objective_args(tiny_sd3, prompt_file, out, "nft", "--use_lora", "--rank", "4",
                                                "--lora_alpha", "4", "--beta", "0.01", "--train_sigma_range", "0.4", "1"),
               config="single_gpu")
    lines = train_lines(out)
    # 4 samples x 2 timesteps in micro batches of 2: 4 backward passes, 2 to an optimizer step.
    assert [l["step"] for l in lines] == [2, 4]
    assert all("train/old_deviation" in l for l in lines)
    # The reference is the adapter switched off: the KL grows from 0 as the adapter trains.
    assert 0 <= lines[0]["train/kl"] < lines[1]["train/kl"]
    lora = load_file(os.path.join(out, "pytorch_lora_weights.safetensors"))
    assert lora and all(torch.isfinite(v).all() for v in lora.values())


@pytest.fixture(scope="module")
def two_process_runs(tiny_sd3, prompt_file, tmp_path_factory):
    out = {}
    for objective, config in (("nft", "zero2"), ("awm", "multi_gpu")):
        output_dir = str(tmp_path_factory.mktemp(f"{objective}-{config}"))
        extra = ("--beta", "0.01") if objective == "awm" else ()
        run_script("train_genrl.py", objective_args(tiny_sd3, prompt_file, output_dir, objective, *extra),
                   config=config, num_processes=2)
        out[objective] = output_dir
    return out


@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_two_processes_train_and_export(two_process_runs, tiny_sd3, objective):
    out = two_process_runs[objective]
    lines = train_lines(out)
    assert [l["step"] for l in lines] == [2, 4]
    assert all(torch.isfinite(torch.tensor(l["train/policy_loss"])) for l in lines)
    trained = load_file(os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors"))
    base = load_file(os.path.join(tiny_sd3, "transformer", "diffusion_pytorch_model.safetensors"))
    assert any(not torch.equal(trained[k], base[k]) for k in base), "training did not change any weight"


def test_a_soft_updated_sampling_policy_lags_the_weights_and_resumes_to_the_same_end(tiny_sd3, prompt_file, tmp_path):
    from diffusers import SD3Transformer2DModel

    out = str(tmp_path / "soft")
    args = objective_args(tiny_sd3, prompt_file, out, "nft", "--sampling_policy_decay_rate", "0.2",
                          "--num_epochs", "3", "--checkpointing_steps", "2", "--resume_from_checkpoint", "latest")
    run_script("train_genrl.py", args)
    assert [l["step"] for l in train_lines(out)] == [2, 4, 6]
    final = load_file(os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors"))

    # The sampling policy is its own set of weights: after step 6 (eta = min(0.2 * 6, 0.5)) it lies
    # between the initial and the trained weights, equal to neither.
    state = torch.load(os.path.join(out, "checkpoint-6", "sampling_policy", "rank0.pt"), weights_only=True)
    names = [n for n, _ in SD3Transformer2DModel.from_pretrained(os.path.join(out, "transformer")).named_parameters()]
    base = load_file(os.path.join(tiny_sd3, "transformer", "diffusion_pytorch_model.safetensors"))
    assert len(state["shadow"]) == len(names)
    shadow = dict(zip(names, state["shadow"]))
    assert any(not torch.equal(shadow[n], final[n]) for n in names), "the sampling policy equals the trained weights"
    assert any(not torch.equal(shadow[n], base[n]) for n in names), "the sampling policy never moved"

    # Killed after checkpoint-2: resuming restores the sampling policy too, so the run ends where
    # the uninterrupted one did (its later rollouts sample from the restored lagging weights).
    for name in ("checkpoint-4", "checkpoint-6", "transformer"):
        shutil.rmtree(os.path.join(out, name))
    run_script("train_genrl.py", args)
    resumed = load_file(os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors"))
    diff = max((resumed[k] - final[k]).abs().max().item() for k in final)
    assert diff <= 1e-6, f"the resumed run ends {diff} away from the uninterrupted one"


@pytest.mark.parametrize("inner_epochs", [1, 2])
def test_on_policy_nft_trains_as_if_every_old_velocity_were_recorded(tiny_sd3, prompt_file, tmp_path, inner_epochs):
    """Two optimizer steps an epoch (four with two inner epochs): the first takes NFT's old
    velocities from its own forward, the later ones from those recorded before it (with two inner
    epochs, every sample's, the first step's included). A sampling policy that follows the weights
    (a soft update of rate 1e-30) records them all: both runs end at the same weights."""
    ends = {}
    for name, extra in (("on-policy", ()), ("all-recorded", ("--sampling_policy_decay_rate", "1e-30"))):
        out = str(tmp_path / name)
        run_script("train_genrl.py", objective_args(tiny_sd3, prompt_file, out, "nft", *extra, "--num_inner_epochs",
                                                    str(inner_epochs)))
        assert [l["step"] for l in train_lines(out)] == [2 * inner_epochs, 4 * inner_epochs]
        ends[name] = load_file(os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors"))
    base = load_file(os.path.join(tiny_sd3, "transformer", "diffusion_pytorch_model.safetensors"))
    assert any(not torch.equal(ends["on-policy"][k], base[k]) for k in base), "training did not change any weight"
    for key, value in ends["all-recorded"].items():
        torch.testing.assert_close(ends["on-policy"][key], value, rtol=1e-5, atol=1e-6)


def test_two_processes_train_only_the_max_variance_samples_of_each_group(tiny_sd3, prompt_file, tmp_path):
    """--train_samples_per_group under ZeRO-2: each rank samples one group of 8 and trains 4 of
    them, so an epoch takes half the optimizer steps of training all 8, on both ranks alike."""
    out = str(tmp_path / "nft-pods")
    args = objective_args(tiny_sd3, prompt_file, out, "nft", "--train_samples_per_group", "4")
    args[args.index("--group_size") + 1] = "8"
    args[args.index("--rollout_batch_size") + 1] = "8"
    proc = run_script("train_genrl.py", args, config="zero2", num_processes=2)
    assert "Samples per process per epoch = 8 (4 trained: the 4 of each group whose rewards vary most)" in proc.stderr
    lines = train_lines(out)
    # 4 trained samples x 2 timesteps in micro batches of 2: 4 backward passes, 2 to an optimizer step.
    assert [l["step"] for l in lines] == [2, 4]
    assert [l["train/kept_fraction"] for l in lines] == [0.5, 0.5]
    assert all(torch.isfinite(torch.tensor(l["train/policy_loss"])) for l in lines)
