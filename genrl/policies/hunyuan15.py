"""HunyuanVideo 1.5 text-to-video (``HunyuanVideo15Pipeline``): a Qwen2.5-VL text encoder beside a
ByT5 encoder of the prompt's quoted text, an MMDiT over the latents of a 16x causal VAE, CFG by the
pipeline's guider."""

from __future__ import annotations

import numpy as np
import torch

from genrl.errors import SetupError
from genrl.policies.base import FlowPolicy, check_divisible, module_dtype
from genrl.policies.masked_text import pad_to_width, valid_lengths

# The embeddings of one prompt: Qwen2.5-VL's and ByT5's, each with its token mask.
TEXT_KEYS = ("prompt_embeds", "prompt_embeds_mask", "glyph_embeds", "glyph_embeds_mask")


def check_guider(guider) -> None:
    """The pipeline's guider must be plain CFG, v = v_u + g (v_c - v_u) at every step, which
    ``predict_velocity`` reproduces; anything else is one sentence."""
    config = guider.config
    plain = (type(guider).__name__ == "ClassifierFreeGuidance" and not config.get("guidance_rescale")
             and not config.get("use_original_formulation") and (config.get("start"), config.get("stop")) == (0.0, 1.0))
    if not plain:
        settings = {k: v for k, v in config.items() if not k.startswith("_")}
        raise SetupError(f"The pipeline's guider ({type(guider).__name__} {settings}) is not supported: genrl samples "
                         "HunyuanVideo 1.5 with plain CFG at every step (ClassifierFreeGuidance without rescale, start 0, "
                         "stop 1).")


