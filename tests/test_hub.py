"""Hub push and model card, against a local fake Hub (tests/fake_hub_server.py): no network."""

import json
import os
import socket
import time

import cv2
import huggingface_hub.constants
import numpy as np
import pytest
from huggingface_hub import ModelCard

from genrl.checkpoints.output_lock import LOCK_FILE
from genrl.hub.model_card import CardEvaluation, PipelineUsage, write_model_card
from genrl.hub.push import HubPushError, push_checkpoint_async, push_to_hub
from tests.fake_hub_server import FakeHubServer

TOKEN = "hf_dummy_token_for_tests"


def record(base_model: str, args: dict | None = None, **more) -> dict:
    """A run as ``genrl_config.json`` records it, for a card: the reward spec "r" unless given."""
    return {"base_model": base_model, "reward_fn": "r", "args": args or {}, **more}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake Hub; huggingface_hub pointed at it (ENDPOINT is read when HfApi is built)."""
    with FakeHubServer() as server:
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # conftest sets it on
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.endpoint)
        monkeypatch.setattr(huggingface_hub.constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agents.json"))
        yield server
    assert server.unhandled == []


def _snapshot(folder) -> dict[str, bytes]:
    """Every file under ``folder``: relative posix path -> bytes."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder).replace(os.sep, "/")] = open(path, "rb").read()
    return out


def _write(path, data: bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture
def export_dir(tmp_path):
    """A final export as the trainer leaves it: model files, model card, logs, and two
    intermediate checkpoints and the folder's lock that must never be pushed."""
    root = tmp_path / "run"
    rng = np.random.default_rng(0)
    _write(root / "genrl_config.json", b'{"base_model": "tiny/wan", "family": "wan", "use_lora": false}')
    _write(root / "transformer" / "config.json", b'{"_class_name": "WanTransformer3DModel"}')
    _write(root / "transformer" / "diffusion_pytorch_model.safetensors", rng.bytes(4096))
    _write(root / "logs" / "metrics.jsonl", b'{"step": 1, "reward/r_mean": 0.5}\n')
    cv2.imwrite(str(root / "samples.png"), rng.integers(0, 255, (16, 32, 3), dtype=np.uint8))
    _write(root / LOCK_FILE, b'{"host": "node-7", "pid": 4242}\n')
    for step in (10, 20):
        ckpt = root / f"checkpoint-{step}"
        _write(ckpt / "genrl_config.json", b"{}")
        _write(ckpt / "transformer" / "diffusion_pytorch_model.safetensors", rng.bytes(1024))
        _write(ckpt / "optimizer.bin", rng.bytes(2048))
        _write(ckpt / "random_states_0.pkl", rng.bytes(64))
    record = {"base_model": "tiny/wan", "reward_fn": "jpeg_compressibility:1.0", "args": {"learning_rate": 1e-5},
              "launch_command": "accelerate launch train_genrl.py", "family": "test"}
    write_model_card(str(root), record, sample_images=["samples.png"],
                     evaluation=CardEvaluation(metrics={"jpeg_compressibility": {"mean": 0.25, "std": 0.5}}))
    return root


def test_push_uploads_the_export_and_card_without_checkpoints(hub, export_dir):
    url = push_to_hub(str(export_dir), repo_id="me/wan-grpo", token=TOKEN, commit_message="final model")

    local = _snapshot(export_dir)
    expected = {p: b for p, b in local.items() if not p.startswith("checkpoint-") and p != LOCK_FILE}
    assert hub.files["me/wan-grpo"] == expected  # same paths, same bytes
    assert "README.md" in expected and "transformer/diffusion_pytorch_model.safetensors" in expected
    assert not any("optimizer" in p or p.startswith("checkpoint-") for p in hub.files["me/wan-grpo"])
    assert hub.commits["me/wan-grpo"] == ["final model"]
    assert url.startswith(hub.endpoint + "/me/wan-grpo/commit/")
    assert _snapshot(export_dir) == local  # pushing never touches local files


def test_push_to_an_existing_repo_updates_it(hub, export_dir):
    push_to_hub(str(export_dir), repo_id="me/wan-grpo", token=TOKEN)
    _write(export_dir / "genrl_config.json", b'{"changed": true}')
    push_to_hub(str(export_dir), repo_id="me/wan-grpo", token=TOKEN, commit_message="second")
    assert hub.files["me/wan-grpo"]["genrl_config.json"] == b'{"changed": true}'
    assert hub.commits["me/wan-grpo"][-1] == "second"
    assert [r for r in hub.requests if r == ("POST", "/api/repos/create")] == [("POST", "/api/repos/create")] * 2


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_push_with_the_hub_down_fails_clearly_and_keeps_the_export(monkeypatch, export_dir):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    before = _snapshot(export_dir)

    start = time.monotonic()
    with pytest.raises(HubPushError) as info:
        push_to_hub(str(export_dir), repo_id="me/wan-grpo", token=TOKEN)
    message = str(info.value)
    assert "Creating the Hub repo 'me/wan-grpo'" in message
    assert f"local export at {export_dir} is intact" in message
    assert time.monotonic() - start < 30  # a refused connection is not retried for minutes
    assert _snapshot(export_dir) == before


def test_push_refused_at_commit_names_the_upload_and_keeps_the_export(hub, export_dir):
    hub.reject_commits = True
    before = _snapshot(export_dir)
    with pytest.raises(HubPushError, match=r"(?s)Uploading .* to the Hub repo 'me/wan-grpo'.*local export at .* is intact"):
        push_to_hub(str(export_dir), repo_id="me/wan-grpo", token=TOKEN)
    assert hub.files["me/wan-grpo"] == {}
    assert _snapshot(export_dir) == before


def test_push_refuses_a_missing_or_empty_export(tmp_path):
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "absent"):
        with pytest.raises(ValueError, match="not a folder holding an export"):
            push_to_hub(str(folder), repo_id="me/x", token=TOKEN)


