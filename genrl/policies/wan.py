"""Wan 2.1 / 2.2 text-to-video (``WanPipeline``): UMT5 text encoder, 3D VAE, true CFG."""

from __future__ import annotations

import torch

from genrl.errors import SetupError
from genrl.policies.base import FlowPolicy, check_divisible, module_dtype


EXPERTS = ("high", "low")


def two_expert_message(source: str, boundary_ratio: float | None) -> str:
    """Why a Wan 2.2 pipeline with two expert transformers (A14B) needs ``--wan_expert``, in one sentence."""
    return (
        f"{source!r} is a two-expert Wan 2.2 pipeline (transformer for timesteps from {boundary_ratio} x 1000 up, "
        "transformer_2 below): choose the expert to train with --wan_expert high or --wan_expert low (the other one "
        "stays frozen and samples its own steps)."
    )


class WanPolicy(FlowPolicy):
    """Latents ``(B, C, F', h, w)`` with F' = (F - 1) / 4 + 1 and h, w = H / 8, W / 8 (for the
    published VAE); timesteps go to the transformer in [0, 1000].

    Wan 2.2 A14B has two experts of one architecture: ``pipeline.transformer`` for the timesteps
    t >= boundary_ratio x 1000 (the high-noise steps) and ``pipeline.transformer_2`` below, the
    latter guided with ``guidance_scale_2`` (None: the same scale, as WanPipeline). One of them is
    trained (``expert``: "high" or "low"; it is ``self.transformer``, the module the trainer
    prepares and passes in); the other (``frozen_expert``) is a frozen part like the VAE and
    samples its own steps. Without ``expert`` the policy samples with both (evaluation) and
    ``self.transformer`` is the high-noise one.
    """

    family = "wan"
    is_video = True
    uses_true_cfg = True
    guidance_options = {"guidance_scale_2": None}  # WanPipeline.__call__'s default: the first scale

    def __init__(self, pipeline, *, expert: str | None = None, guidance_scale_2: float | None = None, **defaults):
        super().__init__(pipeline, **defaults)
        self.frozen_expert, self.expert, self.boundary = None, None, None
        self.guidance_scale_2 = guidance_scale_2
        if getattr(pipeline, "transformer_2", None) is None:
            if expert is not None or guidance_scale_2 is not None:
                raise SetupError("--wan_expert and --guidance_scale_2 apply only to a two-expert Wan 2.2 pipeline (A14B).")
            return
        if expert not in (None, *EXPERTS):
            raise SetupError(f"--wan_expert must be one of {EXPERTS}, got {expert!r}.")
        ratio = pipeline.config.get("boundary_ratio")
        if ratio is None:
            raise SetupError(f"{type(pipeline).__name__} has a transformer_2 but no boundary_ratio to split the steps at.")
        self.boundary = float(ratio) * self.scheduler.config.num_train_timesteps
        self.expert = expert
        high, low = pipeline.transformer, pipeline.transformer_2
        self.transformer, self.frozen_expert = (low, high) if expert == "low" else (high, low)

    @property
    def trained_component(self) -> str:
        """The pipeline component the trained transformer is (its export's subfolder)."""
        return "transformer_2" if self.expert == "low" else "transformer"

    def frozen_modules(self) -> dict[str, torch.nn.Module]:
        frozen = super().frozen_modules()
        if self.frozen_expert is not None:
            frozen["transformer_2" if self.frozen_expert is self.pipeline.transformer_2 else "transformer"] = self.frozen_expert
        return frozen

    def expert_of(self, timestep: torch.Tensor) -> torch.Tensor:
        """``(B,)`` bool: which samples at ``timestep`` ``(B,)`` the trained expert denoises (all of
        them without two experts)."""
        if self.boundary is None:
            return torch.ones_like(timestep, dtype=torch.bool)
        high = timestep >= self.boundary
        return ~high if self.expert == "low" else high

    def trained_steps(self, num_inference_steps: int) -> tuple[int, int] | None:
        """``(a, b)``: the trained expert denoises steps a..b-1 of the ``num_inference_steps`` sampling
        steps (a contiguous run: the high-noise expert's first, the low-noise one's last); None
        without two experts."""
        if self.expert is None:
            return None
        timesteps, _ = self.timesteps_and_sigmas(num_inference_steps, torch.zeros(1), "cpu")
        own = torch.nonzero(self.expert_of(timesteps)).flatten().tolist()
        return (own[0], own[-1] + 1) if own else (0, 0)

    def trained_sigma_range(self) -> tuple[float, float] | None:
        """The noise levels [lo, hi] whose steps the trained expert denoises (flow matching: t =
        sigma x 1000, so the boundary is boundary_ratio in sigma); None without two experts."""
        if self.boundary is None or self.expert is None:
            return None
        ratio = self.boundary / self.scheduler.config.num_train_timesteps
        return (ratio, 1.0) if self.expert == "high" else (0.0, ratio - 1e-6)

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
        cfg = self.use_cfg(guidance_scale)  # as WanPipeline: decided by the first scale for both experts
        if self.boundary is None:
            return self._velocity(transformer, latents, timestep, embeds, cfg, guidance_scale)
        low_scale = guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
        trained = self.expert_of(timestep)
        high = timestep >= self.boundary
        velocity = torch.empty(latents.shape, dtype=torch.float32, device=latents.device)
        for rows in (trained, ~trained):  # at most two forwards, each expert its own samples
            if rows.any():
                model = transformer if rows is trained else self.frozen_expert
                scale = guidance_scale if bool(high[rows][0]) else low_scale
                part = {k: v[rows] for k, v in embeds.items()}
                velocity[rows] = self._velocity(model, latents[rows], timestep[rows], part, cfg, scale)
        return velocity

    def _velocity(self, transformer, latents, timestep, embeds, cfg: bool, guidance_scale: float) -> torch.Tensor:
        dtype = module_dtype(transformer)
        (prompt_embeds,) = self._require(embeds, "prompt_embeds")
        x, t, extra = self._model_inputs(latents, timestep.float(), embeds)
        x, context, extra = x.to(dtype), prompt_embeds.to(dtype), {k: v.to(dtype) for k, v in extra.items()}
        if cfg:
            (negative_embeds,) = self._require(embeds, "negative_prompt_embeds")
            x, t, context = torch.cat([x, x]), torch.cat([t, t]), torch.cat([negative_embeds.to(dtype), context])
            extra = {k: torch.cat([v, v]) for k, v in extra.items()}
        velocity = transformer(hidden_states=x, timestep=t, encoder_hidden_states=context, **extra, return_dict=False)[0]
        return self._guided(velocity, guidance_scale) if cfg else velocity.float()

    def _model_inputs(
        self, latents: torch.Tensor, timestep: torch.Tensor, embeds: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The transformer's ``hidden_states``, ``timestep`` and further conditioning inputs for
        ``latents`` ``(B, C, F', h, w)`` at ``timestep`` ``(B,)``, one sample each (CFG doubles them)."""
        if self.pipeline.config.get("expand_timesteps", False):
            # Wan 2.2 TI2V: one timestep per latent token (all equal for text-to-video).
            timestep = timestep[:, None].expand(-1, self.image_seq_len(latents))
        return latents, timestep, {}

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

