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
the dataclasses of genrl/config/, parsed by genrl/training/train_args.py; the no-argument run's values
are in recipes/toy_nft.yaml. What the run holds (models, optimizer, rewards, sampler, step
counts) is one ``genrl.training.run.Run``, built once before the first epoch; the phases take it.
"""

import faulthandler
import glob
import os
import sys
import time
from contextlib import ExitStack, nullcontext

from accelerate.logging import get_logger
from tqdm.auto import tqdm

from genrl.training.console import close_progress_bars, hide_loading_bars, progress_postfix, silence_known_noise

silence_known_noise()  # before the libraries below load: some warn on import

from genrl.checkpoints.checkpointing import (
    checkpoint_dirs,
    export_model,
    prune_checkpoints,
    save_checkpoint,
    set_aside_checkpoint,
    trim_metrics,
)
from genrl.checkpoints.node_storage import checkpoint_writer
from genrl.checkpoints.update_checkpoint import UpdateInProgress
from genrl.distributed.launch import describe_timeout, end_processes
from genrl.distributed.memory import peak_memory_gb
from genrl.distributed.preemption import (
    Preempted,
    PreemptionWatch,
    capture_rng_states,
    preempted_message,
    restore_rng_states,
)
from genrl.distributed.zero3 import zero_init_disabled
from genrl.errors import find_setup_error, stop_line
from genrl.evaluation.plots import plot_training_curves
from genrl.evaluation.reward_watch import RewardWatch, watched_rewards
from genrl.hub.model_card import PipelineUsage, write_run_card
from genrl.hub.push import HubPushError, push_checkpoint_async, push_to_hub
from genrl.rewards import clear_reward_models
from genrl.training.experience import EpochExperience, ScoredRollouts, collect_rollouts, epoch_advantages
from genrl.training.nan_guard import NonFiniteError, NonFiniteSamples, samples_stop_message
from genrl.training.run import Run, build_run, resume
from genrl.training.throughput import PhaseFigures, throughput_logs
from genrl.training.train_args import parse_args
from genrl.training.train_logging import RewardHackingStop, crossed, evaluate_and_log, log_metrics, watch_evaluation
from genrl.training.update import UpdateResult, UpdateStopped, update_policy

logger = get_logger(__name__)


def main(args, held: ExitStack | None = None):
    """The run; ``held`` keeps what it holds for its life (the output folder's lock) until
    the caller closes it, else until the process ends."""
    run = build_run(args, held)  # data, accelerator, output folder, models, optimizer, rewards
    resume(run)
    start_logs(run)
    logger.info(run.schedule.summary())
    # One bar over the whole run (optimizer steps, ETA, latest rewards); per-phase bars would
    # print two lines per epoch.
    run.progress = tqdm(
        total=run.schedule.planned_steps, initial=run.global_step, desc="training", unit="step",
        disable=not run.accelerator.is_main_process,
    )
    if args.eval_steps and run.first_epoch == 0:
        run.last_eval = evaluate_and_log(run, step=run.global_step, epoch=run.first_epoch, at_pipeline_defaults=True)
    watch_evaluation(run.accelerator, run.watch, run.last_eval, step=run.global_step)
    # SIGTERM / SIGUSR1 / SIGINT from here on: the ranks agree at the next safe point, save, and exit.
    run.preemption = PreemptionWatch().install()
    if held is not None:  # a run called in-process gives the signals back to its caller
        held.callback(run.preemption.restore)

    # ---- Training: the phases of "What one epoch does" (README) ------------------------------------
    for epoch in range(run.first_epoch, args.num_epochs):
        if args.max_train_steps is not None and run.global_step >= args.max_train_steps:
            break
        epoch_start = time.perf_counter()
        # 1-5. Prompt groups, rollouts, decoded samples to the CPU, rewards, advantages.
        experience = gather_experience(run, epoch)
        # 6. Policy update: on the recorded SDE transitions (grpo) or on the clean samples noised
        #    again (nft, awm); 7. the EMA every --ema_update_interval optimizer steps.
        t0 = time.perf_counter()
        update, skipped = train(run, experience)
        run.global_step = update.global_step
        train_seconds = time.perf_counter() - t0
        # 7. Logs, evaluation, checkpoints.
        epoch_logs = log_epoch(run, experience, update, skipped=skipped, train_seconds=train_seconds,
                               epoch_seconds=time.perf_counter() - epoch_start)
        if run.preempted():  # after the update, before evaluation: the grace time is short
            stop_preempted(run, global_step=run.global_step, epoch=epoch)
        done = update.reached_max_steps or epoch == args.num_epochs - 1
        if crossed(args.eval_steps, experience.step_at_epoch_start, run.global_step) or (done and args.eval_steps):
            evaluate_and_watch(run, epoch, last=done)
        run.progress.set_postfix_str(progress_postfix(epoch_logs, run.last_eval))
        if crossed(args.checkpointing_steps, experience.step_at_epoch_start, run.global_step):
            checkpoint(run, epoch)
        if update.reached_max_steps:
            break
    run.progress.close()

    # ---- Export, plots, model card, Hub ----------------------------------------------------------
    export(run)


def start_logs(run: Run) -> None:
    """The trackers (main process), ``metrics.jsonl`` trimmed to a resumed checkpoint's epochs (a
    resumed run redoes the epochs after it), and the reward-hacking watch, which has seen a
    resumed run's evaluations (its metrics, trimmed)."""
    args, accelerator = run.args, run.accelerator
    if accelerator.is_main_process:
        tracker_config = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in run.record["args"].items()}
        accelerator.init_trackers(args.tracker_project_name, config=tracker_config)
        trim_metrics(run.metrics_path, run.first_epoch - 1)
    trained, held_out = watched_rewards(args.reward_fn, args.eval_reward_fn)
    run.watch = RewardWatch.from_metrics(run.metrics_path if run.resume_path and accelerator.is_main_process else "",
                                         trained=trained, held_out=held_out, patience=args.watch_patience,
                                         diversity_fraction=args.watch_diversity_fraction)


