"""Evaluation: determinism, bounds, one generator, process-count independence, outputs."""

import json
import os
import socket
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch
from conftest import assert_help_documents_each_section

import eval_genrl
import genrl.evaluation.evaluate as evaluation
from genrl.config.evaluator import DEFAULT_PROMPTS
from genrl.data.prompts import PromptSet
from genrl.evaluation.evaluate import EvalSettings, batches_of_process, eval_batches, evaluate, spread_indices
from genrl.evaluation.outputs import save_eval_outputs, save_image_grid
from genrl.policies import load_policy
from genrl.rewards import build_reward_fn
from genrl.testing.tiny_pipelines import save_tiny_pipeline
from genrl.training.rollout import SamplingConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a red circle", "two blue squares", "a cat on a table", "a dog", "the sun over the sea", "a blue bird", "a tree"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Few steps: the tests pin the evaluation's bookkeeping, not image quality.
CONFIG = SamplingConfig(num_inference_steps=3, guidance_scale=3.0, noise_level=0.9, sde_window_size=1)


@pytest.fixture(scope="module", autouse=True)
def few_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    return save_tiny_pipeline("wan", str(tmp_path_factory.mktemp("models") / "tiny-wan"), seed=0)


@pytest.fixture(scope="module")
def policy(tiny_wan):
    return load_policy(tiny_wan)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def reward_fn():
    return build_reward_fn("jpeg_compressibility,temporal_smoothness:0.5")


def _evaluate(policy, reward_fn, prompts=PROMPTS, metadata=(), **kwargs):
    settings = EvalSettings(**{"seed": 0, "batch_size": 2, "max_batches": 2, "config": CONFIG, **kwargs})
    return evaluate(policy, policy.transformer, PromptSet(prompts, list(metadata)), reward_fn, settings, device="cpu")


def _script_args(model, prompts_file, output_dir, *extra):
    return ["--model", model, "--prompts", prompts_file, "--output_dir", str(output_dir), "--batch_size", "2",
            "--max_batches", "3", "--num_inference_steps", "3", "--guidance_scale", "3.0",
            "--reward_fn", "jpeg_compressibility,temporal_smoothness:0.5", *extra]


@pytest.mark.parametrize("extra, sentence", [
    (["--batch_size", "0"], "--batch_size must be at least 1; got 0."),
    (["--vae_decode_batch_size", "0"], "--vae_decode_batch_size must be at least 1; got 0."),
    (["--max_batches", "-1"], "--max_batches must be >= 0 (0 = every prompt); got -1."),
    (["--samples_per_prompt", "0"], "--samples_per_prompt must be at least 1; got 0."),
    (["--cfg_normalization", "-1"], "--cfg_normalization must be a finite number >= 0 (0: off), got -1.0."),
    (["--ode_solver", "rk4"], "argument --ode_solver: invalid choice: 'rk4'"),
    (["--attention_backend", "warp_drive"], "--attention_backend 'warp_drive' is not a diffusers attention backend; choose"),
    (["--no_such_flag", "3"], "unrecognized arguments: --no_such_flag 3"),
])
def test_bad_flags_are_one_sentence_before_any_model_loads(tmp_path, capsys, extra, sentence):
    """The model path is never opened: parsing alone refuses these, in one line (no usage block)."""
    with pytest.raises(SystemExit) as exit_info:
        eval_genrl.parse_args(_script_args(str(tmp_path / "no-model"), str(tmp_path / "p.txt"), tmp_path / "out", *extra))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and sentence in err
    assert err.count("\n") == 1 and err.startswith("eval_genrl.py: error: "), err


def test_every_eval_flag_has_help_and_the_help_is_grouped_by_section(capsys):
    from genrl.config.evaluator import EVALUATOR_SECTIONS, build_eval_parser

    with pytest.raises(SystemExit):
        eval_genrl.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "(default: genrl-eval)" in text and "--checkpoint MODEL" in text
    assert_help_documents_each_section(build_eval_parser(), EVALUATOR_SECTIONS, text)


