"""Z-Image (``ZImagePipeline``): Qwen3 text encoder, a single-stream DiT over its own 2x2
patches, true CFG in the pipeline's own form."""

from __future__ import annotations

import torch

from genrl.math.guidance import renormalized_guidance, truncated_guidance_scale
from genrl.math.sde import expand_per_sample
from genrl.policies.base import FlowPolicy, check_divisible, module_dtype, unwrap_module
from genrl.policies.masked_text import pad_token_rows, token_rows


class ZImagePolicy(FlowPolicy):
    """Latents ``(B, C, H / 8, W / 8)`` (for the published VAE), as ``ZImagePipeline`` draws
    them; the transformer patchifies them itself. It takes the captions as one tensor per prompt
    (the prompt's tokens, no padding): they are kept padded to ``max_sequence_length`` with a
    ``prompt_embeds_mask`` and cut back to that list for each forward. The transformer sees
    t' = (1000 - t) / 1000 and predicts -v.

    ``guidance_scale`` means what it means to ``ZImagePipeline``: g > 0 runs the unconditional
    branch and v = v_c + g (v_c - v_u) (0: the conditional velocity alone, as Z-Image-Turbo samples).
    So do the pipeline's two refinements of it: ``cfg_truncation`` (guide only while the progress
    1 - t / 1000 is at most it; 1, the pipeline's default, guides every step) and
    ``cfg_normalization`` (cap the guided velocity's norm at that many times the conditional one's;
    0, the pipeline's default False, leaves it), ``genrl.math.guidance``.
    """

    family = "zimage"
    is_video = False
    uses_true_cfg = True

    pipeline_text_tokens = 512  # ZImagePipeline's max_sequence_length
    guidance_options = {"cfg_normalization": 0.0, "cfg_truncation": 1.0}  # ZImagePipeline.__call__'s defaults

    def __init__(self, pipeline, *, cfg_normalization: float = 0.0, cfg_truncation: float = 1.0, **defaults):
        super().__init__(pipeline, **defaults)
        self.cfg_normalization, self.cfg_truncation = float(cfg_normalization), float(cfg_truncation)

    def text_tokenizer(self):
        return self.pipeline.tokenizer

    def pipeline_default_size(self) -> tuple[int, int, int]:
        return 1024, 1024, 1  # ZImagePipeline.__call__ defaults

    def use_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 0

    def conditional_guidance(self, guidance_scale: float) -> float:
        return 0.0

    @torch.no_grad()
    def encode_prompts(self, prompts, device, guidance_scale, negative_prompt=""):
        cfg = self.use_cfg(guidance_scale)
        # Fresh lists: ZImagePipeline.encode_prompt writes the chat-templated text into them.
        positive, negative = self.pipeline.encode_prompt(
            prompt=list(prompts),
            device=torch.device(device),
            do_classifier_free_guidance=cfg,
            negative_prompt=[negative_prompt] * len(prompts) if cfg else None,
            max_sequence_length=self.max_sequence_length,
        )
        embeds, mask = pad_token_rows(positive, self.max_sequence_length)
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if cfg:
            out["negative_prompt_embeds"], out["negative_prompt_embeds_mask"] = pad_token_rows(
                negative, self.max_sequence_length
            )
        return out

    def latent_shape(self, height, width, num_frames):
        factor = self.pipeline.vae_scale_factor
        check_divisible("height", height, 2 * factor)
        check_divisible("width", width, 2 * factor)
        return (self.transformer.config.in_channels, height // factor, width // factor)

    def image_seq_len(self, latents):
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)

    default_max_shift = 1.15

    def schedule_kwargs(self, num_inference_steps, latents):
        # ZImagePipeline: its linear sigmas, and mu (used when the scheduler shifts dynamically).
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        return {"sigmas": get_default_z_image_sigmas(num_inference_steps), "mu": self.shift_mu(latents)}

    def predict_velocity(self, transformer, latents, timestep, embeds, guidance_scale):
        dtype = module_dtype(transformer)
        captions = token_rows(*self._require(embeds, "prompt_embeds", "prompt_embeds_mask"))
        x, t = latents.to(dtype), (1000 - timestep.float()) / 1000
        cfg, scale = self.use_cfg(guidance_scale), None
        if cfg and self.cfg_truncation < 1:  # only then can a step be past it (reading t syncs with the device)
            scale = truncated_guidance_scale(guidance_scale, t, self.cfg_truncation)
            cfg = bool((scale > 0).any())  # every sample past it: one conditional forward, as the pipeline's
        if cfg:
            # ZImagePipeline's order: [cond; uncond] in one forward.
            captions += token_rows(*self._require(embeds, "negative_prompt_embeds", "negative_prompt_embeds_mask"))
            x, t = torch.cat([x, x]), torch.cat([t, t])
        forget_meta_rope_table(transformer, x)
        out = transformer(list(x.unsqueeze(2).unbind(0)), t, [c.to(dtype) for c in captions], return_dict=False)[0]
        velocity = -torch.stack([o.float() for o in out]).squeeze(2)
        if not cfg:
            return velocity
        v_cond, v_uncond = velocity.chunk(2)
        if scale is None:
            return renormalized_guidance(v_cond + guidance_scale * (v_cond - v_uncond), v_cond, self.cfg_normalization)
        scale = expand_per_sample(scale, v_cond)
        guided = renormalized_guidance(v_cond + scale * (v_cond - v_uncond), v_cond, self.cfg_normalization)
        return torch.where(scale > 0, guided, v_cond)  # unguided samples are not renormalized either


def forget_meta_rope_table(transformer: torch.nn.Module, x: torch.Tensor) -> None:
    """Z-Image's RoPE table is filled on first use on the input's device and moved with it later;
    one filled on the meta device (the trainer's FLOP count) holds no numbers to move, so it is
    dropped before a real forward and built again."""
    rope = unwrap_module(transformer).rope_embedder
    if rope.freqs_cis is not None and rope.freqs_cis[0].is_meta and not x.is_meta:
        rope.freqs_cis = None
