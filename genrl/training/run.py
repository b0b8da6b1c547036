"""One training run's live state, ``Run``, built once from the parsed arguments by ``build_run``:
the prompts and the prompt-group sampler, the accelerator, the policy with its trained
transformer, optimizer, learning-rate scheduler, EMA, soft-updated sampling policy and KL
reference, the rewards, the NaN guard, and the checkpoint it resumes (``resume``). The phases of
an epoch (train_genrl.py, ``collect_rollouts``, ``update_policy``, ``evaluate_and_log``,
``save_checkpoint``) take it, and the epochs move its step counts on.

``build_run`` keeps the order of the set-up: the prompts first (an empty or missing prompt set
fails before any model loads), then the accelerator and the output folder (its lock, and a
checkpoint refused before any model loads), then the models, rewards and optimizer.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, ContextManager

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from diffusers.optimization import get_scheduler
from tqdm.auto import tqdm

from genrl.checkpoints.checkpointing import load_checkpoint, prepare_output_dir, read_state, run_identity, run_record
from genrl.checkpoints.node_storage import checkpoint_writer, output_dir_is_node_local, use_node_local_checkpoints
from genrl.checkpoints.output_lock import lock_output_dir
from genrl.checkpoints.update_checkpoint import UpdateInProgress, load_update_in_progress
from genrl.data.prompts import PromptSet, check_conditioning, load_prompts
from genrl.data.sampler import PromptGroupSampler
from genrl.distributed.launch import build_accelerator, configure_deepspeed, cpu_threads_per_process
from genrl.distributed.memory import describe_weight_dtypes, weight_dtypes
from genrl.distributed.preemption import PreemptionWatch
from genrl.distributed.zero3 import settle_zero3_params, size_zero3_buckets, zero_init_disabled
from genrl.distributed.zero_init import describe_partitioned_build, zero3_init_requested
from genrl.errors import SetupError, said_once
from genrl.evaluation.evaluate import EvalSettings
from genrl.evaluation.pipeline_defaults import at_pipeline_defaults
from genrl.evaluation.reward_watch import RewardWatch
from genrl.hub.redact import redact_argv
from genrl.objectives import UpdateConfig, check_sigma_range_holds, reference_model
from genrl.policies import FlowPolicy, guidance_options_of, load_policy
from genrl.rewards import RewardFn, build_eval_reward_fn, build_reward_fn, load_reward_options
from genrl.rewards.lifecycle import describe_reward_models
from genrl.training.acceleration import compile_repeated_blocks, probe_attention_backend, set_attention_backend
from genrl.training.ema import EMA
from genrl.training.experience import AdvantageConfig
from genrl.training.experts import expert_sigma_range
from genrl.training.lr_schedule import scheduler_step_rules
from genrl.training.nan_guard import NonFiniteGuard
from genrl.training.rollout import SamplingConfig
from genrl.training.schedule import RunSchedule, backward_passes_per_step
from genrl.training.throughput import TransformerTally, count_transformer_flops
from genrl.training.train_args import sampling_configs
from genrl.training.train_logging import EvalPlan
from genrl.training.trainable import frozen_copy, make_trainable

logger = get_logger(__name__)


@dataclass
class Run:
    """What a training run holds while it runs (every process its own).

    args: the parsed arguments (``genrl.training.train_args.parse_args``), as a checkpoint records them.
    policy: the pipeline around the trained transformer (text encoders, VAE, schedule).
    model: the trained transformer as Accelerate prepared it (DDP / DeepSpeed wrapped).
    ema: the EMA of the trained weights (``--use_ema``); sampling_policy: the soft-updated copy
        the rollouts sample with (``--sampling_policy_decay_rate`` > 0); frozen_reference: a
        frozen copy of the initial transformer (full fine-tuning with a KL term or the reward
        watch's drift); None where not asked for.
    reward_fn: the trained rewards; None between an epoch's rollouts and the next with
        ``--reward_clear_before_train`` (``build_rewards`` builds them again).
    reward_weights: ``{reward name: weight}`` of ``reward_fn``.
    eval_plan: the in-training evaluation (None: no evaluation prompts).
    tally: the transformer's forwards counted per phase (``perf/*`` metrics).
    identity: the arguments a checkpoint must share to be resumed (``run_identity``);
        record: what an export records of the run (``run_record``).
    node_local: each node writes its own checkpoints (``--output_dir`` not shared).
    resume_path: the checkpoint resumed (None: a new run).
    metrics_path: ``<output_dir>/<logging_dir>/metrics.jsonl``.
    launch_time: ``time.perf_counter()`` at launch; ``time/elapsed_s`` counts from it.

    How far it got (``resume`` sets them, the epochs move them on): ``global_step`` optimizer
    steps done; ``first_epoch`` the epoch training starts at; ``saved_step`` the step of the last
    checkpoint written or resumed (None: none yet); ``pending`` an epoch whose update a
    checkpoint interrupted (finished first); ``last_eval`` the last evaluation's values;
    ``checkpoint_pushes`` the futures of background checkpoint uploads (main process).

    Set when training starts (train_genrl.py's ``main``): the reward-hacking ``watch``, the
    ``progress`` bar over the optimizer steps, the ``preemption`` watch of stop signals.
    """

    args: argparse.Namespace
    accelerator: Accelerator
    schedule: RunSchedule
    train_set: PromptSet
    sampler: PromptGroupSampler
    policy: FlowPolicy
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any  # Accelerate's wrapper of a diffusers scheduler
    ema: EMA | None
    sampling_policy: EMA | None
    frozen_reference: torch.nn.Module | None
    reward_fn: RewardFn | None
    build_rewards: Callable[[], RewardFn]
    reward_weights: dict[str, float]
    sampling: SamplingConfig
    update_config: UpdateConfig
    advantage_config: AdvantageConfig
    eval_plan: EvalPlan | None
    tally: TransformerTally
    guard: NonFiniteGuard
    identity: dict
    record: dict
    node_local: bool
    resume_path: str | None
    metrics_path: str
    launch_time: float
    global_step: int = 0
    first_epoch: int = 0
    saved_step: int | None = None
    pending: UpdateInProgress | None = None
    last_eval: dict = field(default_factory=dict)
    checkpoint_pushes: list = field(default_factory=list)
    watch: RewardWatch | None = None
    progress: tqdm | None = None
    preemption: PreemptionWatch | None = None

    @property
    def device(self) -> torch.device:
        """This process's training device."""
        return self.accelerator.device

    def reference(self) -> Callable[[], ContextManager[torch.nn.Module]] | None:
        """A context giving the reference policy's transformer (``reference_model``: the frozen
        copy, or under LoRA the trained one with its adapter off); None without either."""
        if not self.args.use_lora and self.frozen_reference is None:
            return None
        return partial(reference_model, self.model, self.frozen_reference)

    def preempted(self) -> bool:
        """Whether every rank agreed on a stop signal (a collective: call it on every rank)."""
        return self.preemption.agreed(self.accelerator)


def build_run(args: argparse.Namespace, held: ExitStack | None = None) -> Run:
    """Everything the epochs need, built once; ``held`` keeps the output folder's lock for the
    run's life (else the process's). Bad input stops here, before or while loading, with one
    sentence."""
    launch_time = time.perf_counter()  # wall time in the logs counts from here (set-up included)
    train_set, eval_set = load_data(args)
    accelerator, node_local = start_accelerator(args, held)
    schedule = RunSchedule.from_args(args, num_processes=accelerator.num_processes, num_prompts=len(train_set))
    # A checkpoint that could run code, cannot be read or belongs to another run is refused
    # before any model loads (load_checkpoint checks it again right before reading it); so is
    # an --output_dir holding another run's checkpoints.
    identity = run_identity(args)
    try:
        resume_path = prepare_output_dir(accelerator, args.output_dir, identity, resume_from_checkpoint=args.resume_from_checkpoint,
                                         overwrite=args.overwrite_output_dir, node_local=node_local)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"train_genrl.py: error: {e}")
    sampler = PromptGroupSampler(
        num_prompts=len(train_set), group_size=args.group_size, batch_size=args.rollout_batch_size,
        batches_per_epoch=args.rollout_batches_per_epoch, num_processes=accelerator.num_processes,
        rank=accelerator.process_index, seed=args.seed,
    )
    if repeats := sampler.repeats_warning():
        logger.warning(repeats)

    policy = load_base_policy(args, accelerator, image_conditioned=train_set.images is not None)
    reward_fn, eval_reward_fn, build_rewards = load_rewards(args)
    frozen_reference, trainable = reference_and_trainable(args, accelerator, policy)
    sampling, eval_sampling = sampling_configs(args)
    # One expert of two: its own steps only (the window of GRPO's recorded steps, the noise levels nft and awm draw).
    train_sigma_range = expert_sigma_range(policy, args.objective, sampling, args.train_sigma_range)
    if train_sigma_range:  # too few steps in the range: one sentence now, not after the first rollout
        check_sigma_range_holds(policy, sampling, schedule.timesteps_per_sample, train_sigma_range)
    tally = speed_levers(args, accelerator, policy, frozen_reference, sampling, train_set.prompts[0])
    optimizer, lr_scheduler = build_optimizer(args, accelerator, trainable)
    model, optimizer, lr_scheduler, ema, sampling_policy = prepare_trained(args, accelerator, policy, optimizer, lr_scheduler)

    # The token lives on in args.hub_token for the push alone: the command line and the
    # arguments are recorded redacted (config, card, trackers), and libraries that read
    # sys.argv themselves (wandb records it) see it redacted too.
    sys.argv[:] = redact_argv(sys.argv)
    record = run_record(args, policy.family, sys.argv, reward_models=describe_reward_models())
    return Run(
        args=args, accelerator=accelerator, schedule=schedule, train_set=train_set, sampler=sampler, policy=policy,
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, ema=ema, sampling_policy=sampling_policy,
        frozen_reference=frozen_reference, reward_fn=reward_fn, build_rewards=build_rewards,
        reward_weights=dict(zip(reward_fn.names, reward_fn.weights)), sampling=sampling,
        update_config=update_config(args, schedule, train_sigma_range), advantage_config=advantage_config(args),
        eval_plan=None if eval_set is None else eval_plan(args, eval_set, eval_reward_fn, eval_sampling, policy), tally=tally, guard=NonFiniteGuard(args.learning_rate), identity=identity, record=record,
        node_local=node_local, resume_path=resume_path,
        metrics_path=os.path.join(args.output_dir, args.logging_dir, "metrics.jsonl"), launch_time=launch_time,
    )


def load_data(args: argparse.Namespace) -> tuple[PromptSet, PromptSet | None]:
    """The training prompts and the evaluation prompts (None without ``--eval_prompt_dataset``);
    a missing, empty or malformed set is one sentence."""
    try:
        train_set = load_prompts(args.prompt_dataset, split=args.train_split, prompt_column=args.prompt_column,
                                 image_column=args.image_column)
        eval_set = None
        if args.eval_prompt_dataset:
            eval_set = load_prompts(args.eval_prompt_dataset, split=args.eval_split, prompt_column=args.prompt_column,
                                    image_column=args.image_column)
        check_conditioning(train_set, eval_set, args.image_column)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(said_once(f"train_genrl.py: error: {e}") or 1)
    return train_set, eval_set


def start_accelerator(args: argparse.Namespace, held: ExitStack | None) -> tuple[Accelerator, bool]:
    """The Accelerator (DeepSpeed configured), the logs, the output folder locked for this run,
    the CPU threads, and the attention backend probed; also whether the nodes write their own
    checkpoints (``--output_dir`` on node-local disks)."""
    accelerator = build_accelerator(
        output_dir=args.output_dir, logging_dir=args.logging_dir, mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=backward_passes_per_step(args),
        log_with=args.report_to, collective_timeout_s=args.collective_timeout,
    )
    configure_deepspeed(accelerator, micro_batch_size=args.train_batch_size, max_grad_norm=args.max_grad_norm)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(
        f"process {accelerator.process_index} of {accelerator.num_processes} on {accelerator.device} "
        f"(distributed type {accelerator.distributed_type.value}, mixed precision {accelerator.mixed_precision})",
        main_process_only=False,
    )
    # Nodes that do not share --output_dir (local disks) each complete their own checkpoints.
    try:
        node_local = output_dir_is_node_local(accelerator, args.output_dir)
    except SetupError as e:
        raise SystemExit(f"train_genrl.py: error: {e}")
    use_node_local_checkpoints(accelerator, node_local)
    if node_local:
        logger.info("The nodes do not share --output_dir: each node writes and completes its own checkpoints; "
                    "the export, samples and logs are written on the main node.", main_process_only=True)
    if accelerator.is_local_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    # One run per output folder (each node's, when they are node-local): a second run into it stops
    # here, before anything in it is read, cleared (--overwrite_output_dir) or written and before
    # any model loads.
    lock = lock_output_dir(accelerator, args.output_dir, take=checkpoint_writer(accelerator, node_local))
    if held is not None:
        held.enter_context(lock)
    if args.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.cpu_threads is not None and accelerator.device.type == "cpu":
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # not on macOS
        torch.set_num_threads(cpu_threads_per_process(args.cpu_threads, cores, local_processes))
        logger.info(f"{torch.get_num_threads()} torch thread(s) per process on the CPU (--cpu_threads {args.cpu_threads}).")
    if args.attention_backend:  # a missing package or kernel fails now, not after minutes of loading models
        probe_attention_backend(args.attention_backend, accelerator.device, weight_dtype(accelerator))
    return accelerator, node_local


def weight_dtype(accelerator) -> torch.dtype:
    """The dtype of the frozen weights (and of the trained ones under DeepSpeed): the mixed precision's."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)


def load_base_policy(args: argparse.Namespace, accelerator, image_conditioned: bool) -> FlowPolicy:
    """The pipeline of ``--pretrained_model_name_or_path`` on the training device. With
    zero3_init_flag: true the transformer is built already partitioned (no rank holds all of
    it); the frozen parts are never sharded."""
    plugin = accelerator.state.deepspeed_plugin
    dtype = weight_dtype(accelerator)
    with zero_init_disabled():
        try:
            policy = load_policy(args.pretrained_model_name_or_path, revision=args.revision, variant=args.variant, dtype=dtype,
                                 zero3_init_config=plugin.deepspeed_config if zero3_init_requested(plugin) else None,
                                 max_sequence_length=args.max_sequence_length, wan_expert=args.wan_expert,
                                 guidance_scale_2=args.guidance_scale_2, image_conditioned=image_conditioned,
                                 guidance_options=guidance_options_of(vars(args)))
        except SetupError as e:
            raise SetupError(f"--pretrained_model_name_or_path: {e}") from e
        policy.to(accelerator.device, dtype)
    if zero3_init_requested(plugin):
        logger.info(describe_partitioned_build(policy.transformer), main_process_only=False)
    return policy


def load_rewards(args: argparse.Namespace) -> tuple[RewardFn, RewardFn, Callable[[], RewardFn]]:
    """``(reward_fn, eval_reward_fn, build)``: the trained rewards, those the evaluation scores
    (the trained ones where ``--eval_reward_fn`` names no others), and what builds the trained
    ones again after ``--reward_clear_before_train`` freed them. Reward models are never sharded;
    in sync mode they wait on the CPU and visit the training device to score."""
    with zero_init_disabled():
        options = load_reward_options(args.reward_options)
        device = "cpu" if args.reward_mode == "sync" else args.reward_device
        build = partial(build_reward_fn, args.reward_fn, device=device, options=options)
        reward_fn = build()
        eval_reward_fn = build_eval_reward_fn(args.eval_reward_fn, args.reward_fn, reward_fn, device=device, options=options)
    return reward_fn, eval_reward_fn, build


def reference_and_trainable(
    args: argparse.Namespace, accelerator, policy: FlowPolicy
) -> tuple[torch.nn.Module | None, list[torch.nn.Parameter]]:
    """The frozen reference copy (or None) and the trainable parameters of ``policy.transformer``
    (its LoRA adapter's, or all of them). The KL reference (and the reward watch's) is, under
    LoRA, the adapter switched off; for full fine-tuning a frozen copy, kept only when asked
    for (a second transformer in memory)."""
    keep_copy = (args.beta > 0 or args.watch_reference) and not args.use_lora
    reference = frozen_copy(policy.transformer, accelerator.device, weight_dtype(accelerator)) if keep_copy else None
    trainable = make_trainable(
        policy.transformer, use_lora=args.use_lora, rank=args.rank, lora_alpha=args.lora_alpha,
        lora_target_modules=args.lora_target_modules, gradient_checkpointing=args.gradient_checkpointing,
        float32=args.use_lora or accelerator.mixed_precision == "fp16", seed=args.seed,
    )
    return reference, trainable


def speed_levers(
    args: argparse.Namespace, accelerator, policy: FlowPolicy, reference: torch.nn.Module | None, sampling: SamplingConfig,
    prompt: str,
) -> TransformerTally:
    """``--attention_backend`` and ``--compile`` on the trained transformer and the frozen copy,
    after the LoRA set-up; the FLOPs of one sequence through it (``prompt``'s) are counted first,
    on the bare module, and the returned tally counts the sequences each epoch sends through it."""
    device, dtype = accelerator.device, weight_dtype(accelerator)
    transformers = [policy.transformer] + ([reference] if reference is not None else [])
    try:
        flop_cost = count_transformer_flops(policy, policy.transformer, sampling, prompt, device)
    except Exception as e:  # a metric must not stop the run
        logger.warning(f"The transformer's FLOPs could not be counted ({type(e).__name__}: {e}); perf/* is not logged.")
        flop_cost = None
    if args.attention_backend:
        set_attention_backend(transformers, args.attention_backend, device=device, dtype=dtype)
    if args.compile:
        for transformer in transformers:
            compile_repeated_blocks(transformer, fullgraph=True)
    return TransformerTally(transformers, flop_cost)


def build_optimizer(
    args: argparse.Namespace, accelerator: Accelerator, trainable: list[torch.nn.Parameter]
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over ``trainable`` and its learning-rate scheduler. On a GPU one fused kernel takes
    the AdamW step (unfused, the step of 1.4 B fp32 parameters was 6% of a Wan 1.3B PPO step on
    an H200); on the CPU torch's default."""
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                  weight_decay=args.adam_weight_decay, eps=args.adam_epsilon,
                                  fused=True if accelerator.device.type == "cuda" else None)
    # The flags count optimizer steps; Accelerate steps the scheduler once per process for each.
    per_step = accelerator.num_processes
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 step_rules=args.lr_step_rules and scheduler_step_rules(args.lr_step_rules, per_step),
                                 num_warmup_steps=args.lr_warmup_steps * per_step,
                                 num_training_steps=(args.max_train_steps or 10**6) * per_step)
    return optimizer, lr_scheduler


