"""Qwen-Image-Edit (``QwenImageEditPipeline``) and Qwen-Image-Edit-2509 / -2511
(``QwenImageEditPlusPipeline``, one image per prompt): Qwen-Image whose every prompt comes with
the image to edit, which conditions the transformer twice:

- the text encoder (Qwen2.5-VL) reads the image before the instruction, so the embeddings of a
  prompt (and of the negative prompt) are those of its (prompt, image) pair: ``prompt_embeds``
  ``(B, V + T, D)`` and its mask, V the image's vision tokens, T = ``max_sequence_length``;
- the image's VAE latents, packed 2x2 like the noise, ``image_latents`` ``(B, L_c, 4C)``, follow
  the noisy latents' tokens in the transformer's image stream; the velocity is read off the
  noisy ones.

The pipelines size the image at a fixed area (the VAE's 1024^2 pixels; the text encoder's the
same for Edit, 384^2 for Edit Plus) and the image's own aspect ratio. Here the area is the
pipeline's (or the model folder's ``condition_image_area``, ``default_condition_image_area``) and
the aspect ratio the sampled size's, so that the samples of a batch share one conditioning shape
(the transformer's positional embedding takes one per batch): for an image of the sampled
aspect ratio and the pipeline's area, exactly the pipeline's sizing.
"""

from __future__ import annotations

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    VAE_IMAGE_SIZE,
    calculate_dimensions,
)
from transformers import Qwen2VLProcessor
from transformers.utils import is_torchvision_available

from genrl.data.prompt_images import read_image, unique_images
from genrl.policies.masked_text import pad_to_width
from genrl.policies.qwenimage import QwenImagePolicy