def gather_experience(run: Run, epoch: int) -> EpochExperience:
    """Phases 1-5 of ``epoch``: this process's rollouts, scored, and their advantages over every
    process; or, when the run resumed inside this epoch's update, the experience its checkpoint
    kept (an :class:`UpdateInProgress`)."""
    step_at_epoch_start = run.global_step
    rng_at_epoch_start = capture_rng_states()  # what a checkpoint taken during the rollouts records
    run.tally.take()  # the forwards since the last epoch (evaluation) are not this epoch's
    if run.pending is not None and run.pending.epoch == epoch:  # its update stopped part-way: finish it
        return run.pending
    scored = sample_and_score(run, epoch, rng_at_epoch_start)
    rollout_flops = run.tally.take()
    if run.saved_step is not None:  # its weights sampled finite rollouts: the older checkpoints may go now
        prune_kept_checkpoints(run)
    if run.args.reward_clear_before_train:
        run.reward_fn = None
        clear_reward_models()
    # 5. Advantages over the whole epoch, all ranks.
    advantages = epoch_advantages(run.accelerator, scored.rewards, run.reward_weights, run.sampler.group_ids(),
                                  run.advantage_config)
    return EpochExperience(epoch, step_at_epoch_start, scored.rollout, advantages, scored.timings, rollout_flops)


def sample_and_score(run: Run, epoch: int, rng_at_epoch_start) -> ScoredRollouts:
    """Phases 1-4: the epoch's rollouts (with the soft-updated sampling policy, when kept) and
    their rewards. A stop signal ends the run with the last finished epoch's checkpoint
    (``rng_at_epoch_start``: the RNG states it records); non-finite samples end it with one
    sentence, the checkpoint of these weights set aside."""
    run.model.eval()
    if run.reward_fn is None:  # freed before the last update (--reward_clear_before_train)
        with zero_init_disabled():
            run.reward_fn = run.build_rewards()
    try:
        with run.sampling_policy.swapped_in() if run.sampling_policy is not None else nullcontext():
            return collect_rollouts(run, epoch, stop=run.preempted)
    except Preempted:  # the weights are the last finished epoch's: so is the checkpoint
        restore_rng_states(rng_at_epoch_start)
        stop_preempted(run, global_step=run.global_step, epoch=epoch - 1)
    except NonFiniteSamples as error:  # these weights diverged: a checkpoint of them must not be resumed
        raise diverged(run, error, epoch) from None


