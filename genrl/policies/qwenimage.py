"""Qwen-Image (``QwenImagePipeline``): a Qwen2.5-VL text encoder, an MMDiT over 2x2-packed latents,
true CFG whose combination is rescaled to the conditional velocity's norm."""

from __future__ import annotations

import numpy as np
import torch

from genrl.policies.base import FlowPolicy, module_dtype
from genrl.policies.flux import FluxPolicy
from genrl.policies.masked_text import pad_to_width, valid_lengths


def renormed_cfg(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's true CFG on packed velocities ``(B, L, 4C)``: v = v_u + s (v_c - v_u), then
    rescaled token by token to the conditional norm, v * |v_c| / |v| (norms over the last dim)."""
    combined = v_uncond + scale * (v_cond - v_uncond)
    return combined * (v_cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class QwenImagePolicy(FlowPolicy):
    """Latents are kept unpacked, ``(B, C, H / 8, W / 8)`` (for the published VAE), the noise
    ``QwenImagePipeline`` draws before packing it into ``(B, H/16 * W/16, 4C)`` tokens. The prompt's
    hidden states (the system prefix of its template dropped) come right-padded with a mask; they
    are kept padded to ``max_sequence_length`` and cut to the batch's longest prompt for a forward,
    as the pipeline pads them. Timesteps go in as t / 1000; decoding undoes the VAE's per-channel
    mean and std. ``guidance_scale`` is the pipeline's ``true_cfg_scale``: above 1 the negative
    prompt (default "") runs too, and the velocities combine as ``renormed_cfg``."""

    family = "qwenimage"
    is_video = False
    uses_true_cfg = True

    pipeline_text_tokens = 1024  # QwenImagePipeline's max_sequence_length
    guidance_keyword = "true_cfg_scale"  # its guidance_scale is a guidance-distilled model's input

    def text_tokenizer(self):
        return self.pipeline.tokenizer

    @torch.no_grad()
    def encode_prompts(self, prompts, device, guidance_scale, negative_prompt=""):
        width = self.max_sequence_length
        out = {}
        groups = {"prompt_embeds": list(prompts)}
        if self.use_cfg(guidance_scale):
            groups["negative_prompt_embeds"] = [negative_prompt] * len(prompts)
        for key, texts in groups.items():
            embeds, mask = self.pipeline.encode_prompt(prompt=texts, device=torch.device(device), max_sequence_length=width)
            out[key], out[f"{key}_mask"] = pad_to_width(embeds, mask, width)
        return out

    # FLUX.1's latent layout (and its pipeline's fallback max_shift).
    latent_shape = FluxPolicy.latent_shape
    image_seq_len = FluxPolicy.image_seq_len
    default_max_shift = FluxPolicy.default_max_shift

    def schedule_kwargs(self, num_inference_steps, latents):
        # QwenImagePipeline: sigmas linspace(1, 1/N, N) and mu (used when the scheduler shifts dynamically).
        return {"sigmas": np.linspace(1.0, 1 / num_inference_steps, num_inference_steps), "mu": self.shift_mu(latents)}

    def predict_velocity(self, transformer, latents, timestep, embeds, guidance_scale):
        dtype = module_dtype(transformer)
        context, mask = self._require(embeds, "prompt_embeds", "prompt_embeds_mask")
        batch, channels, h, w = latents.shape
        pipeline = type(self.pipeline)
        x = pipeline._pack_latents(latents.to(dtype), batch, channels, h, w)
        noise_tokens = x.shape[1]
        x, img_shapes = self._image_stream(x, embeds, h, w)
        t = timestep.float() / 1000
        cfg = self.use_cfg(guidance_scale)
        if cfg:  # [uncond; cond] in one forward
            negative, negative_mask = self._require(embeds, "negative_prompt_embeds", "negative_prompt_embeds_mask")
            x, t = torch.cat([x, x]), torch.cat([t, t])
            context, mask = torch.cat([negative, context]), torch.cat([negative_mask, mask])
        tokens = max(valid_lengths(mask))  # the padding the pipeline would have: to the longest prompt
        velocity = transformer(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=context[:, :tokens].to(dtype),
            encoder_hidden_states_mask=mask[:, :tokens].to(context.device),  # (the FLOP count keeps masks real)
            img_shapes=[img_shapes] * len(x),
            return_dict=False,
        )[0][:, :noise_tokens].float()
        if cfg:
            v_uncond, v_cond = velocity.chunk(2)
            velocity = renormed_cfg(v_cond, v_uncond, guidance_scale)
        factor = self.pipeline.vae_scale_factor
        return pipeline._unpack_latents(velocity, h * factor, w * factor, factor).squeeze(2)

    def _image_stream(self, x: torch.Tensor, embeds: dict[str, torch.Tensor], h: int, w: int):
        """The transformer's image tokens ``(B, L, 4C)`` and the ``(frames, rows, columns)`` of each
        image they hold (its ``img_shapes`` entry): here the packed noisy latents ``x`` alone, of the
        unpacked size ``h`` x ``w``; the velocity is read off their first L tokens."""
        return x, [(1, h // 2, w // 2)]

    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipeline.vae
        z_dim = vae.config.z_dim
        latents = latents.unsqueeze(2).to(device=vae.device, dtype=vae.dtype)  # one frame: (B, C, 1, h, w)
        # As QwenImagePipeline: latents / (1 / std) + mean, in the VAE's dtype.
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        image = vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]  # (B, C, H, W) in [-1, 1]
        return (image * 0.5 + 0.5).clamp(0, 1).float().unsqueeze(2)
