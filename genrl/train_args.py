"""The trainer's command line: every flag of ``train_genrl.py``, the no-argument run's values,
and the checks that need no model, so bad input fails with one sentence before anything loads.

``parse_args`` is what the script calls; ``DEFAULT_RUN`` (and ``DEFAULT_RUN_BY_OBJECTIVE``) is
the no-argument run; ``num_trained_timesteps`` and ``sampling_configs`` turn the flags into the
numbers and ``SamplingConfig``s the trainer runs with.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

from genrl.acceleration import check_attention_backend_name
from genrl.distributed import check_launched_processes, check_mixed_precision
from genrl.errors import said_once
from genrl.lr_schedule import parse_step_rules
from genrl.objectives import OBJECTIVES, get_objective
from genrl.rewards import check_reward_options, load_reward_options, parse_reward_spec
from genrl.rollout import SamplingConfig, sde_window_start
from genrl.sampler import check_batch_sizes
from genrl.sde import ODE_SOLVERS, SDE_TYPES

# The repository root: the shipped model and prompts live under genrl/assets.
GENRL_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(GENRL_ROOT, "genrl", "assets", "toy-shapes-t2i")
DEFAULT_TRAIN_PROMPTS = os.path.join(GENRL_ROOT, "genrl", "assets", "prompts", "toy_train.txt")
DEFAULT_EVAL_PROMPTS = os.path.join(GENRL_ROOT, "genrl", "assets", "prompts", "toy_test.txt")
# The no-argument run: the shipped toy model and its rule-based reward, sized so that the
# held-out score rises clearly within about ten minutes on two CPU cores. It samples, trains and
# evaluates without classifier-free guidance, as DiffusionNFT does: the shipped model can draw
# what a prompt asks but, unguided, follows it only part of the time (README "The shipped toy model").
DEFAULT_RUN = dict(
    pretrained_model_name_or_path=DEFAULT_MODEL,
    prompt_dataset=DEFAULT_TRAIN_PROMPTS,
    eval_prompt_dataset=DEFAULT_EVAL_PROMPTS,
    reward_fn="toy_geneval",
    # Evaluation also reports the per-category breakdown (weight 0: not in the total).
    eval_reward_fn="toy_geneval," + ",".join(f"toy_geneval_{c}:0" for c in ("strict", "color", "shape", "count", "position")),
    objective="nft",
    guidance_scale=1.0,
    rollout_batch_size=32,
    train_batch_size=32,
    gradient_accumulation_steps=2,
    # 200 optimizer steps (100 epochs): NFT with PODS (below) is at about 0.78, level with the supervised
    # ceiling, by then, in about the wall time the 260 steps of plain NFT took (docs/history.md).
    max_train_steps=200,
    num_epochs=100,
    # Every 40 steps, each of the 122 held-out prompts from four noises: one noise moves the score by
    # about 0.025 at fixed weights, as much as 40 steps of training late in the run (README "Learning").
    eval_steps=40,
    eval_samples_per_prompt=4,
    eval_batch_size=32,
    eval_max_batches=4,
    # The toy VAE decodes 8 samples a call in about half the time of 8 calls (7% of an epoch);
    # calls of one shape keep samples independent of the batch layout (genrl.rollout.decode_in_chunks).
    vae_decode_batch_size=8,
    # Every core: on a CPU `accelerate launch` would run the demo on one thread (1.25x slower on 2 cores).
    cpu_threads=0,
    # The reward watch: 8 prompts x 4 samples of diversity, the drift from a frozen copy of the
    # initial weights (the toy transformer is 1.3 M parameters).
    eval_diversity_prompts=8,
    watch_reference=True,
)
# What the no-argument run changes with --objective (bench/bench_learning.py compares them).
# GRPO needs recorded SDE steps: a 4-step window in the first 8 of 10 steps, one initial noise
# per group. NFT and AWM train on clean samples: the plain ODE, each sample from its own noise,
# re-noised at steps among the 6 noisiest of 10 (sigma >= 0.4), where the layout a prompt asks for
# is decided (docs/history.md: NFT reaches 0.6 in about two thirds of the steps). NFT trains all
# 6 (timestep_fraction 0.6: steadier, docs/history.md); AWM 4, as many as GRPO's window.
# NFT samples 16 per prompt and trains the 8 whose rewards vary most (PODS): faster per step and
# higher at the end than training all of 8, for about 1.4x the epoch (docs/history.md). Its beta
# is 0.5, not DiffusionNFT's 1: a weaker pull-back of each epoch's second step reaches 0.6 sooner
# and ends as high and closer over six seeds; 0.3 starts barely faster and spreads the seeds. With
# beta 0.5 its learning rate is 2e-4, not 1e-4: 0.6 by step 30 instead of 40 on six seeds and a
# higher end (README "Learning"; at beta 1 larger rates had not paid, docs/history.md);
# 3e-4 ends higher on average but spreads six seeds 0.08 apart; with AdamW beta2 0.99 they stay together but
# end no higher than 2e-4 (docs/history.md).
DEFAULT_RUN_BY_OBJECTIVE = {
    "grpo": dict(noise_level=0.7, same_latent=True, sde_window_size=4, sde_window_range=[0, 8], learning_rate=1e-4,
                 rollout_batches_per_epoch=4),
    "nft": dict(noise_level=0.0, same_latent=False, learning_rate=2e-4, timestep_fraction=0.6, train_sigma_range=[0.4, 1.0],
                group_size=16, rollout_batches_per_epoch=8, train_samples_per_group=8, nft_beta=0.5),
    "awm": dict(noise_level=0.0, same_latent=False, learning_rate=1e-4, timestep_fraction=0.4, train_sigma_range=[0.4, 1.0],
                rollout_batches_per_epoch=4),
}


def under_zero3() -> bool:
    """Whether this process was launched with a ZeRO-3 config (``accelerate launch`` sets the
    stage in the environment before the script parses its arguments)."""
    return os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: the usage block (80 lines here) would bury
    the sentence that says what to change; ``--help`` still shows it. Under a launcher every
    process parses the same command line: the first of each machine says it (``said_once``)."""

    def error(self, message: str):
        self.exit(2, said_once(f"{self.prog}: error: {message}\n"))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default, except where there is none to show (None, an off switch),
    and keeps the epilog's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def default_run_epilog() -> str:
    """The --help epilog: what the no-argument run sets (DEFAULT_RUN), shipped paths made relative."""
    shown = {k: os.path.relpath(v, GENRL_ROOT) if isinstance(v, str) and v.startswith(GENRL_ROOT) else v
             for k, v in {**DEFAULT_RUN, **DEFAULT_RUN_BY_OBJECTIVE[DEFAULT_RUN["objective"]]}.items()}
    lines = [
        f"  --{k}" if v is True else f"  --no-{k}" if v is False
        else f"  --{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in shown.items()
    ]
    others = "; ".join(
        f"{o}: " + ", ".join(f"{k} {v}" for k, v in values.items())
        for o, values in DEFAULT_RUN_BY_OBJECTIVE.items() if o != DEFAULT_RUN["objective"]
    )
    return (
        "Without --pretrained_model_name_or_path the run is the embedded default (DEFAULT_RUN in\n"
        "genrl/train_args.py): the shipped toy model, its prompts and reward, with these values in place\n"
        "of the defaults shown above (any flag you pass still wins):\n" + "\n".join(lines) + "\n"
        f"With another --objective the toy run samples as that objective needs ({others}).\n"
        "Passing --pretrained_model_name_or_path leaves all of them: the defaults above apply, and\n"
        "--prompt_dataset and --reward_fn become required."
    )


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the trainer, in groups, each with a line of help and its default."""
    parser = OneLineErrorParser(
        prog="train_genrl.py",
        usage="%(prog)s [--flag VALUE ...]   (flags below, by group)",
        description="GRPO fine-tuning of flow-matching image and video generators (Wan, SD3, FLUX).",
        epilog=default_run_epilog(),
        formatter_class=HelpFormatter,
    )
    group = parser.add_argument_group("model")
    group.add_argument("--pretrained_model_name_or_path", type=str, default=None,
                       help="Diffusers pipeline folder or Hub id (Wan, SD3, FLUX). Default: the shipped toy model "
                            "and the rest of DEFAULT_RUN (see the end of this help).")
    group.add_argument("--revision", type=str, default=None, help="Hub revision (branch, tag or commit) of the model.")
    group.add_argument("--variant", type=str, default=None, help='Weight file variant to load, e.g. "fp16".')
    group.add_argument("--wan_expert", choices=["high", "low"], default=None,
                       help="A two-expert Wan 2.2 model (A14B): the expert to train, high (transformer, the noisy steps "
                            "from boundary_ratio x 1000 up) or low (transformer_2, the steps below); the other stays "
                            "frozen and samples its own steps. The trained steps must be the expert's own.")

    group = parser.add_argument_group("data")
    group.add_argument("--prompt_dataset", type=str, default=None,
                       help="Training prompts: .txt (one per line), .jsonl/.csv with --prompt_column, a saved dataset or a Hub dataset.")
    group.add_argument("--eval_prompt_dataset", type=str, default=None,
                       help="Held-out prompts for evaluation (default: the --eval_split of --prompt_dataset if it has one).")
    group.add_argument("--prompt_column", type=str, default="prompt",
                       help="Column holding the prompt in .jsonl/.csv/datasets; other columns reach rewards as metadata.")
    group.add_argument("--train_split", type=str, default="train", help="Split of a dataset used for training.")
    group.add_argument("--eval_split", type=str, default="test", help="Split of a dataset used for evaluation.")

    group = parser.add_argument_group("rewards")
    group.add_argument("--reward_fn", type=str, default=None,
                       help='Rewards and weights, "name:weight,name:weight" (registered names or package.module:function).')
    group.add_argument("--reward_options", type=str, default=None,
                       help='JSON (or a .json file) of per-reward options, e.g. {"hpsv3": {"checkpoint": "...", "base_model": "..."}}.')
    group.add_argument("--reward_mode", choices=["async", "sync"], default="async",
                       help="async: score batch i in a thread while batch i+1 denoises (reward models on --reward_device). "
                            "sync: reward models on the training device, scored after all rollouts of the epoch.")
    group.add_argument("--reward_device", type=str, default="cpu", help="Device of reward models in async mode.")
    group.add_argument("--reward_workers", type=int, default=1, help="Threads scoring rollout batches in async mode.")
    group.add_argument("--reward_clear_before_train", action="store_true",
                       help="Free reward models before the policy update and rebuild them next epoch (tight memory).")
    group.add_argument("--reward_combine", choices=["sum", "normalize_each"], default="sum",
                       help="sum: normalise the weighted sum of rewards; normalize_each: normalise each reward, then sum with weights.")

    group = parser.add_argument_group("sampling")
    group.add_argument("--seed", type=int, default=42, help="Run seed: with the epoch and prompt it fixes every sample.")
    group.add_argument("--resolution", type=int, default=None, help="Square size; or set --height/--width.")
    group.add_argument("--height", type=int, default=None, help="Sample height in pixels (default: the model's).")
    group.add_argument("--width", type=int, default=None, help="Sample width in pixels (default: the model's).")
    group.add_argument("--num_frames", type=int, default=None, help="Video frames (video models; default: the model's).")
    group.add_argument("--max_sequence_length", type=int, default=None,
                       help="T5/UMT5 tokens per prompt, padded to it (default: the pipeline's, SD3 256, FLUX and Wan "
                            "512; Flow-GRPO and DiffusionNFT use 128). Padding tokens join the transformer's attention.")
    group.add_argument("--num_inference_steps", type=int, default=10, help="Denoising steps per sample.")
    group.add_argument("--guidance_scale", type=float, default=4.5, help="Classifier-free guidance scale (1: off).")
    group.add_argument("--negative_prompt", type=str, default="", help="Negative prompt for classifier-free guidance.")
    group.add_argument("--guidance_scale_2", type=float, default=None,
                       help="Two-expert Wan 2.2: the guidance scale of the low-noise expert's steps (default: --guidance_scale).")
    group.add_argument("--noise_level", type=float, default=0.7, help="SDE noise level a.")
    group.add_argument("--sde_type", choices=SDE_TYPES, default="flow_sde",
                       help="Stochastic sampler: Flow-GRPO's SDE or the coefficient-preserving one.")
    group.add_argument("--ode_solver", choices=ODE_SOLVERS, default="euler",
                       help="Deterministic steps (rollouts and evaluation): Euler, or the second-order two-step "
                            "Adams-Bashforth method (one model call per step, as Euler).")
    group.add_argument("--vae_decode_batch_size", type=int, default=1,
                       help="Samples per VAE decode call (rollouts and evaluation; the last call padded to it, so samples "
                            "stay independent of the batch layout). 1 bounds the VAE's memory; more is faster for images.")
    group.add_argument("--sde_window_size", type=int, default=0, help="Stochastic steps per trajectory (0: every step).")
    group.add_argument("--sde_window_range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                       help="Window start is drawn per prompt in [LO, HI - size] (default: anywhere).")
    group.add_argument("--sde_window_shift_every", type=int, default=0, metavar="EPOCHS",
                       help="MixGRPO's progressive window: one window for every prompt, starting at LO and moving one "
                            "step towards the clean end every EPOCHS epochs (0: a random window per prompt group).")
    group.add_argument("--same_latent", action=argparse.BooleanOptionalAction, default=True,
                       help="All K samples of a prompt start from the same noise.")

    group = parser.add_argument_group("objective and GRPO")
    group.add_argument("--objective", choices=list(OBJECTIVES), default=None,
                       help="Default grpo (the no-argument run: nft). grpo: clipped ratio loss on the recorded SDE transitions (needs --noise_level > 0). "
                            "nft: DiffusionNFT, awm: advantage-weighted flow matching; both train on the clean "
                            "samples noised again (any sampler, no log-probs).")
    group.add_argument("--nft_beta", type=float, default=1.0,
                       help="NFT's step size beta: how far the implicit positive/negative policies sit from the sampling one "
                            "(1.0, DiffusionNFT's; the no-argument toy run: 0.5).")
    group.add_argument("--sampling_policy_decay_rate", type=float, default=0.0,
                       help="nft, awm: sample from a soft-updated copy of the trained weights, theta_old <- eta theta_old + "
                            "(1 - eta) theta after optimizer step i, eta = min(rate i, --sampling_policy_decay_max) "
                            "(DiffusionNFT: 0.001). 0: sample from the trained weights (on-policy).")
    group.add_argument("--sampling_policy_decay_max", type=float, default=0.5,
                       help="The cap of the soft update's eta (DiffusionNFT: 0.5).")
    group.add_argument("--group_size", type=int, default=8, help="Samples per prompt (K).")
    group.add_argument("--rollout_batch_size", type=int, default=8, help="Samples per rollout batch per process.")
    group.add_argument("--rollout_batches_per_epoch", type=int, default=2, help="Rollout batches per process per epoch.")
    group.add_argument("--num_inner_epochs", type=int, default=1, help="Passes over an epoch's samples.")
    group.add_argument("--timestep_fraction", type=float, default=1.0,
                       help="Fraction of the timesteps trained on per sample: of the stochastic steps (grpo), "
                            "of the sampling steps (nft, awm).")
    group.add_argument("--train_sigma_range", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                       help="nft, awm: draw the trained timesteps among the sampling steps whose noise level sigma lies in "
                            "[LO, HI] (1: pure noise, where a sample's layout is decided; 0: clean); default: every step. "
                            "GRPO's counterpart is --sde_window_range.")
    group.add_argument("--no_timestep_shuffle", action="store_true", help="GRPO: train on the first steps, in order.")
    group.add_argument("--clip_range", type=float, default=1e-3, help="PPO clip range of the probability ratio.")
    group.add_argument("--adv_clip_max", type=float, default=5.0, help="Advantages are clipped to [-this, this].")
    group.add_argument("--std_mode", choices=["group", "global", "max_group"], default="group",
                       help="Whose standard deviation normalises the advantages: the prompt group's, the epoch's, "
                            "or the largest group's.")
    group.add_argument("--beta", type=float, default=0.0, help="KL weight against the reference policy.")
    group.add_argument("--kl_form", choices=["transition", "sde_variance"], default="transition",
                       help="GRPO's KL: transition = KL of the two Gaussian steps, / 2 (std_t sqrt|dt|)^2 (Flow-GRPO's Wan "
                            "script, Flash-GRPO); sde_variance = / 2 std_t^2 (Flow-GRPO's SD3 script), i.e. x |dt|.")
    group.add_argument("--grpo_guard", action="store_true",
                       help="GRPO-Guard's normalised ratio: s (logp - logp_old) + mean((mu - mu_old)^2) / (2s), the SDE "
                            "ratio's negative bias removed and the timesteps evened out (flow_sde only).")
    group.add_argument("--grpo_guard_reweight", action="store_true",
                       help="GRPO-Guard's per-timestep gradient reweighting: each trained step's loss times 1 / (T dt), so "
                            "the short steps of a shifted schedule train as much as the long ones (flow_sde only; the paper "
                            "uses it with --grpo_guard).")
    group.add_argument("--filter_zero_advantage", action="store_true",
                       help="Drop zero-advantage samples (every rank keeps the same count).")
    group.add_argument("--train_samples_per_group", type=int, default=None,
                       help="Train on M of each group's --group_size samples: the M whose advantages vary most (PODS's "
                            "max-variance down-sampling: the j worst and M - j best), their advantages normalised among "
                            "themselves. A larger group then costs rollouts, not training. Default: all of them.")

    group = parser.add_argument_group("optimisation")
    group.add_argument("--train_batch_size", type=int, default=8, help="Samples per micro batch per process in the update.")
    group.add_argument("--gradient_accumulation_steps", type=int, default=1,
                       help="Micro batches per optimizer step (each also accumulates over its trained timesteps).")
    group.add_argument("--learning_rate", type=float, default=1e-4,
                       help="AdamW learning rate (the no-argument NFT run: 2e-4).")
    group.add_argument("--adam_beta1", type=float, default=0.9, help="AdamW beta1.")
    group.add_argument("--adam_beta2", type=float, default=0.999, help="AdamW beta2.")
    group.add_argument("--adam_weight_decay", type=float, default=1e-4, help="AdamW weight decay.")
    group.add_argument("--adam_epsilon", type=float, default=1e-8, help="AdamW epsilon.")
    group.add_argument("--max_grad_norm", type=float, default=1.0, help="Gradient norm clipping threshold.")
    group.add_argument("--lr_scheduler", type=str, default="constant",
                       help='diffusers scheduler name: "constant", "constant_with_warmup", "linear", "cosine", ...')
    group.add_argument("--lr_warmup_steps", type=int, default=0, help="Warm-up optimizer steps of the scheduler.")
    group.add_argument("--lr_step_rules", type=str, default=None,
                       help='With --lr_scheduler piecewise_constant: "m1:s1,...,m_last", the rate times m1 below '
                            'optimizer step s1, ..., then times m_last (e.g. "1:200,0.5").')
    group.add_argument("--num_epochs", type=int, default=100, help="Stop after this many epochs (or --max_train_steps).")
    group.add_argument("--max_train_steps", type=int, default=None, help="Stop after this many optimizer steps.")

    group = parser.add_argument_group("memory and speed")
    group.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                       help="Autocast precision (default: the accelerate config's); the SDE math stays fp32.")
    group.add_argument("--allow_tf32", action="store_true", help="Allow TF32 matmuls on Ampere+ GPUs.")
    group.add_argument("--cpu_threads", type=int, default=None,
                       help="Torch threads per process when training on the CPU; 0: the machine's cores shared among its "
                            "processes. Default: as launched (`accelerate launch` sets 1 per CPU process unless given "
                            "--num_cpu_threads_per_process or OMP_NUM_THREADS).")
    group.add_argument("--gradient_checkpointing", action="store_true",
                       help="Recompute the transformer's activations in the backward pass (less memory, slower).")
    group.add_argument("--attention_backend", type=str, default=None, metavar="NAME",
                       help="Attention kernel of the transformer (and its frozen reference) through diffusers' attention "
                            "dispatcher, e.g. native, flash (flash-attn 2), _flash_3 (FlashAttention-3, Hopper), "
                            "_native_cudnn, sage; default: the model's own. Wan and FLUX only (SD3's attention does not go "
                            "through the dispatcher). A backend whose package or device is missing fails before training.")
    group.add_argument("--compile", action="store_true",
                       help="Regional torch.compile (fullgraph) of the transformer's repeated blocks, after the LoRA set-up: "
                            "the first rollout and update of the run compile (minutes for a large model), later ones run the "
                            "compiled blocks. Not with ZeRO-3.")
    group.add_argument("--peak_tflops", type=float, default=None,
                       help="Peak dense TFLOP/s of one device in the training precision (its data sheet's dense figure, e.g. 989 for an "
                            "H100 SXM in bf16): logs perf/mfu, the transformer's counted FLOPs per second over this peak.")

    group = parser.add_argument_group("LoRA")
    group.add_argument("--use_lora", action="store_true", help="Train a LoRA adapter instead of every transformer weight.")
    group.add_argument("--rank", type=int, default=32, help="LoRA rank.")
    group.add_argument("--lora_alpha", type=int, default=64, help="LoRA alpha (scale = alpha / rank).")
    group.add_argument("--lora_target_modules", type=str, default="to_q,to_k,to_v,to_out.0",
                       help="Comma-separated module names to adapt; each matches the modules whose dotted name ends "
                       "with it (attn.to_q: the joint attention's, not SD3.5-M's attn2.to_q).")

    group = parser.add_argument_group("EMA")
    group.add_argument("--use_ema", action="store_true", help="Keep an fp32 EMA of the trained weights (used by eval and export).")
    group.add_argument("--ema_decay", type=float, default=0.9, help="EMA decay per update.")
    group.add_argument("--ema_update_interval", type=int, default=8,
                       help="Update the EMA every N optimizer steps (the global step count, not micro batches).")
    group.add_argument("--ema_warmup", action="store_true", help="Ramp the decay up from 0 over the first updates.")
    group.add_argument("--ema_device", type=str, default=None, help="Where the fp32 shadow lives (default: with the weights).")

    group = parser.add_argument_group("evaluation")
    group.add_argument("--eval_steps", type=int, default=None,
                       help="Evaluate before training, then at the end of each epoch that passed a multiple of this many steps.")
    group.add_argument("--eval_max_batches", type=int, default=4, help="Evaluate on at most this many batches of prompts.")
    group.add_argument("--eval_batch_size", type=int, default=8, help="Prompts per evaluation batch (all processes together).")
    group.add_argument("--eval_num_inference_steps", type=int, default=None, help="Evaluation steps (default: --num_inference_steps).")
    group.add_argument("--eval_guidance_scale", type=float, default=None, help="Evaluation guidance (default: --guidance_scale).")
    group.add_argument("--eval_seed", type=int, default=0, help="Seed of the evaluation noise (the same at every evaluation).")
    group.add_argument("--eval_samples_per_prompt", type=int, default=1,
                       help="Noise draws of each evaluation prompt; the score is their mean (draw k: the noise of "
                            "--eval_seed + 1000 k). One evaluation moves with its noise; K draws move about sqrt(K) times less.")
    group.add_argument("--eval_reward_fn", type=str, default=None,
                       help="Rewards reported at evaluation (default: --reward_fn); weight 0 reports without adding to the total.")
    group.add_argument("--eval_log_samples", type=int, default=8,
                       help="Evaluation samples shown in the logged grid, evenly spaced over the evaluated prompts.")
    group.add_argument("--eval_video_fps", type=float, default=16.0, help="Frame rate of the evaluation MP4s (video models).")

    group = parser.add_argument_group(
        "reward watch", "Signs of reward hacking, at each evaluation: held-out rewards (--eval_reward_fn names with weight 0) "
        "falling while the trained one rises, the samples of a prompt collapsing, the drift from the reference policy."
    )
    group.add_argument("--eval_diversity_prompts", type=int, default=2,
                       help="Prompts (spread over the evaluation set) whose samples measure diversity at each evaluation; 0: off.")
    group.add_argument("--eval_diversity_samples", type=int, default=4, help="Samples per diversity prompt, each from its own noise.")
    group.add_argument("--watch_patience", type=int, default=3,
                       help="Warn when a trained reward rose while a held-out one fell at each of this many evaluations in a row.")
    group.add_argument("--watch_diversity_fraction", type=float, default=0.5,
                       help="Warn when the diversity falls below this fraction of its first value.")
    group.add_argument("--watch_reference", action="store_true",
                       help="Full fine-tuning: keep a frozen copy of the initial weights so that evaluation also logs the "
                            "drift from them (eval/velocity_kl; a second copy of the transformer in memory). LoRA and "
                            "--beta > 0 log it without this.")
    group.add_argument("--stop_on_reward_hacking", action="store_true",
                       help="Stop at the first alarm, keeping the checkpoints written before it (none after it, no export).")

    group = parser.add_argument_group("checkpoints")
    group.add_argument("--checkpointing_steps", type=int, default=None,
                       help="Checkpoint at the end of each epoch in which the optimizer step count passed a multiple of this.")
    group.add_argument("--checkpoints_total_limit", type=int, default=None,
                       help="Keep at most this many checkpoints (the oldest is removed after a new one is complete).")
    group.add_argument("--resume_from_checkpoint", type=str, default=None, help='"latest" or a checkpoint folder.')
    group.add_argument("--overwrite_output_dir", action="store_true", help="Start afresh: remove the checkpoints and metrics already in --output_dir.")

    group = parser.add_argument_group("Hub")
    group.add_argument("--push_to_hub", action="store_true", help="Upload the export and its model card at the end.")
    group.add_argument("--hub_model_id", type=str, default=None, help="Hub repo to push to (default: the --output_dir name).")
    group.add_argument("--hub_token", type=str, default=None,
                       help="Hub token for the upload (never recorded; `hf auth login` or HF_TOKEN keep it off the command line).")
    group.add_argument("--collective_timeout", type=float, default=1800, help="Seconds a process waits for the others in a collective before the run fails (a hung or stopped rank).")
    group.add_argument("--hub_private", action="store_true", help="Create the Hub repo private.")
    group.add_argument("--push_checkpoints", action="store_true", help="Also push each checkpoint (in the background).")

    group = parser.add_argument_group("output and logging")
    group.add_argument("--output_dir", type=str, default="genrl-output", help="Where the export, samples, logs and checkpoints go.")
    group.add_argument("--logging_dir", type=str, default="logs", help="Folder of metrics.jsonl and tracker logs, inside --output_dir.")
    group.add_argument("--report_to", type=str, default="tensorboard", help='"tensorboard", "wandb", "all" or "none".')
    group.add_argument("--tracker_project_name", type=str, default="genrl", help="Project name for the trackers.")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    known = parser.parse_known_args(argv)[0]
    if known.pretrained_model_name_or_path is None:
        objective = known.objective or DEFAULT_RUN["objective"]
        # An objective without a toy-run preset samples as the shared defaults say.
        defaults = {**DEFAULT_RUN, **DEFAULT_RUN_BY_OBJECTIVE.get(objective, {})}
        if under_zero3():
            # A full frozen copy on every rank is what ZeRO-3 exists to avoid: under zero3.yaml the
            # no-argument run watches diversity and rewards without the drift from the reference.
            defaults["watch_reference"] = False
        # Flags given on the command line still win over these defaults.
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    args.objective = args.objective or "grpo"
    try:
        validate_args(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        parser.error(str(e))  # one line (OneLineErrorParser), exit status 2
    return args


def validate_args(args) -> None:
    """Every check that needs no model, so bad input fails before any model loads, with one sentence."""
    model = args.pretrained_model_name_or_path
    looks_local = os.path.isabs(model) or model.startswith(".") or os.path.exists(model) or model.count("/") > 1
    if looks_local and not os.path.isdir(model):
        raise FileNotFoundError(f"--pretrained_model_name_or_path {model!r} is not a folder (nor a Hub id like 'org/name').")
    if args.prompt_dataset is None:
        raise ValueError("--prompt_dataset is required with your own model (a .txt file with one prompt per line works).")
    if args.reward_fn is None:
        raise ValueError('--reward_fn is required with your own model, e.g. --reward_fn "hpsv3:1.0".')
    parse_reward_spec(args.reward_fn)  # unknown names fail here, listing the known ones
    args.eval_reward_fn = args.eval_reward_fn or args.reward_fn
    parse_reward_spec(args.eval_reward_fn)
    # Also imports every module:function reward and checks the paths the options name.
    check_reward_options(load_reward_options(args.reward_options), [args.reward_fn, args.eval_reward_fn])
    if args.resolution is not None:
        args.height = args.height or args.resolution
        args.width = args.width or args.resolution
    check_launched_processes()  # before the sizes: they are checked for the processes that run
    check_mixed_precision(args.mixed_precision)
    num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    check_batch_sizes(
        group_size=args.group_size,
        train_batch_size=args.rollout_batch_size,
        num_processes=num_processes,
        batches_per_epoch=args.rollout_batches_per_epoch,
        train_micro_batch_size=args.train_batch_size * args.gradient_accumulation_steps,
        train_samples_per_group=args.train_samples_per_group,
    )
    if not 0 < args.timestep_fraction <= 1:
        raise ValueError(f"--timestep_fraction must be in (0, 1], got {args.timestep_fraction}.")
    if args.max_sequence_length is not None and args.max_sequence_length < 1:
        raise ValueError(f"--max_sequence_length must be at least 1 token; got {args.max_sequence_length}.")
    if not math.isfinite(args.noise_level) or args.noise_level < 0:
        raise ValueError(f"--noise_level must be a finite number >= 0 (0: deterministic sampling), got {args.noise_level}.")
    if args.num_inference_steps < 1:
        raise ValueError(f"--num_inference_steps must be at least 1, got {args.num_inference_steps}.")
    # Each objective checks its own flags: the chosen one that they fit, the others that theirs are not given.
    objective = get_objective(args.objective)
    for other in OBJECTIVES.values():
        if other is not objective:
            other.check_unused_args(args)
    objective.check_args(args)
    if args.vae_decode_batch_size < 1:
        raise ValueError(f"--vae_decode_batch_size must be at least 1, got {args.vae_decode_batch_size}.")
    if args.sde_window_size < 0 or args.sde_window_size > args.num_inference_steps - 1:
        raise ValueError(
            f"--sde_window_size {args.sde_window_size} must be between 0 and num_inference_steps - 1 "
            f"({args.num_inference_steps - 1}): the last step is always deterministic."
        )
    if args.sde_window_shift_every < 0 or (args.sde_window_shift_every and not args.sde_window_size):
        raise ValueError(
            f"--sde_window_shift_every slides an SDE window of --sde_window_size steps every so many epochs: it must be "
            f">= 0 and needs --sde_window_size > 0, got {args.sde_window_shift_every} with --sde_window_size "
            f"{args.sde_window_size}."
        )
    if args.sde_window_size and args.sde_window_range:  # the window must fit its range (the rollout's own check)
        window = SamplingConfig(num_inference_steps=args.num_inference_steps, sde_window_size=args.sde_window_size,
                                sde_window_range=tuple(args.sde_window_range))
        sde_window_start("", args.seed, 0, args.num_inference_steps, window)
    # accelerate launch exports the config's ZeRO stage, so this is known before any model loads.
    if args.beta > 0 and not args.use_lora and under_zero3():
        raise ValueError(
            "--beta > 0 with full fine-tuning under ZeRO-3 would keep a full reference copy on every rank; "
            "use --use_lora (the reference is the adapter switched off) or --beta 0."
        )
    if args.watch_reference and not args.use_lora and under_zero3():
        raise ValueError(
            "--watch_reference with full fine-tuning under ZeRO-3 would keep a full reference copy on every rank; "
            "use --use_lora (the reference is the adapter switched off) or leave --watch_reference out."
        )
    if args.cpu_threads is not None and args.cpu_threads < 0:
        raise ValueError(f"--cpu_threads must be >= 0 (0: the machine's cores shared among its processes), got {args.cpu_threads}.")
    if args.eval_samples_per_prompt < 1:
        raise ValueError(f"--eval_samples_per_prompt must be at least 1, got {args.eval_samples_per_prompt}.")
    if args.eval_diversity_prompts < 0 or (args.eval_diversity_prompts and args.eval_diversity_samples < 2):
        raise ValueError(
            f"--eval_diversity_prompts must be >= 0 and --eval_diversity_samples >= 2 (diversity compares samples), got "
            f"{args.eval_diversity_prompts} and {args.eval_diversity_samples}."
        )
    if args.watch_patience < 1 or not 0 <= args.watch_diversity_fraction < 1:
        raise ValueError(
            f"--watch_patience must be >= 1 and --watch_diversity_fraction in [0, 1), got {args.watch_patience} and "
            f"{args.watch_diversity_fraction}."
        )
    if (args.lr_scheduler == "piecewise_constant") != (args.lr_step_rules is not None):
        raise ValueError("--lr_step_rules goes with --lr_scheduler piecewise_constant, and that scheduler needs the rules: "
                         "give both or neither.")
    if args.lr_step_rules is not None:
        parse_step_rules(args.lr_step_rules)
    if args.compile and under_zero3():
        raise ValueError(
            "--compile does not work under ZeRO-3 (DeepSpeed gathers each block's partitioned weights in hooks that "
            "torch.compile cannot trace); use --compile with zero2, multi_gpu or one process, or leave it out under zero3."
        )
    if args.attention_backend is not None:
        check_attention_backend_name(args.attention_backend)  # the names diffusers knows, listed
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ValueError(f"--peak_tflops must be the device's peak TFLOP/s, a number > 0, got {args.peak_tflops}.")
    if not args.collective_timeout > 0:
        raise ValueError(f"--collective_timeout must be a number of seconds > 0, got {args.collective_timeout}.")
    if args.overwrite_output_dir and args.resume_from_checkpoint:
        raise ValueError("--overwrite_output_dir starts afresh and --resume_from_checkpoint continues: give one of them.")
    # Absolute from here on: samples, plots, checkpoints and the card are paths inside it, and
    # a relative one would be resolved against it a second time (genrl-output/genrl-output/...).
    args.output_dir = os.path.abspath(args.output_dir)
    check_writable(args.output_dir)
    if args.push_to_hub and not args.hub_model_id:
        args.hub_model_id = os.path.basename(args.output_dir)


def check_writable(folder: str) -> None:
    """A file can be written in ``folder``, or in its deepest existing parent when it does not
    exist yet (nothing is created here); else one sentence saying why not: found now rather
    than at the first checkpoint, after the models loaded."""
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(f"--output_dir {folder!r} cannot be written to ({e.strerror or e}); choose another folder.") from None


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
