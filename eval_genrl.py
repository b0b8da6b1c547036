"""Bounded, deterministic evaluation of a base model, a genrl export, a training checkpoint or a
LoRA adapter on a prompt set, scored by genrl rewards.

    python eval_genrl.py --model runs/wan-hps/checkpoint-200 --max_batches 8 --seed 0
    accelerate launch --num_processes 2 eval_genrl.py --model runs/wan-hps --use_ema \
        --reward_fn "hpsv3:1.0" --prompts prompts/test.txt
    python eval_genrl.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --compare runs/wan-hps

Writes ``<output_dir>/metrics.json`` (per-reward mean and std, per-prompt scores, settings),
``samples.png`` and, for videos, ``videos/<index>.mp4``. With ``--compare MODEL_B`` both models
are evaluated on the same prompts and seeds: ``model_a/`` and ``model_b/`` hold each one's
outputs, ``compare.png`` and ``compare.html`` show them side by side.

The numbers depend only on the arguments, not on the number of processes (see
``genrl.evaluation.evaluate``).
"""

import argparse
import faulthandler
import gc
import json
import logging
import os
from contextlib import ExitStack

from genrl.training.console import close_progress_bars, hide_loading_bars, silence_known_noise

silence_known_noise()  # before the libraries below load: some warn on import

import torch
from accelerate.logging import get_logger

from genrl.checkpoints.checkpointing import CONFIG_FILE, LORA_EMA_FILE, LORA_FILE, load_trained_policy
from genrl.checkpoints.output_lock import lock_output_dir
from genrl.data.prompts import PromptSet, load_prompts
from genrl.distributed.launch import build_accelerator, check_mixed_precision, end_processes
from genrl.distributed.zero3 import zero_init_disabled
from genrl.errors import find_setup_error, said_once, stop_line
from genrl.evaluation.evaluate import EvalResult, EvalSettings, evaluate
from genrl.evaluation.outputs import save_comparison, save_eval_outputs
from genrl.math.sde import ODE_SOLVERS
from genrl.policies import FlowPolicy, load_policy
from genrl.rewards import build_reward_fn, check_reward_options
from genrl.training.acceleration import (
    check_attention_backend_name,
    compile_repeated_blocks,
    probe_attention_backend,
    set_attention_backend,
)
from genrl.training.rollout import SamplingConfig

logger = get_logger(__name__)

