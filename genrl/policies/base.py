"""The interface the rollout loop and the trainer see: one thin adapter per model family.

A ``FlowPolicy`` wraps a loaded diffusers pipeline. It owns the frozen parts (text encoders,
VAE) and knows the family's conventions (prompt encoding, latent layout, timestep scaling,
guidance, decoding), while the trainable transformer is always passed in explicitly, since
the trainer calls it wrapped (DeepSpeed / DDP) or unwrapped.

Conventions shared by every family:
- embeddings are a dict of batch-first tensors ``(B, ...)`` so they can be sliced and
  concatenated per sample; true-CFG families add ``negative_*`` keys;
- latents are float32 in the layout the denoising loop steps: Wan ``(B, C, F', h, w)``,
  SD3 and FLUX ``(B, C, h, w)`` (FLUX packs its 2x2 patches inside ``predict_velocity``);
- timesteps are in scheduler units ``[0, num_train_timesteps]``, sigmas in ``[0, 1]``;
- decoded samples are float ``(B, C, F, H, W)`` in ``[0, 1]`` (F = 1 for images).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from genrl.data.prompt_images import read_image, unique_images
from genrl.data.seeding import randn_per_sample


def calculate_shift(
    image_seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float
) -> float:
    """Resolution-dependent shift ``mu`` of FLUX/SD3.5: linear in the number of image tokens,
    mu = base_shift + (max_shift - base_shift) * (L - base_seq_len) / (max_seq_len - base_seq_len)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


