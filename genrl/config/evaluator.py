"""The evaluator's configuration (``eval_genrl.py``): what is evaluated, on which prompts and
rewards, how it is sampled and what is written, one dataclass each, parsed as the trainer's are.

A setting left as None is filled from the export's own in-training evaluation, else from
``FALLBACK``; each section's ``check`` runs on the filled-in values."""

import os
from dataclasses import dataclass
from typing import Literal

from transformers.hf_argparser import HfArg

from genrl.config.files import GENRL_ROOT
from genrl.config.parser import ConfigParser, HelpFormatter
from genrl.config.sampling import check_guidance_options
from genrl.distributed.launch import check_mixed_precision
from genrl.math.sde import ODE_SOLVERS
from genrl.rewards import check_reward_options
from genrl.training.acceleration import check_attention_backend_name

DEFAULT_REWARD = "toy_geneval"  # the no-argument training run's reward, for its held-out prompts
DEFAULT_PROMPTS = os.path.join(GENRL_ROOT, "genrl", "assets", "prompts", "toy_test.txt")
# What an unset setting becomes when the model is not a genrl export (None: each pipeline's own).
FALLBACK = {"reward_fn": DEFAULT_REWARD, "num_inference_steps": 16, "guidance_scale": 4.5, "prompts": DEFAULT_PROMPTS,
            "max_batches": 8, "batch_size": 4, "seed": 0, "ode_solver": "euler", "samples_per_prompt": 1,
            "max_sequence_length": None, "image_column": "image"}


@dataclass
class EvalModelArguments:
    _argument_group_name = "model"

    model: str = HfArg(
        aliases=["--checkpoint", "--pretrained_model_name_or_path"],
        help="A base diffusers pipeline (folder or Hub id), a genrl export (output_dir), a checkpoint-<step> folder, "
        "or a LoRA adapter (a .safetensors file or a folder holding one; needs --base_model).",
    )
    base_model: str | None = HfArg(default=None, help="Base pipeline of a bare LoRA adapter.")
    compare: str | None = HfArg(
        default=None, metadata={"metavar": "MODEL_B"},
        help="A second model, evaluated on the same prompts and seeds, shown side by side.",
    )
    use_ema: bool = HfArg(default=False, help="Evaluate the EMA weights of a genrl export/checkpoint.")


@dataclass
class EvalDataArguments:
    _argument_group_name = "prompts and rewards"
    _argument_group_description = "Unset: the export's own evaluation's, else the toy run's held-out prompts and reward."

    prompts: str | None = HfArg(
        default=None,
        help="Prompt file (.txt one per line, .jsonl/.csv with a prompt column) or dataset; default: the export's own "
        "evaluation prompts, else the toy test prompts of the no-argument training run.",
    )
    prompt_column: str = HfArg(default="prompt", help="Column of the prompt text in a record file or dataset.")
    image_column: str | None = HfArg(
        default=None,
        help="Column of each prompt's conditioning image (image-to-video and editing models); default: the export's "
        "own, else 'image'.",
    )
    reward_fn: str | None = HfArg(
        default=None,
        help=f"Reward spec 'name:weight,...'; default: the one the export was trained with, else {DEFAULT_REWARD!r}.",
    )
    max_batches: int | None = HfArg(
        default=None, help="Evaluate at most this many batches (0 = every prompt); default: the export's own, else 8."
    )
    batch_size: int | None = HfArg(
        default=None, help="Prompts per batch (per forward pass); default: the export's own, else 4."
    )
    seed: int | None = HfArg(
        default=None, help="Batch b starts from noise seeded with seed + b; default: the export's own, else 0."
    )
    samples_per_prompt: int | None = HfArg(
        default=None,
        help="Noise draws of each prompt, the score their mean; draw k starts from the noise of --seed + 1000 k "
        "(draw 0: the one-sample evaluation's). Default: the export's own, else 1.",
    )

    def check(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"--batch_size must be at least 1; got {self.batch_size}.")
        if self.samples_per_prompt < 1:
            raise ValueError(f"--samples_per_prompt must be at least 1; got {self.samples_per_prompt}.")
        if self.max_batches < 0:
            raise ValueError(f"--max_batches must be >= 0 (0 = every prompt); got {self.max_batches}.")
        check_reward_options({}, [self.reward_fn])  # unknown names, module:function rewards that do not import


