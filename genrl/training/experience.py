"""An epoch's experience (phases 1-5 of "What one epoch does" in the README): this process's
rollouts, scored by the rewards, and their advantages normalised over every process.

``collect_rollouts`` samples the prompt-group batches the sampler gave this process, moves the
decoded samples to the CPU and hands them to the rewards (scored in a thread while the next
batch denoises, or all at the end on the training device). ``epoch_advantages`` gathers the
rewards of every process, normalises them per prompt group (``genrl.math.advantages``) and says
which samples this process trains on (the same count on every process).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from genrl.distributed.preemption import Preempted
from genrl.math.advantages import (
    balanced_keep_mask,
    clip_advantages,
    combine_rewards,
    fill_abstentions,
    max_variance_subset,
    zero_std_ratio,
)
from genrl.rewards import RewardScorer, cached_reward_models, on_device
from genrl.training.rollout import Rollout, SampleBatch, concat_rollouts, sample_rollout

if TYPE_CHECKING:
    from genrl.training.run import Run


@dataclass
class ScoredRollouts:
    """This process's samples of one epoch.

    rollout: the epoch's rollout batches joined, B samples (``genrl.training.rollout.Rollout``).
    rewards: ``{reward name: (B,)}`` float, one score per sample, for the names of the spec.
    timings: ``time/rollout_s`` (denoising), ``time/decode_s`` (VAE), ``time/reward_s`` (scoring
        left after the last batch: all of it in sync mode).
    """

    rollout: Rollout
    rewards: dict[str, torch.Tensor]
    timings: dict[str, float]


def collect_rollouts(run: Run, epoch: int, *, stop: Callable[[], bool] | None = None) -> ScoredRollouts:
    """Phases 1-4: sample every batch of ``(prompt index, index in its group)`` pairs the run's
    sampler gives this process in ``epoch`` with the trained transformer as it is (the caller
    swaps a sampling policy in), stop on non-finite samples before any reward sees them, and
    score them with ``run.reward_fn``: ``--reward_mode`` "async" scores batch i in
    ``--reward_workers`` threads while batch i + 1 denoises; "sync" scores all of them at the
    end, with the cached reward models moved onto the training device.

    ``stop`` (every rank calls it before each batch, so it may be a collective): when it returns
    True the epoch's samples are dropped and :class:`~genrl.distributed.preemption.Preempted` is raised."""
    accelerator, prompt_set, reward_fn, reward_mode = run.accelerator, run.train_set, run.reward_fn, run.args.reward_mode
    device = accelerator.device
    t0 = time.perf_counter()
    scorer = RewardScorer(reward_fn, mode=reward_mode, max_workers=run.args.reward_workers)
    rollouts = []
    for batch in run.sampler.batches(epoch):
        if stop is not None and stop():
            scorer.close()  # batches still queued are cancelled, the one being scored finishes
            raise Preempted(f"stopped in the rollouts of epoch {epoch}")
        prompts = [prompt_set.prompts[i] for i, _ in batch]
        metadata = [prompt_set.metadata[i] for i, _ in batch]
        images = [prompt_set.images[i] for i, _ in batch] if prompt_set.images is not None else None
        rollout = sample_rollout(run.policy, run.model, SampleBatch(prompts, [k for _, k in batch], seed=run.args.seed, epoch=epoch, images=images),
                                 config=run.sampling, device=device)
        run.guard.check_samples(accelerator, rollout.samples, epoch, run.global_step)  # before any reward sees them
        scorer.submit(rollout.samples, prompts, metadata)  # samples are already on the CPU
        rollouts.append(rollout)
    timings = {"time/decode_s": sum(r.decode_seconds for r in rollouts)}
    timings["time/rollout_s"] = time.perf_counter() - t0 - timings["time/decode_s"]  # denoising alone
    t0 = time.perf_counter()
    if reward_mode == "sync":
        with on_device(cached_reward_models(), device):
            scores = scorer.collect()
    else:
        scores = scorer.collect()
    scorer.close()
    timings["time/reward_s"] = time.perf_counter() - t0
    rewards = {name: torch.cat([s[name] for s in scores]) for name in reward_fn.names}
    return ScoredRollouts(concat_rollouts(rollouts), rewards, timings)


@dataclass
class EpochAdvantages:
    """What the update trains on, on this process.

    advantages: ``(B,)`` float, the normalised and clipped advantage of each of this process's samples.
    kept: ``(k,)`` long, the indices of the samples trained on (all B; with
        ``train_samples_per_group`` the max-variance ones of each group; with
        ``filter_zero_advantage`` the informative ones of those; k is the same on every process).
    logs: ``reward/<name>_mean``, ``reward/<name>_std`` over every process's samples,
        ``reward/zero_std_ratio``, ``train/kept_fraction`` (trained on) and
        ``train/informative_fraction`` (|A| > 1e-8, what ``filter_zero_advantage`` keeps before
        rounding up to a multiple of the micro batch).
    """

    advantages: torch.Tensor
    kept: torch.Tensor
    logs: dict[str, float]