def diverged(run: Run, error: NonFiniteSamples, epoch: int) -> NonFiniteError:
    """The error that stops a run whose weights gave non-finite samples in ``epoch``. The last
    checkpoint holds these weights when every optimizer step since it was skipped: it is set
    aside so that ``latest`` does not resume it."""
    args = run.args
    holds_them = run.saved_step is not None and run.global_step - run.saved_step <= run.guard.consecutive
    aside = set_aside_checkpoint(run.accelerator, args.output_dir, run.saved_step, node_local=run.node_local) if holds_them else None
    kept = checkpoint_dirs(args.output_dir)
    untrained = run.resume_path is not None and run.global_step == run.saved_step and epoch == run.first_epoch
    return NonFiniteError(samples_stop_message(
        error.epoch, error.step, args.learning_rate, set_aside=aside, last_good=os.path.basename(kept[-1]) if kept else None,
        resumed_from=run.resume_path if untrained else None,
    ))


def train(run: Run, experience: EpochExperience) -> tuple[UpdateResult, int]:
    """Phases 6-7: the policy update on ``experience`` (the rest of it, for the experience of an
    interrupted update) and its EMA steps; also how many of its optimizer steps were skipped as
    non-finite. A stop signal after an optimizer step ends the run with a checkpoint that keeps
    the epoch's experience, so that the resumed run finishes the update."""
    resume_update = experience.update if isinstance(experience, UpdateInProgress) else None
    skipped_before = run.guard.skipped - (resume_update.skipped_steps if resume_update is not None else 0)
    try:
        update = update_policy(run, experience, stop=run.preempted, resume=resume_update)
    except UpdateStopped as stopped:  # after a whole optimizer step: keep the epoch's experience to finish it
        stop_preempted(run, global_step=stopped.global_step, epoch=experience.epoch - 1,
                       in_progress=UpdateInProgress.of(experience, stopped.partial))
    return update, run.guard.skipped - skipped_before


def log_epoch(run: Run, experience: EpochExperience, update: UpdateResult, *, skipped: int, train_seconds: float,
              epoch_seconds: float) -> dict[str, float]:
    """The epoch's metrics (rewards and advantages, the update's statistics, ``skipped``
    non-finite steps, learning rate, memory, times, throughput) to the trackers and
    ``metrics.jsonl``; returns them."""
    epoch_logs = {
        **experience.advantages.logs, **update.logs(), "train/skipped_steps": skipped,
        "train/lr": run.lr_scheduler.get_last_lr()[0], "memory/peak_gb": peak_memory_gb(run.device),
        **experience.timings, "time/train_s": train_seconds, "time/elapsed_s": time.perf_counter() - run.launch_time,
        **throughput_logs(
            samples=run.schedule.samples_per_epoch_all_processes, epoch_seconds=epoch_seconds,
            rollout=PhaseFigures(experience.timings["time/rollout_s"], experience.rollout_flops),
            update=PhaseFigures(train_seconds, run.tally.take()), peak_tflops=run.args.peak_tflops,
        ),
    }
    log_metrics(run.accelerator, run.metrics_path, epoch_logs, step=run.global_step, epoch=experience.epoch)
    return epoch_logs


def evaluate_and_watch(run: Run, epoch: int, last: bool) -> None:
    """The evaluation at the end of ``epoch`` (the ``last`` one also at the pipeline's defaults,
    with --eval_pipeline_defaults), and the reward-hacking watch on it; with
    --stop_on_reward_hacking an alarm stops the run before this epoch's checkpoint, so that none
    holds these weights."""
    run.last_eval = evaluate_and_log(run, step=run.global_step, epoch=epoch, at_pipeline_defaults=last)
    alarms = watch_evaluation(run.accelerator, run.watch, run.last_eval, step=run.global_step)
    if alarms and run.args.stop_on_reward_hacking:
        kept = checkpoint_dirs(run.args.output_dir)
        raise RewardHackingStop(
            f"the reward-hacking watch raised an alarm at step {run.global_step} ({alarms[0]}); stopped as "
            f"--stop_on_reward_hacking asks, without a checkpoint or export after it "
            f"({'the last checkpoint before it is ' + kept[-1] if kept else 'no checkpoint was written before it'})."
        )


def checkpoint(run: Run, epoch: int) -> None:
    """``checkpoint-<global_step>`` after ``epoch``, unless its last optimizer step was non-finite."""
    if run.guard.consecutive:
        logger.warning(f"Not saving checkpoint-{run.global_step}: its last optimizer step was non-finite.")
        return
    save_and_push_checkpoint(run, global_step=run.global_step, epoch=epoch)
    run.saved_step = run.global_step