@dataclass
class EvalSamplingArguments:
    _argument_group_name = "sampling"
    _argument_group_description = "Unset: what the export evaluated with during training, else the model's own."

    num_inference_steps: int | None = HfArg(
        default=None, help="Default: what the export evaluated with during training, else 16."
    )
    guidance_scale: float | None = HfArg(
        default=None, help="Default: what the export evaluated with during training, else 4.5."
    )
    ode_solver: Literal[ODE_SOLVERS] | None = HfArg(
        default=None, help="Default: what the export evaluated with during training, else euler."
    )
    max_sequence_length: int | None = HfArg(
        default=None,
        help="T5/UMT5 tokens per prompt, for both models of a comparison. Default: what the export trained with, else "
        "each pipeline's own.",
    )
    cfg_truncation: float | None = HfArg(
        default=None, help="Z-Image: guide only while the progress 1 - t/1000 is at most this, for both models of a "
        "comparison. Default: what the export trained with, else its pipeline's 1 (every step).",
    )
    cfg_normalization: float | None = HfArg(
        default=None, help="Z-Image: cap the guided velocity's norm at this many times the conditional one's, for both "
        "models of a comparison. Default: what the export trained with, else its pipeline's, off.",
    )
    vae_decode_batch_size: int = HfArg(
        default=1, help="Samples per VAE decode call (1: bounded memory; any size: batch-layout independent)."
    )
    negative_prompt: str = HfArg(default="", help="Negative prompt for classifier-free guidance.")
    height: int | None = HfArg(default=None, help="Default: the model's own.")
    width: int | None = HfArg(default=None, help="Default: the model's own.")
    num_frames: int | None = HfArg(default=None, help="Default: the model's own (videos).")
    mixed_precision: Literal["bf16", "fp16", "no"] = HfArg(default="no", help="Weight dtype of the model while sampling.")
    attention_backend: str | None = HfArg(
        default=None, metadata={"metavar": "NAME"},
        help="diffusers attention backend of the transformer (as train_genrl.py's), e.g. _native_cudnn, flash; "
        "default: diffusers' own (torch SDPA).",
    )
    compile: bool = HfArg(
        default=False,
        help="Regional torch.compile of the transformer's repeated blocks (as train_genrl.py's); the first batch pays "
        "the compilation.",
    )

    def check(self) -> None:
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError(f"--max_sequence_length must be at least 1 token; got {self.max_sequence_length}.")
        if self.vae_decode_batch_size < 1:
            raise ValueError(f"--vae_decode_batch_size must be at least 1; got {self.vae_decode_batch_size}.")
        check_guidance_options(self.cfg_truncation, self.cfg_normalization)
        if self.attention_backend is not None:
            check_attention_backend_name(self.attention_backend)
        check_mixed_precision(self.mixed_precision)


@dataclass
class EvalOutputArguments:
    _argument_group_name = "output"

    save_samples: int = HfArg(
        default=16, help="How many samples (evenly spaced over the prompts) go into the grid and MP4s; -1 = all."
    )
    fps: float = HfArg(default=16.0, help="Frame rate of the written MP4s.")
    output_dir: str = HfArg(default="genrl-eval", help="Where metrics.json, the sample grid and the MP4s go.")

    def check(self) -> None:
        if self.save_samples < -1:
            raise ValueError(f"--save_samples must be >= 0, or -1 for all; got {self.save_samples}.")


EVALUATOR_SECTIONS = (EvalModelArguments, EvalDataArguments, EvalSamplingArguments, EvalOutputArguments)


def build_eval_parser() -> ConfigParser:
    """Every flag of the evaluator, one group per section, each with its help and default."""
    return ConfigParser(EVALUATOR_SECTIONS, prog="eval_genrl.py",
                        description="Deterministic, bounded evaluation of a genrl model.", formatter_class=HelpFormatter)