DEFAULT_REWARD = "toy_geneval"  # the embedded default run's reward, for its default prompts
DEFAULT_PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "genrl", "assets", "prompts", "toy_test.txt")
WEIGHT_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args(input_args=None):
    parser = argparse.ArgumentParser(prog="eval_genrl.py", description="Deterministic, bounded evaluation of a genrl model.")
    parser.add_argument(
        "--model", "--checkpoint", "--pretrained_model_name_or_path", dest="model", type=str, required=True,
        help="A base diffusers pipeline (folder or Hub id), a genrl export (output_dir), a checkpoint-<step> "
        "folder, or a LoRA adapter (a .safetensors file or a folder holding one; needs --base_model).",
    )
    parser.add_argument("--base_model", type=str, default=None, help="Base pipeline of a bare LoRA adapter.")
    parser.add_argument("--compare", type=str, default=None, metavar="MODEL_B",
                        help="A second model, evaluated on the same prompts and seeds, shown side by side.")
    parser.add_argument("--use_ema", action="store_true", help="Evaluate the EMA weights of a genrl export/checkpoint.")
    parser.add_argument("--prompts", type=str, default=None,
                        help="Prompt file (.txt one per line, .jsonl/.csv with a prompt column) or dataset; default: the "
                        "export's own evaluation prompts, else the toy test prompts of the embedded default run.")
    parser.add_argument("--prompt_column", type=str, default="prompt")
    parser.add_argument("--image_column", type=str, default=None,
                        help="Column of each prompt's conditioning image (image-to-video models); default: the export's "
                        "own, else 'image'.")
    parser.add_argument("--reward_fn", type=str, default=None,
                        help=f"Reward spec 'name:weight,...'; default: the one the export was trained with, else {DEFAULT_REWARD!r}.")
    parser.add_argument("--max_batches", type=int, default=None,
                        help="Evaluate at most this many batches (0 = every prompt); default: the export's own, else 8.")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="Prompts per batch (per forward pass); default: the export's own, else 4.")
    parser.add_argument("--seed", type=int, default=None,
                        help="Batch b starts from noise seeded with seed + b; default: the export's own, else 0.")
    parser.add_argument("--samples_per_prompt", type=int, default=None,
                        help="Noise draws of each prompt, the score their mean; draw k starts from the noise of --seed + "
                        "1000 k (draw 0: the one-sample evaluation's). Default: the export's own, else 1.")
    parser.add_argument("--num_inference_steps", type=int, default=None,
                        help="Default: what the export evaluated with during training, else 16.")
    parser.add_argument("--guidance_scale", type=float, default=None,
                        help="Default: what the export evaluated with during training, else 4.5.")
    parser.add_argument("--ode_solver", choices=ODE_SOLVERS, default=None,
                        help="Default: what the export evaluated with during training, else euler.")
    parser.add_argument("--max_sequence_length", type=int, default=None,
                        help="T5/UMT5 tokens per prompt, for both models of a comparison. Default: what the export "
                        "trained with, else each pipeline's own.")
    parser.add_argument("--vae_decode_batch_size", type=int, default=1,
                        help="Samples per VAE decode call (1: bounded memory; any size: batch-layout independent).")
    parser.add_argument("--negative_prompt", type=str, default="")
    parser.add_argument("--height", type=int, default=None, help="Default: the model's own.")
    parser.add_argument("--width", type=int, default=None, help="Default: the model's own.")
    parser.add_argument("--num_frames", type=int, default=None, help="Default: the model's own (videos).")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=sorted(WEIGHT_DTYPES),
                        help="Weight dtype of the model while sampling.")
    parser.add_argument("--attention_backend", type=str, default=None, metavar="NAME",
                        help="diffusers attention backend of the transformer (as train_genrl.py's), e.g. _native_cudnn, "
                        "flash; default: diffusers' own (torch SDPA).")
    parser.add_argument("--compile", action="store_true",
                        help="Regional torch.compile of the transformer's repeated blocks (as train_genrl.py's); the first "
                        "batch pays the compilation.")
    parser.add_argument("--save_samples", type=int, default=16,
                        help="How many samples (evenly spaced over the prompts) go into the grid and MP4s; -1 = all.")
    parser.add_argument("--fps", type=float, default=16.0, help="Frame rate of the written MP4s.")
    parser.add_argument("--output_dir", type=str, default="genrl-eval")
    args = parser.parse_args(input_args)
    # Unset settings follow the export's own in-training evaluation (model A's, else B's), so a
    # trained model is scored on the prompts, batches, noise and reward its training run used.
    trained = trained_settings(args.model) or trained_settings(args.compare)
    fallback = {"reward_fn": DEFAULT_REWARD, "num_inference_steps": 16, "guidance_scale": 4.5, "prompts": DEFAULT_PROMPTS,
                "max_batches": 8, "batch_size": 4, "seed": 0, "ode_solver": "euler", "samples_per_prompt": 1,
                "max_sequence_length": None, "image_column": "image"}  # None: each pipeline's own
    for key, value in fallback.items():
        if getattr(args, key) is None:
            setattr(args, key, trained.get(key, value))

    if args.max_sequence_length is not None and args.max_sequence_length < 1:
        parser.error(f"--max_sequence_length must be at least 1 token; got {args.max_sequence_length}.")
    if args.batch_size < 1:
        parser.error(f"--batch_size must be at least 1; got {args.batch_size}.")
    if args.samples_per_prompt < 1:
        parser.error(f"--samples_per_prompt must be at least 1; got {args.samples_per_prompt}.")
    if args.vae_decode_batch_size < 1:
        parser.error(f"--vae_decode_batch_size must be at least 1; got {args.vae_decode_batch_size}.")
    if args.max_batches < 0:
        parser.error(f"--max_batches must be >= 0 (0 = every prompt); got {args.max_batches}.")
    if args.save_samples < -1:
        parser.error(f"--save_samples must be >= 0, or -1 for all; got {args.save_samples}.")
    if args.attention_backend is not None:
        try:
            check_attention_backend_name(args.attention_backend)
        except ValueError as error:
            parser.error(str(error))
    try:
        check_reward_options({}, [args.reward_fn])  # unknown names, module:function rewards that do not import
        check_mixed_precision(args.mixed_precision)
    except (ValueError, ImportError) as error:
        parser.error(str(error))
    return args