@pytest.mark.parametrize("case", ["missing", "base", "no_ema"])
def test_use_ema_without_ema_weights_is_one_sentence_naming_why(tiny_sd3, prompt_file, tmp_path, case):
    """--use_ema on a path with no EMA weights: a folder that is not there (a
    checkpoint the run has not written), a base model, an export trained without EMA.
    Each ends in its own sentence (exit status 1), not a traceback calling it a base model."""
    model = {"missing": str(tmp_path / "genrl-output" / "checkpoint-40"), "base": tiny_sd3,
             "no_ema": str(tmp_path / "export")}[case]
    if case == "no_ema":
        os.makedirs(model)
        with open(os.path.join(model, "genrl_config.json"), "w") as f:
            json.dump({"base_model": tiny_sd3, "use_lora": False, "has_ema": False}, f)
    with pytest.raises(SystemExit) as exit_info:
        eval_genrl.run(_script_args(model, prompt_file, tmp_path / "out", "--use_ema"))
    message = exit_info.value.code
    assert isinstance(message, str) and message.startswith(f"eval_genrl.py: error: {model!r} "), message
    assert {"missing": "is not a folder here", "base": "it is a base model",
            "no_ema": "was trained without --use_ema"}[case] in message
    assert "\n" not in message and message.endswith("leave out --use_ema." if case != "missing" else "genrl_config.json).")


def test_a_guidance_option_of_another_family_is_one_sentence(tiny_sd3, prompt_file, tmp_path):
    """Z-Image's --cfg_truncation on an SD3 model: refused from its model_index.json, in one sentence."""
    with pytest.raises(SystemExit) as exit_info:
        eval_genrl.run(_script_args(tiny_sd3, prompt_file, tmp_path / "out", "--cfg_truncation", "0.5"))
    assert exit_info.value.code == ("eval_genrl.py: error: --cfg_truncation applies only to ZImagePipeline; "
                                    f"{tiny_sd3!r} is a StableDiffusion3Pipeline.")


# ------------------------------------------------------------------------------ batch plan


def test_eval_batches_are_global_and_bounded():
    assert eval_batches(7, 2, None) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert eval_batches(7, 2, 2) == [range(0, 2), range(2, 4)]
    assert eval_batches(3, 4, 5) == [range(0, 3)]
    with pytest.raises(ValueError, match="batch_size"):
        eval_batches(3, 0, None)
    with pytest.raises(ValueError, match="max_batches"):
        eval_batches(3, 2, 0)


def test_every_process_runs_as_many_batches_and_all_batches_run_once():
    for num_batches in (1, 4, 5):
        plans = [batches_of_process(num_batches, r, 3) for r in range(3)]
        assert len({len(p) for p in plans}) == 1
        assert sorted(b for p in plans for b in p if b is not None) == list(range(num_batches))


# ------------------------------------------------------------------------------ evaluate


def test_evaluate_is_deterministic_and_the_seed_matters(policy, reward_fn):
    policy.transformer.train()  # as the trainer leaves it
    a = _evaluate(policy, reward_fn)
    assert policy.transformer.training  # evaluated in eval mode, handed back in train mode
    b = _evaluate(policy, reward_fn)
    c = _evaluate(policy, reward_fn, seed=1)
    assert a.metrics == b.metrics and a.per_prompt == b.per_prompt
    assert torch.equal(a.samples, b.samples)
    assert a.samples.dtype == torch.uint8 and a.samples.shape == (4, 5, 32, 32, 3)  # (N, F, H, W, C)
    assert not torch.equal(a.samples, c.samples)
    assert a.per_prompt != c.per_prompt


def test_max_batches_bounds_the_evaluation(policy, reward_fn):
    result = _evaluate(policy, reward_fn, max_batches=2)
    assert [r["index"] for r in result.per_prompt] == [0, 1, 2, 3]
    assert [r["prompt"] for r in result.per_prompt] == PROMPTS[:4]
    assert result.settings["num_batches"] == 2 and result.settings["num_samples"] == 4
    # metrics are over exactly those samples
    totals = torch.tensor([r["scores"]["total"] for r in result.per_prompt], dtype=torch.float64)
    assert result.metrics["total"]["mean"] == pytest.approx(float(totals.mean()))
    assert result.metrics["total"]["std"] == pytest.approx(float(totals.std(correction=0)))
    assert set(result.metrics) == {"jpeg_compressibility", "temporal_smoothness", "total"}


