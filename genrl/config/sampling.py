"""How rollouts are sampled: size, steps, guidance, the SDE's noise and its window."""

import math
from dataclasses import dataclass
from typing import Literal

from transformers.hf_argparser import HfArg

from genrl.math.sde import ODE_SOLVERS, SDE_TYPES
from genrl.training.rollout import SamplingConfig, sde_window_start


@dataclass
class SamplingArguments:
    _argument_group_name = "sampling"

    seed: int = HfArg(default=42, help="Run seed: with the epoch and prompt it fixes every sample.")
    resolution: int | None = HfArg(default=None, help="Square size; or set --height/--width.")
    height: int | None = HfArg(default=None, help="Sample height in pixels (default: the model's).")
    width: int | None = HfArg(default=None, help="Sample width in pixels (default: the model's).")
    num_frames: int | None = HfArg(default=None, help="Video frames (video models; default: the model's).")
    max_sequence_length: int | None = HfArg(
        default=None,
        help="T5/UMT5 tokens per prompt, padded to it (default: the pipeline's, SD3 256, FLUX and Wan 512; Flow-GRPO "
        "and DiffusionNFT use 128). Padding tokens join the transformer's attention.",
    )
    num_inference_steps: int = HfArg(default=10, help="Denoising steps per sample.")
    guidance_scale: float = HfArg(
        default=4.5, help="Classifier-free guidance scale, as the model's pipeline reads it (1: off; Z-Image's: 0)."
    )
    negative_prompt: str = HfArg(default="", help="Negative prompt for classifier-free guidance.")
    guidance_scale_2: float | None = HfArg(
        default=None, help="Two-expert Wan 2.2: the guidance scale of the low-noise expert's steps (default: --guidance_scale)."
    )
    cfg_truncation: float | None = HfArg(
        default=None, help="Z-Image: guide only while the progress 1 - t/1000 is at most this (default: its pipeline's "
        "1, every step).",
    )
    cfg_normalization: float | None = HfArg(
        default=None, help="Z-Image: cap the guided velocity's norm at this many times the conditional one's (default: "
        "its pipeline's, off; its True is 1).",
    )
    noise_level: float = HfArg(default=0.7, help="SDE noise level a.")
    sde_type: Literal[SDE_TYPES] = HfArg(
        default="flow_sde", help="Stochastic sampler: Flow-GRPO's SDE or the coefficient-preserving one."
    )
    ode_solver: Literal[ODE_SOLVERS] = HfArg(
        default="euler",
        help="Deterministic steps (rollouts and evaluation): Euler, or the second-order two-step Adams-Bashforth "
        "method (one model call per step, as Euler).",
    )
    vae_decode_batch_size: int = HfArg(
        default=1,
        help="Samples per VAE decode call (rollouts and evaluation; the last call padded to it, so samples stay "
        "independent of the batch layout). 1 bounds the VAE's memory; more is faster for images.",
    )
    sde_window_size: int = HfArg(default=0, help="Stochastic steps per trajectory (0: every step).")
    sde_window_range: list[int] | None = HfArg(
        default=None, metadata={"nargs": 2, "metavar": ("LO", "HI")},
        help="Window start is drawn per prompt in [LO, HI - size] (default: anywhere).",
    )
    sde_window_shift_every: int = HfArg(
        default=0, metadata={"metavar": "EPOCHS"},
        help="MixGRPO's progressive window: one window for every prompt, starting at LO and moving one step towards "
        "the clean end every EPOCHS epochs (0: a random window per prompt group).",
    )
    same_latent: bool = HfArg(default=True, help="All K samples of a prompt start from the same noise.")

    def check(self) -> None:
        """Fills in ``height`` and ``width`` from ``resolution``."""
        if self.resolution is not None:
            self.height = self.height or self.resolution
            self.width = self.width or self.resolution
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError(f"--max_sequence_length must be at least 1 token; got {self.max_sequence_length}.")
        check_guidance_options(self.cfg_truncation, self.cfg_normalization)
        if not math.isfinite(self.noise_level) or self.noise_level < 0:
            raise ValueError(f"--noise_level must be a finite number >= 0 (0: deterministic sampling), got {self.noise_level}.")
        if self.num_inference_steps < 1:
            raise ValueError(f"--num_inference_steps must be at least 1, got {self.num_inference_steps}.")
        if self.vae_decode_batch_size < 1:
            raise ValueError(f"--vae_decode_batch_size must be at least 1, got {self.vae_decode_batch_size}.")


def check_guidance_options(cfg_truncation: float | None, cfg_normalization: float | None) -> None:
    """Z-Image's guidance options as the flags give them (None: unset)."""
    if cfg_truncation is not None and not math.isfinite(cfg_truncation):
        raise ValueError(f"--cfg_truncation must be a finite number (1: guide every step), got {cfg_truncation}.")
    if cfg_normalization is not None and not (math.isfinite(cfg_normalization) and cfg_normalization >= 0):
        raise ValueError(f"--cfg_normalization must be a finite number >= 0 (0: off), got {cfg_normalization}.")


def check_sde_window(args) -> None:
    """The SDE window (``--sde_window_*``) fits the sampling steps: checked after the objective's
    own checks (``genrl.config.checks``), which say first when it has no stochastic step to train."""
    size, steps = args.sde_window_size, args.num_inference_steps
    if size < 0 or size > steps - 1:
        raise ValueError(
            f"--sde_window_size {size} must be between 0 and num_inference_steps - 1 ({steps - 1}): the last step is "
            f"always deterministic."
        )
    if args.sde_window_shift_every < 0 or (args.sde_window_shift_every and not size):
        raise ValueError(
            f"--sde_window_shift_every slides an SDE window of --sde_window_size steps every so many epochs: it must "
            f"be >= 0 and needs --sde_window_size > 0, got {args.sde_window_shift_every} with --sde_window_size {size}."
        )
    if size and args.sde_window_range:  # the window must fit its range (the rollout's own check)
        window = SamplingConfig(num_inference_steps=steps, sde_window_size=size, sde_window_range=tuple(args.sde_window_range))
        sde_window_start("", args.seed, 0, steps, window)