def unwrap_module(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / DeepSpeed / torch.compile wrappers."""
    while True:
        if hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
            module = module.module
        elif hasattr(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype inputs of ``module`` should be cast to (its first floating parameter's)."""
    inner = unwrap_module(module)
    dtype = getattr(inner, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    for param in inner.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def as_flow_match_scheduler(scheduler) -> FlowMatchEulerDiscreteScheduler:
    """The pipeline's scheduler if it is a ``FlowMatchEulerDiscreteScheduler``; otherwise one
    built with the same shift (Wan ships ``UniPCMultistepScheduler`` with ``flow_shift``), since
    the SDE step and its log-prob are defined on the flow-matching Euler schedule."""
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler
    config = scheduler.config
    shift = config.get("flow_shift", None) or config.get("shift", None) or 1.0
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=config.get("num_train_timesteps", 1000), shift=float(shift)
    )


class FlowPolicy:
    """Adapter over a diffusers flow-matching pipeline. Subclasses fill in the family's parts.

    Attributes:
        family: "wan", "sd3" or "flux".
        pipeline: the wrapped diffusers pipeline.
        transformer: ``pipeline.transformer``, the trainable module.
        scheduler: the ``FlowMatchEulerDiscreteScheduler`` sampling uses.
        is_video: whether samples have more than one frame.
        default_height, default_width, default_num_frames: sampling size when none is given.
        default_condition_image_area: the pixels an image-editing family resizes its conditioning
            image to (None: its pipeline's).
        text_tokens: the ``max_sequence_length`` asked for (None: the pipeline's default).
        guidance_options: the family's guidance settings besides the scale, by the names its
            pipeline's call gives them, with the values ``pipe(prompt)`` uses (Z-Image's
            ``cfg_truncation``; Wan 2.2 A14B's ``guidance_scale_2``); the adapter holds them as
            attributes of those names and ``pipeline_call_guidance`` restores the defaults.
    """

    family: str = ""
    is_video: bool = False
    uses_true_cfg: bool = True  # CFG as two forwards (cond, uncond); else guidance is an input
    image_conditioned: bool = False  # every prompt comes with a conditioning image (image-to-video)
    pipeline_text_tokens: int = 512  # T5/UMT5 tokens per prompt the family's pipeline encodes by default
    guidance_keyword: str = "guidance_scale"  # the pipeline call's name for the scale genrl samples at
    guidance_options: dict[str, float | None] = {}

    def __init__(
        self,
        pipeline,
        *,
        default_height: int | None = None,
        default_width: int | None = None,
        default_num_frames: int | None = None,
        default_condition_image_area: int | None = None,
        max_sequence_length: int | None = None,
    ):
        if getattr(pipeline, "transformer", None) is None:
            raise ValueError(f"{type(pipeline).__name__} has no transformer; genrl trains the pipeline's transformer.")
        self.pipeline = pipeline
        self.transformer = pipeline.transformer
        self.scheduler = as_flow_match_scheduler(pipeline.scheduler)
        height, width, num_frames = self.pipeline_default_size()
        self.default_height = default_height or height
        self.default_width = default_width or width
        self.default_num_frames = default_num_frames or num_frames
        self.default_condition_image_area = default_condition_image_area
        if max_sequence_length is not None and max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be at least 1; got {max_sequence_length}.")
        self.text_tokens = max_sequence_length

    @property
    def max_sequence_length(self) -> int:
        """T5/UMT5 tokens per prompt (padded to it): ``max_sequence_length`` when given, else the
        pipeline's default, at most what the tokenizer takes."""
        tokenizer = self.text_tokenizer()
        limit = tokenizer.model_max_length if tokenizer is not None else self.pipeline_text_tokens
        return min(self.text_tokens or self.pipeline_text_tokens, limit)

    # ----- family-specific parts -------------------------------------------------------

    def text_tokenizer(self):
        """The tokenizer of the encoder ``max_sequence_length`` applies to (T5 or UMT5), or None."""
        raise NotImplementedError

    def pipeline_default_size(self) -> tuple[int, int, int]:
        """(height, width, num_frames) the pipeline itself samples at by default; image
        pipelines (SD3, FLUX): default_sample_size latent pixels times the VAE's scale."""
        size = self.pipeline.default_sample_size * self.pipeline.vae_scale_factor
        return size, size, 1

    trained_component = "transformer"  # the pipeline component trained (the export's subfolder)

    @classmethod
    def replaced_components(cls, path: str, revision: str | None) -> dict:
        """Components of the pipeline folder ``path`` that ``load_policy`` builds itself rather than
        leave to the pipeline's loader (none)."""
        return {}

    def trained_steps(self, num_inference_steps: int) -> tuple[int, int] | None:
        """``(a, b)`` when the trained transformer denoises only steps a..b-1 (one expert of two);
        None: every step."""
        return None

    def trained_sigma_range(self) -> tuple[float, float] | None:
        """The noise levels [lo, hi] the trained transformer denoises (one expert of two); None: all."""
        return None

    def frozen_modules(self) -> dict[str, torch.nn.Module]:
        """Text encoders and VAE by component name."""
        return {
            name: module
            for name, module in self.pipeline.components.items()
            if isinstance(module, torch.nn.Module) and name.startswith(("text_encoder", "vae"))
        }

    def encode_prompts(
        self, prompts: list[str], device: torch.device | str, guidance_scale: float, negative_prompt: str = ""
    ) -> dict[str, torch.Tensor]:
        """Text embeddings, every tensor ``(B, ...)``; with true CFG (guidance_scale > 1) also
        the ``negative_*`` embeddings of ``negative_prompt``."""
        raise NotImplementedError

    def encode_images(
        self, images: Sequence | None, height: int, width: int, num_frames: int, device: torch.device | str
    ) -> dict[str, torch.Tensor]:
        """The conditioning of ``images`` (one per prompt; None for the text-only families),
        every tensor ``(B, ...)``, to join the prompt embeddings: an image-to-video family's
        ``_encode_image`` of each distinct image, once (a prompt group's samples share theirs)."""
        name = type(self.pipeline).__name__
        if not self.image_conditioned:
            if images is not None:
                raise ValueError(f"{name} takes no conditioning images; sample it with images=None.")
            return {}
        if images is None or len(images) == 0:
            raise ValueError(f"{name} samples from an image: give one image per prompt.")
        unique, rows = unique_images(images)
        with torch.no_grad():
            parts = [self._encode_image(read_image(image), height, width, num_frames, torch.device(device)) for image in unique]
        index = torch.tensor(rows, device=device)
        return {key: torch.cat([part[key] for part in parts])[index] for key in parts[0]}

    def _encode_image(
        self, image, height: int, width: int, num_frames: int, device: torch.device
    ) -> dict[str, torch.Tensor]:
        """One RGB PIL image's conditioning, every tensor ``(1, ...)`` (image-to-video families)."""
        raise NotImplementedError

    def encode_conditioning(
        self, prompts: list[str], images: Sequence | None, height: int, width: int, num_frames: int,
        device: torch.device | str, guidance_scale: float, negative_prompt: str = "",
    ) -> dict[str, torch.Tensor]:
        """Everything the transformer is conditioned on, every tensor ``(B, ...)``: the prompts'
        embeddings (``encode_prompts``) and their images' (``encode_images``); a family whose text
        encoder reads the image too encodes them together."""
        embeds = self.encode_prompts(prompts, device, guidance_scale, negative_prompt)
        embeds.update(self.encode_images(images, height, width, num_frames, device))
        return embeds

    def finish_latents(self, latents: torch.Tensor, embeds: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sampled latents ``(B, ...)`` as the pipeline hands them to the VAE: unchanged, except
        for families that denoise around an encoded image and put it back."""
        return latents

    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        """Shape of one sample's latents (without the batch dim); fails on sizes the model cannot take."""
        raise NotImplementedError

    def image_seq_len(self, latents: torch.Tensor) -> int:
        """Number of image tokens the transformer sees for ``latents`` (sets FLUX/SD3.5's shift)."""
        raise NotImplementedError

    def schedule_kwargs(self, num_inference_steps: int, latents: torch.Tensor) -> dict:
        """Extra arguments of ``scheduler.set_timesteps``, as the family's pipeline passes them."""
        if not self.scheduler.config.get("use_dynamic_shifting", False):
            return {}
        return {"mu": self.shift_mu(latents)}

    # The pipelines' fallback when the scheduler config has no max_shift (SD3: 1.16, FLUX: 1.15).
    default_max_shift = 1.16

    def shift_mu(self, latents: torch.Tensor) -> float:
        """The resolution-dependent timestep shift mu of the scheduler's dynamic shifting."""
        config = self.scheduler.config
        return calculate_shift(
            self.image_seq_len(latents),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", self.default_max_shift),
        )

    def predict_velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        embeds: dict[str, torch.Tensor],
        guidance_scale: float,
    ) -> torch.Tensor:
        """Velocity v, float32, shaped like ``latents``; ``timestep`` is ``(B,)`` in scheduler
        units. With true CFG: v = v_u + g (v_c - v_u), cond and uncond in one forward."""
        raise NotImplementedError

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> float32 ``(B, C, F, H, W)`` in [0, 1], as the pipeline decodes them; image
        pipelines (SD3, FLUX): x = latents / scaling_factor + shift_factor through the VAE."""
        vae = self.pipeline.vae
        latents = latents.to(device=vae.device, dtype=vae.dtype)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]  # (B, C, H, W) in [-1, 1]
        return (image * 0.5 + 0.5).clamp(0, 1).float().unsqueeze(2)

    # ----- shared parts ------------------------------------------------------------------

    def use_cfg(self, guidance_scale: float) -> bool:
        """Whether sampling at ``guidance_scale`` runs the unconditional branch too."""
        return self.uses_true_cfg and guidance_scale > 1.0

    def conditional_guidance(self, guidance_scale: float) -> float:
        """The ``guidance_scale`` that makes ``predict_velocity`` return the conditional velocity
        alone (the likelihood-free objectives train it): 1 for true-CFG families; guidance-
        distilled ones (FLUX) keep the scale they sample with, since it is a model input."""
        return 1.0 if self.uses_true_cfg else guidance_scale

    @contextmanager
    def pipeline_call_guidance(self) -> Iterator["FlowPolicy"]:
        """Within it the policy guides as ``pipe(prompt)`` does: its ``guidance_options`` at the
        pipeline call's defaults, whatever the run set them to."""
        kept = {name: getattr(self, name) for name in self.guidance_options}
        try:
            for name, value in self.guidance_options.items():
                setattr(self, name, value)
            yield self
        finally:
            for name, value in kept.items():
                setattr(self, name, value)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "FlowPolicy":
        """Move the frozen parts (text encoders, VAE) to ``device`` (and ``dtype``), freeze them
        and put them in eval mode. The transformer is left alone: the trainer prepares it."""
        for module in self.frozen_modules().values():
            module.to(device) if dtype is None else module.to(device, dtype)
            module.requires_grad_(False)
            module.eval()
        return self

    def resolve_size(
        self, height: int | None, width: int | None, num_frames: int | None
    ) -> tuple[int, int, int]:
        """Fill unset sizes with the policy defaults; images always have one frame."""
        height = height or self.default_height
        width = width or self.default_width
        num_frames = (num_frames or self.default_num_frames) if self.is_video else 1
        return height, width, num_frames

    def prepare_latents(
        self,
        generators: Sequence[torch.Generator],
        height: int,
        width: int,
        num_frames: int,
        device: torch.device | str,
    ) -> torch.Tensor:
        """Initial noise ``(B, *latent_shape)`` float32; sample i drawn from ``generators[i]``
        on the CPU (identical on every machine and batch layout), then moved to ``device``."""
        if len(generators) == 0:
            raise ValueError("prepare_latents needs one generator per sample; got an empty list.")
        return randn_per_sample(self.latent_shape(height, width, num_frames), generators, device)

    def timesteps_and_sigmas(
        self, num_inference_steps: int, latents: torch.Tensor, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling schedule: timesteps ``(T,)`` in scheduler units and sigmas ``(T + 1,)``
        float32, from 1 down to a final 0, exactly as the family's pipeline sets them."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be at least 1; got {num_inference_steps}.")
        self.scheduler.set_timesteps(
            num_inference_steps, device=device, **self.schedule_kwargs(num_inference_steps, latents)
        )
        timesteps = self.scheduler.timesteps.to(device=device, dtype=torch.float32).clone()
        sigmas = self.scheduler.sigmas.to(device=device, dtype=torch.float32).clone()
        if sigmas[-1] != 0 or not bool((sigmas[1:] < sigmas[:-1]).all()):
            raise ValueError("The scheduler must give decreasing sigmas ending at 0 (invert_sigmas is not supported).")
        return timesteps, sigmas

    def _guided(self, velocity: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """Split a ``[uncond; cond]`` batch and combine: v = v_u + g (v_c - v_u), float32."""
        v_uncond, v_cond = velocity.float().chunk(2)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def _require(self, embeds: dict[str, torch.Tensor], *keys: str) -> list[torch.Tensor]:
        missing = [k for k in keys if k not in embeds]
        if missing:
            raise ValueError(
                f"{self.family} embeddings lack {missing}; encode_prompts with the same guidance_scale"
                " (> 1 adds the negative embeddings) as the one sampling uses."
            )
        return [embeds[k] for k in keys]


def check_divisible(name: str, value: int, multiple: int) -> None:
    """One clear error for a size the VAE and patchifier cannot take."""
    if value <= 0 or value % multiple != 0:
        raise ValueError(f"{name}={value} is not supported; it must be a positive multiple of {multiple}.")

