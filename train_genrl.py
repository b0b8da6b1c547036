#!/usr/bin/env python
"""RL fine-tuning (GRPO, DiffusionNFT, AWM) of flow-matching generators with Accelerate.

    accelerate launch train_genrl.py                                      # the toy run, recipes/toy_nft.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8 train_genrl.py \
        --config recipes/flux1_dev_grpo.yaml
    accelerate launch --config_file accelerate_configs/zero2.yaml train_genrl.py \
        --pretrained_model_name_or_path Wan-AI/Wan2.1-T2V-1.3B-Diffusers \
        --reward_fn "hpsv3:1.0,videoalign_mq:0.5" --prompt_dataset prompts.txt --use_lora

One epoch (``main`` below, numbered as in the README's "What one epoch does"): sample groups
of K images/videos per prompt, score them, turn the scores into group-normalised advantages,
then update the policy: clipped policy-gradient steps on recorded SDE transitions (grpo) or
advantage-weighted flow matching on the clean samples noised again (nft, awm). The flags are
the dataclasses of genrl/config/, parsed by genrl/train_args.py; the no-argument run's values
are in recipes/toy_nft.yaml.
"""

import faulthandler
import glob
import logging
import os
import sys
import time
from contextlib import ExitStack, nullcontext
from functools import partial

import torch
from accelerate.logging import get_logger
from tqdm.auto import tqdm

from genrl.console import close_progress_bars, hide_loading_bars, progress_postfix, silence_known_noise

silence_known_noise()  # before the libraries below load: some warn on import

from diffusers.optimization import get_scheduler
from genrl.acceleration import compile_repeated_blocks, probe_attention_backend, set_attention_backend
from genrl.checkpointing import (
    checkpoint_dirs, export_model, load_checkpoint, prepare_output_dir, read_state, run_identity, run_record, save_checkpoint,
    prune_checkpoints, set_aside_checkpoint, trim_metrics,
)
from genrl.data import load_prompts
from genrl.distributed import (
    build_accelerator, configure_deepspeed, cpu_threads_per_process, describe_timeout, end_processes, peak_memory_gb,
    describe_weight_dtypes, settle_zero3_params, size_zero3_buckets, weight_dtypes, zero_init_disabled,
)
from genrl.ema import EMA
from genrl.errors import SetupError, find_setup_error, said_once, stop_line
from genrl.evaluation import EvalSettings
from genrl.experience import AdvantageConfig, ScoredRollouts, collect_rollouts, epoch_advantages
from genrl.experts import expert_sigma_range
from genrl.hub import HubPushError, push_checkpoint_async, push_to_hub
from genrl.lr_schedule import scheduler_step_rules
from genrl.model_card import write_run_card
from genrl.nan_guard import NonFiniteError, NonFiniteGuard, NonFiniteSamples, samples_stop_message
from genrl.node_storage import checkpoint_writer, output_dir_is_node_local, use_node_local_checkpoints
from genrl.objectives import UpdateConfig, check_sigma_range_holds, reference_model
from genrl.output_lock import lock_output_dir
from genrl.plots import plot_training_curves
from genrl.policies import load_policy
from genrl.preemption import Preempted, PreemptionWatch, capture_rng_states, preempted_message, restore_rng_states
from genrl.redact import redact_argv
from genrl.reward_watch import RewardWatch, watched_rewards
from genrl.rewards import build_eval_reward_fn, build_reward_fn, clear_reward_models, load_reward_options
from genrl.rewards.lifecycle import describe_reward_models
from genrl.sampler import PromptGroupSampler
from genrl.schedule import RunSchedule, backward_passes_per_step
from genrl.throughput import PhaseFigures, TransformerTally, count_transformer_flops, throughput_logs
from genrl.train_args import parse_args, sampling_configs
from genrl.train_logging import EvalPlan, RewardHackingStop, crossed, evaluate_and_log, log_metrics, watch_evaluation
from genrl.trainable import frozen_copy, make_trainable
from genrl.update import UpdateStopped, update_policy
from genrl.update_checkpoint import UpdateInProgress, load_update_in_progress
from genrl.zero_init import describe_partitioned_build, zero3_init_requested

