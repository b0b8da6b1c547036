"""Wan image-to-video (``WanImageToVideoPipeline``): Wan 2.1 I2V, Wan 2.2 I2V A14B, and Wan 2.2
TI2V-5B sampling from an image.

Each prompt comes with an image, encoded once per distinct image of a batch (a prompt group's
samples share theirs) into batch-first tensors that join the prompt embeddings, so they slice
and concatenate with the samples like the text:

- ``condition``: Wan 2.1 I2V and Wan 2.2 I2V (channel conditioning) ``(B, 4 + C, F', h, w)``, the
  first-frame mask (4 channels, one per frame of a latent frame) and the VAE latents of the
  video [image, black frames ...], concatenated to the noisy latents along the channels;
  Wan 2.2 TI2V (``expand_timesteps``) ``(B, C, 1, h, w)``, the image's latents, which are the
  first latent frame (a clean frame: its tokens get timestep 0).
- ``image_embeds``: Wan 2.1 I2V only (a transformer with ``image_dim``) ``(B, 257, 1280)``, the
  penultimate hidden states of its CLIP image encoder, which the transformer attends to.

TI2V's first latent frame is the image's whatever the sampler does with it: the transformer
sees the image there, its velocity there is 0 (so that frame adds nothing that depends on the
weights to a step's log-prob or to a flow-matching loss) and ``finish_latents`` puts the image
back before decoding, as the pipeline does.
"""

from __future__ import annotations

import torch

from genrl.policies.wan import WanPolicy


class WanImageToVideoPolicy(WanPolicy):
    """``WanPolicy`` conditioned on one image per prompt (``encode_images``); latents are the
    VAE's ``(B, z_dim, F', h, w)`` (the transformer takes more channels: the condition's)."""

    image_conditioned = True

    @property
    def first_frame_conditioned(self) -> bool:
        """Wan 2.2 TI2V's conditioning: the image is the first latent frame."""
        return bool(self.pipeline.config.get("expand_timesteps", False))

    @property
    def uses_image_encoder(self) -> bool:
        """Whether the transformer attends to CLIP image embeddings (Wan 2.1 I2V), as the pipeline decides it."""
        transformer = self.pipeline.transformer if self.pipeline.transformer is not None else self.transformer
        return transformer.config.get("image_dim") is not None

    def frozen_modules(self) -> dict[str, torch.nn.Module]:
        frozen = super().frozen_modules()
        if isinstance(getattr(self.pipeline, "image_encoder", None), torch.nn.Module):
            frozen["image_encoder"] = self.pipeline.image_encoder
        return frozen

    def latent_shape(self, height, width, num_frames):
        return (self.pipeline.vae.config.z_dim, *super().latent_shape(height, width, num_frames)[1:])

    def _encode_image(self, image, height: int, width: int, num_frames: int, device: torch.device) -> dict[str, torch.Tensor]:
        """One PIL image's ``condition`` (and ``image_embeds``), batch of 1, by the pipeline's own
        preprocessing and ``prepare_latents`` (float32, the VAE's mode)."""
        pipeline = self.pipeline
        pixels = pipeline.video_processor.preprocess(image, height=height, width=width).to(device, torch.float32)
        unused_noise = torch.empty((1, *self.latent_shape(height, width, num_frames)), device=device)
        prepared = pipeline.prepare_latents(
            pixels, batch_size=1, num_channels_latents=pipeline.vae.config.z_dim, height=height, width=width,
            num_frames=num_frames, dtype=torch.float32, device=device, latents=unused_noise,
        )
        embeds = {"condition": prepared[1]}
        if self.uses_image_encoder:
            embeds["image_embeds"] = pipeline.encode_image(image, device)
        return embeds

    def _model_inputs(self, latents, timestep, embeds):
        if "condition" not in embeds:
            raise ValueError("Image-to-video embeddings lack the image's 'condition'; join encode_images(...) to encode_prompts(...).")
        extra = {}
        if self.uses_image_encoder:
            (extra["encoder_hidden_states_image"],) = self._require(embeds, "image_embeds")
        if not self.first_frame_conditioned:
            return torch.cat([latents, embeds["condition"].to(latents.dtype)], dim=1), timestep, extra
        # TI2V: frame 0 is the image at noise level 0, the other frames' tokens at the step's timestep.
        p_t, p_h, p_w = self.transformer.config.patch_size
        _, _, frames, h, w = latents.shape
        noised = torch.ones(frames // p_t, h // p_h, w // p_w, device=latents.device)
        noised[0] = 0
        return self.finish_latents(latents, embeds), timestep[:, None] * noised.flatten()[None], extra

    def _velocity(self, transformer, latents, timestep, embeds, cfg, guidance_scale):
        velocity = super()._velocity(transformer, latents, timestep, embeds, cfg, guidance_scale)
        if not self.first_frame_conditioned:
            return velocity
        return torch.cat([torch.zeros_like(velocity[:, :, :1]), velocity[:, :, 1:]], dim=2)

    def finish_latents(self, latents, embeds):
        if not self.first_frame_conditioned:
            return latents
        return torch.cat([embeds["condition"].to(latents.dtype), latents[:, :, 1:]], dim=2)