def save_and_push_checkpoint(run: Run, *, global_step: int, epoch: int, in_progress: UpdateInProgress | None = None) -> str:
    """``checkpoint-<global_step>`` after ``epoch`` (every rank; ``in_progress``: with the next
    epoch's update stopped part-way), then (main process, with --push_checkpoints) its upload in
    the background, its future appended to ``run.checkpoint_pushes``. Returns its path."""
    args = run.args
    for push in run.checkpoint_pushes:  # pruning must not delete a checkpoint still uploading
        push.exception()
    path = save_checkpoint(run, global_step=global_step, epoch=epoch, in_progress=in_progress)
    logger.info(f"Saved {path}")
    if args.push_to_hub and args.push_checkpoints and run.accelerator.is_main_process:
        run.checkpoint_pushes.append(
            push_checkpoint_async(path, repo_id=args.hub_model_id, token=args.hub_token, private=args.hub_private)
        )
    return path


def prune_kept_checkpoints(run: Run) -> None:
    """Remove the oldest checkpoints beyond --checkpoints_total_limit (on each process that writes
    them), once the newest one's weights have sampled finite rollouts, so that a checkpoint set
    aside for diverged weights always leaves the one before it; never one still uploading."""
    args = run.args
    if not args.checkpoints_total_limit or not checkpoint_writer(run.accelerator, run.node_local):
        return
    for push in run.checkpoint_pushes:
        push.exception()
    kept = checkpoint_dirs(args.output_dir)
    prune_checkpoints(args.output_dir, args.checkpoints_total_limit, keep=kept[-1] if kept else None)


def stop_preempted(run: Run, *, global_step: int, epoch: int, in_progress: UpdateInProgress | None = None) -> None:
    """Every rank, once they agreed on a stop signal at a safe point: save the weights of
    ``global_step`` (after ``epoch``; ``in_progress``: with the next epoch's interrupted update)
    unless ``checkpoint-<run.saved_step>`` already holds them, there are none to keep, or their
    last step was skipped as non-finite; print one sentence; end with the pre-emption exit status
    (128 + the signal's number)."""
    run.progress.close()
    checkpoint = None
    if global_step == run.saved_step:
        checkpoint = f"checkpoint-{global_step}"
    elif global_step > 0 and not run.guard.consecutive:  # as at an epoch's end: no checkpoint after a skipped step
        checkpoint = os.path.basename(save_and_push_checkpoint(run, global_step=global_step, epoch=epoch,
                                                               in_progress=in_progress))
    if run.accelerator.is_main_process:
        print(f"train_genrl.py: {preempted_message(global_step, checkpoint, run.preemption.signum)}", file=sys.stderr,
              flush=True)
    end_processes(run.accelerator, exit_code=run.preemption.exit_code)
    raise SystemExit(run.preemption.exit_code)  # one process: no process group to end


def export(run: Run) -> None:
    """The trained weights (and their EMA) in diffusers format in --output_dir, then on the main
    process the plots, model card and uploads; exit status 1 when the Hub upload failed (the
    local export stays). Weights that just gave a non-finite loss are not exported."""
    args, accelerator = run.args, run.accelerator
    if run.guard.consecutive:
        raise NonFiniteError(run.guard.stop_message(run.global_step))
    prune_kept_checkpoints(run)  # the export's weights sampled
    export_model(accelerator, run.model, run.policy, args.output_dir, config=run.record, use_lora=args.use_lora, ema=run.ema)
    push_failed = accelerator.is_main_process and not publish_export(run)
    end_processes(accelerator, exit_code=1 if push_failed else 0)
    if push_failed:
        raise SystemExit(1)


def publish_export(run: Run) -> bool:
    """Main process, after the export: the training curves and the model card next to it, the
    checkpoint uploads awaited, and with --push_to_hub the upload. False when that failed (the
    local export stays as it is)."""
    args = run.args
    images = sorted(glob.glob(os.path.join(args.output_dir, "samples", "eval-*.png")))[-1:]
    if os.path.exists(run.metrics_path):
        images.append(plot_training_curves(run.metrics_path, os.path.join(args.output_dir, "training_curves.png")))
    write_run_card(args.output_dir, run.metrics_path, run.record, is_video=run.policy.is_video,
                   usage=PipelineUsage.of(run.policy), last_eval=run.last_eval,
                   sample_images=images, repo_id=args.hub_model_id, watch_alarms=run.watch.alarms if run.watch.history else None)
    logger.info(f"Exported to {args.output_dir}")
    for push in run.checkpoint_pushes:
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