def prepare_trained(args: argparse.Namespace, accelerator, policy: FlowPolicy, optimizer, lr_scheduler):
    """``(model, optimizer, lr_scheduler, ema, sampling_policy)``: the transformer, optimizer and
    scheduler as Accelerate prepared them, then the EMA (``--use_ema``) and DiffusionNFT's
    soft-updated sampling policy (``--sampling_policy_decay_rate`` > 0; an fp32 shadow of the
    trained weights that the rollouts, and NFT's old velocities, use, stepping towards them
    after every optimizer step), each None where not asked for."""
    plugin = accelerator.state.deepspeed_plugin
    buckets = size_zero3_buckets(plugin, policy.transformer)
    if buckets:
        logger.info(f"ZeRO-3 buffer sizes (elements): {buckets}", main_process_only=True)
    model, optimizer, lr_scheduler = accelerator.prepare(policy.transformer, optimizer, lr_scheduler)
    logger.info(describe_weight_dtypes(*weight_dtypes(model, optimizer)), main_process_only=True)
    # EMA after prepare: under ZeRO-3 it keeps this rank's partition of each parameter.
    trainable = [p for p in accelerator.unwrap_model(model).parameters() if p.requires_grad]
    ema = EMA(trainable, args.ema_decay, args.ema_update_interval, args.ema_warmup, args.ema_device) if args.use_ema else None
    sampling_policy = EMA(trainable, device=args.ema_device) if args.sampling_policy_decay_rate > 0 else None
    for shadow in (ema, sampling_policy):
        if shadow is not None:
            shadow.settle = partial(settle_zero3_params, model)
    return model, optimizer, lr_scheduler, ema, sampling_policy


