"""What the trainer records (phase 7 of an epoch): metrics to the trackers and
``logs/metrics.jsonl``, and the in-training evaluation with its sample grid (and MP4s for video
models) on disk and in the trackers, and the reward watch's probe (``genrl.evaluation.reward_watch``):
the diversity of a few prompts' samples and their drift from the reference policy."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager

import cv2
import torch
from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm

from genrl.data.prompts import PromptSet
from genrl.errors import SetupError
from genrl.evaluation.evaluate import EvalResult, EvalSettings, evaluate, spread_indices
from genrl.evaluation.outputs import compact_scores, grid_cells, save_image_grid, save_videos, score_caption
from genrl.evaluation.pipeline_defaults import LOG_PREFIX as PIPELINE_DEFAULTS
from genrl.evaluation.pipeline_defaults import SETTING_KEYS, settings_text
from genrl.evaluation.reward_watch import RewardWatch, group_diversity
from genrl.math.nft import velocity_kl
from genrl.policies.base import FlowPolicy
from genrl.training.console import eval_line
from genrl.training.rollout import SampleBatch, SamplingConfig, sample_rollout

if TYPE_CHECKING:
    from genrl.training.run import Run

logger = get_logger(__name__)


def crossed(every: int | None, before: int, after: int) -> bool:
    """Whether the step count passed a multiple of ``every`` going from ``before`` to ``after``
    (never when ``every`` is None or 0): the epoch-end cadence of evaluations and checkpoints."""
    return bool(every) and after // every > before // every


def log_metrics(accelerator, metrics_path: str, values: dict[str, float], *, step: int, epoch: int) -> None:
    """``values`` to the trackers at ``step``, and (main process) one line
    ``{"step": step, "epoch": epoch, **values}`` appended to ``metrics_path``."""
    accelerator.log(values, step=step)
    if accelerator.is_main_process:
        os.makedirs(os.path.dirname(metrics_path), exist_ok=True)
        with open(metrics_path, "a") as f:
            f.write(json.dumps({"step": step, "epoch": epoch, **values}) + "\n")


def log_image(accelerator, tag: str, png_path: str, step: int) -> None:
    """Send a PNG written to disk to the trackers that show images."""
    image = cv2.cvtColor(cv2.imread(png_path), cv2.COLOR_BGR2RGB)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image(tag, image, step, dataformats="HWC")
        elif tracker.name == "wandb":
            import wandb

            tracker.log({tag: wandb.Image(image)}, step=step)


def log_videos(accelerator, tag: str, mp4_paths: list[str], step: int) -> None:
    """Send MP4s written to disk to the trackers that show videos (wandb; TensorBoard shows
    the grid of middle frames, and the MP4s stay in --output_dir/samples)."""
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            import wandb

            tracker.log({tag: [wandb.Video(path, format="mp4") for path in mp4_paths]}, step=step)


def log_eval_samples(accelerator, result: EvalResult, output_dir: str, step: int, *, is_video: bool, video_fps: float) -> None:
    """Main process: the kept evaluation samples (beside their conditioning images for image-to-video,
    ``grid_cells``) as ``samples/eval-<step>.png``, captioned with
    their prompt and scores, and for video models their MP4s in ``samples/eval-<step>/``; both
    go to the trackers that show them."""
    captions = [r["prompt"] + "\n" + score_caption(compact_scores(r["scores"]), sep=" ", between="=")
                for r in result.sample_rows()]
    grid = save_image_grid(grid_cells(result), os.path.join(output_dir, "samples", f"eval-{step:06d}.png"), captions=captions)
    log_image(accelerator, "eval/samples", grid, step)
    if is_video:  # the grid shows middle frames; the clips themselves go next to it
        videos = save_videos(result.samples, os.path.join(output_dir, "samples", f"eval-{step:06d}"), fps=video_fps)
        log_videos(accelerator, "eval/videos", videos, step)


@dataclass(frozen=True)
class EvalPlan:
    """What the in-training evaluation runs (the ``--eval_*`` flags): ``prompts`` scored by
    ``reward_fn``, sampled and kept as ``settings`` says (deterministic; ``keep_samples`` of
    them go to the grid, MP4s at ``video_fps``). The reward watch's probe: ``probe_prompts``
    prompts spread over the set (0: none), ``probe_samples`` samples each
    (``--eval_diversity_prompts``, ``--eval_diversity_samples``). ``pipeline_defaults``: the
    sampling at the pipeline's own default steps and guidance (``genrl.evaluation.pipeline_defaults``), where
    the evaluations asked for it score too (``--eval_pipeline_defaults``); None: nowhere else."""

    prompts: PromptSet
    reward_fn: Callable
    settings: EvalSettings
    video_fps: float
    probe_prompts: int = 0
    probe_samples: int = 4
    pipeline_defaults: SamplingConfig | None = None


def evaluate_plan(plan: EvalPlan, policy: FlowPolicy, model: torch.nn.Module, *, accelerator=None, device=None,
                  config: SamplingConfig | None = None, keep_samples: int | None = None) -> EvalResult:
    """``evaluate`` on the plan's prompts, reward, noise and batches, sampled as ``config`` says
    (default: the plan's own), keeping ``keep_samples`` samples (default: the plan's), on
    ``device`` (default: the accelerator's)."""
    settings = plan.settings
    if config is not None:
        settings = dataclasses.replace(settings, config=config)
    if keep_samples is not None:
        settings = dataclasses.replace(settings, keep_samples=keep_samples)
    return evaluate(policy, model, plan.prompts, plan.reward_fn, settings, device=device, accelerator=accelerator,
                    show_progress=False)


@torch.no_grad()
def watch_probe(
    plan: EvalPlan, policy: FlowPolicy, model: torch.nn.Module, device, reference: Callable[[], ContextManager] | None
) -> dict[str, float]:
    """``eval/diversity``: ``group_diversity`` of ``probe_samples`` samples of each of
    ``probe_prompts`` prompts, each from its own initial noise (the plain ODE, the same noises at
    every evaluation); with a ``reference`` (a context giving the reference policy's transformer),
    ``eval/velocity_kl``: mean((v_theta - v_ref)^2) at every state of those trajectories, the
    KL of the two policies' SDE transitions up to a per-step factor. Every process runs the same
    probe (lockstep under ZeRO-3); the values are the same on every process."""
    if not plan.probe_prompts or len(plan.prompts) == 0:
        return {}
    config = dataclasses.replace(plan.settings.config, noise_level=0.0, same_latent=False)
    k = plan.probe_samples
    drifts = []

    def measure_drift(latents, timesteps, embeds, velocity):
        with reference() as ref:
            ref_velocity = policy.predict_velocity(ref, latents, timesteps, embeds, config.guidance_scale)
        drifts.append(velocity_kl(velocity, ref_velocity).mean())  # one device sync at the end, not per step

    groups = []
    for i in spread_indices(len(plan.prompts), plan.probe_prompts):  # one prompt's samples per call
        images = [plan.prompts.images[i]] * k if plan.prompts.images is not None else None
        rollout = sample_rollout(policy, model, SampleBatch([plan.prompts.prompts[i]] * k, list(range(k)), seed=plan.settings.seed, epoch=0, images=images),
                                 config=config, device=device, on_step=measure_drift if reference else None)
        groups.append(rollout.samples)
    values = {"eval/diversity": group_diversity(torch.stack(groups))}
    if drifts:
        values["eval/velocity_kl"] = torch.stack(drifts).mean().item()
    return values


def evaluate_and_log(run: Run, *, step: int, epoch: int, at_pipeline_defaults: bool = False) -> dict[str, float]:
    """Bounded deterministic evaluation of ``run.eval_plan`` (the EMA weights when kept) at
    optimizer step ``step``: ``eval/<reward>_mean`` and ``_std``, the watch probe's
    ``eval/diversity`` (and with a reference policy ``eval/velocity_kl``, see ``watch_probe``),
    and ``time/elapsed_s``, counted from ``run.launch_time``, logged and returned; the sample
    grid written, one line printed above the progress bar. ``at_pipeline_defaults`` with a plan
    that has them: the same prompts and noise also sampled at the pipeline's default steps and
    guidance, ``eval_pipeline_defaults/*`` (``pipeline_defaults_values``), one more line. No plan
    (no evaluation prompts): nothing, ``{}``."""
    plan, policy, model, accelerator, ema = run.eval_plan, run.policy, run.model, run.accelerator, run.ema
    if plan is None:
        return {}
    model.eval()
    at_defaults = at_pipeline_defaults and plan.pipeline_defaults is not None
    with ema.swapped_in() if ema is not None else nullcontext():
        result = evaluate_plan(plan, policy, model, accelerator=accelerator)
        probe = watch_probe(plan, policy, model, accelerator.device, run.reference())
        defaults = None
        if at_defaults:
            with policy.pipeline_call_guidance():  # pipe(prompt) leaves the family's guidance options at their defaults
                defaults = evaluate_plan(plan, policy, model, accelerator=accelerator, config=plan.pipeline_defaults,
                                         keep_samples=0)
    values = result.log_dict("eval")
    values.update(probe)
    if defaults is not None:
        values.update(pipeline_defaults_values(defaults))
    values["time/elapsed_s"] = time.perf_counter() - run.launch_time
    log_metrics(accelerator, run.metrics_path, values, step=step, epoch=epoch)
    if accelerator.is_main_process and result.samples is not None:
        log_eval_samples(accelerator, result, run.args.output_dir, step, is_video=policy.is_video, video_fps=plan.video_fps)
    if accelerator.is_main_process:
        tqdm.write(eval_line(step, values))  # above the progress bar, which stays at the bottom
        if defaults is not None:
            where = f"at the pipeline's defaults ({settings_text(defaults.settings)})"
            tqdm.write(eval_line(step, values, prefix=PIPELINE_DEFAULTS, where=where))
    return values


def pipeline_defaults_values(result: EvalResult) -> dict[str, float]:
    """An evaluation at the pipeline's defaults as log values: ``eval_pipeline_defaults/<reward>_mean``
    and ``_std``, and the steps and guidance it sampled with (what the model card states)."""
    return {**result.log_dict(PIPELINE_DEFAULTS), **{f"{PIPELINE_DEFAULTS}/{k}": result.settings[k] for k in SETTING_KEYS}}


class RewardHackingStop(SetupError):
    """``--stop_on_reward_hacking`` and the watch raised an alarm: the scripts print the one
    sentence (the alarm, the checkpoint to go back to), no traceback."""


def watch_evaluation(accelerator, watch: RewardWatch, values: dict[str, float], *, step: int) -> list[str]:
    """The main process's ``watch`` observes the evaluation ``values`` at ``step`` and warns in
    the log for each new alarm; every process returns the new alarms (the main process's)."""
    alarms = watch.observe(step, values) if accelerator.is_main_process and values else []
    for sentence in alarms:
        logger.warning(f"Reward-hacking watch, step {step}: {sentence}.")
    return broadcast_object_list([alarms], from_process=0)[0] if accelerator.num_processes > 1 else alarms
