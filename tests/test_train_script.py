"""train_genrl.py in one process: LoRA and full fine-tuning, EMA export, argument errors."""

import json
import os
import subprocess

import pytest
import torch
from conftest import assert_help_documents_each_section, run_script
from safetensors.torch import load_file

from genrl.training import train_args


def base_args(model: str, prompts: str, output_dir: str, *extra: str) -> list[str]:
    return [
        "--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--reward_fn", "jpeg_compressibility",
        "--output_dir", output_dir, "--group_size", "4", "--rollout_batch_size", "4", "--rollout_batches_per_epoch", "2",
        "--train_batch_size", "4", "--num_inference_steps", "4", "--num_epochs", "2", "--report_to", "none",
        "--learning_rate", "1e-2", *extra,
    ]


def metrics(output_dir: str) -> list[dict]:
    return [json.loads(l) for l in open(os.path.join(output_dir, "logs", "metrics.jsonl"))]


def test_lora_with_kl_to_the_adapter_free_reference(tiny_sd3, prompt_file, tmp_path):
    from genrl.checkpoints.checkpointing import load_trained_policy

    out = str(tmp_path / "lora")
    proc = run_script("train_genrl.py", base_args(tiny_sd3, prompt_file, out, "--use_lora", "--rank", "4",
                                                  "--lora_alpha", "4", "--beta", "0.1", "--lora_target_modules", "to_q,to_v",
                                                  "--mixed_precision", "bf16", "--gradient_checkpointing",
                                                  "--reward_mode", "sync", "--cpu_threads", "2"))
    # Without DeepSpeed bf16 is autocast: the adapter stays float32.
    assert "Trained weights in float32, the optimizer's master weights in float32." in proc.stderr + proc.stdout
    # accelerate launch would leave the process one thread (OMP_NUM_THREADS=1); the flag gives it two.
    assert "2 torch thread(s) per process on the CPU (--cpu_threads 2)." in proc.stderr + proc.stdout
    lora = load_file(os.path.join(out, "pytorch_lora_weights.safetensors"))
    assert lora and all("lora" in k for k in lora)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in lora.items()), "LoRA B stayed zero: nothing trained"
    assert not os.path.exists(os.path.join(out, "transformer")), "LoRA runs export the adapter, not the transformer"
    logged = metrics(out)
    assert len(logged) == 2 and all("reward/jpeg_compressibility_mean" in l for l in logged)
    assert logged[-1]["train/kl"] > 0, "after an update the adapter-free reference must differ"

    trained = load_trained_policy(out)
    base = load_trained_policy(tiny_sd3)
    diffs = [(p - q).abs().max().item() for p, q in zip(trained.transformer.parameters(), base.transformer.parameters())]
    assert max(diffs) > 0, "the exported adapter did not change the loaded transformer"


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_deepspeed_bf16_trains_bf16_weights_from_fp32_masters(tiny_sd3, prompt_file, tmp_path, config):
    """The bf16-weights lever (fused bf16 kernels, half the weight memory): DeepSpeed's bf16 mode,
    also with one process. The forward runs bf16 weights, the optimizer steps fp32 masters, and
    the update's recomputed log-probs still match the rollout's. Under ZeRO-3 the transformer is
    built partitioned (zero3.yaml's zero3_init_flag), its bf16 weights written in from the fp32 files."""
    out = str(tmp_path / "bf16")
    proc = run_script("train_genrl.py", base_args(tiny_sd3, prompt_file, out, "--num_epochs", "1", "--mixed_precision",
                                                  "bf16", "--learning_rate", "1e-3"), config=config, num_processes=1)
    assert "Trained weights in bfloat16, the optimizer's master weights in float32." in proc.stderr + proc.stdout
    logged = [l for l in metrics(out) if "train/ratio_min" in l][-1]
    assert 0 <= logged["train/approx_kl"] < 1e-3
    assert 0.95 < logged["train/ratio_min"] <= logged["train/ratio_max"] < 1.05
    trained = load_file(os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors"))
    base = load_file(os.path.join(tiny_sd3, "transformer", "diffusion_pytorch_model.safetensors"))
    key = "norm_out.linear.weight"
    assert trained[key].dtype == torch.bfloat16 and not torch.equal(trained[key].float(), base[key].bfloat16().float())


def test_full_finetuning_with_ema_and_kl_to_a_frozen_copy(tiny_sd3, prompt_file, tmp_path):
    from genrl.checkpoints.checkpointing import load_trained_policy

    out = str(tmp_path / "full")
    run_script("train_genrl.py", base_args(tiny_sd3, prompt_file, out, "--use_ema", "--ema_decay", "0.5",
                                           "--ema_update_interval", "2", "--checkpointing_steps", "2",
                                           "--beta", "0.05"))
    trained = load_file(os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors"))
    ema = load_file(os.path.join(out, "transformer_ema", "diffusion_pytorch_model.safetensors"))
    base = load_file(os.path.join(tiny_sd3, "transformer", "diffusion_pytorch_model.safetensors"))
    key = "norm_out.linear.weight"
    assert not torch.equal(trained[key], base[key])
    # 2 optimizer steps per epoch, interval 2: the shadow was updated once per epoch, so it
    # lies strictly between the base and the trained weights.
    assert not torch.equal(ema[key], trained[key]) and not torch.equal(ema[key], base[key])
    assert json.load(open(os.path.join(out, "genrl_config.json")))["has_ema"] is True
    assert os.path.isfile(os.path.join(out, "checkpoint-4", "ema", "rank0.pt"))
    assert metrics(out)[-1]["train/kl"] > 0, "the frozen reference copy must drift from the trained weights"
    policy = load_trained_policy(os.path.join(out, "checkpoint-4"), use_ema=True)
    loaded = dict(policy.transformer.named_parameters())[key]
    torch.testing.assert_close(loaded, ema[key])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--group_size", "3"], "group"),
        (["--reward_fn", "no_such_reward"], "jpeg_compressibility"),
        (["--pretrained_model_name_or_path", "/no/such/model"], "/no/such/model"),
        (["--sde_window_size", "9"], "sde_window_size"),
        (["--attention_backend", "fastest"], "native, sage"),  # the valid names, listed
        (["--peak_tflops", "0"], "--peak_tflops"),
        (["--objective", "grpo", "--sampling_policy_decay_rate", "0.001"], "nft or awm"),
        (["--objective", "nft", "--sampling_policy_decay_max", "1.0"], "--sampling_policy_decay_max in [0, 1)"),
        (["--lr_step_rules", "1:200,0.5"], "--lr_step_rules goes with --lr_scheduler piecewise_constant"),
        (["--lr_scheduler", "piecewise_constant"], "that scheduler needs the rules"),
        (["--lr_scheduler", "piecewise_constant", "--lr_step_rules", "1:200"], "'1:200' is not of the form"),
    ],
)
def test_bad_arguments_fail_with_one_sentence_before_loading(tiny_sd3, prompt_file, tmp_path, capsys, extra, message):
    args = base_args(tiny_sd3, prompt_file, str(tmp_path / "out"), *extra)
    with pytest.raises(SystemExit) as exit_info:
        train_args.parse_args(args)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("train_genrl.py: error:") or "error:" in error
    assert message in error