logger = get_logger(__name__)


def main(args, held: ExitStack | None = None):
    """The run; ``held`` keeps what it holds for its life (the output folder's lock) until
    the caller closes it, else until the process ends."""
    launch_time = time.perf_counter()  # wall time in the logs counts from here (set-up included)

    # ---- Data (first: an empty or missing prompt set fails before any model loads) ---------------
    try:
        train_set = load_prompts(args.prompt_dataset, split=args.train_split, prompt_column=args.prompt_column)
        eval_set = None
        if args.eval_prompt_dataset:
            eval_set = load_prompts(args.eval_prompt_dataset, split=args.eval_split, prompt_column=args.prompt_column)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(said_once(f"train_genrl.py: error: {e}") or 1)

    # ---- Accelerator -------------------------------------------------------------------
    accelerator = build_accelerator(
        output_dir=args.output_dir, logging_dir=args.logging_dir, mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=backward_passes_per_step(args),
        log_with=args.report_to, collective_timeout_s=args.collective_timeout,
    )
    configure_deepspeed(accelerator, micro_batch_size=args.train_batch_size, max_grad_norm=args.max_grad_norm)
    schedule = RunSchedule.from_args(args, num_processes=accelerator.num_processes, num_prompts=len(train_set))
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
    device = accelerator.device
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    if args.attention_backend:  # a missing package or kernel fails now, not after minutes of loading models
        probe_attention_backend(args.attention_backend, device, weight_dtype)

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

    # ---- Models --------------------------------------------------------------------------
    # With zero3_init_flag: true the transformer is built already partitioned (no rank holds all
    # of it); frozen parts and reward models are never sharded.
    plugin = accelerator.state.deepspeed_plugin
    with zero_init_disabled():
        try:
            policy = load_policy(args.pretrained_model_name_or_path, revision=args.revision, variant=args.variant, dtype=weight_dtype,
                                 zero3_init_config=plugin.deepspeed_config if zero3_init_requested(plugin) else None,
                                 max_sequence_length=args.max_sequence_length, wan_expert=args.wan_expert,
                                 guidance_scale_2=args.guidance_scale_2)
        except SetupError as e:
            raise SetupError(f"--pretrained_model_name_or_path: {e}") from e
        policy.to(device, weight_dtype)
        reward_options = load_reward_options(args.reward_options)
        # In sync mode reward models wait on the CPU and visit the training device to score.
        reward_device = "cpu" if args.reward_mode == "sync" else args.reward_device
        build_rewards = partial(build_reward_fn, args.reward_fn, device=reward_device, options=reward_options)
        reward_fn = build_rewards()
        eval_reward_fn = build_eval_reward_fn(args.eval_reward_fn, args.reward_fn, reward_fn, device=reward_device,
                                              options=reward_options)
    if zero3_init_requested(plugin):
        logger.info(describe_partitioned_build(policy.transformer), main_process_only=False)
    reward_weights = dict(zip(reward_fn.names, reward_fn.weights))
    # The KL reference (and the reward watch's): under LoRA the adapter switched off; for full
    # fine-tuning a frozen copy, kept only when asked for (a second transformer in memory).
    keep_copy = (args.beta > 0 or args.watch_reference) and not args.use_lora
    ref_transformer = frozen_copy(policy.transformer, device, weight_dtype) if keep_copy else None
    trainable = make_trainable(
        policy.transformer, use_lora=args.use_lora, rank=args.rank, lora_alpha=args.lora_alpha,
        lora_target_modules=args.lora_target_modules, gradient_checkpointing=args.gradient_checkpointing,
        float32=args.use_lora or accelerator.mixed_precision == "fp16", seed=args.seed,
    )
    sampling, eval_sampling = sampling_configs(args)
    # One expert of two: its own steps only (the window of GRPO's recorded steps, the noise levels nft and awm draw).
    train_sigma_range = expert_sigma_range(policy, args.objective, sampling, args.train_sigma_range)
    if train_sigma_range:  # too few steps in the range: one sentence now, not after the first rollout
        check_sigma_range_holds(policy, sampling, schedule.timesteps_per_sample, train_sigma_range)
    # Speed levers (--attention_backend, --compile) on the trained transformer and the frozen copy,
    # after the LoRA set-up; the FLOPs of one sequence through it are counted first, on the bare
    # module, and the tally counts the sequences each epoch sends through it (perf/* metrics).
    transformers = [policy.transformer] + ([ref_transformer] if ref_transformer is not None else [])
    try:
        flop_cost = count_transformer_flops(policy, policy.transformer, sampling, train_set.prompts[0], device)
    except Exception as e:  # a metric must not stop the run
        logger.warning(f"The transformer's FLOPs could not be counted ({type(e).__name__}: {e}); perf/* is not logged.")
        flop_cost = None
    if args.attention_backend:
        set_attention_backend(transformers, args.attention_backend, device=device, dtype=weight_dtype)
    if args.compile:
        for transformer in transformers:
            compile_repeated_blocks(transformer, fullgraph=True)
    tally = TransformerTally(transformers, flop_cost)
    # On a GPU one fused kernel takes the AdamW step (unfused, the step of 1.4 B fp32 parameters
    # was 6% of a Wan 1.3B PPO step on an H200); on the CPU torch's default.
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                  weight_decay=args.adam_weight_decay, eps=args.adam_epsilon,
                                  fused=True if device.type == "cuda" else None)
    # The flags count optimizer steps; Accelerate steps the scheduler once per process for each.
    per_step = accelerator.num_processes
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 step_rules=args.lr_step_rules and scheduler_step_rules(args.lr_step_rules, per_step),
                                 num_warmup_steps=args.lr_warmup_steps * per_step,
                                 num_training_steps=(args.max_train_steps or 10**6) * per_step)
    buckets = size_zero3_buckets(plugin, policy.transformer)
    if buckets:
        logger.info(f"ZeRO-3 buffer sizes (elements): {buckets}", main_process_only=True)
    model, optimizer, lr_scheduler = accelerator.prepare(policy.transformer, optimizer, lr_scheduler)
    logger.info(describe_weight_dtypes(*weight_dtypes(model, optimizer)), main_process_only=True)
    # EMA after prepare: under ZeRO-3 it keeps this rank's partition of each parameter.
    trainable = [p for p in accelerator.unwrap_model(model).parameters() if p.requires_grad]
    ema = EMA(trainable, args.ema_decay, args.ema_update_interval, args.ema_warmup, args.ema_device) if args.use_ema else None
    # DiffusionNFT's soft-updated sampling policy: an fp32 shadow of the trained weights that the
    # rollouts (and NFT's old velocities) use, stepping towards them after every optimizer step.
    sampling_policy = EMA(trainable, device=args.ema_device) if args.sampling_policy_decay_rate > 0 else None
    for shadow in (ema, sampling_policy):
        if shadow is not None:
            shadow.settle = partial(settle_zero3_params, model)

    update_config = UpdateConfig(
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
    advantage_config = AdvantageConfig(
        reward_combine=args.reward_combine, std_mode=args.std_mode, adv_clip_max=args.adv_clip_max,
        filter_zero_advantage=args.filter_zero_advantage,
        micro_batch_size=args.train_batch_size * args.gradient_accumulation_steps,
        train_samples_per_group=args.train_samples_per_group,
    )
    eval_settings = EvalSettings(eval_sampling, seed=args.eval_seed, batch_size=args.eval_batch_size,
                                 max_batches=args.eval_max_batches, keep_samples=args.eval_log_samples,
                                 samples_per_prompt=args.eval_samples_per_prompt)
    eval_plan = None if eval_set is None else EvalPlan(
        eval_set, eval_reward_fn, eval_settings, video_fps=args.eval_video_fps,
        probe_prompts=args.eval_diversity_prompts, probe_samples=args.eval_diversity_samples,
    )
    # The token lives on in args.hub_token for the push alone: the command line and the
    # arguments are recorded redacted (config, card, trackers), and libraries that read
    # sys.argv themselves (wandb records it) see it redacted too.
    sys.argv[:] = redact_argv(sys.argv)
    run_config = run_record(args, policy.family, sys.argv, reward_models=describe_reward_models())

    # ---- Resume, trackers, logs ------------------------------------------------------------------
    global_step, first_epoch, saved_step, pending = 0, 0, None, None
    if resume_path is not None:
        accelerator.print(f"Resuming from {resume_path}")
        try:
            global_step, last_epoch = load_checkpoint(accelerator, resume_path, ema, run=identity,
                                                      sampling_policy=sampling_policy)
        except ValueError as e:  # an unsafe or unreadable file, the wrong number of processes
            raise SystemExit(f"train_genrl.py: error: {e}")
        first_epoch, saved_step = last_epoch + 1, global_step
        if read_state(resume_path).get("update_in_progress"):  # stopped inside an epoch's update
            pending = load_update_in_progress(resume_path, accelerator.process_index, device)
    elif args.resume_from_checkpoint:
        accelerator.print(f"No checkpoint in {args.output_dir} yet: starting a new run.")
    metrics_path = os.path.join(args.output_dir, args.logging_dir, "metrics.jsonl")
    if accelerator.is_main_process:
        tracker_config = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in run_config["args"].items()}
        accelerator.init_trackers(args.tracker_project_name, config=tracker_config)
        trim_metrics(metrics_path, first_epoch - 1)  # a resumed run redoes the epochs after its checkpoint
    has_reference = args.use_lora or ref_transformer is not None
    evaluate_now = partial(evaluate_and_log, eval_plan, policy, model, accelerator, ema=ema, output_dir=args.output_dir,
                           metrics_path=metrics_path, launch_time=launch_time,
                           reference=partial(reference_model, model, ref_transformer) if has_reference else None)
    # The reward-hacking watch has seen a resumed run's evaluations (its metrics, trimmed above).
    trained, held_out = watched_rewards(args.reward_fn, args.eval_reward_fn)
    watch = RewardWatch.from_metrics(metrics_path if resume_path and accelerator.is_main_process else "", trained=trained,
                                     held_out=held_out, patience=args.watch_patience,
                                     diversity_fraction=args.watch_diversity_fraction)
    logger.info(schedule.summary())
    # One bar over the whole run (optimizer steps, ETA, latest rewards); per-phase bars would
    # print two lines per epoch.
    progress = tqdm(
        total=schedule.planned_steps, initial=global_step, desc="training", unit="step",
        disable=not accelerator.is_main_process,
    )
    last_eval = evaluate_now(step=global_step, epoch=first_epoch) if args.eval_steps and first_epoch == 0 else {}
    watch_evaluation(accelerator, watch, last_eval, step=global_step)
    guard = NonFiniteGuard(args.learning_rate)  # NaN / Inf: skip the step, stop after a few in a row
    checkpoint_pushes = []  # futures of background checkpoint uploads (main process)
    save = partial(save_and_push_checkpoint, accelerator, model, policy, ema, args, run_config=run_config, identity=identity,
                   pushes=checkpoint_pushes, sampling_policy=sampling_policy, node_local=node_local)
    # SIGTERM / SIGUSR1 / SIGINT from here on: the ranks agree at the next safe point, save, and exit.
    preemption = PreemptionWatch().install()
    if held is not None:  # a run called in-process gives the signals back to its caller
        held.callback(preemption.restore)

    # ---- Training: the phases of "What one epoch does" (README) ------------------------------------
    for epoch in range(first_epoch, args.num_epochs):
        if args.max_train_steps is not None and global_step >= args.max_train_steps:
            break
        step_at_epoch_start = global_step
        epoch_start = time.perf_counter()
        rng_at_epoch_start = capture_rng_states()  # what a checkpoint taken during the rollouts records
        tally.take()  # the forwards since the last epoch (evaluation) are not this epoch's

        if pending is not None and pending.epoch == epoch:  # its update stopped part-way: finish it
            scored = ScoredRollouts(pending.rollout, rewards={}, timings=pending.timings)
            advantages, rollout_flops, step_at_epoch_start = pending.advantages, pending.rollout_flops, pending.step_at_epoch_start
        else:
            # 1-4. Prompt groups, rollouts, decoded samples to the CPU, rewards (async: as they come).
            model.eval()
            if reward_fn is None:  # freed before the last update (--reward_clear_before_train)
                with zero_init_disabled():
                    reward_fn = build_rewards()
            try:
                with sampling_policy.swapped_in() if sampling_policy is not None else nullcontext():
                    scored = collect_rollouts(
                        policy, model, train_set, sampler.batches(epoch), reward_fn, accelerator=accelerator, guard=guard,
                        config=sampling, seed=args.seed, epoch=epoch, global_step=global_step, reward_mode=args.reward_mode,
                        reward_workers=args.reward_workers, stop=partial(preemption.agreed, accelerator),
                    )
            except Preempted:  # the weights are the last finished epoch's: so is the checkpoint
                restore_rng_states(rng_at_epoch_start)
                progress.close()
                stop_preempted(accelerator, preemption, save, global_step=global_step, epoch=epoch - 1, saved_step=saved_step,
                               nonfinite=bool(guard.consecutive))
            except NonFiniteSamples as error:  # these weights diverged: a checkpoint of them must not be resumed
                # The last checkpoint holds these weights when every optimizer step since it was skipped.
                holds_them = saved_step is not None and global_step - saved_step <= guard.consecutive
                aside = set_aside_checkpoint(accelerator, args.output_dir, saved_step, node_local=node_local) if holds_them else None
                kept = checkpoint_dirs(args.output_dir)
                untrained = resume_path is not None and global_step == saved_step and epoch == first_epoch
                raise NonFiniteError(samples_stop_message(
                    error.epoch, error.step, args.learning_rate, set_aside=aside, last_good=os.path.basename(kept[-1]) if kept else None,
                    resumed_from=resume_path if untrained else None,
                )) from None
            rollout_flops = tally.take()
            if saved_step is not None:  # its weights sampled finite rollouts: the older checkpoints may go now
                prune_kept_checkpoints(accelerator, args, checkpoint_pushes, node_local=node_local)
            if args.reward_clear_before_train:
                reward_fn = None
                clear_reward_models()

            # 5. Advantages over the whole epoch, all ranks.
            advantages = epoch_advantages(accelerator, scored.rewards, reward_weights, sampler.group_ids(), advantage_config)

        # 6. Policy update: on the recorded SDE transitions (grpo) or on the clean samples noised
        #    again (nft, awm); 7. the EMA every --ema_update_interval optimizer steps.
        t0 = time.perf_counter()
        skipped_before = guard.skipped
        resume_update = pending.update if pending is not None and pending.epoch == epoch else None
        if resume_update is not None:
            skipped_before -= resume_update.skipped_steps
        try:
            update = update_policy(
                policy, model, optimizer, lr_scheduler, accelerator, scored.rollout, advantages.advantages, advantages.kept,
                config=update_config, sampling=sampling, seed=args.seed, epoch=epoch, global_step=global_step, guard=guard,
                ema=ema, frozen_reference=ref_transformer, sampling_policy=sampling_policy, progress=progress,
                stop=partial(preemption.agreed, accelerator), resume=resume_update,
            )
        except UpdateStopped as stopped:  # after a whole optimizer step: keep the epoch's experience to finish it
            progress.close()
            in_progress = UpdateInProgress(epoch, step_at_epoch_start, scored.rollout, advantages, scored.timings,
                                           rollout_flops, stopped.partial)
            stop_preempted(accelerator, preemption, partial(save, in_progress=in_progress), global_step=stopped.global_step,
                           epoch=epoch - 1, saved_step=saved_step, nonfinite=bool(guard.consecutive))
        global_step = update.global_step
        train_seconds = time.perf_counter() - t0
        epoch_seconds = time.perf_counter() - epoch_start

        # 7. Logs, evaluation, checkpoints.
        epoch_logs = {
            **advantages.logs, **update.logs(), "train/skipped_steps": guard.skipped - skipped_before,
            "train/lr": lr_scheduler.get_last_lr()[0], "memory/peak_gb": peak_memory_gb(device),
            **scored.timings, "time/train_s": train_seconds, "time/elapsed_s": time.perf_counter() - launch_time,
            **throughput_logs(
                samples=schedule.samples_per_epoch_all_processes,
                epoch_seconds=epoch_seconds, rollout=PhaseFigures(scored.timings["time/rollout_s"], rollout_flops),
                update=PhaseFigures(train_seconds, tally.take()), peak_tflops=args.peak_tflops,
            ),
        }
        log_metrics(accelerator, metrics_path, epoch_logs, step=global_step, epoch=epoch)
        if preemption.agreed(accelerator):  # after the update, before evaluation: the grace time is short
            progress.close()
            stop_preempted(accelerator, preemption, save, global_step=global_step, epoch=epoch, saved_step=saved_step,
                           nonfinite=bool(guard.consecutive))
        done = update.reached_max_steps or epoch == args.num_epochs - 1
        if crossed(args.eval_steps, step_at_epoch_start, global_step) or (done and args.eval_steps):
            last_eval = evaluate_now(step=global_step, epoch=epoch)
            alarms = watch_evaluation(accelerator, watch, last_eval, step=global_step)
            if alarms and args.stop_on_reward_hacking:  # before this epoch's checkpoint: none holds these weights
                kept = checkpoint_dirs(args.output_dir)
                raise RewardHackingStop(
                    f"the reward-hacking watch raised an alarm at step {global_step} ({alarms[0]}); stopped as "
                    f"--stop_on_reward_hacking asks, without a checkpoint or export after it "
                    f"({'the last checkpoint before it is ' + kept[-1] if kept else 'no checkpoint was written before it'})."
                )
        progress.set_postfix_str(progress_postfix(epoch_logs, last_eval))
        if crossed(args.checkpointing_steps, step_at_epoch_start, global_step) and guard.consecutive:
            logger.warning(f"Not saving checkpoint-{global_step}: its last optimizer step was non-finite.")
        elif crossed(args.checkpointing_steps, step_at_epoch_start, global_step):
            save(global_step=global_step, epoch=epoch)
            saved_step = global_step
        if update.reached_max_steps:
            break
    progress.close()

    # ---- Export, plots, model card, Hub ----------------------------------------------------------
    if guard.consecutive:  # weights that just gave a non-finite loss are not exported
        raise NonFiniteError(guard.stop_message(global_step))
    prune_kept_checkpoints(accelerator, args, checkpoint_pushes, node_local=node_local)  # the export's weights sampled
    export_model(accelerator, model, policy, args.output_dir, config=run_config, use_lora=args.use_lora, ema=ema)
    push_failed = accelerator.is_main_process and not publish_export(
        args, run_config, metrics_path, last_eval=last_eval, is_video=policy.is_video, checkpoint_pushes=checkpoint_pushes,
        watch_alarms=watch.alarms if watch.history else None,
    )
    end_processes(accelerator, exit_code=1 if push_failed else 0)
    if push_failed:
        raise SystemExit(1)


