"""Wan image-to-video: prompt sets whose records carry an image (paths, URLs, ``datasets.Image``),
refused in one sentence when an image is missing; evaluation grids with the image beside the clip;
and train_genrl.py on Wan 2.1 I2V (LoRA, GRPO), Wan 2.2 TI2V from images (full, NFT), both under
ZeRO-2 on 2 processes, and Wan 2.2 I2V A14B (one expert, AWM) in one process, whose exports load
back and evaluate as in training. (Sampling parity with the pipeline: test_policies; log-probs
recomputed in training: test_rollout.)"""

import functools
import http.server
import json
import os
import threading

import cv2
import datasets
import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import load_file

from genrl.data.prompts import check_conditioning, load_prompts
from genrl.evaluation.evaluate import EvalResult
from genrl.evaluation.outputs import save_eval_outputs

from conftest import run_script, trainer_exit_in_process

PROMPTS = ["a red circle", "a blue square", "a green triangle", "a yellow circle"]


def write_image(path, seed: int, height: int = 24, width: int = 40) -> str:
    PIL.Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)).save(path)
    return str(path)


def write_records(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def i2v_prompts(tmp_path_factory) -> str:
    """Four prompts, each with its own image in ``images/`` beside the file."""
    root = tmp_path_factory.mktemp("i2v-prompts")
    (root / "images").mkdir()
    for i in range(len(PROMPTS)):
        write_image(root / "images" / f"{i}.png", seed=i)
    return write_records(root / "prompts.jsonl", [{"prompt": p, "image": f"images/{i}.png"} for i, p in enumerate(PROMPTS)])


@pytest.fixture
def served(tmp_path):
    """``tmp_path`` served over HTTP on localhost; yields its base URL."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_image_column_gives_each_prompt_its_image_and_stays_out_of_the_metadata(tmp_path, served, monkeypatch):
    """A path relative to the prompt file (not the working directory), an absolute one, a URL
    (fetched once, its bytes kept) and a saved dataset's ``datasets.Image`` (its bytes)."""
    (tmp_path / "imgs").mkdir()
    relative, absolute, remote = (write_image(tmp_path / "imgs" / f"{i}.png", seed=i) for i in range(3))
    prompts = write_records(tmp_path / "p.jsonl", [
        {"prompt": "a cat", "image": "imgs/0.png", "tag": "x"}, {"prompt": "a dog", "image": absolute, "tag": "y"},
        {"prompt": "a fox", "image": f"{served}/imgs/2.png", "tag": "z"}, {"prompt": "", "image": "gone.png", "tag": "w"}])
    monkeypatch.chdir(tmp_path / "imgs")
    loaded = load_prompts(prompts)
    assert loaded.prompts == ["a cat", "a dog", "a fox"]  # the record without a prompt is skipped, image and all
    assert loaded.images[:2] == [relative, absolute]
    assert loaded.images[2] == open(remote, "rb").read()
    assert loaded.metadata == [{"tag": "x"}, {"tag": "y"}, {"tag": "z"}]
    assert load_prompts(prompts, image_column="none").images is None  # text-only: no such column

    folder = str(tmp_path / "saved")
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image()})
    datasets.Dataset.from_dict({"prompt": ["a cow"], "image": [relative]}, features=features).save_to_disk(folder)
    saved = load_prompts(folder)
    assert saved.images == [open(relative, "rb").read()] and saved.metadata == [{}]


def test_a_missing_or_unreadable_image_is_one_sentence_naming_the_record(tmp_path, served, monkeypatch, i2v_prompts):
    write_image(tmp_path / "ok.png", seed=0)
    (tmp_path / "text.png").write_text("not an image")
    missing = write_records(tmp_path / "missing.jsonl", [{"prompt": "a cat", "image": "ok.png"},
                                                          {"prompt": "a dog", "image": "nope.png"}])
    message = trainer_exit_in_process(["--pretrained_model_name_or_path", "unused", "--prompt_dataset", missing,
                                       "--reward_fn", "jpeg_compressibility", "--output_dir", str(tmp_path / "out"),
                                       "--report_to", "none"], monkeypatch)
    assert message == (f"train_genrl.py: error: Prompt dataset {missing!r} record 2: its image "
                       f"{str(tmp_path / 'nope.png')!r} does not exist.")
    cases = {
        "unreadable": ({"prompt": "a cat", "image": "text.png"}, "record 1: its image .*text.png' is not a readable image"),
        "empty": ({"prompt": "a cat", "image": ""}, "record 1 has no image in its 'image' column; every record of an "
                                                     "image-to-video prompt set needs one."),
        "url": ({"prompt": "a cat", "image": f"{served}/absent.png"}, "record 1: its image .*absent.png' could not be "
                                                                       "fetched \\(HTTP 404 "),
    }
    for name, (record, sentence) in cases.items():
        with pytest.raises(ValueError, match=sentence):
            load_prompts(write_records(tmp_path / f"{name}.jsonl", [record]))
    text_only = tmp_path / "text.txt"
    text_only.write_text("a cat\n")
    with pytest.raises(ValueError, match="The training prompts have an image column 'image' and the evaluation prompts do not"):
        check_conditioning(load_prompts(i2v_prompts), load_prompts(str(text_only)), "image")


