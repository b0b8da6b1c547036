"""Every key a recipe sets is a flag (recipes are read by the trainer's own parser), each real-model
recipe names its launch line, the image recipes lay out the epoch and adapt the modules their
papers do, and the DiffusionNFT recipe's values train a tiny model end to end."""

import glob
import json
import os
import re

import pytest
import torch

from genrl.rewards import load_reward_options
from genrl.training import train_args

from conftest import ROOT, run_script

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))
MODEL_RECIPES = [p for p in RECIPES if not os.path.basename(p).startswith("toy_")]


def recipe_words(path: str) -> list[str]:
    """The trainer arguments that run a recipe."""
    return ["--config", path]


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_flags_parse(path):
    args = train_args.parse_args(recipe_words(path))
    assert os.path.isfile(os.path.join(ROOT, args.prompt_dataset)), "the recipe's default prompt file must ship"
    assert args.reward_options is None or load_reward_options(args.reward_options)


def test_there_are_recipes_for_wan_sd35_and_flux():
    names = " ".join(os.path.basename(p) for p in MODEL_RECIPES)
    assert "wan21" in names and "sd35" in names and "flux" in names


@pytest.mark.parametrize("path", MODEL_RECIPES, ids=os.path.basename)
def test_each_model_recipe_names_its_launch_line(path):
    """The header's command launches this file with a shipped accelerate config."""
    text = " ".join(open(path).read().replace("\\\n#", " ").split())
    launch = re.search(r"accelerate launch --config_file (\S+) --num_processes 8 train_genrl.py --config (\S+)", text)
    assert launch, "no launch line in the header"
    assert os.path.isfile(os.path.join(ROOT, launch[1])) and launch[2] == f"recipes/{os.path.basename(path)}"


JOINT_ATTENTION = r"\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$"


@pytest.mark.parametrize("name, layout, adapted_pattern, rank", [
    ("sd35_medium_flow_grpo.yaml", "sd3.5", JOINT_ATTENTION, 32),
    ("sd35_medium_diffusionnft.yaml", "sd3.5", JOINT_ATTENTION, 32),
    # Flow-GRPO's train_flux.py: the attention (single blocks' included) and the double blocks' feed-forwards.
    ("flux1_dev_grpo.yaml", "flux", JOINT_ATTENTION[:-1] + r"|\.(ff|ff_context)\.net\.(0\.proj|2)$", 64),
    # Flow-Factory's Z-Image default: every block's attention and SwiGLU (refiners included).
    ("zimage_grpo.yaml", "zimage", r"\.attention\.(to_q|to_k|to_v|to_out\.0)$|\.feed_forward\.(w1|w2|w3)$", 64),
    # Flow-Factory's FLUX.2 [klein] list: the single blocks' fused projection, not their attn.to_out.
    ("flux2_klein_grpo.yaml", "flux2-klein",
     JOINT_ATTENTION[:-1] + r"|\.(ff|ff_context)\.(linear_in|linear_out)$|single_transformer_blocks\.\d+\.attn\.to_qkv_mlp_proj$", 64),
    ("qwenimage_grpo.yaml", "qwenimage", JOINT_ATTENTION[:-1] + r"|\.(img_mlp|txt_mlp)\.net\.0\.proj$", 64),
    # Flow-Factory's Qwen-Image-Edit list: both projections of the feed-forwards.
    ("qwenimage_edit_grpo.yaml", "qwenimage-edit-plus", JOINT_ATTENTION[:-1] + r"|\.(img_mlp|txt_mlp)\.net\.(0\.proj|2)$", 64),
    ("flux2_dev_grpo.yaml", "flux2",
     JOINT_ATTENTION[:-1] + r"|\.(ff|ff_context)\.(linear_in|linear_out)$|single_transformer_blocks\.\d+\.attn\.to_qkv_mlp_proj$", 64),
    # HunyuanVideo 1.5: both streams' attention projections (the text refiner's self-attention too).
    ("hunyuanvideo15_t2v_grpo.yaml", "hunyuanvideo15", JOINT_ATTENTION, 64),
])
def test_image_recipes_adapt_the_modules_their_papers_do(name, layout, adapted_pattern, rank):
    """Flow-GRPO's and DiffusionNFT's LoRA targets, which name the joint attention's projections
    ``attn.to_q`` ... ``attn.to_add_out``: on SD3.5-M not the image-only ``attn2`` its first blocks
    add (bare suffixes such as ``to_q`` would take it too)."""
    import re

    from genrl.testing.tiny_pipelines import build_tiny_pipeline
    from genrl.training.trainable import make_trainable

    args = train_args.parse_args(recipe_words(os.path.join(ROOT, "recipes", name)))
    transformer = build_tiny_pipeline(layout).transformer
    if layout == "sd3.5":
        assert any(n.endswith("attn2.to_q") for n, _ in transformer.named_modules())  # the SD3.5-M layout
    pattern = re.compile(adapted_pattern)
    expected = {n for n, m in transformer.named_modules() if pattern.search(n) and isinstance(m, torch.nn.Linear)}
    make_trainable(transformer, use_lora=args.use_lora, rank=args.rank, lora_alpha=args.lora_alpha,
                   lora_target_modules=args.lora_target_modules, gradient_checkpointing=False, float32=True)
    adapted = {n for n, m in transformer.named_modules() if hasattr(m, "lora_A")}
    assert (args.rank, args.lora_alpha) == (rank, 2 * rank)
    assert adapted == expected, sorted(adapted ^ expected)