def test_checkpoint_push_runs_in_background_and_sends_only_model_files(hub, export_dir):
    future = push_checkpoint_async(str(export_dir / "checkpoint-20"), repo_id="me/wan-grpo", token=TOKEN, step=20)
    url = future.result(timeout=60)
    assert url.startswith(hub.endpoint)
    ckpt = _snapshot(export_dir / "checkpoint-20")
    assert hub.files["me/wan-grpo"] == {
        "genrl_config.json": ckpt["genrl_config.json"],
        "transformer/diffusion_pytorch_model.safetensors": ckpt["transformer/diffusion_pytorch_model.safetensors"],
    }
    assert hub.commits["me/wan-grpo"] == ["Training in progress, step 20"]


def test_model_card_metadata_and_body(export_dir, tmp_path):
    card = ModelCard.load(str(export_dir / "README.md"))
    assert card.data.base_model == "tiny/wan"
    assert card.data.library_name == "diffusers"
    assert {"genrl", "grpo", "test"} <= set(card.data.tags) and "lora" not in card.data.tags
    assert "| jpeg_compressibility | 0.2500 | 0.5000 |" in card.text
    assert "![sample 1](samples.png)" in card.text
    assert "accelerate launch train_genrl.py" in card.text
    assert 'subfolder="transformer"' in card.text


def test_model_card_for_a_lora_export_with_a_local_base_and_outside_images(tmp_path):
    export = tmp_path / "lora"
    _write(export / "pytorch_lora_weights.safetensors", b"x")
    base = tmp_path / "base_model"
    base.mkdir()
    image = tmp_path / "elsewhere" / "grid.png"
    image.parent.mkdir()
    cv2.imwrite(str(image), np.zeros((4, 4, 3), np.uint8))

    path = write_model_card(str(export), record(str(base), {"rank": 4}, launch_command=""), sample_images=[str(image)])
    card = ModelCard.load(path)
    assert card.data.base_model is None  # a local path is not a Hub id
    assert "lora" in card.data.tags
    assert "load_lora_weights" in card.text and "## Evaluation" not in card.text
    assert (export / "samples" / "grid.png").read_bytes() == image.read_bytes()
    assert "![sample 1](samples/grid.png)" in card.text


