"""HunyuanVideo 1.5 text-to-video: the tiny model's prompt layout (the crop the pipeline makes, the
quoted text through ByT5), the guiders sampling can and cannot reproduce, and two processes under
ZeRO-2 training it with LoRA, whose adapter its transformer loads (the pipeline has no LoRA loader)
and whose export eval_genrl.py evaluates as in training. Image-to-video: the image's conditioning,
the checkpoints refused, and two processes under ZeRO-2 training it with LoRA from a prompt set
with images, evaluated alike. (Sampling parity with the pipelines: test_policies; log-prob
recomputation: test_rollout; the objectives' losses: test_objectives, test_family_objectives.)"""

import json
import os

import pytest
import torch
from diffusers import ClassifierFreeGuidance

from conftest import run_script

from genrl.errors import SetupError
from genrl.evaluation.pipeline_defaults import pipeline_call_defaults
from genrl.policies import policy_for_pipeline
from genrl.testing.tiny_pipelines import TINY_CHAT_VOCAB, build_tiny_pipeline, build_tiny_policy

TEMPLATE_TAIL = 5  # <|im_end|> \n <|im_start|> assistant \n after the prompt


@pytest.fixture(scope="module")
def policy():
    return build_tiny_policy("hunyuanvideo15").to("cpu")


def test_the_prompt_is_cropped_after_the_system_message_and_quoted_text_goes_to_byt5(policy):
    """The pipeline drops the first 108 tokens of the chat-templated prompt (Qwen2.5-VL's count
    for its system message and the user turn's start), which the tiny tokenizer matches: what is
    left begins with the prompt. ByT5 reads 'Text "...". ' where the prompt quotes text, nothing
    where it does not, and the transformer sees those tokens."""
    pipeline = policy.pipeline
    prompts = ["a cat", 'a sign that says "open"']
    templated = pipeline.tokenizer.apply_chat_template(
        [[{"role": "system", "content": pipeline.system_message}, {"role": "user", "content": "a cat"}]],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"][0]
    crop = pipeline.prompt_template_encode_start_idx
    assert crop == 108 and templated[crop:crop + 2] == [TINY_CHAT_VOCAB.index("a"), TINY_CHAT_VOCAB.index("cat")]

    embeds = policy.encode_prompts(prompts, "cpu", guidance_scale=1.0)
    assert embeds["prompt_embeds_mask"].sum(dim=1).tolist() == [2 + TEMPLATE_TAIL, 7 + TEMPLATE_TAIL]
    glyph_tokens = len(pipeline.tokenizer_2('Text "open". ')["input_ids"])
    assert embeds["glyph_embeds_mask"].sum(dim=1).tolist() == [0, glyph_tokens]
    assert embeds["glyph_embeds"].shape[1] == pipeline.tokenizer_2_max_length and (embeds["glyph_embeds"][0] == 0).all()

    latents = policy.prepare_latents([torch.Generator().manual_seed(0)] * 2, 32, 48, 5, "cpu")
    unquoted = {**embeds, "glyph_embeds_mask": torch.zeros_like(embeds["glyph_embeds_mask"])}
    t = torch.tensor([700.0, 700.0])
    with torch.no_grad():
        v = policy.predict_velocity(policy.transformer, latents, t, embeds, 1.0)
        v_unquoted = policy.predict_velocity(policy.transformer, latents, t, unquoted, 1.0)
    torch.testing.assert_close(v[0], v_unquoted[0], rtol=0, atol=1e-5)  # its padding is masked out
    assert not torch.allclose(v[1], v_unquoted[1], atol=1e-3)


def test_the_guider_decides_cfg_and_one_sampling_cannot_reproduce_is_refused():
    pipeline = build_tiny_pipeline("hunyuanvideo15")
    assert pipeline_call_defaults(pipeline) == {"num_inference_steps": 50, "guidance_scale": 6.0}
    policy = policy_for_pipeline(pipeline)
    assert policy.use_cfg(6.0) and not policy.use_cfg(1.0)
    pipeline.target_size = 640  # the 480p checkpoints': pipe(prompt) samples 121 frames at 480x848
    assert policy.pipeline_default_size() == (480, 848, 121)
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=6.0, enabled=False)  # the pipeline then runs no CFG
    assert not policy.use_cfg(6.0) and "negative_prompt_embeds" not in policy.encode_prompts(["a cat"], "cpu", 6.0)
    for guider in (ClassifierFreeGuidance(guidance_rescale=0.7), ClassifierFreeGuidance(start=0.2),
                   ClassifierFreeGuidance(use_original_formulation=True)):
        pipeline.guider = guider
        with pytest.raises(SetupError, match=r"guider \(ClassifierFreeGuidance .*\) is not supported: .* plain CFG"):
            policy_for_pipeline(pipeline)