def test_one_generator_per_evaluation_reseeded_with_seed_plus_batch(policy, reward_fn, monkeypatch):
    built = []

    def counting_generator():
        built.append(1)
        return torch.Generator(device="cpu")

    monkeypatch.setattr(evaluation, "make_eval_generator", counting_generator)
    same = ["a red circle"] * 4  # same prompt everywhere: only the noise differs between batches
    two_batches = _evaluate(policy, reward_fn, prompts=same, seed=0, max_batches=2)
    assert len(built) == 1  # not one per batch
    one_batch = _evaluate(policy, reward_fn, prompts=same, seed=1, max_batches=1)
    assert len(built) == 2
    # batch 1 of seed 0 is seeded with 0 + 1, exactly like batch 0 of seed 1
    assert torch.equal(two_batches.samples[2:4], one_batch.samples[0:2])
    assert not torch.equal(two_batches.samples[0:2], two_batches.samples[2:4])
    # within a batch, each position draws its own noise
    assert not torch.equal(two_batches.samples[0], two_batches.samples[1])


def test_several_samples_per_prompt_score_what_separate_evaluations_at_seed_plus_1000k_would(policy, reward_fn):
    """Draw k of K is the one-sample evaluation at seed + 1000 k, so draw 0 is today's evaluation
    bit for bit and the mean over K draws measures the weights rather than one noise."""
    one, other = _evaluate(policy, reward_fn, seed=5), _evaluate(policy, reward_fn, seed=1005)
    both = _evaluate(policy, reward_fn, seed=5, samples_per_prompt=2)
    assert torch.equal(both.samples, one.samples)  # the grid shows draw 0
    assert both.settings["num_samples"] == 8 and both.settings["samples_per_prompt"] == 2
    for name, stats in both.metrics.items():
        assert stats["draw_means"] == [one.metrics[name]["mean"], other.metrics[name]["mean"]]
        assert stats["count"] == 8
        assert stats["mean"] == pytest.approx((one.metrics[name]["mean"] + other.metrics[name]["mean"]) / 2, abs=1e-12)
    for row, a, b in zip(both.per_prompt, one.per_prompt, other.per_prompt):
        assert row["draws"] == [a["scores"], b["scores"]]
        for name, value in row["scores"].items():
            assert value == pytest.approx((a["scores"][name] + b["scores"][name]) / 2, abs=1e-12)
    assert one.metrics["total"]["mean"] != other.metrics["total"]["mean"]  # the draws differ
    assert "draws" not in one.per_prompt[0] and "draw_means" not in one.metrics["total"]


def test_evaluation_samples_are_the_plain_euler_ode_of_the_training_loop(policy):
    """Evaluation runs the trainer's denoising loop at noise level 0: x' = x + v (sigma' - sigma)
    from the generator's sequential draws, written out here independently."""
    prompts = PROMPTS[:2]
    config = SamplingConfig(num_inference_steps=3, guidance_scale=3.0, noise_level=0.9, sde_window_size=1)
    samples = evaluation.sample_deterministic(
        policy, policy.transformer, prompts, torch.Generator().manual_seed(5), config=config, device="cpu"
    )
    height, width, frames = policy.resolve_size(None, None, None)
    generator = torch.Generator().manual_seed(5)
    x = torch.stack([torch.randn(policy.latent_shape(height, width, frames), generator=generator) for _ in prompts])
    embeds = policy.encode_prompts(prompts, "cpu", 3.0)
    timesteps, sigmas = policy.timesteps_and_sigmas(3, x, "cpu")
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            x = x + policy.predict_velocity(policy.transformer, x, t.expand(2), embeds, 3.0) * (sigmas[i + 1] - sigmas[i])
        expected = torch.cat([policy.decode(x[b : b + 1]) for b in range(2)])
    torch.testing.assert_close(samples, expected, rtol=0, atol=1e-6)


