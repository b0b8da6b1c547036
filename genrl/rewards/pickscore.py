"""PickScore (Kirstain et al., 2023): a CLIP ViT-H/14 fine-tuned on Pick-a-Pic's human
preferences, the reward of Flow-GRPO's and DiffusionNFT's SD3.5-M runs.

score(image, prompt) = exp(logit_scale) * cos(E_text(prompt), E_image(image)) / 26, with E the
CLIP projections; the division by 26 is the one both papers' code applies (it brings typical
images to about 0.8-0.9), so logged scores compare with their curves. Advantages are normalised,
so the scale does not change what is learned. A video scores the mean of its frames, each
scored as an image.

Images are preprocessed as upstream does: uint8 frames as PIL images through the processor's
image preprocessing (shortest side to 224, bicubic; centre crop; CLIP normalisation); prompts
are tokenised to at most 77 tokens. Scored in float32 by default, as upstream.

Sources (defaults in brackets; local folders work offline, Hub ids need the network or cache):

- ``checkpoint``: the CLIP model, a folder or repo in transformers' format
  [``yuvalkirstain/PickScore_v1``];
- ``processor``: the folder or repo of its tokenizer and image preprocessing
  [``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``; only its json/tokenizer files are fetched].
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from genrl.distributed.zero3 import zero_init_disabled
from genrl.rewards import lifecycle
from genrl.rewards.model_reward import FOLDER, ScorerFamily, build_scorer_reward, resolve_dtype, resolve_folder

DEFAULT_CHECKPOINT = "yuvalkirstain/PickScore_v1"
DEFAULT_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
# What a processor folder needs: configs and tokenizer files, not the 4 GB of weights beside them.
PROCESSOR_PATTERNS = ("*.json", "*.txt", "*.model")
# The weights as safetensors where the repo has them, else its PyTorch file (read with
# weights_only, which runs no code from it); never both (each is 4 GB).
CHECKPOINT_PATTERNS = (("*.json", "*.safetensors"), ("*.json", "*.bin"))
SCALE = 26.0
MAX_TOKENS = 77

PICKSCORE = ScorerFamily(
    family="PickScore",
    cache_name="pickscore",
    rewards=("pickscore",),
    options=frozenset({"checkpoint", "processor", "dtype", "batch_size"}),
    cache_fields=("checkpoint", "processor"),
    sources={"checkpoint": DEFAULT_CHECKPOINT, "processor": DEFAULT_PROCESSOR},
    paths={"checkpoint": FOLDER, "processor": FOLDER},
)


def pickscore_from_embeddings(text_embeds: torch.Tensor, image_embeds: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """``(N, D)`` text and image projections -> ``(N,)``: exp(logit_scale) cos(t_i, v_i) / 26."""
    text = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
    image = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
    return logit_scale.exp() * (text * image).sum(dim=-1) / SCALE


class PickScoreScorer:
    """A loaded PickScore model with its tokenizer and image processor. ``.device`` is where the
    model is; ``.to(device)`` moves both (and the lifecycle cache key) together."""

    family = "PickScore"

    def __init__(self, model: nn.Module, tokenizer, image_processor, device: Union[str, torch.device], *, batch_size: int = 16):
        if batch_size < 1:
            raise ValueError(f"PickScore batch_size must be at least 1, got {batch_size}.")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.device = torch.device(device)
        self.batch_size = batch_size

    def to(self, device: Union[str, torch.device]) -> "PickScoreScorer":
        lifecycle.move(self, device)
        return self

    @torch.no_grad()
    def score_images(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """uint8 ``(N, H, W, 3)`` and N prompts -> float32 CPU ``(N,)``."""
        from PIL import Image

        if len(prompts) != images.shape[0]:
            raise ValueError(f"PickScore got {images.shape[0]} images and {len(prompts)} prompts.")
        dtype = next(self.model.parameters()).dtype
        scores = []
        for start in range(0, images.shape[0], self.batch_size):
            frames = images[start:start + self.batch_size].cpu().numpy()
            pixels = self.image_processor(images=[Image.fromarray(np.ascontiguousarray(f)) for f in frames],
                                          return_tensors="pt")["pixel_values"]
            text = self.tokenizer(list(prompts[start:start + self.batch_size]), padding=True, truncation=True,
                                  max_length=MAX_TOKENS, return_tensors="pt")
            # The projections of the pooled outputs: what get_text/image_features return on every
            # transformers release (5.x wraps them in an output object, 4.x does not).
            image_embeds = self.model.visual_projection(
                self.model.vision_model(pixel_values=pixels.to(self.device, dtype)).pooler_output)
            text_embeds = self.model.text_projection(self.model.text_model(
                input_ids=text["input_ids"].to(self.device), attention_mask=text["attention_mask"].to(self.device)).pooler_output)
            scores.append(pickscore_from_embeddings(text_embeds.float(), image_embeds.float(), self.model.logit_scale.float()).cpu())
        return torch.cat(scores)

    def score_frames(self, clips: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """uint8 ``(N, F, H, W, 3)`` -> float32 CPU ``(N, F)``: every frame scored as an image."""
        n, f = clips.shape[:2]
        frame_prompts = [p for p in prompts for _ in range(f)]
        return self.score_images(clips.reshape(n * f, *clips.shape[2:]), frame_prompts).reshape(n, f)


def load_pickscore_scorer(
    checkpoint: Optional[str] = None,
    processor: Optional[str] = None,
    *,
    device: Union[str, torch.device] = "cpu",
    dtype: Union[str, torch.dtype, None] = "float32",
    batch_size: int = 16,
) -> PickScoreScorer:
    """Load PickScore (sources and defaults in the module doc); ``dtype`` None: bfloat16 on CUDA."""
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    model_folder = resolve_folder(checkpoint or DEFAULT_CHECKPOINT, CHECKPOINT_PATTERNS[0])
    if not any(name.endswith(".safetensors") for name in os.listdir(model_folder)):
        model_folder = resolve_folder(checkpoint or DEFAULT_CHECKPOINT, CHECKPOINT_PATTERNS[1])
    processor_folder = resolve_folder(processor or DEFAULT_PROCESSOR, PROCESSOR_PATTERNS)
    with zero_init_disabled():  # a frozen reward model is never partitioned by ZeRO-3
        # Cast after loading: from_pretrained's dtype argument is named differently in 4.x and 5.x.
        model = CLIPModel.from_pretrained(model_folder).to(device, resolve_dtype(dtype, device))
    return PickScoreScorer(
        model, AutoTokenizer.from_pretrained(processor_folder),
        AutoImageProcessor.from_pretrained(processor_folder), device, batch_size=batch_size,
    )


def build_pickscore_reward(name: str = "pickscore", device: Union[str, torch.device] = "cpu", **options: Any):
    """Registry factory for ``pickscore``; ``options`` go to :func:`load_pickscore_scorer`.

    The callable ``fn(samples, prompts, metadata=None)`` returns ``{"pickscore": (N,)}`` (float32,
    CPU), the mean over a sample's frames."""

    def score(scorer: PickScoreScorer, clips: torch.Tensor, prompts: list[str], metadata: Optional[Sequence[Mapping]]):
        return {"pickscore": scorer.score_frames(clips, prompts).mean(dim=1)}

    # The default dtype spelled out, so that the cache key names what is loaded.
    return build_scorer_reward(PICKSCORE, name, device, {"dtype": "float32", **options}, load_pickscore_scorer, score)


build_pickscore_reward.check_options = PICKSCORE.check_options  # option names and paths, checked before any model loads