def test_kl_reference_copy_is_refused_under_zero3(tiny_sd3, prompt_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")  # what accelerate launch sets for zero3.yaml
    with pytest.raises(SystemExit):
        train_args.parse_args(base_args(tiny_sd3, prompt_file, str(tmp_path / "out"), "--beta", "0.1"))
    assert "ZeRO-3" in capsys.readouterr().err
    train_args.parse_args(base_args(tiny_sd3, prompt_file, str(tmp_path / "out"), "--beta", "0.1", "--use_lora"))


def test_compile_is_refused_under_zero3(tiny_sd3, prompt_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(SystemExit):
        train_args.parse_args(base_args(tiny_sd3, prompt_file, str(tmp_path / "out"), "--compile"))
    assert "--compile does not work under ZeRO-3" in capsys.readouterr().err
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert train_args.parse_args(base_args(tiny_sd3, prompt_file, str(tmp_path / "out"), "--compile")).compile


def test_a_missing_attention_backend_is_refused_before_any_model_loads(tiny_sd3, prompt_file, tmp_path, monkeypatch):
    from conftest import trainer_exit_in_process

    args = base_args(tiny_sd3, prompt_file, str(tmp_path / "out"), "--attention_backend", "flash")
    message = trainer_exit_in_process(args, monkeypatch)
    assert message.startswith("train_genrl.py: error: --attention_backend flash cannot be used here: "), message
    assert "flash-attn" in message and "\n" not in message


@pytest.mark.parametrize("inner_epochs", [1, 2])
def test_throughput_and_counted_flops_are_logged_every_epoch(tiny_sd3, prompt_file, tmp_path, inner_epochs):
    """NFT on 4-step CFG rollouts: per epoch 8 samples x 4 steps x 2 (CFG) rollout forwards, 8
    samples x 2 trained timesteps of training forwards with their backward, and old-velocity
    forwards (no grad, conditional) only for the second batch's 4 samples x 2 timesteps: the
    first optimizer step (accumulation 2 = one batch's 2 timesteps) still runs on the sampling
    weights and takes its old velocity from its own forward. Each priced at FlopCounterMode's
    count of the saved transformer, taken here on the real module. With two inner epochs every
    sample comes back after the weights move: each has its old velocity recorded once (8 x 2),
    and the training forwards double."""
    from test_throughput import counted_on_cpu

    from genrl.policies import load_policy

    out = str(tmp_path / "out")
    run_script("train_genrl.py", base_args(tiny_sd3, prompt_file, out, "--objective", "nft", "--noise_level", "0",
                                           "--no-same_latent", "--timestep_fraction", "0.5", "--peak_tflops", "0.5",
                                           "--num_inner_epochs", str(inner_epochs)))
    policy = load_policy(tiny_sd3)
    forward, train = counted_on_cpu(policy, policy.transformer.requires_grad_(True))
    logged = metrics(out)
    assert len(logged) == 2
    for epoch in logged:
        old_velocity_forwards = 4 * 2 if inner_epochs == 1 else 8 * 2
        assert epoch["perf/transformer_flops"] == (8 * 4 * 2 + old_velocity_forwards) * forward + inner_epochs * 8 * 2 * train
        assert epoch["time/samples_per_s"] == pytest.approx(8 / epoch["time/epoch_s"])
        assert epoch["perf/transformer_tflops"] == pytest.approx(epoch["perf/transformer_flops"] / epoch["time/epoch_s"] / 1e12)
        assert epoch["perf/mfu"] == pytest.approx(epoch["perf/transformer_tflops"] / 0.5)
        assert epoch["perf/rollout_tflops"] > 0 and epoch["perf/train_tflops"] > 0
        assert epoch["time/epoch_s"] >= epoch["time/rollout_s"] + epoch["time/train_s"]


def test_empty_prompt_file_is_refused_before_any_model_loads(tiny_sd3, tmp_path, monkeypatch):
    from conftest import trainer_exit_in_process

    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    message = trainer_exit_in_process(base_args(tiny_sd3, str(empty), str(tmp_path / "out")), monkeypatch)
    assert message.startswith("train_genrl.py: error:") and "empty" in message, message


@pytest.mark.parametrize("family, reward, extra", [
    ("wan", "temporal_smoothness:1,jpeg_compressibility:0.1",
     ["--num_frames", "5", "--sde_window_shift_every", "1", "--eval_prompt_dataset", "PROMPTS", "--eval_steps", "1", "--eval_max_batches", "1",
      "--eval_log_samples", "2"]),
    ("flux", "jpeg_compressibility",
     ["--use_lora", "--rank", "4", "--guidance_scale", "3.5", "--grpo_guard", "--grpo_guard_reweight",
      "--max_sequence_length", "6"]),
    # Wan 2.2 TI2V-5B's layout (16x patchifying VAE, a timestep per token), LoRA as users train the 5B.
    ("wan2.2", "temporal_smoothness", ["--num_frames", "5", "--use_lora", "--rank", "4"]),
])
def test_video_and_flux_pipelines_train_through_the_same_script(family, reward, extra, prompt_file, tmp_path):
    from genrl.testing.tiny_pipelines import save_tiny_pipeline

    model = save_tiny_pipeline(family, str(tmp_path / f"tiny-{family}"))
    layout, family = family, family.split("2.")[0]  # "wan2.2" is a layout of family "wan"
    out = str(tmp_path / "out")
    extra = [prompt_file if e == "PROMPTS" else e for e in extra]
    args = base_args(model, prompt_file, out, "--num_epochs", "1", "--sde_window_size", "2", *extra)
    args[args.index("--reward_fn") + 1] = reward
    run_script("train_genrl.py", args)
    logged = [l for l in metrics(out) if "train/approx_kl" in l][-1]
    # The update recomputes the rollout's log-probs (CFG, layout, schedule): the ratios stay near 1
    # over one epoch of small steps; a mismatch between the two would put them far off.
    assert 0 <= logged["train/approx_kl"] < 1e-3 and "time/decode_s" in logged
    assert 0.95 < logged["train/ratio_min"] <= logged["train/ratio_max"] < 1.05
    for name in (r.split(":")[0] for r in reward.split(",")):
        assert f"reward/{name}_mean" in logged
    config = json.load(open(os.path.join(out, "genrl_config.json")))
    assert config["family"] == family
    assert config["reward_models"] == {}  # rule-based rewards: no model, no template to trace
    exported = "pytorch_lora_weights.safetensors" if "--use_lora" in extra else "transformer"
    assert os.path.exists(os.path.join(out, exported))
    if "--max_sequence_length" in extra:  # the export samples with the T5 tokens it trained with
        import eval_genrl
        from genrl.checkpoints.checkpointing import load_trained_policy

        assert load_trained_policy(out).max_sequence_length == 6
        assert eval_genrl.trained_settings(out)["max_sequence_length"] == 6
    if layout == "wan":  # evaluation of a video model writes playable clips beside the grid
        from genrl.rewards.video_io import read_video

        clips = sorted(os.listdir(os.path.join(out, "samples", "eval-000000")))
        assert clips == ["00000.mp4", "00001.mp4"]
        frames, _ = read_video(os.path.join(out, "samples", "eval-000000", clips[0]))
        assert frames.shape[0] == 5


def run_train(args: list[str], **env) -> "subprocess.CompletedProcess[bytes]":
    """train_genrl.py as a user runs it (``python train_genrl.py``, conftest.run_python); bytes,
    so that tqdm's carriage returns are not counted as lines."""
    from conftest import run_python, script_env

    return run_python("train_genrl.py", args, env={**script_env(), **env}, text=False)


def error_lines(proc) -> list[str]:
    """Lines of stderr as a terminal shows them (a progress bar's carriage returns stay on its line)."""
    return proc.stderr.decode(errors="replace").strip().split("\n")


def test_a_bad_flag_is_one_line_naming_the_flag_without_the_usage_block(tiny_sd3, prompt_file, tmp_path):
    """The script as a user runs it: exit status 2 and one line, nothing else on stderr."""
    proc = run_train(base_args(tiny_sd3, prompt_file, str(tmp_path / "out"), "--group_size", "3"))
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, lines
    # A value that passes every check, not one that fails on the next.
    assert lines[0].startswith("train_genrl.py: error: ") and "--rollout_batch_size 6" in lines[0]


@pytest.mark.parametrize("extra, flag", [
    (["--train_batch_size", "3"], "--train_batch_size 2"),
    (["--group_size", "three"], "--group_size"),  # argparse's own errors are one line too
    (["--vae_decode_batch_size", "0"], "--vae_decode_batch_size must be at least 1"),
])
def test_other_bad_flags_are_one_line_too(tiny_sd3, prompt_file, tmp_path, capsys, extra, flag):
    """The same parser in-process (a launch per case costs a full import of the script)."""
    from genrl.training import train_args
    with pytest.raises(SystemExit) as exit_info:
        train_args.parse_args(base_args(tiny_sd3, prompt_file, str(tmp_path / "out"), *extra))
    lines = capsys.readouterr().err.strip().split("\n")
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("train_genrl.py: error: ") and flag in lines[0] and "usage" not in lines[0]


def test_a_hub_model_without_network_is_one_sentence_not_a_traceback(prompt_file, tmp_path):
    proc = run_train(base_args("genrl-test/no-such-model", prompt_file, str(tmp_path / "out")),
                     HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    lines = error_lines(proc)
    assert proc.returncode == 1 and len(lines) <= 3 and "Traceback" not in proc.stderr.decode(), lines
    assert lines[-1].startswith("train_genrl.py: error: --pretrained_model_name_or_path")
    assert "'genrl-test/no-such-model'" in lines[-1] and "local folder" in lines[-1] and "HF_HUB_OFFLINE" in lines[-1]


def test_hpsv3_without_its_weights_names_the_repos_and_reward_options(tiny_sd3, prompt_file, tmp_path):
    args = base_args(tiny_sd3, prompt_file, str(tmp_path / "out"))
    args[args.index("--reward_fn") + 1] = "hpsv3"
    proc = run_train(args, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))  # an empty Hub cache
    lines = error_lines(proc)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr.decode(), lines[-20:]
    assert len(lines) <= 3, lines  # the start-up log line and the sentence
    last = lines[-1]
    assert last.startswith("train_genrl.py: error: Reward 'hpsv3'")
    assert "MizzenAI/HPSv3" in last and "Qwen/Qwen2-VL-7B-Instruct" in last and "--reward_options '{\"hpsv3\"" in last


def test_every_flag_has_help_and_the_help_is_grouped_by_section(capsys):
    from genrl.config import SECTIONS

    with pytest.raises(SystemExit):
        train_args.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "recipes/toy_nft.yaml" in text and "--config PATH" in text
    assert "(default: 8)" in text  # defaults are shown, and they are the plain ones, not the toy run's
    assert_help_documents_each_section(train_args.build_parser(), SECTIONS, text)


def test_the_console_shows_one_line_per_evaluation_and_the_card_the_score_at_the_pipeline_defaults(
        tiny_sd3, prompt_file, tmp_path):
    """About 20 lines for a run with 3 evaluations: no per-epoch bars, no known-noise warnings.
    With --eval_pipeline_defaults the first and the last evaluation also sample as pipe(prompt)
    does (the SD3 pipeline's 28 steps at guidance 7), one line each, and the card states both."""
    out = str(tmp_path / "out")
    proc = run_train(base_args(tiny_sd3, prompt_file, out, "--eval_prompt_dataset", prompt_file, "--eval_steps", "2",
                               "--eval_max_batches", "1", "--eval_batch_size", "4", "--eval_pipeline_defaults"))
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    output = (proc.stdout + proc.stderr).decode(errors="replace")
    assert output.count("\n") < 25, output  # the 9-line "Running training" block at start included
    evals = [l for l in output.splitlines() if "eval at step" in l]
    assert len(evals) == 5, evals  # before training, steps 2 and 4; at the pipeline's defaults before and at 4
    assert [l.split()[3] for l in evals if "at the pipeline's defaults (28 steps, guidance 7):" in l] == ["0", "4"]
    key = "eval_pipeline_defaults/jpeg_compressibility_mean"
    records = [r for r in metrics(out) if key in r]
    assert [(r["step"], r["eval_pipeline_defaults/num_inference_steps"], r["eval_pipeline_defaults/guidance_scale"])
            for r in records] == [(0, 28, 7.0), (4, 28, 7.0)]
    assert records[0][key] != records[0]["eval/jpeg_compressibility_mean"]  # sampled otherwise than the run's 4 steps
    first_lines = " ".join(open(os.path.join(out, "README.md")).read().split("## How to use")[0].split())
    assert (f"At the pipeline's defaults (`pipe(prompt)`: 28 steps, guidance 7) it scores {records[1][key]:.4f} on "
            f"`jpeg_compressibility`, its base model {records[0][key]:.4f}") in first_lines, first_lines
    final_bar = output.rsplit("\r", 1)[-1] if "\r" in output else output
    assert "training: 100%" in output and "4/4" in output and "reward jpeg_compressibility" in output, final_bar
    for noise in ("epoch 0 rollout", "epoch 0 update", "requires torchvision", "float32: []", "Setting accelerator to CPU",
                  "Generating train split"):
        assert noise not in output, noise


def test_a_prompt_set_smaller_than_an_epoch_is_named_once_and_the_run_goes_on(tiny_sd3, tmp_path):
    # 2 groups an epoch from 1 prompt: the repeat samples the same images (seeds follow the prompt),
    # which a user would otherwise only see as a slower, no better run.
    prompts = tmp_path / "one.txt"
    prompts.write_text("a red circle\n")
    proc = run_train(base_args(tiny_sd3, str(prompts), str(tmp_path / "out"), "--num_epochs", "1"))
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    output = (proc.stdout + proc.stderr).decode(errors="replace")
    assert output.count("Each epoch draws 2 prompt groups") == 1, output
    assert "from 1 prompt," in output and "give at least 2 prompts" in output
