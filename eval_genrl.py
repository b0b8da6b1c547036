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
from genrl.config.evaluator import EVALUATOR_SECTIONS, FALLBACK, build_eval_parser
from genrl.config.sections import check_sections
from genrl.data.prompts import PromptSet, load_prompts
from genrl.distributed.launch import build_accelerator, end_processes
from genrl.distributed.zero3 import zero_init_disabled
from genrl.errors import find_setup_error, said_once, stop_line
from genrl.evaluation.evaluate import EvalResult, EvalSettings, evaluate
from genrl.evaluation.outputs import save_comparison, save_eval_outputs
from genrl.policies import FlowPolicy, guidance_options_of, load_policy
from genrl.rewards import build_reward_fn
from genrl.training.acceleration import compile_repeated_blocks, probe_attention_backend, set_attention_backend
from genrl.training.rollout import SamplingConfig

logger = get_logger(__name__)

WEIGHT_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args(input_args=None) -> argparse.Namespace:
    """The checked arguments (``genrl.config.evaluator``); a problem is one line on stderr and
    exit status 2."""
    parser = build_eval_parser()
    args = parser.parse_args(input_args)
    # Unset settings follow the export's own in-training evaluation (model A's, else B's), so a
    # trained model is scored on the prompts, batches, noise and reward its training run used.
    trained = trained_settings(args.model) or trained_settings(args.compare)
    for key, value in FALLBACK.items():
        if getattr(args, key) is None:
            setattr(args, key, trained.get(key, value))
    try:
        check_sections(args, EVALUATOR_SECTIONS)
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
               max_sequence_length: int | None = None, image_conditioned: bool | None = None,
               guidance_options: dict[str, float] | None = None) -> FlowPolicy:
    """Any model ``--model`` accepts -> a FlowPolicy with its trained weights in the transformer;
    ``image_conditioned``: whether the prompts come with images (``load_policy``);
    ``guidance_options``: Z-Image's, over an export's own."""
    lora = _lora_file(path, use_ema)
    with zero_init_disabled():
        if lora is None:
            return load_trained_policy(path, use_ema=use_ema, dtype=dtype, max_sequence_length=max_sequence_length,
                                       image_conditioned=image_conditioned, guidance_options=guidance_options)
        if base_model is None:
            raise ValueError(f"{path!r} is a bare LoRA adapter; give its base pipeline with --base_model.")
        policy = load_policy(base_model, dtype=dtype, max_sequence_length=max_sequence_length,
                             image_conditioned=image_conditioned, guidance_options=guidance_options)
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
    guidance_options = guidance_options_of(vars(args))
    policy = load_model(path, base_model=args.base_model, use_ema=args.use_ema, dtype=dtype,
                        max_sequence_length=args.max_sequence_length, image_conditioned=prompts.images is not None,
                        guidance_options=guidance_options)
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
    result.settings.update(model=path, use_ema=args.use_ema, reward_fn=args.reward_fn, mixed_precision=args.mixed_precision,
                           **{k: getattr(policy, k) for k in policy.guidance_options if getattr(policy, k) is not None})
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