class ImageTextQwen2VLProcessor(Qwen2VLProcessor):
    """transformers' ``Qwen2VLProcessor`` without its video half, whose processor needs torchvision:
    the Qwen-Image-Edit pipelines hand it text and images only. Its image processor is the one
    ``AutoImageProcessor`` gives without torchvision (the PIL backend)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def condition_size(area: int, height: int, width: int) -> tuple[int, int]:
    """(height, width) the pipelines resize an image of aspect ratio ``width / height`` to for an
    ``area`` of pixels: w = sqrt(area * r), h = w / r, each rounded to a multiple of 32."""
    cond_width, cond_height = calculate_dimensions(area, width / height)
    return int(cond_height), int(cond_width)


class QwenImageEditPolicy(QwenImagePolicy):
    """``QwenImagePolicy`` conditioned on one image per prompt (``encode_conditioning``); latents,
    schedule, true CFG and decoding are Qwen-Image's."""

    family = "qwenimage-edit"
    image_conditioned = True
    pipeline_image_area = 1024 * 1024  # QwenImageEditPipeline's, for the VAE and the text encoder
    text_encoder_image_area: int | None = None  # None: the VAE's image

    @classmethod
    def replaced_components(cls, path: str, revision: str | None) -> dict:
        """Without torchvision, the pipeline's processor is an ``ImageTextQwen2VLProcessor`` of
        the same folder (transformers' own cannot be built there)."""
        if is_torchvision_available():
            return {}
        return {"processor": ImageTextQwen2VLProcessor.from_pretrained(path, subfolder="processor", revision=revision)}

    def condition_sizes(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(height, width) of the image the text encoder reads and of the one the VAE encodes,
        for samples of ``height`` x ``width``."""
        vae_area = self.default_condition_image_area or self.pipeline_image_area
        return (condition_size(self.text_encoder_image_area or vae_area, height, width),
                condition_size(vae_area, height, width))

    def encode_prompts(self, prompts, device, guidance_scale, negative_prompt=""):
        raise ValueError(f"{type(self.pipeline).__name__} reads each prompt with its image: "
                         "encode them with encode_conditioning(prompts, images, ...).")

    @torch.no_grad()
    def encode_conditioning(
        self, prompts, images, height, width, num_frames, device, guidance_scale, negative_prompt=""
    ):
        if images is None or len(images) != len(prompts):
            raise ValueError(f"{type(self.pipeline).__name__} edits an image: give one image per prompt.")
        device = torch.device(device)
        unique, image_rows = unique_images(images)
        read_size, vae_size = self.condition_sizes(height, width)
        pictures = [read_image(image) for image in unique]
        seen = [self.pipeline.image_processor.resize(picture, *read_size) for picture in pictures]
        tokens = self.max_sequence_length + self._vision_tokens(seen[0])
        out = {"image_latents": torch.cat([self._image_latents(p, vae_size, device) for p in pictures])[image_rows]}
        # Each distinct (prompt, image) pair encoded once: a prompt group shares one.
        pairs: dict[tuple[str, int], int] = {}
        rows = [pairs.setdefault((prompt, r), len(pairs)) for prompt, r in zip(prompts, image_rows)]
        groups = {"prompt_embeds": (list(pairs), rows)}
        if self.use_cfg(guidance_scale):  # the negative prompt is read with each image too
            groups["negative_prompt_embeds"] = ([(negative_prompt, r) for r in range(len(unique))], image_rows)
        for key, (keys, index) in groups.items():
            encoded = [self._encode_pair(text, seen[r], tokens, device) for text, r in keys]
            out[key] = torch.cat([e for e, _ in encoded])[index]
            out[f"{key}_mask"] = torch.cat([m for _, m in encoded])[index]
        return out

    def _encode_pair(self, text: str, image, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(1, tokens, D)`` hidden states of ``text`` read with ``image`` and their mask ``(1, tokens)``."""
        embeds, mask = self.pipeline.encode_prompt(prompt=[text], image=image, device=device)
        return pad_to_width(embeds, mask, tokens)

    def _vision_tokens(self, image) -> int:
        """Tokens the text encoder gives ``image`` (a PIL image at its reading size): its patch grid
        over the merged patches, as the processor counts them."""
        processor = self.pipeline.processor.image_processor
        grid = processor(images=[image], return_tensors="pt")["image_grid_thw"]
        return int(grid.prod()) // processor.merge_size ** 2

    def _image_latents(self, picture, size: tuple[int, int], device: torch.device) -> torch.Tensor:
        """``(1, L_c, 4C)`` float32: ``picture`` resized to ``size`` and VAE-encoded as the pipeline
        does (the mode, normalised by the latents' mean and std), packed 2x2."""
        pipeline, vae = self.pipeline, self.pipeline.vae
        pixels = pipeline.image_processor.preprocess(picture, *size).unsqueeze(2).to(device, vae.dtype)
        latents = pipeline._encode_vae_image(pixels, generator=None)  # (1, C, 1, h, w)
        _, channels, _, h, w = latents.shape
        return type(pipeline)._pack_latents(latents, 1, channels, h, w).float()

    def _image_stream(self, x, embeds, h, w):
        if "image_latents" not in embeds:
            raise ValueError(
                "Qwen-Image-Edit embeddings lack the image's 'image_latents'; encode with encode_conditioning.")
        factor = self.pipeline.vae_scale_factor
        _, (cond_h, cond_w) = self.condition_sizes(h * factor, w * factor)
        condition = embeds["image_latents"].to(device=x.device, dtype=x.dtype)
        shapes = [(1, h // 2, w // 2), (1, cond_h // factor // 2, cond_w // factor // 2)]
        return torch.cat([x, condition], dim=1), shapes


class QwenImageEditPlusPolicy(QwenImageEditPolicy):
    """Qwen-Image-Edit-2509 / -2511: the text encoder reads a smaller image (384^2 pixels) after
    "Picture 1: "; the 2511 transformer gives the image's tokens timestep 0 (``zero_cond_t``, read
    off the ``img_shapes``)."""

    family = "qwenimage-edit-plus"
    pipeline_image_area = VAE_IMAGE_SIZE
    text_encoder_image_area = CONDITION_IMAGE_SIZE