def test_the_grid_shows_each_conditioning_image_left_of_its_clips_middle_frame(tmp_path):
    video = torch.randint(0, 256, (2, 3, 8, 12, 3), dtype=torch.uint8)  # (N, F, H, W, C)
    conditions = torch.randint(0, 256, (2, 8, 12, 3), dtype=torch.uint8)
    rows = [{"index": i, "prompt": f"p{i}", "scores": {"total": 0.5}} for i in range(2)]
    result = EvalResult(metrics={}, per_prompt=rows, samples=video, conditions=conditions, sample_indices=[0, 1])
    grid = cv2.imread(save_eval_outputs(result, str(tmp_path), nrow=2)["grid"])[..., ::-1]
    scale = -(-160 // (2 * 12 + 2))  # captioned cells are enlarged to at least 160 px
    cell = grid[2 : 2 + 8 * scale : scale, 2 : 2 + 26 * scale : scale]  # the first cell, back to its own size
    assert np.array_equal(cell[:, :12], conditions[0].numpy()) and np.array_equal(cell[:, 14:], video[0, 1].numpy())
    assert (cell[:, 12:14] == 255).all()
    assert sorted(os.listdir(tmp_path / "videos")) == ["00000.mp4", "00001.mp4"]  # the clips alone


# ------------------------------------------------------------------------------ train_genrl.py


def train_args(model: str, prompts: str, output_dir: str, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--reward_fn", "jpeg_compressibility",
            "--output_dir", output_dir, "--group_size", "2", "--rollout_batch_size", "2", "--rollout_batches_per_epoch", "1",
            "--train_batch_size", "2", "--num_inference_steps", "4", "--max_train_steps", "1", "--report_to", "none",
            "--learning_rate", "1e-2", "--adam_epsilon", "1e-4", "--guidance_scale", "2", *extra]


def weights(folder: str) -> dict:
    return load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))


def moved(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def metric_lines(output_dir: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(output_dir, "logs", "metrics.jsonl"))]


@pytest.mark.slow
def test_zero2_lora_grpo_on_wan21_i2v_loads_back_and_evaluates_as_in_training(i2v_prompts, tmp_path):
    from diffusers import WanImageToVideoPipeline

    import eval_genrl
    from genrl.testing.tiny_pipelines import save_tiny_pipeline

    model = save_tiny_pipeline("wan2.1-i2v", str(tmp_path / "model"))
    out = str(tmp_path / "out")
    run_script("train_genrl.py", train_args(model, i2v_prompts, out, "--use_lora", "--rank", "4", "--sde_window_size", "2",
                                            "--eval_prompt_dataset", i2v_prompts, "--eval_steps", "1", "--eval_batch_size",
                                            "2", "--eval_max_batches", "1"), config="zero2", num_processes=2)
    lines = metric_lines(out)
    trained = [l for l in lines if "train/approx_kl" in l][-1]
    assert 0 <= trained["train/approx_kl"] < 1e-3 and 0.95 < trained["train/ratio_min"] <= trained["train/ratio_max"] < 1.05
    grid = cv2.imread(os.path.join(out, "samples", "eval-000001.png"))
    assert grid.shape[1] > 2 * 2 * 32, "each cell holds the image and the clip"

    pipeline = WanImageToVideoPipeline.from_pretrained(model)
    base = {k: v.clone() for k, v in pipeline.transformer.state_dict().items()}
    pipeline.load_lora_weights(out)
    pipeline.fuse_lora()
    pipeline.unload_lora_weights()
    assert moved(base, pipeline.transformer.state_dict())

    last_eval = [l for l in lines if "eval/total_mean" in l][-1]
    eval_genrl.main(eval_genrl.parse_args(["--model", out, "--output_dir", str(tmp_path / "eval")]))
    evaluated = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert evaluated["settings"]["num_samples"] == 2
    assert evaluated["metrics"]["total"]["mean"] == pytest.approx(last_eval["eval/total_mean"], abs=1e-4)


@pytest.mark.slow
def test_zero2_full_nft_on_wan22_ti2v_from_images(i2v_prompts, tmp_path):
    """Wan 2.2 TI2V-5B's own folder, its prompts with images: trained as image-to-video."""
    from diffusers import WanTransformer3DModel

    from genrl.checkpoints.checkpointing import load_trained_policy
    from genrl.testing.tiny_pipelines import save_tiny_pipeline

    model = save_tiny_pipeline("wan2.2", str(tmp_path / "model"))
    out = str(tmp_path / "out")
    run_script("train_genrl.py", train_args(model, i2v_prompts, out, "--objective", "nft", "--noise_level", "0",
                                            "--timestep_fraction", "0.5"), config="zero2", num_processes=2)
    assert all(torch.isfinite(torch.tensor(l["train/policy_loss"])) for l in metric_lines(out) if "train/policy_loss" in l)
    exported = WanTransformer3DModel.from_pretrained(os.path.join(out, "transformer")).state_dict()
    assert moved(exported, weights(os.path.join(model, "transformer")))
    policy = load_trained_policy(out, image_conditioned=True)
    assert type(policy.pipeline).__name__ == "WanImageToVideoPipeline" and policy.first_frame_conditioned


@pytest.mark.slow
def test_awm_trains_one_expert_of_wan22_i2v_a14b(i2v_prompts, tmp_path):
    from genrl.checkpoints.checkpointing import load_trained_policy
    from genrl.testing.tiny_pipelines import save_tiny_pipeline

    model = save_tiny_pipeline("wan2.2-i2v-a14b", str(tmp_path / "model"))
    out = str(tmp_path / "out")
    run_script("train_genrl.py", train_args(model, i2v_prompts, out, "--objective", "awm", "--noise_level", "0",
                                            "--timestep_fraction", "0.5", "--wan_expert", "low"))
    assert sorted(n for n in os.listdir(out) if n.startswith("transformer")) == ["transformer_2"]
    assert moved(weights(os.path.join(out, "transformer_2")), weights(os.path.join(model, "transformer_2")))
    policy = load_trained_policy(out, image_conditioned=True)
    assert policy.expert == "low" and policy.image_conditioned