def _lora_file(path: str, use_ema: bool) -> str | None:
    """The LoRA weights file ``path`` is or holds when it is a bare adapter (no genrl config,
    no diffusers pipeline), else None."""
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return path
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in (CONFIG_FILE, "model_index.json")):
        candidate = os.path.join(path, LORA_EMA_FILE if use_ema else LORA_FILE)
        return candidate if os.path.isfile(candidate) else None
    return None


def load_model(path: str, *, base_model: str | None, use_ema: bool, dtype: torch.dtype,
               max_sequence_length: int | None = None, image_conditioned: bool | None = None) -> FlowPolicy:
    """Any model ``--model`` accepts -> a FlowPolicy with its trained weights in the transformer;
    ``image_conditioned``: whether the prompts come with images (``load_policy``)."""
    lora = _lora_file(path, use_ema)
    with zero_init_disabled():
        if lora is None:
            return load_trained_policy(path, use_ema=use_ema, dtype=dtype, max_sequence_length=max_sequence_length,
                                       image_conditioned=image_conditioned)
        if base_model is None:
            raise ValueError(f"{path!r} is a bare LoRA adapter; give its base pipeline with --base_model.")
        policy = load_policy(base_model, dtype=dtype, max_sequence_length=max_sequence_length,
                             image_conditioned=image_conditioned)
        policy.pipeline.load_lora_weights(os.path.dirname(os.path.abspath(lora)), weight_name=os.path.basename(lora))
        policy.pipeline.fuse_lora()
        policy.pipeline.unload_lora_weights()
        return policy


def trained_settings(path: str | None) -> dict:
    """How a genrl export/checkpoint evaluated during training: reward spec, steps, guidance,
    prompts, batches and seed (empty for anything else)."""
    config = os.path.join(path, CONFIG_FILE) if path and os.path.isdir(path) else None
    if config is None or not os.path.isfile(config):
        return {}
    with open(config) as f:
        config = json.load(f)
    trained = config.get("args", {})
    settings = {
        "reward_fn": trained.get("eval_reward_fn") or config.get("reward_fn"),
        "num_inference_steps": trained.get("eval_num_inference_steps") or trained.get("num_inference_steps"),
        "guidance_scale": trained.get("eval_guidance_scale") if trained.get("eval_guidance_scale") is not None
        else trained.get("guidance_scale"),
        "prompts": trained.get("eval_prompt_dataset"),
        "max_batches": trained.get("eval_max_batches"),
        "batch_size": trained.get("eval_batch_size"),
        "seed": trained.get("eval_seed"),
        "samples_per_prompt": trained.get("eval_samples_per_prompt"),
        "ode_solver": trained.get("ode_solver"),
        "max_sequence_length": trained.get("max_sequence_length"),
        "image_column": trained.get("image_column"),
    }
    return {k: v for k, v in settings.items() if v is not None}


def evaluate_model(path, args, accelerator, prompts: PromptSet, reward_fn, config: SamplingConfig) -> EvalResult:
    """``prompts`` evaluated with the model at ``path`` (loaded, sampled, then freed), as the flags say."""
    dtype = WEIGHT_DTYPES[args.mixed_precision]
    policy = load_model(path, base_model=args.base_model, use_ema=args.use_ema, dtype=dtype,
                        max_sequence_length=args.max_sequence_length, image_conditioned=prompts.images is not None)
    policy.to(accelerator.device)  # text encoders and VAE were loaded in dtype
    policy.transformer.to(accelerator.device)
    if dtype != torch.float32:
        policy.transformer.to(dtype)
    if args.attention_backend:
        set_attention_backend([policy.transformer], args.attention_backend, device=accelerator.device, dtype=dtype)
    if args.compile:
        compile_repeated_blocks(policy.transformer, fullgraph=True)
    settings = EvalSettings(config, seed=args.seed, batch_size=args.batch_size, max_batches=args.max_batches or None,
                            keep_samples=None if args.save_samples == -1 else args.save_samples,
                            samples_per_prompt=args.samples_per_prompt)
    result = evaluate(policy, policy.transformer, prompts, reward_fn, settings, accelerator=accelerator)
    result.settings.update(model=path, use_ema=args.use_ema, reward_fn=args.reward_fn, mixed_precision=args.mixed_precision)
    del policy
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def model_label(path: str) -> str:
    """A model's name in the comparison: its folder's name (``.`` and ``runs/x/`` too), or the
    last part of a Hub id."""
    return os.path.basename(os.path.abspath(path))


