"""The trainer's command line: ``parse_args`` reads the flags and config files into the
typed sections of ``genrl.config`` and checks them before anything loads, so bad input fails
with one sentence; ``num_trained_timesteps`` and ``sampling_configs`` turn the arguments into
the numbers and ``SamplingConfig``s the trainer runs with.

Values come from the sections' defaults, then a config file (``--config``; without it and
without ``--pretrained_model_name_or_path``, the toy run's ``recipes/toy_<objective>.yaml``),
then the command line, each winning over the one before. The result is one flat namespace,
the arguments a checkpoint records (``genrl.checkpoints.checkpointing.run_identity``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from genrl.config import SECTIONS, build_parser, find_config, read_config, toy_config
from genrl.config.checks import check_run
from genrl.config.files import GENRL_ROOT
from genrl.config.sections import check_sections
from genrl.config.sources import config_file_values, drop_inapplicable, given_on_command_line
from genrl.errors import said_once
from genrl.objectives import get_objective
from genrl.training.rollout import SamplingConfig

# The shipped toy model and its prompt split (the toy run's config files name them).
DEFAULT_MODEL = os.path.join(GENRL_ROOT, "genrl", "assets", "toy-shapes-t2i")
DEFAULT_TRAIN_PROMPTS = os.path.join(GENRL_ROOT, "genrl", "assets", "prompts", "toy_train.txt")
DEFAULT_EVAL_PROMPTS = os.path.join(GENRL_ROOT, "genrl", "assets", "prompts", "toy_test.txt")

__all__ = ["parse_args", "build_parser", "num_trained_timesteps", "sampling_configs", "toy_run", "DEFAULT_MODEL",
           "DEFAULT_TRAIN_PROMPTS", "DEFAULT_EVAL_PROMPTS"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked arguments of ``argv`` (default: the script's own), as one namespace; a
    problem is one line on stderr and exit status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    given = given_on_command_line(parser, argv)
    path = given.get("config")
    if path is None and "pretrained_model_name_or_path" not in given:
        path = toy_config(given.get("objective"))
    file_values, source = {}, None
    if path is not None:
        try:
            path = find_config(path)
            source = os.path.relpath(path, GENRL_ROOT) if path.startswith(GENRL_ROOT + os.sep) else path
            file_values = config_file_values(build_parser(context=f"{source}: "), read_config(path))
        except (ValueError, OSError) as e:
            parser.error(str(e))
        parser.set_defaults(**file_values)  # flags on the command line still win
    args = parser.parse_args(argv)
    del args.config  # the arguments are the run's values, wherever they came from
    for note in drop_inapplicable(args, file_values, given, field_defaults(), source):
        if said_once(note):
            print(f"train_genrl.py: note: {note}", file=sys.stderr)
    try:
        check_sections(args)
        check_run(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        parser.error(str(e))  # one line, exit status 2
    return args


def field_defaults() -> dict:
    """Every flag's default, by name."""
    return {f.name: f.default for section in SECTIONS for f in dataclasses.fields(section)}


def toy_run(objective: str | None = None) -> dict:
    """The values of the toy run's config file for ``objective`` (default: the no-argument
    run's), shipped paths absolute."""
    return read_config(toy_config(objective))


def num_trained_timesteps(args) -> int:
    """Timesteps each sample trains on: a fraction of the recorded SDE steps (grpo: the window,
    or every step but the last, sigma' = 0) or of the sampling steps (nft, awm); the objective's
    ``num_trained_timesteps``."""
    return get_objective(args.objective).num_trained_timesteps(args)


def sampling_configs(args) -> tuple[SamplingConfig, SamplingConfig]:
    """How rollouts are sampled, and how evaluation samples (deterministic: noise level 0, its
    own steps and guidance, defaulting to the rollouts')."""
    common = dict(height=args.height, width=args.width, num_frames=args.num_frames, negative_prompt=args.negative_prompt,
                  decode_batch_size=args.vae_decode_batch_size)
    sampling = SamplingConfig(
        num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale, noise_level=args.noise_level,
        sde_type=args.sde_type, sde_window_size=args.sde_window_size,
        sde_window_range=tuple(args.sde_window_range) if args.sde_window_range else (0, None),
        sde_window_shift_every=args.sde_window_shift_every,
        same_latent=args.same_latent, record_means=args.grpo_guard, ode_solver=args.ode_solver, **common,
    )
    eval_sampling = SamplingConfig(
        num_inference_steps=args.eval_num_inference_steps or args.num_inference_steps,
        guidance_scale=args.eval_guidance_scale if args.eval_guidance_scale is not None else args.guidance_scale,
        noise_level=0.0, ode_solver=args.ode_solver, **common,
    )
    return sampling, eval_sampling