def save_and_push_checkpoint(accelerator, model, policy, ema, args, *, global_step: int, epoch: int, run_config: dict,
                             identity: dict, pushes: list, sampling_policy=None, node_local: bool = False,
                             in_progress: UpdateInProgress | None = None) -> str:
    """``checkpoint-<global_step>`` after ``epoch`` (every rank; ``in_progress``: with the next
    epoch's update stopped part-way), then (main process, with --push_checkpoints) its upload in
    the background, its future appended to ``pushes``. Returns its path."""
    for push in pushes:  # pruning must not delete a checkpoint still uploading
        push.exception()
    path = save_checkpoint(
        accelerator, model, policy, args.output_dir, global_step=global_step, epoch=epoch, config=run_config,
        use_lora=args.use_lora, ema=ema, total_limit=None, run=identity,
        sampling_policy=sampling_policy, node_local=node_local, in_progress=in_progress,
    )
    logger.info(f"Saved {path}")
    if args.push_to_hub and args.push_checkpoints and accelerator.is_main_process:
        pushes.append(push_checkpoint_async(path, repo_id=args.hub_model_id, token=args.hub_token, private=args.hub_private))
    return path


def prune_kept_checkpoints(accelerator, args, pushes: list, *, node_local: bool) -> None:
    """Remove the oldest checkpoints beyond --checkpoints_total_limit (on each process that writes
    them), once the newest one's weights have sampled finite rollouts, so that a checkpoint set
    aside for diverged weights always leaves the one before it; never one still uploading."""
    if not args.checkpoints_total_limit or not checkpoint_writer(accelerator, node_local):
        return
    for push in pushes:
        push.exception()
    kept = checkpoint_dirs(args.output_dir)
    prune_checkpoints(args.output_dir, args.checkpoints_total_limit, keep=kept[-1] if kept else None)