def test_model_card_names_a_missing_image(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.png"):
        write_model_card(str(tmp_path), record("a/b"), sample_images=["nope.png"])


def test_model_card_reads_eval_metrics_in_log_dict_form(tmp_path):
    flat = {"eval/total_mean": 0.5, "eval/total_std": 0.25, "eval/toy_geneval_mean": 0.125, "eval/toy_geneval_std": 0.0}
    card = ModelCard.load(write_model_card(str(tmp_path), record("a/b"), evaluation=CardEvaluation(metrics=flat)))
    assert "| total | 0.5000 | 0.2500 |" in card.text
    assert "| toy_geneval | 0.1250 | 0.0000 |" in card.text
    assert "eval/" not in card.text


def test_model_card_names_a_local_base_by_its_folder_and_loads_generically(tmp_path):
    base = tmp_path / "some" / "where" / "toy-base"
    base.mkdir(parents=True)
    export = tmp_path / "export"
    export.mkdir()
    hyper = {"use_lora": False, "rank": 32, "lora_alpha": 64, "use_ema": True, "ema_decay": 0.9, "learning_rate": 1e-4}
    local = ModelCard.load(write_model_card(str(export), record(str(base), hyper))).text
    assert "`toy-base`" in local and f"`{base}`" not in local
    assert "bfloat16)" not in local and 'pipe.to("cuda")' not in local and "<this-repo-id>" not in local
    assert "torch.cuda.is_available()" in local and f'from_pretrained("{export}", subfolder="transformer"' in local
    assert "| ema_decay |" in local and "| rank |" not in local and "| lora_alpha |" not in local

    pushed = ModelCard.load(write_model_card(str(export), record(str(base), hyper), repo_id="me/run")).text
    assert str(tmp_path) not in pushed.split("## Training")[0]  # nothing above the launch command names this machine
    assert 'from_pretrained("me/run", subfolder="transformer"' in pushed and '"path/to/toy-base"' in pushed


def test_model_card_shows_the_score_before_and_after_training(tmp_path):
    from genrl.hub.model_card import first_and_last_eval

    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "epoch": 0, "eval/toy_geneval_mean": 0.4, "eval/total_mean": 0.4},
             {"step": 2, "epoch": 0, "reward/toy_geneval_mean": 0.3},
             {"step": 20, "epoch": 9, "eval/toy_geneval_mean": 0.45, "eval/total_mean": 0.45},
             {"step": 40, "epoch": 19, "eval/toy_geneval_mean": 0.5, "eval/total_mean": 0.5}]
    metrics.write_text("".join(json.dumps(l) + "\n" for l in lines) + '{"step": 4')
    evals = first_and_last_eval(str(metrics))
    assert [step for step, _ in evals] == [0, 40]
    evaluation = CardEvaluation(metrics=evals[-1][1], baseline=evals[0][1], steps=(0, 40))
    card = ModelCard.load(write_model_card(str(tmp_path), record("a/b", reward_fn="toy_geneval"), evaluation=evaluation)).text
    assert "| reward | before (step 0) | after (step 40) | change |" in card
    assert "| toy_geneval | 0.4000 | 0.5000 | +0.1000 |" in card and "| total |" not in card


def test_model_card_names_the_objective_it_was_trained_with(tmp_path):
    export = tmp_path / "nft"
    (export / "transformer").mkdir(parents=True)
    write_model_card(str(export), record("tiny/sd3", {"objective": "nft"}, reward_fn="toy_geneval"))
    card = ModelCard.load(str(export / "README.md"))
    assert "diffusion-nft" in card.data.tags and "grpo" not in card.data.tags
    assert "(DiffusionNFT)" in card.text and "GRPO" not in card.text.split("## Training")[0]


