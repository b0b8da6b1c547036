"""The image families beyond SD3 and FLUX.1 (Z-Image, FLUX.2 [klein] and [dev], Qwen-Image, Qwen-Image-Edit from prompts
with images) through the real scripts: two processes under the shipped ZeRO-2 and ZeRO-3
configs train each family once with LoRA and once with every weight (two objectives per family),
the export loads as diffusers loads it, and eval_genrl.py on the export gives the training's last
evaluation. (Sampling parity with the pipelines, log-prob recomputation and every objective x mode's
update run in process: test_policies, test_rollout, test_family_objectives.)"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from test_wan_i2v import write_image, write_records

from conftest import PROMPTS, run_script
from test_train_objectives import objective_args, train_lines

pytestmark = pytest.mark.slow

REWARD = "jpeg_compressibility"


def last_eval(output_dir: str) -> float:
    lines = [json.loads(l) for l in open(os.path.join(output_dir, "logs", "metrics.jsonl"))]
    return [l for l in lines if f"eval/{REWARD}_mean" in l][-1][f"eval/{REWARD}_mean"]


@pytest.fixture(scope="module")
def edit_prompts(tmp_path_factory) -> str:
    """The prompts, each with its own square image to edit in ``images/`` beside the file."""
    root = tmp_path_factory.mktemp("edit-prompts")
    (root / "images").mkdir()
    records = [{"prompt": p, "image": write_image(root / "images" / f"{i}.png", seed=i, height=40, width=40)}
               for i, p in enumerate(PROMPTS)]
    return write_records(root / "prompts.jsonl", records)


@pytest.mark.parametrize("family, objective, use_lora, config", [
    ("zimage", "nft", True, "zero2"),
    ("flux2-klein", "grpo", False, "zero2"),
    ("qwenimage", "awm", True, "zero2"),
    ("qwenimage", "grpo", False, "zero2"),
    ("flux2", "nft", False, "zero2"),
    ("qwenimage-edit", "grpo", True, "zero2"),
    # ZeRO-3: every trained weight partitioned across the ranks, gathered for the export.
    ("zimage", "grpo", False, "zero3"),
    ("qwenimage", "nft", True, "zero3"),
    ("flux2-klein", "awm", True, "zero3"),
    ("flux2", "grpo", True, "zero3"),  # the guidance embedding's weights partitioned too
    ("qwenimage-edit", "nft", False, "zero3"),
])
def test_two_processes_train_export_and_evaluate_as_in_training(family, objective, use_lora, config, prompt_file,
                                                                edit_prompts, tmp_path):
    editing = family.startswith("qwenimage-edit")
    train_export_and_evaluate(family, objective, use_lora, config, edit_prompts if editing else prompt_file, tmp_path)


def train_export_and_evaluate(family: str, objective: str, use_lora: bool, config: str, prompts: str, tmp_path) -> None:
    """Two processes train ``family`` with ``objective``; the export loads with diffusers alone and
    ``eval_genrl.py`` on it repeats the run's last evaluation."""
    import diffusers

    from genrl.testing.tiny_pipelines import save_tiny_pipeline

    model = save_tiny_pipeline(family, tmp_path / f"tiny-{family}")
    out = str(tmp_path / "out")
    extra = ["--use_lora", "--rank", "4", "--lora_alpha", "8"] if use_lora else []
    if family == "zimage":  # its pipeline's guidance options: the export must carry them to eval_genrl.py
        extra += ["--cfg_truncation", "0.3", "--cfg_normalization", "1.0"]
    editing = family.startswith("qwenimage-edit")
    args = objective_args(model, prompts, out, objective, *extra)
    if objective == "grpo":  # GRPO trains the recorded SDE steps
        args[args.index("--noise_level") + 1] = "0.7"
    run_script("train_genrl.py", args, config=config, num_processes=2)
    lines = train_lines(out)
    assert [l["step"] for l in lines] == [2, 4]
    assert all(torch.isfinite(torch.tensor(l["train/policy_loss"])) for l in lines)
    assert json.load(open(os.path.join(out, "genrl_config.json")))["family"] == family

    # The export as a user loads it, with diffusers alone (Qwen-Image-Edit's processor, unused here, needs torchvision).
    components = {"processor": None} if editing else {}
    pipeline = diffusers.DiffusionPipeline.from_pretrained(model, **components)
    base = {k: v.clone() for k, v in pipeline.transformer.state_dict().items()}
    if use_lora:
        pipeline.load_lora_weights(out, weight_name="pytorch_lora_weights.safetensors")
        pipeline.fuse_lora()
        pipeline.unload_lora_weights()  # the fused weights stay, under the base model's names
        assert load_file(os.path.join(out, "pytorch_lora_weights.safetensors"))
    else:
        transformer = type(pipeline.transformer).from_pretrained(out, subfolder="transformer")
        pipeline = type(pipeline).from_pretrained(model, transformer=transformer, **components)
    trained = pipeline.transformer.state_dict()
    assert any(not torch.equal(trained[k], base[k]) for k in base), "the export changed no weight"

    # eval_genrl.py on the export repeats the run's own last evaluation (its prompts, noise, steps).
    run_script("eval_genrl.py", ["--model", out, "--output_dir", str(tmp_path / "eval")])
    metrics = json.load(open(tmp_path / "eval" / "metrics.json"))["metrics"]
    assert metrics[REWARD]["mean"] == pytest.approx(last_eval(out), abs=1e-5)
    if family == "zimage":  # the pipeline's defaults given as flags win over the export's options, and sample otherwise
        run_script("eval_genrl.py", ["--model", out, "--output_dir", str(tmp_path / "plain"), "--cfg_truncation", "1",
                                     "--cfg_normalization", "0"])
        plain = json.load(open(tmp_path / "plain" / "metrics.json"))
        assert plain["settings"]["cfg_truncation"] == 1 and plain["settings"]["cfg_normalization"] == 0
        assert abs(plain["metrics"][REWARD]["mean"] - last_eval(out)) > 1e-4
