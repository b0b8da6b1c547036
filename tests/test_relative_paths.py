"""The scripts run from another working directory with relative paths, as a user types them.

The other script tests pass absolute temporary paths; these pass every directory relative to
the working directory (``genrl-output``, the default, included), which is what the README's
commands do.
"""

import os
import re
import subprocess

import pytest

from conftest import run_python

# A markdown image link, ![alt](target)
_IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")
# The src of an <img> or <video>/<source> in the comparison page
_HTML_SRC = re.compile(r'src="([^"]+)"')


def run_in(cwd: str, script: str, args: list[str]) -> subprocess.CompletedProcess:
    """Run a top-level script with ``cwd`` as the working directory."""
    return run_python(script, args, cwd=cwd)


def train_args(cwd: str, model: str, prompts: str, *extra: str) -> list[str]:
    """A two-epoch run with the model and prompts given relative to ``cwd`` and --output_dir
    left at its default, genrl-output."""
    return [
        "--pretrained_model_name_or_path", os.path.relpath(model, cwd), "--prompt_dataset", os.path.relpath(prompts, cwd),
        "--reward_fn", "jpeg_compressibility", "--group_size", "4", "--rollout_batch_size", "4",
        "--rollout_batches_per_epoch", "1", "--train_batch_size", "4", "--num_inference_steps", "3", "--num_epochs", "2",
        "--checkpointing_steps", "1", *extra,
    ]


@pytest.fixture(scope="module")
def trained(tiny_sd3, prompt_file, tmp_path_factory):
    """A short training run launched from its own working directory, every path relative."""
    cwd = str(tmp_path_factory.mktemp("user_cwd"))
    evaluation = ["--eval_prompt_dataset", os.path.relpath(prompt_file, cwd), "--eval_steps", "1",
                  "--eval_max_batches", "1", "--eval_batch_size", "4"]
    return cwd, run_in(cwd, "train_genrl.py", train_args(cwd, tiny_sd3, prompt_file, *evaluation))


def test_training_with_the_default_relative_output_dir_writes_a_card_whose_images_exist(trained):
    cwd, proc = trained
    assert proc.returncode == 0, proc.stderr[-4000:]
    output_dir = os.path.join(cwd, "genrl-output")
    assert not os.path.exists(os.path.join(output_dir, "genrl-output")), "the output dir was joined with itself"
    card = open(os.path.join(output_dir, "README.md")).read()
    images = _IMAGE_LINK.findall(card)
    assert any("eval-" in image for image in images) and any("training_curves" in image for image in images), card
    for image in images:
        assert not os.path.isabs(image), f"the card links {image!r}, which only exists on this machine"
        assert os.path.isfile(os.path.join(output_dir, image)), f"the card links {image!r}, which is not in the export"
    for name in ("genrl_config.json", "transformer/diffusion_pytorch_model.safetensors", "logs/metrics.jsonl",
                 "checkpoint-2/genrl_state.json"):
        assert os.path.isfile(os.path.join(output_dir, name)), name
    assert len(os.listdir(os.path.join(output_dir, "logs"))) > 1, "the TensorBoard logs belong in genrl-output/logs too"


def test_resume_latest_in_a_relative_output_dir(trained, tiny_sd3, prompt_file):
    cwd, proc = trained
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = run_in(cwd, "train_genrl.py", train_args(cwd, tiny_sd3, prompt_file, "--num_epochs", "3",
                                                       "--resume_from_checkpoint", "latest", "--report_to", "none"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "Resuming from" in resumed.stdout + resumed.stderr
    assert os.path.isfile(os.path.join(cwd, "genrl-output", "checkpoint-3", "genrl_state.json"))


def test_evaluation_and_comparison_with_relative_paths(trained, tiny_sd3):
    cwd, proc = trained
    assert proc.returncode == 0, proc.stderr[-4000:]
    common = ["--batch_size", "2", "--max_batches", "1", "--num_inference_steps", "2", "--reward_fn", "jpeg_compressibility"]
    single = run_in(cwd, "eval_genrl.py", ["--checkpoint", "genrl-output/checkpoint-2", "--output_dir", "eval-ckpt", *common])
    assert single.returncode == 0, single.stderr[-4000:]
    for name in ("metrics.json", "samples.png"):
        assert os.path.isfile(os.path.join(cwd, "eval-ckpt", name)), name

    # From inside the export, as "cd genrl-output && python eval_genrl.py --compare ." would
    inside = os.path.join(cwd, "genrl-output")
    compared = run_in(inside, "eval_genrl.py", ["--model", os.path.relpath(tiny_sd3, inside), "--compare", ".",
                                                "--output_dir", "../eval-cmp", *common])
    assert compared.returncode == 0, compared.stderr[-4000:]
    out = os.path.join(cwd, "eval-cmp")
    for name in ("model_a/metrics.json", "model_b/metrics.json", "compare.png", "compare.html"):
        assert os.path.isfile(os.path.join(out, name)), name
    html = open(os.path.join(out, "compare.html")).read()
    sources = _HTML_SRC.findall(html)
    assert sources and all(os.path.isfile(os.path.join(out, src)) for src in sources), sources
    assert f"<h1>{os.path.basename(tiny_sd3)} vs genrl-output</h1>" in html, "models are named by their folder"
