"""HunyuanVideo 1.5 image-to-video (``HunyuanVideo15ImageToVideoPipeline``): the text-to-video model's
inputs, with the image where text-to-video has zeros.

Each prompt comes with an image, encoded once per distinct image of a batch (a prompt group's
samples share theirs) into batch-first tensors that join the prompt embeddings:

- ``condition`` ``(B, C + 1, F', h, w)``: the VAE latents of the image (its mode, scaled) in the
  first latent frame and zeros in the others, then a mask channel, 1 on the first latent frame;
  concatenated to the noisy latents along the channels.
- ``image_embeds`` ``(B, N, D)``: the last hidden states of its SigLIP vision encoder (729 x 1152
  for the published checkpoints), which the transformer attends to beside the text, in both
  branches of CFG.

The pipeline picks the video's size from the image (the bucket of about target_size² pixels
nearest its aspect ratio) and crops the image to it. genrl samples a run at one size (``--height``,
``--width``) and crops every image to that size the same way: at the bucket of the images' aspect
ratio, the samples are the pipeline's.
"""

from __future__ import annotations

import torch

from genrl.errors import SetupError
from genrl.policies.hunyuan15 import HunyuanVideo15Policy


class HunyuanVideo15ImageToVideoPolicy(HunyuanVideo15Policy):
    """``HunyuanVideo15Policy`` conditioned on one image per prompt (``encode_images``). A
    step-distilled checkpoint (``use_meanflow``: its transformer also takes the next step's
    timestep) is refused."""

    image_conditioned = True

    def __init__(self, pipeline, **defaults):
        super().__init__(pipeline, **defaults)
        if self.transformer.config.get("use_meanflow", False):
            raise SetupError(f"{type(pipeline).__name__}'s transformer is step-distilled (use_meanflow: it takes each "
                             "step's next timestep as well), which genrl does not sample; train a checkpoint without it "
                             "(e.g. hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v).")

    def pipeline_default_size(self) -> tuple[int, int, int]:
        pipeline = self.pipeline  # the size pipe(image=...) samples a 16:9 image at, 121 frames (__call__'s default)
        height, width = pipeline.video_processor.calculate_default_height_width(9, 16, pipeline.target_size)
        return int(height), int(width), 121

    def frozen_modules(self) -> dict[str, torch.nn.Module]:
        return {**super().frozen_modules(), "image_encoder": self.pipeline.image_encoder}

    def _encode_image(self, image, height: int, width: int, num_frames: int, device: torch.device) -> dict[str, torch.Tensor]:
        """One PIL image's ``condition`` and ``image_embeds``, batch of 1, float32, by the pipeline's own
        crop, ``prepare_cond_latents_and_mask`` and ``encode_image``."""
        pipeline = self.pipeline
        image = pipeline.video_processor.resize(image, height=height, width=width, resize_mode="crop")
        shape_only = torch.empty((1, *self.latent_shape(height, width, num_frames)), device=device)
        latents, mask = pipeline.prepare_cond_latents_and_mask(
            latents=shape_only, image=image, batch_size=1, height=height, width=width, dtype=torch.float32, device=device,
        )
        image_embeds = pipeline.encode_image(image=image, batch_size=1, device=device, dtype=torch.float32)
        return {"condition": torch.cat([latents, mask], dim=1), "image_embeds": image_embeds}

    def _image_inputs(self, latents, embeds):
        if "condition" not in embeds or "image_embeds" not in embeds:
            raise ValueError("Image-to-video embeddings lack the image's 'condition' and 'image_embeds'; join "
                             "encode_images(...) to encode_prompts(...).")
        return embeds["condition"], embeds["image_embeds"]