class HunyuanVideo15Policy(FlowPolicy):
    """Latents ``(B, C, F', h, w)`` with F' = (F - 1) / 4 + 1 and h, w = H / 16, W / 16 (for the
    published VAE), as the pipeline draws them. The transformer takes them with C zero condition
    channels and a zero mask channel (no image), and timesteps in [0, 1000] in its own dtype.

    A prompt is two masked token sequences, kept right-padded: the third-to-last hidden states of
    Qwen2.5-VL over the chat-templated prompt, its system part cropped (``max_sequence_length``
    wide), and ByT5's encoding of the prompt's quoted text (256 wide; no token where none is
    quoted). The transformer masks every padding token out of its attention, so a forward cuts both
    to the batch's longest and passes no image tokens (the pipeline's are zeros that it masks out):
    the velocity is the pipeline's.

    ``guidance_scale`` is the pipeline guider's: above 1 (and with the guider enabled) the negative
    prompt (default "") runs too and v = v_u + g (v_c - v_u). A CFG-distilled checkpoint ships a
    guider at 1."""

    family = "hunyuanvideo15"
    is_video = True
    uses_true_cfg = True
    pipeline_text_tokens = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length

    def __init__(self, pipeline, **defaults):
        super().__init__(pipeline, **defaults)
        check_guider(pipeline.guider)

    def text_tokenizer(self):
        return self.pipeline.tokenizer

    def pipeline_default_size(self) -> tuple[int, int, int]:
        pipeline = self.pipeline  # its 16:9 size of about target_size^2 pixels, 121 frames (__call__'s default)
        width_ratio, height_ratio = pipeline.default_aspect_ratio
        height, width = pipeline.video_processor.calculate_default_height_width(height_ratio, width_ratio,
                                                                               pipeline.target_size)
        return int(height), int(width), 121

    def use_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 1 and self.pipeline.guider.config.get("enabled", True)

    @torch.no_grad()
    def encode_prompts(self, prompts, device, guidance_scale, negative_prompt=""):
        out = self._encode(list(prompts), torch.device(device))
        if self.use_cfg(guidance_scale):
            negative = self._encode([negative_prompt] * len(prompts), torch.device(device))
            out.update({f"negative_{k}": v for k, v in negative.items()})
        return out

    def _encode(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """``TEXT_KEYS``: ``(B, max_sequence_length, D)`` and ``(B, 256, D2)`` with their masks, by the
        pipeline's own encoders (its static helpers: ``encode_prompt`` pads to its fixed 1000 tokens)."""
        pipeline = self.pipeline
        embeds, mask = pipeline._get_mllm_prompt_embeds(
            text_encoder=pipeline.text_encoder, tokenizer=pipeline.tokenizer, prompt=prompts, device=device,
            tokenizer_max_length=self.max_sequence_length, system_message=pipeline.system_message,
            crop_start=pipeline.prompt_template_encode_start_idx,
        )
        glyphs, glyph_mask = pipeline._get_byt5_prompt_embeds(
            tokenizer=pipeline.tokenizer_2, text_encoder=pipeline.text_encoder_2, prompt=prompts, device=device,
            tokenizer_max_length=pipeline.tokenizer_2_max_length,
        )
        out = dict(zip(TEXT_KEYS[:2], pad_to_width(embeds, mask, self.max_sequence_length)))
        out.update(zip(TEXT_KEYS[2:], pad_to_width(glyphs, glyph_mask, pipeline.tokenizer_2_max_length)))
        return out

    def latent_shape(self, height, width, num_frames):
        temporal, spatial = self.pipeline.vae_scale_factor_temporal, self.pipeline.vae_scale_factor_spatial
        check_divisible("height", height, spatial * self.transformer.config.patch_size)
        check_divisible("width", width, spatial * self.transformer.config.patch_size)
        if num_frames < 1 or (num_frames - 1) % temporal != 0:
            raise ValueError(f"num_frames={num_frames} is not supported; num_frames - 1 must be a multiple of {temporal}.")
        return (self.pipeline.vae.config.latent_channels, (num_frames - 1) // temporal + 1, height // spatial,
                width // spatial)

    def image_seq_len(self, latents):
        config = self.transformer.config
        _, _, frames, h, w = latents.shape
        return (frames // config.patch_size_t) * (h // config.patch_size) * (w // config.patch_size)

    def schedule_kwargs(self, num_inference_steps, latents):
        # HunyuanVideo15Pipeline: sigmas linspace(1, 0, N + 1) without the final 0, shifted by the scheduler.
        return {"sigmas": np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1]}

    def predict_velocity(self, transformer, latents, timestep, embeds, guidance_scale):
        dtype = module_dtype(transformer)
        text = self._require(embeds, *TEXT_KEYS)
        condition, image = self._image_inputs(latents, embeds)
        x, t = torch.cat([latents, condition.to(latents.dtype)], dim=1), timestep
        cfg = self.use_cfg(guidance_scale)
        if cfg:  # [uncond; cond] in one forward, both with the image
            negative = self._require(embeds, *(f"negative_{k}" for k in TEXT_KEYS))
            text = [torch.cat([n, c]) for n, c in zip(negative, text)]
            x, t, image = torch.cat([x, x]), torch.cat([t, t]), torch.cat([image, image])
        context, mask, glyphs, glyph_mask = text
        tokens, glyph_tokens = max(valid_lengths(mask)), max(valid_lengths(glyph_mask))
        velocity = transformer(
            hidden_states=x.to(dtype),
            timestep=t.to(dtype),
            encoder_hidden_states=context[:, :tokens].to(dtype),
            encoder_attention_mask=mask[:, :tokens],
            encoder_hidden_states_2=glyphs[:, :glyph_tokens].to(dtype),
            encoder_attention_mask_2=glyph_mask[:, :glyph_tokens],
            image_embeds=image.to(dtype),
            return_dict=False,
        )[0]
        return self._guided(velocity, guidance_scale) if cfg else velocity.float()

    def _image_inputs(self, latents: torch.Tensor, embeds: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """What the transformer takes of the image for ``latents`` ``(B, C, F', h, w)``: the condition
        channels ``(B, C + 1, F', h, w)`` (condition latents, then the mask) and the image embeddings
        ``(B, N, D)``. Text-to-video: zero channels and no image token (the pipeline's zero embeddings,
        which the transformer masks out)."""
        batch, channels, frames, h, w = latents.shape
        return (latents.new_zeros(batch, channels + 1, frames, h, w),
                latents.new_zeros(batch, 0, self.transformer.config.image_embed_dim))

    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipeline.vae
        latents = latents.to(device=vae.device, dtype=vae.dtype) / vae.config.scaling_factor
        # One clip at a time: the VAE's causal attention mask does not broadcast over a batch (diffusers 0.42).
        video = torch.cat([vae.decode(z, return_dict=False)[0] for z in latents.split(1)])  # (B, C, F, H, W) in [-1, 1]
        return (video * 0.5 + 0.5).clamp(0, 1).float()