@pytest.mark.slow
def test_zero2_lora_grpo_loads_into_the_transformer_and_evaluates_as_in_training(prompt_file, tmp_path):
    import diffusers
    from safetensors.torch import load_file

    from genrl.testing.tiny_pipelines import save_tiny_pipeline
    from test_image_families import REWARD, last_eval
    from test_train_objectives import objective_args, train_lines

    model = save_tiny_pipeline("hunyuanvideo15", tmp_path / "tiny-hunyuanvideo15")
    out = str(tmp_path / "out")
    args = objective_args(model, prompt_file, out, "grpo", "--use_lora", "--rank", "4", "--lora_alpha", "8")
    args[args.index("--noise_level") + 1] = "0.7"  # GRPO trains the recorded SDE steps
    run_script("train_genrl.py", args, config="zero2", num_processes=2)
    lines = train_lines(out)
    assert [l["step"] for l in lines] == [2, 4] and all(torch.isfinite(torch.tensor(l["train/policy_loss"])) for l in lines)
    assert json.load(open(os.path.join(out, "genrl_config.json")))["family"] == "hunyuanvideo15"

    # As a user loads it with diffusers alone: the adapter (at its lora_alpha) into the transformer.
    pipeline = diffusers.DiffusionPipeline.from_pretrained(model)
    assert not hasattr(pipeline, "load_lora_weights")
    base = {k: v.clone() for k, v in pipeline.transformer.state_dict().items()}
    pipeline.transformer.load_lora_adapter(out, weight_name="pytorch_lora_weights.safetensors")
    assert pipeline.transformer.peft_config["default_0"].lora_alpha == 8
    pipeline.transformer.fuse_lora()
    pipeline.transformer.unload_lora()
    assert all(k.startswith("transformer.") for k in load_file(os.path.join(out, "pytorch_lora_weights.safetensors")))
    trained = pipeline.transformer.state_dict()
    assert trained.keys() == base.keys() and any(not torch.equal(trained[k], base[k]) for k in base)

    # eval_genrl.py on the export repeats the run's own last evaluation (its prompts, noise, steps).
    run_script("eval_genrl.py", ["--model", out, "--output_dir", str(tmp_path / "eval")])
    metrics = json.load(open(tmp_path / "eval" / "metrics.json"))["metrics"]
    assert metrics[REWARD]["mean"] == pytest.approx(last_eval(out), abs=1e-5)


@pytest.mark.slow
def test_zero3_full_nft_trains_every_weight_partitioned_and_evaluates_as_in_training(prompt_file, tmp_path):
    from test_image_families import train_export_and_evaluate

    train_export_and_evaluate("hunyuanvideo15", "nft", False, "zero3", prompt_file, tmp_path)