def test_run_card_says_first_which_settings_its_scores_need_and_reports_diversity_start_to_end(tmp_path):
    from genrl.hub.model_card import write_run_card

    export = tmp_path / "export"
    (export / "transformer").mkdir(parents=True)
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "eval/toy_geneval_mean": 0.33, "eval/diversity": 0.25},
             {"step": 200, "eval/toy_geneval_mean": 0.78, "eval/diversity": 0.18}]
    metrics.write_text("".join(json.dumps(l) + "\n" for l in lines))
    args = {"num_inference_steps": 10, "guidance_scale": 4.5, "eval_guidance_scale": 1.0, "eval_num_inference_steps": None,
            "negative_prompt": "blurry", "height": 64, "width": 96, "num_frames": 9, "watch_diversity_fraction": 0.5,
            "ode_solver": "ab2"}
    args["objective"] = "nft"
    config = {"base_model": "tiny/sd3", "reward_fn": "toy_geneval", "args": args, "launch_command": "x", "family": "sd3"}
    card = ModelCard.load(write_run_card(str(export), str(metrics), config, is_video=False, last_eval={},
                                         sample_images=[], watch_alarms=[])).text
    settings = {"num_inference_steps": 10, "guidance_scale": 1.0, "height": 64, "width": 96}  # unguided: no negative prompt
    assert json.loads((export / "sampling_config.json").read_text()) == settings
    first_lines = card.split("## How to use")[0]
    assert "Sample it as it was evaluated: 10 steps at guidance 1, 64x96**" in first_lines
    assert "the pipeline's own defaults included, it was not evaluated" in first_lines
    assert "`ab2` solver" in first_lines  # the pipeline integrates otherwise
    assert f"settings = {json.dumps(settings)}" in card and 'image = pipe(prompt="a photo of a cat", **settings).images[0]' in card
    assert "diversity stayed above the alarm's threshold" in card
    assert "went from 0.2500 to 0.1800, 72% of its start; the watch alarms below 50%" in card
    assert "samples held" not in card


@pytest.mark.parametrize("before, after, sentence", [
    # Trained unguided, worse than its base when sampled as pipe(prompt) samples.
    (0.681, 0.602, "At the pipeline's defaults (`pipe(prompt)`: 28 steps, guidance 7) it scores 0.6020 on `toy_geneval`, "
                   "its base model 0.6810: there it is worse than the model it came from, so sample it with the settings above."),
    (0.5, 0.7, "At the pipeline's defaults (`pipe(prompt)`: 28 steps, guidance 7) it scores 0.7000 on `toy_geneval`, "
               "its base model 0.5000."),
    # A resumed run whose first evaluation was not at the pipeline's defaults: the export's figure alone.
    (None, 0.602, "At the pipeline's defaults (`pipe(prompt)`: 28 steps, guidance 7) it scores 0.6020 on `toy_geneval`."),
])
def test_run_card_states_first_what_the_export_scores_at_the_pipeline_defaults(tmp_path, before, after, sentence):
    from genrl.hub.model_card import write_run_card

    export = tmp_path / "export"
    (export / "transformer").mkdir(parents=True)
    settings = {"eval_pipeline_defaults/num_inference_steps": 28, "eval_pipeline_defaults/guidance_scale": 7.0}
    lines = [{"step": 0, "eval/toy_geneval_mean": 0.33, "eval/total_mean": 0.33},
             {"step": 100, "eval/toy_geneval_mean": 0.7, "eval/total_mean": 0.7},
             {"step": 200, "eval/toy_geneval_mean": 0.78, "eval/total_mean": 0.78,
              "eval_pipeline_defaults/toy_geneval_mean": after, "eval_pipeline_defaults/total_mean": after,
              "eval_pipeline_defaults/toy_geneval_strict_mean": 0.1, **settings}]
    if before is not None:
        lines[0].update({"eval_pipeline_defaults/toy_geneval_mean": before, "eval_pipeline_defaults/total_mean": before,
                         **settings})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    args = {"num_inference_steps": 10, "guidance_scale": 1.0, "objective": "nft"}
    config = {"base_model": "tiny/sd3", "reward_fn": "toy_geneval", "args": args, "launch_command": "x", "family": "sd3"}
    card = ModelCard.load(write_run_card(str(export), str(tmp_path / "metrics.jsonl"), config,
                                         is_video=False, last_eval={}, sample_images=[])).text
    first_lines = card.split("## How to use")[0]
    assert "Sample it as it was evaluated: 10 steps at guidance 1**" in first_lines
    assert " ".join(first_lines.split()).count(sentence) == 1, first_lines
    assert "it was not evaluated and" not in first_lines  # the unmeasured wording gives way to the figure
    assert "| toy_geneval | 0.3300 | 0.7800 | +0.4500 |" in card  # the table stays the trained settings'


