"""The model card's usage snippet works where users sample it: for every model family, LoRA and
full fine-tuning, the snippet a trained run's card carries, run as written with diffusers alone,
loads the trained weights into the base pipeline and samples with the run's settings (its
guidance included, under the name or component the family's pipeline takes it by)."""

import re

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from huggingface_hub import ModelCard

from genrl.checkpoints.checkpointing import export_model
from genrl.hub.model_card import PipelineUsage, write_run_card
from genrl.policies import policy_for_pipeline
from genrl.testing.tiny_pipelines import FAMILIES, TINY_SAMPLING_DEFAULTS, build_tiny_pipeline, save_tiny_pipeline
from genrl.training.trainable import make_trainable

GUIDANCE = 2.0
GUIDANCE_2 = 3.0
ZIMAGE_OPTIONS = {"cfg_truncation": 0.3, "cfg_normalization": 1.0}


def adapter_free(name: str) -> str:
    """A parameter's name without its LoRA adapter's name (``lora_A.default.weight`` -> ``lora_A.weight``)."""
    return re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", name)


def snippet_of(card_path: str) -> str:
    return ModelCard.load(card_path).text.split("```python\n")[1].split("```")[0]


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("family", [*FAMILIES, "wan2.2-a14b"])  # the two-expert Wan: its low-noise expert
def test_the_cards_snippet_samples_the_trained_weights_with_the_runs_settings(family, use_lora, tmp_path):
    base = save_tiny_pipeline(family, str(tmp_path / "base"))
    expert = {"expert": "low"} if family == "wan2.2-a14b" else {}
    policy = policy_for_pipeline(build_tiny_pipeline(family),
                                 **{f"default_{k}": v for k, v in TINY_SAMPLING_DEFAULTS[family].items()}, **expert)
    model = policy.transformer
    make_trainable(model, use_lora=use_lora, rank=2, lora_alpha=4, lora_target_modules="to_q,to_k,to_v",
                   gradient_checkpointing=False, float32=True)
    with torch.no_grad():  # "trained": weights that differ from the base's
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    export = str(tmp_path / "export")
    export_model(Accelerator(cpu=True), model, policy, export, config={}, use_lora=use_lora)
    size = TINY_SAMPLING_DEFAULTS[family]
    args = {"num_inference_steps": 2, "guidance_scale": GUIDANCE, "height": size["height"], "width": size["width"],
            "num_frames": size["num_frames"], "max_sequence_length": 16}
    if expert:  # the run's own scale for the low-noise steps, which WanPipeline otherwise sets to guidance_scale
        args["guidance_scale_2"] = GUIDANCE_2
    options = ZIMAGE_OPTIONS if family == "zimage" else {}  # the pipeline call takes them as the run set them
    args.update(options)
    record = {"base_model": base, "reward_fn": "r", "args": args, "launch_command": "x", "family": family}
    card = write_run_card(export, str(tmp_path / "none.jsonl"), record, is_video=policy.is_video,
                          usage=PipelineUsage.of(policy), last_eval={}, sample_images=[])
    snippet = snippet_of(card)
    assert f"from diffusers import {type(policy.pipeline).__name__}" in snippet

    scope = {}
    exec(compile(snippet, f"{family}-card-snippet", "exec"), scope)  # as a user runs it
    pipe, output = scope["pipe"], np.asarray(scope["video" if policy.is_video else "image"])
    frames = (size["num_frames"],) if policy.is_video else ()
    assert output.shape == (*frames, size["height"], size["width"], 3) and np.isfinite(output).all(), output.shape
    # The trained weights are the pipeline's: every trained tensor of the export, loaded.
    loaded = {adapter_free(k): v for k, v in getattr(pipe, policy.trained_component).named_parameters()}
    for name, value in model.named_parameters():
        if value.requires_grad:
            assert torch.equal(loaded[adapter_free(name)].float(), value.detach().float()), (family, name)
    # Guided as the run evaluated: the call's scale, or the pipeline's guider.
    settings = scope["settings"]
    if "guider" in pipe.components:
        assert pipe.guider.config.guidance_scale == GUIDANCE
    else:
        assert settings[policy.guidance_keyword] == GUIDANCE
    assert settings.get("guidance_scale_2") == (GUIDANCE_2 if expert else None)
    assert {k: settings[k] for k in ZIMAGE_OPTIONS if k in settings} == options