@dataclass
class EpochExperience:
    """One epoch's experience on this process: what its update trains on, and what its logs
    report of how it was gathered.

    epoch: the epoch; step_at_epoch_start: the optimizer step it started at.
    rollout: this process's samples of the epoch (``ScoredRollouts.rollout``).
    advantages: their advantages, the kept samples and the epoch's reward logs.
    timings: the ``time/*`` of its rollouts; rollout_flops: their FLOPs (None: not counted).
    """

    epoch: int
    step_at_epoch_start: int
    rollout: Rollout
    advantages: EpochAdvantages
    timings: dict[str, float]
    rollout_flops: float | None


@dataclass(frozen=True)
class AdvantageConfig:
    """How an epoch's rewards become advantages (the flags of the same names).

    reward_combine: how several rewards combine (``genrl.math.advantages.combine_rewards``).
    std_mode: whose standard deviation normalises them: the group's, the epoch's, the largest group's.
    adv_clip_max: advantages are clipped to [-adv_clip_max, adv_clip_max].
    filter_zero_advantage: train only on the informative samples (every process keeps as many).
    micro_batch_size: the kept count is a multiple of it (``--train_batch_size`` ×
        ``--gradient_accumulation_steps``).
    train_samples_per_group: m, train on the m samples of each group whose advantages vary most
        (None: all of them).
    """

    reward_combine: str
    std_mode: str
    adv_clip_max: float
    filter_zero_advantage: bool
    micro_batch_size: int
    train_samples_per_group: int | None = None


def epoch_advantages(
    accelerator,
    rewards: dict[str, torch.Tensor],
    weights: dict[str, float],
    group_ids: torch.Tensor,
    config: AdvantageConfig,
) -> EpochAdvantages:
    """Phase 5: gather ``rewards`` (``{name: (B,)}`` on each process, B the same everywhere)
    from every process, normalise them per prompt group (``group_ids``: ``(B,)`` long, the
    epoch-wide group of each local sample, ``PromptGroupSampler.group_ids``), clip at
    ``config.adv_clip_max`` and pick the samples to train on, a multiple of
    ``config.micro_batch_size``.

    ``config.train_samples_per_group`` m: of each group only the m samples whose advantages vary most
    are trained on (``max_variance_subset``), with advantages normalised again over those m, as
    PODS does; the others get 0. Normalised over the whole group instead, a kept subset's
    advantages need not sum to 0: once most samples of a prompt score high, the subset is the few
    low ones and some high ones, its sum is strongly negative, and NFT pushed the weights away
    (README "Objectives"). Every rank holds whole groups, as many as the others, so every rank
    keeps the same count."""
    device = accelerator.device
    names = list(weights)
    n_local = len(rewards[names[0]])
    raw = {name: accelerator.gather(rewards[name].to(device)).cpu() for name in names}
    group_ids = accelerator.gather(group_ids.to(device)).cpu()
    gathered = {name: fill_abstentions(raw[name], group_ids) for name in names}  # NaN: a judge gave no score

    def normalised(values: dict[str, torch.Tensor], groups: torch.Tensor) -> torch.Tensor:
        combined = combine_rewards(values, weights, groups, mode=config.reward_combine, std_mode=config.std_mode)
        return clip_advantages(combined, config.adv_clip_max)

    advantages = normalised(gathered, group_ids)
    if config.train_samples_per_group:
        selected = max_variance_subset(advantages, group_ids, config.train_samples_per_group)
        subset = {name: gathered[name][selected] for name in names}
        advantages = torch.zeros_like(advantages)
        advantages[selected] = normalised(subset, group_ids[selected])
    else:
        selected = torch.ones_like(advantages, dtype=torch.bool)
    per_rank = advantages.view(accelerator.num_processes, n_local)
    selected = selected.view_as(per_rank)
    keep = selected.clone()
    if config.filter_zero_advantage:  # among the selected samples, which every rank holds as many of
        index = selected.nonzero()[:, 1].view(accelerator.num_processes, -1)
        chosen = balanced_keep_mask(per_rank.gather(1, index), config.micro_batch_size)
        keep = torch.zeros_like(selected).scatter_(1, index, chosen)
    scored = {n: raw[n][~raw[n].isnan()] for n in names}  # the samples each reward scored
    logs = {f"reward/{n}_mean": scored[n].mean().item() for n in names}
    logs.update({f"reward/{n}_std": scored[n].std(unbiased=False).item() for n in names})
    logs.update({f"reward/{n}_abstained": 1 - len(scored[n]) / len(raw[n]) for n in names if len(scored[n]) < len(raw[n])})
    logs["reward/zero_std_ratio"] = zero_std_ratio(sum(weights[n] * gathered[n] for n in names), group_ids)
    logs["train/kept_fraction"] = keep.float().mean().item()
    logs["train/informative_fraction"] = (advantages.abs() > 1e-8).float().mean().item()
    return EpochAdvantages(per_rank[accelerator.process_index], keep[accelerator.process_index].nonzero().squeeze(1), logs)