def test_an_image_to_video_cards_snippet_samples_from_a_conditioning_image(tmp_path, monkeypatch):
    """The snippet of an image-to-video export loads the base as the image-to-video pipeline (Wan
    2.2 TI2V's own folder is a WanPipeline), loads an image and passes it as ``image=``: run as a
    user would run it (the image file it names put in place), it samples the export. A text-only
    card imports no image loader."""
    import PIL.Image
    import torch

    from genrl.hub.model_card import write_run_card
    from genrl.testing.tiny_pipelines import build_tiny_pipeline, save_tiny_pipeline

    base = save_tiny_pipeline("wan2.2", tmp_path / "base")  # TI2V-5B's folder: a WanPipeline
    export = tmp_path / "export"
    trained = build_tiny_pipeline("wan2.2", seed=1).transformer
    trained.save_pretrained(export / "transformer")
    args = {"num_inference_steps": 2, "guidance_scale": 1.0, "height": 64, "width": 64, "num_frames": 5}
    config = {"base_model": base, "reward_fn": "r", "args": args, "launch_command": "x", "family": "wan"}
    card = ModelCard.load(write_run_card(str(export), str(tmp_path / "none.jsonl"), config, is_video=True,
                                         usage=PipelineUsage("WanImageToVideoPipeline", image_conditioned=True),
                                         last_eval={}, sample_images=[]))
    assert card.data.pipeline_tag == "image-to-video"
    snippet = card.text.split("```python\n")[1].split("```")[0]
    assert "pipe = WanImageToVideoPipeline.from_pretrained(" in snippet
    assert "video = pipe(image=input_image, prompt=" in snippet
    monkeypatch.chdir(tmp_path)
    PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 40, 3), dtype=np.uint8)).save("first_frame.png")
    scope = {}
    exec(compile(snippet, "card-snippet", "exec"), scope)
    assert type(scope["pipe"]).__name__ == "WanImageToVideoPipeline"
    assert torch.equal(scope["pipe"].transformer.state_dict()["proj_out.weight"], trained.state_dict()["proj_out.weight"])
    assert np.asarray(scope["video"]).shape == (5, 64, 64, 3)

    text_only = ModelCard.load(write_run_card(str(export), str(tmp_path / "none.jsonl"), config, is_video=True,
                                              last_eval={}, sample_images=[]))
    assert text_only.data.pipeline_tag == "text-to-video" and "load_image" not in text_only.text
    assert "pipe = DiffusionPipeline.from_pretrained(" in text_only.text
    assert 'video = pipe(prompt="a cat walking in the snow", **settings).frames[0]' in text_only.text


def test_a_true_cfg_pipelines_card_guides_as_its_evaluation_did(tmp_path):
    """Qwen-Image's pipeline guides with ``true_cfg_scale``, and only when given a negative prompt
    (its ``guidance_scale`` is a guidance-distilled model's input, ignored): the card's settings
    name the scale so and pass the run's negative prompt even empty, and called with them the
    pipeline runs the unconditional branch at every step; unguided, neither."""
    from genrl.hub.model_card import sampling_settings, write_run_card
    from genrl.policies import QwenImagePolicy
    from genrl.testing.tiny_pipelines import build_tiny_pipeline

    args = {"num_inference_steps": 2, "guidance_scale": 4.0, "negative_prompt": "", "height": 32, "width": 32}
    settings = sampling_settings(args, False, QwenImagePolicy.guidance_keyword)
    assert settings == {"num_inference_steps": 2, "true_cfg_scale": 4.0, "height": 32, "width": 32, "negative_prompt": ""}
    assert sampling_settings({**args, "guidance_scale": 1.0}, False, "true_cfg_scale").keys() == {
        "num_inference_steps", "true_cfg_scale", "height", "width"}
    assert "negative_prompt" not in sampling_settings(args, False)  # a guidance_scale pipeline guides without one

    pipeline = build_tiny_pipeline("qwenimage")
    forwards = []
    pipeline.transformer.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
    pipeline("a red circle", output_type="pt", **settings)
    assert len(forwards) == 2 * 2  # the conditional and the unconditional branch at each step
    (tmp_path / "transformer").mkdir()
    config = {"base_model": "Qwen/Qwen-Image", "reward_fn": "r", "args": args, "launch_command": "x", "family": "qwenimage"}
    card = ModelCard.load(write_run_card(str(tmp_path), str(tmp_path / "none.jsonl"), config, is_video=False,
                                         usage=PipelineUsage("QwenImagePipeline", guidance_keyword="true_cfg_scale"),
                                         last_eval={}, sample_images=[])).text
    assert f"settings = {json.dumps(settings)}" in card and "2 steps at guidance 4, 32x32" in card
    assert json.loads((tmp_path / "sampling_config.json").read_text()) == settings