def update_config(args: argparse.Namespace, schedule: RunSchedule, train_sigma_range) -> UpdateConfig:
    """How the update trains, from the flags of the same names."""
    return UpdateConfig(
        objective=args.objective, micro_batch_size=args.train_batch_size, num_timesteps=schedule.timesteps_per_sample,
        num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale,
        max_grad_norm=args.max_grad_norm, clip_range=args.clip_range, adv_clip_max=args.adv_clip_max,
        num_inner_epochs=args.num_inner_epochs, timestep_fraction=args.timestep_fraction,
        shuffle_timesteps=not args.no_timestep_shuffle, max_train_steps=args.max_train_steps, beta=args.beta,
        kl_form=args.kl_form, nft_beta=args.nft_beta, grpo_guard=args.grpo_guard,
        grpo_guard_reweight=args.grpo_guard_reweight,
        sampling_decay_rate=args.sampling_policy_decay_rate, sampling_decay_max=args.sampling_policy_decay_max,
        train_sigma_range=train_sigma_range,
    )


def advantage_config(args: argparse.Namespace) -> AdvantageConfig:
    """How an epoch's rewards become advantages, from the flags of the same names; the kept
    samples fill whole optimizer steps (``--train_batch_size`` × ``--gradient_accumulation_steps``)."""
    return AdvantageConfig(
        reward_combine=args.reward_combine, std_mode=args.std_mode, adv_clip_max=args.adv_clip_max,
        filter_zero_advantage=args.filter_zero_advantage,
        micro_batch_size=args.train_batch_size * args.gradient_accumulation_steps,
        train_samples_per_group=args.train_samples_per_group,
    )