def test_image_to_video_conditions_on_the_images_first_latent_frame_and_its_siglip_embeddings():
    """One encoding per distinct image: its latents in the first latent frame of the condition
    channels, zeros after, a mask channel that marks that frame, and its SigLIP hidden states; the
    pipeline's default size is the one it samples a 16:9 image at; a step-distilled transformer is
    refused."""
    import numpy as np
    import PIL.Image

    policy = build_tiny_policy("hunyuanvideo15-i2v").to("cpu")
    pipeline = policy.pipeline
    assert set(policy.frozen_modules()) == {"text_encoder", "text_encoder_2", "vae", "image_encoder"}
    a, b = (PIL.Image.fromarray((np.random.RandomState(s).rand(24, 40, 3) * 255).astype(np.uint8)) for s in (0, 1))
    embeds = policy.encode_images([a, b, a], 32, 48, 9, "cpu")
    condition, image_embeds = embeds["condition"], embeds["image_embeds"]
    assert condition.shape == (3, 4 + 1, 3, 2, 3) and image_embeds.shape == (3, 16, 16)
    assert torch.equal(condition[0], condition[2]) and not torch.equal(condition[0], condition[1])
    assert (condition[:, :4, 0] != 0).all() and (condition[:, :4, 1:] == 0).all()
    assert (condition[:, 4, 0] == 1).all() and (condition[:, 4, 1:] == 0).all()
    assert torch.equal(image_embeds[0], image_embeds[2]) and not torch.allclose(image_embeds[0], image_embeds[1])
    with pytest.raises(ValueError, match="HunyuanVideo15ImageToVideoPipeline samples from an image: give one image per prompt"):
        policy.encode_images(None, 32, 48, 5, "cpu")

    pipeline.target_size = 640  # the 480p checkpoints'
    assert policy.pipeline_default_size() == (480, 848, 121)
    pipeline.transformer.register_to_config(use_meanflow=True)  # the step-distilled checkpoint's
    with pytest.raises(SetupError, match=r"transformer is step-distilled \(use_meanflow: .*\), which genrl does not sample"):
        policy_for_pipeline(pipeline)


@pytest.mark.slow
def test_zero2_lora_grpo_from_images_loads_into_the_transformer_and_evaluates_as_in_training(tmp_path):
    """Image-to-video: four prompts, each with its own image, under ZeRO-2 on 2 processes; the PPO
    ratio of its one update is 1 (the rollout's log-probs recomputed with the image), the adapter
    loads into the I2V pipeline's transformer and eval_genrl.py repeats the run's last evaluation."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    from genrl.testing.tiny_pipelines import save_tiny_pipeline
    from test_wan_i2v import PROMPTS, metric_lines, moved, train_args, write_image, write_records

    (tmp_path / "images").mkdir()  # 24 x 40 pixels: the pipeline samples them at the tiny default 32 x 48
    prompts = write_records(tmp_path / "prompts.jsonl", [
        {"prompt": p, "image": write_image(tmp_path / "images" / f"{i}.png", seed=i)} for i, p in enumerate(PROMPTS)])
    model = save_tiny_pipeline("hunyuanvideo15-i2v", tmp_path / "model")
    out = str(tmp_path / "out")
    run_script("train_genrl.py", train_args(model, prompts, out, "--use_lora", "--rank", "4", "--lora_alpha", "8",
                                            "--sde_window_size", "2", "--eval_prompt_dataset", prompts, "--eval_steps", "1",
                                            "--eval_batch_size", "2", "--eval_max_batches", "1"), config="zero2", num_processes=2)
    lines = metric_lines(out)
    trained = [l for l in lines if "train/approx_kl" in l][-1]
    assert 0 <= trained["train/approx_kl"] < 1e-3 and 0.95 < trained["train/ratio_min"] <= trained["train/ratio_max"] < 1.05
    assert json.load(open(os.path.join(out, "genrl_config.json")))["family"] == "hunyuanvideo15"

    pipeline = HunyuanVideo15ImageToVideoPipeline.from_pretrained(model)
    base = {k: v.clone() for k, v in pipeline.transformer.state_dict().items()}
    pipeline.transformer.load_lora_adapter(out, weight_name="pytorch_lora_weights.safetensors")
    pipeline.transformer.fuse_lora()
    pipeline.transformer.unload_lora()
    assert moved(base, pipeline.transformer.state_dict())

    last_eval = [l for l in lines if "eval/total_mean" in l][-1]
    run_script("eval_genrl.py", ["--model", out, "--output_dir", str(tmp_path / "eval")])
    evaluated = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert evaluated["settings"]["num_samples"] == 2
    assert evaluated["metrics"]["total"]["mean"] == pytest.approx(last_eval["eval/total_mean"], abs=1e-5)