def test_noise_level_of_the_training_config_is_ignored(policy, reward_fn):
    deterministic = SamplingConfig(num_inference_steps=3, guidance_scale=3.0, noise_level=0.0)
    a = _evaluate(policy, reward_fn, max_batches=1)
    b = _evaluate(policy, reward_fn, max_batches=1, config=deterministic)
    assert torch.equal(a.samples, b.samples) and a.settings["noise_level"] == 0.0


def test_keep_samples_are_spread_over_the_evaluated_prompts(policy, reward_fn):
    """The logged grid covers the whole prompt set, not only its first kind."""
    everything = _evaluate(policy, reward_fn, max_batches=2)
    some = _evaluate(policy, reward_fn, max_batches=2, keep_samples=2)
    none = _evaluate(policy, reward_fn, max_batches=2, keep_samples=0)
    n = len(everything.per_prompt)
    assert some.sample_indices == spread_indices(n, 2) == [0, n // 2]
    assert torch.equal(some.samples, everything.samples[[0, n // 2]])
    assert [r["index"] for r in some.sample_rows()] == [0, n // 2]
    assert none.samples is None and none.metrics == everything.metrics and none.sample_rows() == []


def test_the_default_runs_grid_shows_every_kind_of_toy_prompt():
    """Count scenes and each of the four relations: before/after grids show what training changed."""
    from genrl.data.toy_scenes import parse_caption
    from genrl.training import train_args

    run = train_args.toy_run()
    with open(run["eval_prompt_dataset"]) as f:
        prompts = [line.strip() for line in f if line.strip()][: run["eval_batch_size"] * run["eval_max_batches"]]
    shown = spread_indices(len(prompts), train_args.build_parser().get_default("eval_log_samples"))
    kinds = lambda indices: {parse_caption(prompts[i]).relation for i in indices}  # noqa: E731
    assert kinds(shown) == kinds(range(len(prompts))) and len(kinds(shown)) == 5


def test_rewards_get_decoded_cpu_samples_and_metadata_in_prompt_order(policy):
    seen = []

    def reward(samples, prompts, metadata):
        seen.append((samples.device.type, samples.dtype, tuple(samples.shape), list(prompts), list(metadata)))
        return {"total": samples.float().mean(dim=(1, 2, 3, 4))}

    metadata = [{"i": i} for i in range(len(PROMPTS))]
    _evaluate(policy, reward, max_batches=2, metadata=metadata)
    assert [s[3] for s in seen] == [PROMPTS[0:2], PROMPTS[2:4]]
    assert [s[4] for s in seen] == [metadata[0:2], metadata[2:4]]
    assert all(s[0] == "cpu" and s[1] == torch.float32 and s[2] == (2, 3, 5, 32, 32) for s in seen)


def test_evaluate_rejects_bad_input(policy, reward_fn):
    with pytest.raises(ValueError, match="empty prompt list"):
        _evaluate(policy, reward_fn, prompts=[])
    with pytest.raises(ValueError, match="2 metadata entries for 7 prompts"):
        _evaluate(policy, reward_fn, metadata=[{}, {}])
    with pytest.raises(ValueError, match="samples_per_prompt must be at least 1; got 0"):
        _evaluate(policy, reward_fn, samples_per_prompt=0)


# ------------------------------------------------------------------------------ grids


def test_image_grid_from_either_layout_is_the_same_png(tmp_path):
    rng = np.random.default_rng(0)
    video = rng.integers(0, 256, (5, 3, 8, 12, 3), dtype=np.uint8)  # (N, F, H, W, C)
    as_float = torch.from_numpy(video).permute(0, 4, 1, 2, 3).float() / 255  # (N, C, F, H, W)
    a = save_image_grid(video, str(tmp_path / "a.png"), nrow=2)
    b = save_image_grid(as_float, str(tmp_path / "b.png"), nrow=2)
    assert open(a, "rb").read(8) == PNG_SIGNATURE
    grid_a, grid_b = cv2.imread(a), cv2.imread(b)
    assert np.array_equal(grid_a, grid_b)
    gap = 2
    assert grid_a.shape == (3 * (8 + gap) + gap, 2 * (12 + gap) + gap, 3)  # 3 rows of 2
    # cell (row 1, col 1) is sample 3's middle frame, RGB -> BGR on disk
    y, x = gap + 1 * (8 + gap), gap + 1 * (12 + gap)
    assert np.array_equal(grid_a[y : y + 8, x : x + 12, ::-1], video[3, 1])


def test_image_grid_with_captions_enlarges_and_writes_text(tmp_path):
    images = np.full((2, 1, 16, 16, 3), 128, dtype=np.uint8)
    plain = cv2.imread(save_image_grid(images, str(tmp_path / "p.png"), nrow=2))
    captioned = cv2.imread(save_image_grid(images, str(tmp_path / "c.png"), nrow=2, captions=["a long prompt " * 3, "b"]))
    assert captioned.shape[1] > plain.shape[1] and captioned.shape[0] > captioned.shape[1] / 2
    assert (captioned < 60).any()  # black caption text
    with pytest.raises(ValueError, match="1 captions for 2 samples"):
        save_image_grid(images, str(tmp_path / "x.png"), captions=["only one"])


# ------------------------------------------------------------------------------ the script


def test_script_writes_identical_outputs_run_after_run(tiny_wan, prompts_file, tmp_path):
    for name in ("run1", "run2"):
        eval_genrl.main(eval_genrl.parse_args(_script_args(tiny_wan, prompts_file, tmp_path / name)))
    first = (tmp_path / "run1" / "metrics.json").read_bytes()
    assert first == (tmp_path / "run2" / "metrics.json").read_bytes()
    metrics = json.loads(first)
    assert metrics["settings"]["num_batches"] == 3 and len(metrics["per_prompt"]) == 6
    assert metrics["settings"]["seed"] == 0 and metrics["settings"]["num_inference_steps"] == 3
    assert {"mean", "std", "count"} == set(metrics["metrics"]["total"]) and metrics["metrics"]["total"]["count"] == 6
    png = tmp_path / "run1" / "samples.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE and cv2.imread(str(png)) is not None
    videos = sorted(os.listdir(tmp_path / "run1" / "videos"))
    assert videos == [f"{i:05d}.mp4" for i in range(6)]
    frames = cv2.VideoCapture(str(tmp_path / "run1" / "videos" / "00000.mp4"))
    assert frames.read()[0]


@pytest.mark.slow
def test_the_speed_levers_leave_the_scores_alone(tiny_wan, prompts_file, tmp_path):
    """--attention_backend native and --compile (regional torch.compile): the same samples and
    scores as the plain run, up to float rounding."""
    eval_genrl.main(eval_genrl.parse_args(_script_args(tiny_wan, prompts_file, tmp_path / "plain")))
    eval_genrl.main(eval_genrl.parse_args(_script_args(tiny_wan, prompts_file, tmp_path / "fast", "--attention_backend",
                                                       "native", "--compile")))
    plain, fast = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("plain", "fast"))
    assert len(fast["per_prompt"]) == len(plain["per_prompt"]) == 6
    for name, stats in plain["metrics"].items():
        assert fast["metrics"][name]["mean"] == pytest.approx(stats["mean"], abs=1e-3)
    diff = np.abs(cv2.imread(str(tmp_path / "fast" / "samples.png")).astype(int) - cv2.imread(str(tmp_path / "plain" / "samples.png")))
    assert (diff > 2).mean() < 1e-3  # compiled kernels round differently: a few pixels of the random model flip


@pytest.mark.slow
def test_one_and_two_processes_give_the_same_numbers(tiny_wan, prompts_file, tmp_path):
    """3 batches on 2 processes: rank 1 has one real batch and one padding batch."""
    eval_genrl.main(eval_genrl.parse_args(_script_args(tiny_wan, prompts_file, tmp_path / "one")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    command = [sys.executable, "-m", "accelerate.commands.launch",
               "--config_file", os.path.join(ROOT, "accelerate_configs", "multi_gpu.yaml"), "--num_processes", "2",
               "--main_process_port", str(port), os.path.join(ROOT, "eval_genrl.py"),
               *_script_args(tiny_wan, prompts_file, tmp_path / "two")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for noise in ("requires torchvision", "Loading pipeline components", "Setting accelerator to CPU"):
        assert noise not in done.stdout + done.stderr, noise  # the trainer's known start-up noise is hidden here too
    assert (tmp_path / "two" / "metrics.json").read_bytes() == (tmp_path / "one" / "metrics.json").read_bytes()
    assert np.array_equal(cv2.imread(str(tmp_path / "two" / "samples.png")), cv2.imread(str(tmp_path / "one" / "samples.png")))


def test_compare_holds_both_models_scores_for_every_prompt(tiny_wan, prompts_file, tmp_path):
    model_b = save_tiny_pipeline("wan", str(tmp_path / "tiny-wan-b"), seed=1)
    out = tmp_path / "cmp"
    eval_genrl.main(eval_genrl.parse_args(_script_args(tiny_wan, prompts_file, out, "--compare", model_b)))
    a = json.loads((out / "model_a" / "metrics.json").read_text())
    b = json.loads((out / "model_b" / "metrics.json").read_text())
    assert [r["prompt"] for r in a["per_prompt"]] == [r["prompt"] for r in b["per_prompt"]] == PROMPTS[:6]
    assert a["settings"]["seed"] == b["settings"]["seed"] and a["per_prompt"] != b["per_prompt"]
    html = (out / "compare.html").read_text()
    rows = html.split("<h2>Per prompt</h2>")[1].split("</tr>")[1:-1]
    assert len(rows) == 6
    for row, ra, rb in zip(rows, a["per_prompt"], b["per_prompt"]):
        assert ra["prompt"] in row
        for scores in (ra["scores"], rb["scores"]):
            for name, value in scores.items():
                assert f"{name}: {value:.4g}" in row
        for src in ("compare_images/%05d_a.png" % ra["index"], "compare_images/%05d_b.png" % ra["index"]):
            assert src in row and cv2.imread(str(out / src)) is not None
    assert f"{b['metrics']['total']['mean'] - a['metrics']['total']['mean']:+.4g}" in html
    grid = cv2.imread(str(out / "compare.png"))
    assert grid is not None and grid.shape[0] > grid.shape[1]  # one row per prompt, two columns


def test_script_evaluates_a_bare_lora_adapter(tiny_wan, prompts_file, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict

    policy = load_policy(tiny_wan)
    torch.manual_seed(0)
    policy.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False))
    type(policy.pipeline).save_lora_weights(str(tmp_path / "adapter"), transformer_lora_layers=get_peft_model_state_dict(policy.transformer))
    adapter = str(tmp_path / "adapter" / "pytorch_lora_weights.safetensors")

    with pytest.raises(ValueError, match="--base_model"):
        eval_genrl.main(eval_genrl.parse_args(_script_args(adapter, prompts_file, tmp_path / "x")))
    eval_genrl.main(eval_genrl.parse_args(_script_args(adapter, prompts_file, tmp_path / "lora", "--base_model", tiny_wan)))
    eval_genrl.main(eval_genrl.parse_args(_script_args(tiny_wan, prompts_file, tmp_path / "base")))
    lora = json.loads((tmp_path / "lora" / "metrics.json").read_text())
    base = json.loads((tmp_path / "base" / "metrics.json").read_text())
    assert lora["per_prompt"] != base["per_prompt"]  # the adapter's weights were applied


def test_not_applicable_scores_are_left_out_of_means_and_written_as_null(policy, tmp_path):
    def reward(samples, prompts, metadata):
        applies = torch.tensor(["circle" in p for p in prompts])
        return {"total": torch.where(applies, torch.ones(len(prompts)), torch.full((len(prompts),), float("nan")))}

    result = _evaluate(policy, reward, max_batches=2)
    assert result.metrics["total"] == {"mean": 1.0, "std": 0.0, "count": 1}  # only "a red circle"
    assert [r["scores"]["total"] for r in result.per_prompt] == [1.0, None, None, None]
    save_eval_outputs(result, str(tmp_path))

    def no_nan(token):
        raise AssertionError(f"metrics.json holds {token}")

    json.loads((tmp_path / "metrics.json").read_text(), parse_constant=no_nan)
    assert evaluation.score_stats([float("nan")]) == {"mean": None, "std": None, "count": 0}
    assert result.log_dict() == {"eval/total_mean": 1.0, "eval/total_std": 0.0}
    # Several draws: a prompt's score is the mean over the draws it applies to, still null where none.
    result = _evaluate(policy, reward, max_batches=2, samples_per_prompt=2)
    assert result.metrics["total"] == {"mean": 1.0, "std": 0.0, "count": 2, "draw_means": [1.0, 1.0]}
    assert [r["scores"]["total"] for r in result.per_prompt] == [1.0, None, None, None]
    assert result.per_prompt[1]["draws"] == [{"total": None}, {"total": None}]


def test_eval_settings_default_to_the_exports_own_training_evaluation(tmp_path):
    import json

    import eval_genrl

    export = tmp_path / "export"
    export.mkdir()
    (export / "genrl_config.json").write_text(json.dumps({
        "base_model": "unused", "reward_fn": "jpeg_compressibility",
        "args": {"eval_reward_fn": "jpeg_incompressibility", "num_inference_steps": 7, "eval_num_inference_steps": None,
                 "guidance_scale": 2.0, "eval_guidance_scale": None},
    }))
    args = eval_genrl.parse_args(["--model", str(export)])
    assert (args.reward_fn, args.num_inference_steps, args.guidance_scale) == ("jpeg_incompressibility", 7, 2.0)
    args = eval_genrl.parse_args(["--model", str(export), "--guidance_scale", "5", "--num_inference_steps", "3"])
    assert (args.num_inference_steps, args.guidance_scale) == (3, 5.0)
    args = eval_genrl.parse_args(["--model", str(tmp_path / "base"), "--compare", str(export)])
    assert args.reward_fn == "jpeg_incompressibility", "a base model compared with an export is scored like the export"
    # The prompts, batching and noise of the training run's evaluation, so the numbers match it.
    assert (args.prompts, args.batch_size, args.max_batches, args.seed) == (DEFAULT_PROMPTS, 4, 8, 0)
    config = json.loads((export / "genrl_config.json").read_text())
    config["args"].update(eval_prompt_dataset="held_out.txt", eval_batch_size=32, eval_max_batches=4, eval_seed=3)
    (export / "genrl_config.json").write_text(json.dumps(config))
    args = eval_genrl.parse_args(["--model", str(export)])
    assert (args.prompts, args.batch_size, args.max_batches, args.seed) == ("held_out.txt", 32, 4, 3)
    args = eval_genrl.parse_args(["--model", str(export), "--batch_size", "2", "--max_batches", "0"])
    assert (args.batch_size, args.max_batches) == (2, 0)
    assert args.samples_per_prompt == 1
    config["args"].update(eval_samples_per_prompt=4)
    (export / "genrl_config.json").write_text(json.dumps(config))
    assert eval_genrl.parse_args(["--model", str(export)]).samples_per_prompt == 4
    assert eval_genrl.parse_args(["--model", str(export), "--samples_per_prompt", "2"]).samples_per_prompt == 2


def test_sample_captions_stay_smaller_than_a_32px_sample(tmp_path):
    """A trained sample's caption: no n/a, no total repeating the one reward, short sub-score names."""
    from genrl.evaluation.outputs import compact_scores, score_caption

    scores = {"total": 0.6667, "toy_geneval": 0.6667, "toy_geneval_strict": 0.0, "toy_geneval_color": 1.0,
              "toy_geneval_shape": 1.0, "toy_geneval_count": None, "toy_geneval_position": 0.0}
    compact = compact_scores(scores)
    assert compact == {"toy_geneval": 0.6667, "strict": 0.0, "color": 1.0, "shape": 1.0, "position": 0.0}
    caption = "a red triangle left of a yellow square\n" + score_caption(compact, sep=" ", between="=")
    grid = cv2.imread(save_image_grid(np.zeros((4, 1, 32, 32, 3), np.uint8), str(tmp_path / "g.png"), captions=[caption] * 4))
    cell, gap = 160, 2  # 32 px samples are enlarged to 160 so that the text is readable
    assert grid.shape[0] - cell - 2 * gap <= cell // 2, "the caption band is taller than half the sample"