def _summary(stats: dict) -> str:
    if stats["mean"] is None:
        return "not applicable to any sample"
    line = f"{stats['mean']:.4f} (std {stats['std']:.4f}, {stats['count']} samples)"
    if stats.get("draw_means"):  # how far one draw of noise moves the score
        line += f"; draws {' / '.join('n/a' if m is None else f'{m:.4f}' for m in stats['draw_means'])}"
    return line


def main(args, held: ExitStack | None = None):
    """The evaluation; ``held`` keeps the output folder's lock until the caller closes it, else
    until the process ends."""
    try:  # first: a missing or malformed prompt file fails before any model loads
        prompt_set = load_prompts(args.prompts, prompt_column=args.prompt_column, image_column=args.image_column)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(said_once(f"eval_genrl.py: error: {e}") or 1)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    accelerator = build_accelerator(output_dir=args.output_dir)
    # Two evaluations into one folder would leave one's metrics.json beside the other's samples
    # and videos; so would one writing into a training run's folder while it runs.
    lock = lock_output_dir(accelerator, args.output_dir)
    if held is not None:
        held.enter_context(lock)
    torch.backends.cuda.matmul.allow_tf32 = False  # same numbers on every GPU generation

    if args.attention_backend:  # a missing package or kernel fails now, not after loading the models
        probe_attention_backend(args.attention_backend, accelerator.device, WEIGHT_DTYPES[args.mixed_precision])
    spec = args.reward_fn
    with zero_init_disabled():
        # NaN marks a score that does not apply to a sample (e.g. a position check on a counting
        # prompt); evaluation averages over the samples it applies to.
        reward_fn = build_reward_fn(spec, device=accelerator.device, allow_nan=True)
    config = SamplingConfig(
        num_inference_steps=args.num_inference_steps,
        guidance_scale=args.guidance_scale,
        noise_level=0.0,
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        negative_prompt=args.negative_prompt,
        ode_solver=args.ode_solver,
        decode_batch_size=args.vae_decode_batch_size,
    )
    logger.info(
        f"Evaluating {args.model} on {len(prompt_set)} prompts (at most {args.max_batches or 'all'} batches of "
        f"{args.batch_size}, {args.samples_per_prompt} sample(s) each) with reward {spec!r}, seed {args.seed}, "
        f"{accelerator.num_processes} process(es).",
        main_process_only=True,
    )

    result_a = evaluate_model(args.model, args, accelerator, prompt_set, reward_fn, config)
    result_b = None
    if args.compare:
        result_b = evaluate_model(args.compare, args, accelerator, prompt_set, reward_fn, config)

    if accelerator.is_main_process:
        if result_b is None:
            save_eval_outputs(result_a, args.output_dir, fps=args.fps)
        else:
            save_eval_outputs(result_a, os.path.join(args.output_dir, "model_a"), fps=args.fps)
            save_eval_outputs(result_b, os.path.join(args.output_dir, "model_b"), fps=args.fps)
            save_comparison(
                result_a,
                result_b,
                args.output_dir,
                labels=(model_label(args.model), model_label(args.compare)),
                video_dirs=("model_a/videos", "model_b/videos"),
            )
        for name, stats in result_a.metrics.items():
            line = f"{name}: {_summary(stats)}"
            if result_b is not None and name in result_b.metrics:
                line += f"  vs  {_summary(result_b.metrics[name])}"
            logger.info(line, main_process_only=True)
        logger.info(f"Wrote the evaluation to {os.path.abspath(args.output_dir)}", main_process_only=True)
    accelerator.wait_for_everyone()
    end_processes(accelerator)


def run(argv=None) -> None:
    """The command line: a problem the user fixes with one change (a model that cannot be
    fetched, more processes than GPUs, a reward that failed) ends in its one sentence and exit
    status 1; where an exception lies behind it, its traceback goes to ``<output_dir>/error.log``,
    which the sentence names."""
    args = parse_args(argv)
    hide_loading_bars()
    try:
        with ExitStack() as held:  # in-process calls (the tests) give the folder's lock back
            main(args, held)
    except Exception as error:
        reason = find_setup_error(error)
        if reason is None:
            raise
        close_progress_bars()
        raise SystemExit(stop_line("eval_genrl.py", reason, error, args.output_dir)) from None


if __name__ == "__main__":
    # A native crash (a SIGABRT from a communication library, a segfault) prints every thread's
    # Python stack, so a rank that dies without a traceback still says where it was.
    faulthandler.enable(all_threads=True)
    run()
