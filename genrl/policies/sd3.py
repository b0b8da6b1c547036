"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): two CLIPs + T5, MMDiT, true CFG."""

from __future__ import annotations

import torch

from genrl.policies.base import FlowPolicy, check_divisible, module_dtype


class SD3Policy(FlowPolicy):
    """Latents ``(B, C, H / 8, W / 8)`` (for the published VAE); timesteps go to the
    transformer in [0, 1000]; decoding undoes the VAE's scaling and shift factors."""

    family = "sd3"
    is_video = False
    uses_true_cfg = True

    pipeline_text_tokens = 256  # StableDiffusion3Pipeline's T5 tokens

    def text_tokenizer(self):
        return getattr(self.pipeline, "tokenizer_3", None)  # None: SD3 without T5

    @torch.no_grad()
    def encode_prompts(self, prompts, device, guidance_scale, negative_prompt=""):
        cfg = self.use_cfg(guidance_scale)
        prompt_embeds, negative_embeds, pooled, negative_pooled = self.pipeline.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=torch.device(device),
            do_classifier_free_guidance=cfg,
            negative_prompt=[negative_prompt] * len(prompts) if cfg else None,
            max_sequence_length=self.max_sequence_length,
        )
        embeds = {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
        if cfg:
            embeds["negative_prompt_embeds"] = negative_embeds
            embeds["negative_pooled_prompt_embeds"] = negative_pooled
        return embeds

    def latent_shape(self, height, width, num_frames):
        multiple = self.pipeline.vae_scale_factor * self.transformer.config.patch_size
        check_divisible("height", height, multiple)
        check_divisible("width", width, multiple)
        factor = self.pipeline.vae_scale_factor
        return (self.transformer.config.in_channels, height // factor, width // factor)

    def image_seq_len(self, latents):
        patch = self.transformer.config.patch_size
        return (latents.shape[-2] // patch) * (latents.shape[-1] // patch)

    def predict_velocity(self, transformer, latents, timestep, embeds, guidance_scale):
        dtype = module_dtype(transformer)
        context, pooled = self._require(embeds, "prompt_embeds", "pooled_prompt_embeds")
        x, t, context, pooled = latents.to(dtype), timestep.float(), context.to(dtype), pooled.to(dtype)
        cfg = self.use_cfg(guidance_scale)
        if cfg:
            # Same order as StableDiffusion3Pipeline: [uncond; cond].
            neg_context, neg_pooled = self._require(embeds, "negative_prompt_embeds", "negative_pooled_prompt_embeds")
            x, t = torch.cat([x, x]), torch.cat([t, t])
            context = torch.cat([neg_context.to(dtype), context])
            pooled = torch.cat([neg_pooled.to(dtype), pooled])
        velocity = transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=context, pooled_projections=pooled, return_dict=False
        )[0]
        return self._guided(velocity, guidance_scale) if cfg else velocity.float()