def eval_plan(args: argparse.Namespace, prompts: PromptSet, reward_fn: RewardFn, sampling: SamplingConfig,
              policy: FlowPolicy) -> EvalPlan:
    """The in-training evaluation of ``prompts``, from the ``--eval_*`` flags (with
    --eval_pipeline_defaults also at ``policy``'s pipeline's default steps and guidance)."""
    settings = EvalSettings(sampling, seed=args.eval_seed, batch_size=args.eval_batch_size, max_batches=args.eval_max_batches,
                            keep_samples=args.eval_log_samples, samples_per_prompt=args.eval_samples_per_prompt)
    return EvalPlan(prompts, reward_fn, settings, video_fps=args.eval_video_fps, probe_prompts=args.eval_diversity_prompts,
                    probe_samples=args.eval_diversity_samples,
                    pipeline_defaults=at_pipeline_defaults(sampling, policy.pipeline, policy.guidance_keyword) if args.eval_pipeline_defaults else None)


def resume(run: Run) -> None:
    """Load the checkpoint ``run`` resumes (weights, optimizer, scheduler, RNG, EMA, sampling
    policy) and set its step counts from it; an epoch whose update it interrupted becomes
    ``run.pending``. Nothing to do for a new run."""
    args, accelerator = run.args, run.accelerator
    if run.resume_path is None:
        if args.resume_from_checkpoint:
            accelerator.print(f"No checkpoint in {args.output_dir} yet: starting a new run.")
        return
    accelerator.print(f"Resuming from {run.resume_path}")
    try:
        global_step, last_epoch = load_checkpoint(accelerator, run.resume_path, run.ema, run=run.identity,
                                                  sampling_policy=run.sampling_policy)
    except ValueError as e:  # an unsafe or unreadable file, the wrong number of processes
        raise SystemExit(f"train_genrl.py: error: {e}")
    run.global_step, run.first_epoch, run.saved_step = global_step, last_epoch + 1, global_step
    if read_state(run.resume_path).get("update_in_progress"):  # stopped inside an epoch's update
        run.pending = load_update_in_progress(run.resume_path, accelerator.process_index, run.device)