@pytest.mark.parametrize("name, groups, steps, timesteps, ema_interval", [
    ("sd35_medium_flow_grpo.yaml", 48, 2, 9, 8),  # pickscore_sd3: 48 prompts x 24, two updates an epoch
    ("sd35_medium_diffusionnft.yaml", 48, 1, 9, 1),  # one update an epoch
    ("flux1_dev_grpo.yaml", 48, 2, 5, 8),  # pickscore_flux: 6 steps
])
def test_image_recipes_lay_out_their_papers_epoch_on_8_gpus(name, groups, steps, timesteps, ema_interval):
    """The epoch each recipe's header claims, at its default 8 processes: prompt groups, optimizer
    steps, trained timesteps per sample, independent initial noise, global advantage std, the
    EMA's decay and interval, PickScore as the reward and 128 T5 tokens."""
    args = train_args.parse_args(recipe_words(os.path.join(ROOT, "recipes", name)))
    per_gpu = args.rollout_batch_size * args.rollout_batches_per_epoch
    assert (args.group_size, 8 * per_gpu // args.group_size) == (24, groups)
    assert per_gpu // (args.train_batch_size * args.gradient_accumulation_steps) == steps
    assert train_args.num_trained_timesteps(args) == timesteps
    assert args.std_mode == "global" and args.use_ema and (args.ema_decay, args.ema_update_interval) == (0.9, ema_interval)
    assert not args.same_latent and args.reward_fn == "pickscore:1.0" and args.max_sequence_length == 128


@pytest.mark.parametrize("name, group_size, groups, steps, window, std_mode", [
    ("zimage_grpo.yaml", 16, 48, 2, (1, [1, 4]), "group"),  # Flow-Factory: 48 unique prompts, 2 steps an epoch
    ("flux2_klein_grpo.yaml", 16, 48, 2, (1, [1, 4]), "group"),
    ("qwenimage_grpo.yaml", 16, 48, 2, (1, [1, 4]), "group"),
    ("qwenimage_edit_grpo.yaml", 16, 48, 2, (1, [1, 4]), "group"),
    ("flux2_dev_grpo.yaml", 16, 48, 2, (1, [1, 4]), "group"),
])
def test_flow_factory_recipes_lay_out_its_epoch_on_8_gpus(name, group_size, groups, steps, window, std_mode):
    """Flow-Factory's GRPO epoch at the recipe's 8 processes: prompt groups of its size, optimizer
    steps, one SDE step per prompt drawn from its window, PickScore as the reward."""
    args = train_args.parse_args(recipe_words(os.path.join(ROOT, "recipes", name)))
    per_gpu = args.rollout_batch_size * args.rollout_batches_per_epoch
    assert per_gpu % args.group_size == 0, "whole groups on each process"
    assert (args.group_size, 8 * per_gpu // args.group_size) == (group_size, groups)
    assert per_gpu // (args.train_batch_size * args.gradient_accumulation_steps) == steps
    assert (args.sde_window_size, args.sde_window_range) == window and train_args.num_trained_timesteps(args) == 1
    assert args.std_mode == std_mode and args.objective == "grpo" and args.reward_fn == "pickscore:1.0"


# The recipe's training values on the tiny model, CPU-sized: what is overridden is only what needs a
# GPU, a Hub model or a real prompt set (a flag wins over the config file's value).
TINY_OVERRIDES = [
    "--prompt_dataset", "{prompts}", "--reward_fn", "jpeg_compressibility", "--reward_mode", "sync",
    "--resolution", "32", "--num_inference_steps", "4", "--eval_num_inference_steps", "4",
    "--group_size", "4", "--rollout_batch_size", "4", "--rollout_batches_per_epoch", "2",
    "--train_batch_size", "4", "--gradient_accumulation_steps", "2", "--mixed_precision", "no",
    "--num_epochs", "3", "--report_to", "none",
]


def test_the_diffusionnft_recipe_trains_the_tiny_sd35_end_to_end(prompt_file, tmp_path):
    # Its soft-updated sampling policy, EMA, KL, global std, ab2 rollouts and LoRA on the joint
    # attention's text projections together, as the recipe sets them, on SD3.5-M's layout.
    from safetensors.torch import load_file

    from genrl.testing.tiny_pipelines import save_tiny_pipeline

    model = save_tiny_pipeline("sd3.5", tmp_path / "tiny-sd3.5")
    words = recipe_words(os.path.join(ROOT, "recipes", "sd35_medium_diffusionnft.yaml"))
    out = tmp_path / "out"
    overrides = [w.format(prompts=prompt_file) for w in TINY_OVERRIDES]
    # The recipe's own config (ZeRO-2), one process.
    run_script("train_genrl.py", [*words, "--pretrained_model_name_or_path", model, *overrides, "--output_dir", str(out)],
               config="zero2")
    trained = [json.loads(l) for l in open(out / "logs" / "metrics.jsonl") if '"train/' in l]
    assert len(trained) == 3 and all("train/kl" in l and "train/old_deviation" in l for l in trained)
    lora = load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert any("add_q_proj" in k for k in lora) and any("to_add_out" in k for k in lora), sorted(lora)[:8]
    assert not any("attn2" in k for k in lora), sorted(lora)[:8]


def test_the_wan22_a14b_recipe_lays_out_flow_factorys_epoch_on_8_gpus():
    """48 prompts x 16 clips, two optimizer steps an epoch, one stochastic step drawn in [1, 2]
    (within the high-noise expert's first steps at any shift the checkpoint ships: step 2 of 10 is
    at sigma >= 0.875 from shift 3 up), the high-noise expert under ZeRO-3."""
    path = os.path.join(ROOT, "recipes", "wan22_t2v_a14b_grpo.yaml")
    args = train_args.parse_args(recipe_words(path))
    per_gpu = args.rollout_batch_size * args.rollout_batches_per_epoch
    assert (args.group_size, 8 * per_gpu // args.group_size) == (16, 48)
    assert per_gpu // (args.train_batch_size * args.gradient_accumulation_steps) == 2
    assert train_args.num_trained_timesteps(args) == 1 and args.wan_expert == "high"
    assert (args.sde_window_size, list(args.sde_window_range)) == (1, [1, 3])
    shift, sigma = 3.0, 1 - 2 / args.num_inference_steps  # step 2's unshifted noise level
    assert shift * sigma / (1 + (shift - 1) * sigma) >= 0.875
    assert "zero3.yaml" in open(path).read()


def test_the_hunyuanvideo15_recipe_lays_out_dancegrpos_epoch_on_8_gpus():
    """A prompt of 24 clips on each GPU, the 8 whose rewards vary most trained in two optimizer
    steps, 60% of the 15 recorded stochastic steps (9) trained a clip; 53 frames, a size the 16x
    VAE takes; VideoAlign's visual quality as the reward."""
    from genrl.testing.tiny_pipelines import build_tiny_policy

    args = train_args.parse_args(recipe_words(os.path.join(ROOT, "recipes", "hunyuanvideo15_t2v_grpo.yaml")))
    per_gpu = args.rollout_batch_size * args.rollout_batches_per_epoch
    assert (args.group_size, per_gpu // args.group_size, args.train_samples_per_group) == (24, 1, 8)
    assert args.train_samples_per_group // (args.train_batch_size * args.gradient_accumulation_steps) == 2
    assert args.sde_window_size == 0 and train_args.num_trained_timesteps(args) == 9
    assert build_tiny_policy("hunyuanvideo15").latent_shape(args.height, args.width, args.num_frames)[1:] == (14, 30, 30)
    assert args.reward_fn == "videoalign_vq:1.0" and args.objective == "grpo" and args.guidance_scale == 6.0
def test_the_qwenimage_edit_recipe_sizes_its_shipped_images_as_the_pipeline_does():
    """At the recipe's sampled aspect ratio the images of its prompt set are read and VAE-encoded
    at the sizes QwenImageEditPlusPipeline gives them from their own aspect ratio."""
    import PIL.Image
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
        CONDITION_IMAGE_SIZE,
        VAE_IMAGE_SIZE,
        calculate_dimensions,
    )

    from genrl.data.prompts import load_prompts
    from genrl.policies.qwenimage_edit import condition_size

    args = train_args.parse_args(recipe_words(os.path.join(ROOT, "recipes", "qwenimage_edit_grpo.yaml")))
    images = load_prompts(os.path.join(ROOT, args.prompt_dataset), image_column=args.image_column).images
    assert len(images) == 8
    for path in images:
        width, height = PIL.Image.open(path).size
        for area in (CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE):
            assert condition_size(area, args.height, args.width) == calculate_dimensions(area, width / height)[::-1]