def stop_preempted(accelerator, preemption: PreemptionWatch, save, *, global_step: int, epoch: int, saved_step: int | None,
                   nonfinite: bool = False) -> None:
    """Every rank, once they agreed on a stop signal at a safe point: ``save`` the weights of
    ``global_step`` (after ``epoch``) unless ``checkpoint-<saved_step>`` already holds them, there
    are none to keep, or (``nonfinite``) their last step was skipped as non-finite; print one
    sentence; end with the pre-emption exit status (128 + the signal's number)."""
    checkpoint = None
    if global_step == saved_step:
        checkpoint = f"checkpoint-{global_step}"
    elif global_step > 0 and not nonfinite:  # as at an epoch's end: no checkpoint after a skipped step
        checkpoint = os.path.basename(save(global_step=global_step, epoch=epoch))
    if accelerator.is_main_process:
        print(f"train_genrl.py: {preempted_message(global_step, checkpoint, preemption.signum)}", file=sys.stderr, flush=True)
    end_processes(accelerator, exit_code=preemption.exit_code)
    raise SystemExit(preemption.exit_code)  # one process: no process group to end


def publish_export(args, run_config: dict, metrics_path: str, *, last_eval: dict, is_video: bool,
                   checkpoint_pushes: list, watch_alarms: list | None) -> bool:
    """Main process, after the export: the training curves and the model card next to it, the
    checkpoint uploads awaited, and with --push_to_hub the upload. False when that failed (the
    local export stays as it is)."""
    images = sorted(glob.glob(os.path.join(args.output_dir, "samples", "eval-*.png")))[-1:]
    if os.path.exists(metrics_path):
        images.append(plot_training_curves(metrics_path, os.path.join(args.output_dir, "training_curves.png")))
    write_run_card(args.output_dir, metrics_path, run_config, objective=args.objective, is_video=is_video,
                   last_eval=last_eval, sample_images=images, repo_id=args.hub_model_id, watch_alarms=watch_alarms)
    logger.info(f"Exported to {args.output_dir}")
    for push in checkpoint_pushes:
        if push.exception() is not None:
            logger.error(f"A checkpoint push failed: {push.exception()}")
    if args.push_to_hub:
        try:
            url = push_to_hub(args.output_dir, repo_id=args.hub_model_id, token=args.hub_token, private=args.hub_private)
            logger.info(f"Pushed to {url}")
        except HubPushError as e:  # the local export stays as it is
            logger.error(str(e))
            return False
    return True


def run(argv=None) -> None:
    """The command line: a problem the user fixes with one change (a model or reward weights
    that cannot be fetched, a reward that failed, a full disk, a learning rate that made the
    weights diverge) ends in its one sentence and exit status 1, not in a traceback; so does a
    collective that timed out waiting for a hung peer (the sentence names the rank and the
    operation). Where an exception lies behind the sentence, its traceback goes to
    ``<output_dir>/<logging_dir>/error.log``, which the sentence names."""
    args = parse_args(argv)
    hide_loading_bars()
    try:
        # A run called in-process (the tests) gives its folder's lock back however main() ends.
        with ExitStack() as held:
            main(args, held)
    except Exception as error:
        reason = find_setup_error(error) or describe_timeout(error, args.collective_timeout)
        if reason is None:
            raise
        close_progress_bars()
        raise SystemExit(stop_line("train_genrl.py", reason, error, os.path.join(args.output_dir, args.logging_dir))) from None


if __name__ == "__main__":
    # A native crash (a SIGABRT from a communication library, a segfault) prints every thread's
    # Python stack, so a rank that dies without a traceback still says where it was.
    faulthandler.enable(all_threads=True)
    run()
