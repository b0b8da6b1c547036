"""FLUX.2: [dev] (``Flux2Pipeline``: Mistral Small 3.1 text encoder, guidance as an input) and
[klein] (``Flux2KleinPipeline``: Qwen3, true CFG), each reading three hidden layers of its text
encoder side by side, with one MMDiT over 2x2-patchified latents normalised by the VAE's batch norm."""

from __future__ import annotations

import numpy as np
import torch

from genrl.policies.base import FlowPolicy, check_divisible, module_dtype


class Flux2LayoutPolicy(FlowPolicy):
    """What the FLUX.2 pipelines share. Latents are ``(B, 4C, H / 16, W / 16)`` (for the published
    VAE): the noise the pipelines draw, whose channels already hold each 2x2 patch; the
    transformer sees them packed as ``(B, H/16 * W/16, 4C)`` tokens with 4-axis position ids (t,
    h, w, l), and the prompt's tokens with ids (0, 0, 0, l). Timesteps go in as t / 1000.
    Decoding undoes the VAE's batch norm on the patchified latents, then the patchify."""

    is_video = False
    pipeline_text_tokens = 512  # the FLUX.2 pipelines' max_sequence_length

    def text_tokenizer(self):
        return self.pipeline.tokenizer

    def latent_shape(self, height, width, num_frames):
        multiple = 2 * self.pipeline.vae_scale_factor
        check_divisible("height", height, multiple)
        check_divisible("width", width, multiple)
        return (self.transformer.config.in_channels, height // multiple, width // multiple)

    def image_seq_len(self, latents):
        return latents.shape[-2] * latents.shape[-1]

    def schedule_kwargs(self, num_inference_steps, latents):
        # The FLUX.2 pipelines: sigmas linspace(1, 1/N, N) (none with flow sigmas) and their
        # empirical mu, which depends on the image tokens and on the number of steps.
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        if self.scheduler.config.get("use_flow_sigmas", False):
            sigmas = None
        return {"sigmas": sigmas, "mu": compute_empirical_mu(self.image_seq_len(latents), num_inference_steps)}

    def _encode(self, prompts: list[str], device) -> torch.Tensor:
        """The pipeline's prompt embeddings ``(B, max_sequence_length, D)``."""
        embeds, _ = self.pipeline.encode_prompt(
            prompt=list(prompts), device=torch.device(device), max_sequence_length=self.max_sequence_length
        )
        return embeds

    def _transformer_velocity(
        self, transformer, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, guidance
    ) -> torch.Tensor:
        """One forward over ``latents`` ``(B, 4C, h, w)`` and prompt embeddings ``(B, L, D)``;
        ``guidance`` ``(B,)`` for a guidance-distilled transformer, else None. Float32 ``(B, 4C, h, w)``."""
        dtype = module_dtype(transformer)
        pipeline = type(self.pipeline)
        x = latents.to(dtype)
        velocity = transformer(
            hidden_states=pipeline._pack_latents(x),
            timestep=timestep.float() / 1000,
            guidance=guidance,
            encoder_hidden_states=context.to(dtype),
            txt_ids=pipeline._prepare_text_ids(context).to(latents.device),
            img_ids=pipeline._prepare_latent_ids(x).to(latents.device),
            return_dict=False,
        )[0]
        return velocity.float().transpose(1, 2).reshape(latents.shape)

    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipeline.vae
        latents = latents.to(device=vae.device, dtype=torch.float32)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).float()
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).float() + vae.config.batch_norm_eps)
        latents = type(self.pipeline)._unpatchify_latents(latents * std + mean).to(vae.dtype)
        image = vae.decode(latents, return_dict=False)[0]  # (B, C, H, W) in [-1, 1]
        return (image * 0.5 + 0.5).clamp(0, 1).float().unsqueeze(2)


class Flux2KleinPolicy(Flux2LayoutPolicy):
    """FLUX.2 [klein]: CFG as two forwards, v = v_u + g (v_c - v_u), when g > 1 and the checkpoint
    is not step-distilled (``is_distilled``, as the pipeline decides). The pipeline's negative
    prompt is "" (genrl's ``negative_prompt``, empty by default)."""

    family = "flux2-klein"
    uses_true_cfg = True

    def use_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 1 and not self.pipeline.config.get("is_distilled", False)

    @torch.no_grad()
    def encode_prompts(self, prompts, device, guidance_scale, negative_prompt=""):
        embeds = {"prompt_embeds": self._encode(prompts, device)}
        if self.use_cfg(guidance_scale):
            embeds["negative_prompt_embeds"] = self._encode([negative_prompt] * len(prompts), device)
        return embeds

    def predict_velocity(self, transformer, latents, timestep, embeds, guidance_scale):
        (context,) = self._require(embeds, "prompt_embeds")
        if not self.use_cfg(guidance_scale):
            return self._transformer_velocity(transformer, latents, timestep, context, None)
        (negative,) = self._require(embeds, "negative_prompt_embeds")
        velocity = self._transformer_velocity(
            transformer, torch.cat([latents, latents]), torch.cat([timestep, timestep]), torch.cat([negative, context]), None
        )
        return self._guided(velocity, guidance_scale)


class Flux2Policy(Flux2LayoutPolicy):
    """FLUX.2 [dev]: guidance-distilled, the scale is an input of the transformer (no true CFG).
    Its tokenizer is Mistral's ``PixtralProcessor``; the text half sets the token limit."""

    family = "flux2"
    uses_true_cfg = False

    def text_tokenizer(self):
        return getattr(self.pipeline.tokenizer, "tokenizer", self.pipeline.tokenizer)

    @torch.no_grad()
    def encode_prompts(self, prompts, device, guidance_scale, negative_prompt=""):
        return {"prompt_embeds": self._encode(prompts, device)}

    def predict_velocity(self, transformer, latents, timestep, embeds, guidance_scale):
        (context,) = self._require(embeds, "prompt_embeds")
        guidance = None
        if self.transformer.config.get("guidance_embeds", False):
            guidance = torch.full((len(latents),), float(guidance_scale), device=latents.device, dtype=torch.float32)
        return self._transformer_velocity(transformer, latents, timestep, context, guidance)
