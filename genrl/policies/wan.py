"""Wan 2.1 / 2.2 text-to-video (``WanPipeline``): UMT5 text encoder, 3D VAE, true CFG."""

from __future__ import annotations

import torch

from genrl.errors import SetupError
from genrl.policies.base import FlowPolicy, check_divisible, module_dtype


def two_expert_message(source: str, boundary_ratio: float | None) -> str:
    """Why a Wan 2.2 pipeline with two expert transformers (A14B) is refused, in one sentence."""
    return (
        f"{source!r} is a two-expert Wan 2.2 pipeline (transformer for timesteps from {boundary_ratio} x 1000 up, "
        "transformer_2 below), and genrl trains one transformer that samples every step; use a single-transformer "
        "Wan model (Wan2.2-TI2V-5B, Wan2.1-T2V-1.3B or -14B)."
    )


class WanPolicy(FlowPolicy):
    """Latents ``(B, C, F', h, w)`` with F' = (F - 1) / 4 + 1 and h, w = H / 8, W / 8 (for the
    published VAE); timesteps go to the transformer in [0, 1000]."""

    family = "wan"
    is_video = True
    uses_true_cfg = True

    def __init__(self, pipeline, **defaults):
        if getattr(pipeline, "transformer_2", None) is not None:
            raise SetupError(two_expert_message(type(pipeline).__name__, pipeline.config.get("boundary_ratio")))
        super().__init__(pipeline, **defaults)

    def pipeline_default_size(self) -> tuple[int, int, int]:
        return 480, 832, 81  # WanPipeline.__call__ defaults

    pipeline_text_tokens = 512  # WanPipeline.__call__'s

    def text_tokenizer(self):
        return self.pipeline.tokenizer

    @torch.no_grad()
    def encode_prompts(self, prompts, device, guidance_scale, negative_prompt=""):
        cfg = self.use_cfg(guidance_scale)
        prompt_embeds, negative_embeds = self.pipeline.encode_prompt(
            prompt=list(prompts),
            negative_prompt=[negative_prompt] * len(prompts) if cfg else None,
            do_classifier_free_guidance=cfg,
            max_sequence_length=self.max_sequence_length,
            device=torch.device(device),
        )
        embeds = {"prompt_embeds": prompt_embeds}
        if cfg:
            embeds["negative_prompt_embeds"] = negative_embeds
        return embeds

    def latent_shape(self, height, width, num_frames):
        temporal = self.pipeline.vae_scale_factor_temporal
        spatial = self.pipeline.vae_scale_factor_spatial
        patch = self.transformer.config.patch_size
        check_divisible("height", height, spatial * patch[1])
        check_divisible("width", width, spatial * patch[2])
        if num_frames < 1 or (num_frames - 1) % temporal != 0:
            raise ValueError(
                f"num_frames={num_frames} is not supported; num_frames - 1 must be a multiple of {temporal}."
            )
        channels = self.transformer.config.in_channels
        return (channels, (num_frames - 1) // temporal + 1, height // spatial, width // spatial)

    def image_seq_len(self, latents):
        p_t, p_h, p_w = self.transformer.config.patch_size
        _, _, frames, h, w = latents.shape
        return (frames // p_t) * (h // p_h) * (w // p_w)

    def predict_velocity(self, transformer, latents, timestep, embeds, guidance_scale):
        dtype = module_dtype(transformer)
        (prompt_embeds,) = self._require(embeds, "prompt_embeds")
        x, t, context = latents.to(dtype), timestep.float(), prompt_embeds.to(dtype)
        cfg = self.use_cfg(guidance_scale)
        if cfg:
            (negative_embeds,) = self._require(embeds, "negative_prompt_embeds")
            x, t, context = torch.cat([x, x]), torch.cat([t, t]), torch.cat([negative_embeds.to(dtype), context])
        if self.pipeline.config.get("expand_timesteps", False):
            # Wan 2.2 TI2V: one timestep per latent token (all equal for text-to-video).
            t = t[:, None].expand(-1, self.image_seq_len(latents))
        velocity = transformer(hidden_states=x, timestep=t, encoder_hidden_states=context, return_dict=False)[0]
        return self._guided(velocity, guidance_scale) if cfg else velocity.float()

    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipeline.vae
        z_dim = vae.config.z_dim
        latents = latents.to(device=vae.device, dtype=vae.dtype)
        # As WanPipeline: latents / (1 / std) + mean, computed in the VAE's dtype.
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]  # (B, C, F, H, W) in [-1, 1]
        return (video * 0.5 + 0.5).clamp(0, 1).float()

