"""FLUX.1 (``FluxPipeline``): CLIP (pooled) + T5, MMDiT over 2x2-packed latents, guidance
as an input of the transformer (guidance-distilled; no true CFG)."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FluxPipeline

from genrl.policies.base import FlowPolicy, check_divisible, module_dtype


class FluxPolicy(FlowPolicy):
    """Latents are kept unpacked, ``(B, C, h, w)`` with h, w = 2 * (H // 16) (for the
    published VAE), exactly the noise ``FluxPipeline`` draws before packing: the SDE step is
    elementwise, so the layout changes nothing, and the shape keeps the image size that the
    positional ids need. ``predict_velocity`` packs to ``(B, h/2 * w/2, 4C)``, builds
    img_ids/txt_ids as the pipeline does, and unpacks the velocity. Timesteps go to the
    transformer as t / 1000."""

    family = "flux"
    is_video = False
    uses_true_cfg = False

    pipeline_text_tokens = 512  # FluxPipeline's T5 tokens

    def text_tokenizer(self):
        return self.pipeline.tokenizer_2

    @torch.no_grad()
    def encode_prompts(self, prompts, device, guidance_scale, negative_prompt=""):
        prompt_embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            device=torch.device(device),
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def latent_shape(self, height, width, num_frames):
        factor = self.pipeline.vae_scale_factor
        check_divisible("height", height, 2 * factor)
        check_divisible("width", width, 2 * factor)
        return (self.transformer.config.in_channels // 4, height // factor, width // factor)

    def image_seq_len(self, latents):
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)

    default_max_shift = 1.15

    def schedule_kwargs(self, num_inference_steps, latents):
        # FluxPipeline: sigmas linspace(1, 1/N, N) and mu always computed (used when the
        # scheduler config asks for dynamic shifting).
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        if self.scheduler.config.get("use_flow_sigmas", False):
            sigmas = None
        return {"sigmas": sigmas, "mu": self.shift_mu(latents)}

    def predict_velocity(self, transformer, latents, timestep, embeds, guidance_scale):
        dtype = module_dtype(transformer)
        context, pooled = self._require(embeds, "prompt_embeds", "pooled_prompt_embeds")
        batch, channels, h, w = latents.shape
        packed = FluxPipeline._pack_latents(latents.to(dtype), batch, channels, h, w)
        img_ids = FluxPipeline._prepare_latent_image_ids(batch, h // 2, w // 2, latents.device, dtype)
        txt_ids = torch.zeros(context.shape[1], 3, device=latents.device, dtype=dtype)
        guidance = None
        if self.transformer.config.get("guidance_embeds", False):
            guidance = torch.full((batch,), float(guidance_scale), device=latents.device, dtype=torch.float32)
        velocity = transformer(
            hidden_states=packed,
            timestep=timestep.to(dtype) / 1000,
            guidance=guidance,
            pooled_projections=pooled.to(dtype),
            encoder_hidden_states=context.to(dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        factor = self.pipeline.vae_scale_factor
        return FluxPipeline._unpack_latents(velocity.float(), h * factor, w * factor, factor)
