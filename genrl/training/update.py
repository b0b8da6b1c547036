"""Phase 6 of an epoch (and the EMA of phase 7): the policy update on the epoch's samples, one
loop for every ``--objective``.

Per inner epoch the kept samples are shuffled and cut into micro batches of
``micro_batch_size``; each micro batch is trained at each of its ``num_timesteps`` trained
timesteps, and every (micro batch, timestep) is one backward pass of the accumulation
(Accelerate's ``gradient_accumulation_steps`` counts them). At each accumulation boundary the
gradient norm is clipped, the NaN guard decides on every rank whether the optimizer steps,
the global step counts up and the EMA steps (every ``ema_update_interval`` optimizer steps).
The update ends early when the global step reaches ``max_train_steps``.

What is trained is the objective's (``genrl.objectives``): what it prepares from the epoch's
samples before the weights move, which timesteps each sample trains at, and the loss of a micro
batch at one of them.

- ``grpo``: the loss of the recorded SDE transitions (``genrl.objectives.grpo``), at each
  sample's own shuffled ``timestep_fraction`` of its stochastic steps.
- ``nft`` / ``awm``: the clean samples noised again at ``num_timesteps`` drawn steps of the
  sampling schedule (``genrl.objectives.forward``); NFT first records the sampling policy's
  velocities there, before the weights move. On-policy, the first optimizer step's passes still
  run on the sampling weights and take them from their own forward instead, so only the later
  passes' are recorded (with one optimizer step per epoch, none; with more inner epochs every
  sample comes back later, so each is recorded once).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from genrl.checkpoints.update_checkpoint import PartialUpdate
from genrl.data.seeding import mix_seeds
from genrl.math.nft import soft_update_decay
from genrl.objectives import EpochUpdate, UpdateConfig, get_objective
from genrl.training.nan_guard import NonFiniteGuard, is_finite

if TYPE_CHECKING:
    from genrl.training.experience import EpochExperience
    from genrl.training.run import Run


class UpdateStopped(Exception):
    """Every rank agreed to stop after an optimizer step with more of the update to run.

    partial: how far the update got (what a checkpoint keeps to finish it on resume).
    global_step: the optimizer-step count at the stop.
    """

    def __init__(self, partial: PartialUpdate, global_step: int):
        super().__init__(f"stopped at step {global_step}")
        self.partial, self.global_step = partial, global_step


@dataclass
class UpdateResult:
    """How the update went.

    global_step: the optimizer-step count after it.
    reached_max_steps: it stopped at ``max_train_steps``.
    step_stats: the loss statistics of every (micro batch, timestep) of the applied optimizer
        steps (a skipped step's NaN statistics stay out).
    grad_norms: the gradient norm of every applied optimizer step (where the backend gives one).
    """

    global_step: int
    reached_max_steps: bool = False
    step_stats: list[dict[str, float]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)

    def logs(self) -> dict[str, float]:
        """``train/<stat>``: the mean of each statistic over ``step_stats``; ``train/grad_norm``."""
        logs = {}
        if self.step_stats:
            for key in self.step_stats[0]:
                logs[f"train/{key}"] = sum(s[key] for s in self.step_stats) / len(self.step_stats)
        if self.grad_norms:
            logs["train/grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        return logs


def micro_steps(
    kept: torch.Tensor, num_recorded_steps: int, config: UpdateConfig, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor | int]]:
    """``(idx, timestep)`` of every backward pass of the update, in order: per inner epoch a
    fresh shuffle of ``kept`` ``(k,)`` cut into micro batches ``idx`` ``(b,)``, each visited at
    every trained timestep column j. The timestep is ``(b,)``, each sample's own of the
    objective's ``draw_timesteps`` (GRPO's recorded steps, of ``num_recorded_steps``), or the
    column j itself where the objective draws none (nft's and awm's forward batch)."""
    micro, objective = config.micro_batch_size, get_objective(config.objective)
    for _ in range(config.num_inner_epochs):
        order = kept[torch.randperm(len(kept), generator=generator)]
        timesteps = objective.draw_timesteps(len(order), num_recorded_steps, config, generator)  # after the shuffle
        for start in range(0, len(order), micro):
            for j in range(config.num_timesteps):
                yield order[start : start + micro], (j if timesteps is None else timesteps[start : start + micro, j])


def micro_steps_before_the_weights_move(accelerator, config: UpdateConfig, on_policy: bool) -> int:
    """How many of the update's first backward passes run on the weights that sampled the
    rollout, where the objective's loss reads the sampling policy's outputs (NFT's old velocity):
    on-policy, from an accumulation boundary, the whole first optimizer step (Accelerate's
    ``gradient_accumulation_steps`` passes); otherwise none. Those passes take the sampling
    outputs from their own forward, so they are recorded only for the later ones."""
    if not get_objective(config.objective).uses_sampling_outputs or not on_policy:
        return 0
    per_step = accelerator.gradient_accumulation_steps
    whole_micro_batches = per_step % config.num_timesteps == 0
    return per_step if whole_micro_batches and accelerator.step % per_step == 0 else 0


def optimizer_step(accelerator, model: torch.nn.Module, optimizer, lr_scheduler, guard: NonFiniteGuard, *,
                   global_step: int, losses_finite: bool, max_grad_norm: float) -> tuple[bool, torch.Tensor | float | None]:
    """After a backward pass: ``(applied, grad norm)``. At an accumulation boundary the norm is
    clipped and the guard decides on every rank whether optimizer step ``global_step`` is
    applied; a skipped step leaves the weights of the last finite one (DeepSpeed has already
    skipped its own step on a non-finite norm). Between boundaries Accelerate's wrappers make
    the steps no-ops."""
    norm, applied = None, True
    if accelerator.sync_gradients:
        norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        applied = guard.check_step(accelerator, global_step, losses_finite, norm)
    if applied:
        optimizer.step()
        lr_scheduler.step()
    optimizer.zero_grad()
    return applied, norm


def update_policy(
    run: Run, experience: EpochExperience, *, stop: Callable[[], bool] | None = None, resume: PartialUpdate | None = None
) -> UpdateResult:
    """Train ``run.model`` on this process's samples of ``experience`` (its rollout, B samples,
    and their advantages ``(B,)``) at the kept samples ``(k,)``, from optimizer step
    ``run.global_step``, as ``run.update_config`` says; ``run.progress`` (a tqdm bar) counts the
    optimizer steps. GRPO recomputes its log-probs as ``run.sampling`` sampled the rollout.
    ``run.sampling_policy``: the soft-updated weights the rollout was sampled with (nft, awm);
    NFT's old velocities come from them, and they step towards the trained weights after every
    optimizer step, as ``run.ema`` does (every ``--ema_update_interval`` of them).

    ``stop`` (a collective: every rank gets the same answer) is asked after each optimizer step
    that leaves more to do; when it says so the update raises :class:`UpdateStopped`.
    ``resume``: such a stop's :class:`~genrl.checkpoints.update_checkpoint.PartialUpdate`, from a checkpoint;
    the update continues its plan after the micro steps it did, with what it had prepared."""
    policy, model, accelerator, guard, config = run.policy, run.model, run.accelerator, run.guard, run.update_config
    sampling_policy, ema, seed, epoch = run.sampling_policy, run.ema, run.args.seed, experience.epoch
    rollout, advantages, kept = experience.rollout, experience.advantages.advantages, experience.advantages.kept
    objective = get_objective(config.objective)
    model.train()
    generator = torch.Generator().manual_seed(mix_seeds(seed, epoch, accelerator.process_index, 7))
    plan = list(micro_steps(kept, rollout.num_steps, config, generator))
    fresh = micro_steps_before_the_weights_move(accelerator, config, on_policy=sampling_policy is None)
    record = []
    if objective.uses_sampling_outputs:
        # Each later micro batch once (its first of num_timesteps consecutive passes). With more
        # inner epochs every sample comes back after the weights move: record each sample once.
        if config.num_inner_epochs == 1:
            record = [idx for idx, _ in plan[fresh :: config.num_timesteps]]
        else:
            record = list(kept.split(config.micro_batch_size))
    if resume is not None:
        prepared, start = resume.prepared, resume.micro_steps
        result = UpdateResult(run.global_step, step_stats=list(resume.step_stats), grad_norms=list(resume.grad_norms))
    else:
        with sampling_policy.swapped_in() if sampling_policy is not None else nullcontext():
            prepared = objective.prepare(policy, model, rollout, record, config=config, seed=seed, epoch=epoch,
                                         device=accelerator.device)
        start, result = 0, UpdateResult(run.global_step)
    update = EpochUpdate(policy, model, rollout, prepared, advantages, config, run.sampling, run.frozen_reference)
    skipped_at_start = guard.skipped - (resume.skipped_steps if resume is not None else 0)
    window_stats, losses_finite = [], True  # of the optimizer step being accumulated
    for n, (idx, timestep) in enumerate(plan):
        if n < start:  # done before the checkpoint this run resumed
            continue
        with accelerator.accumulate(model):
            loss, stats = objective.loss(update, idx, timestep, old_is_current=n < fresh)
            losses_finite = losses_finite and is_finite(loss)
            accelerator.backward(loss)
            applied, norm = optimizer_step(accelerator, model, run.optimizer, run.lr_scheduler, guard,
                                           global_step=result.global_step + 1, losses_finite=losses_finite,
                                           max_grad_norm=config.max_grad_norm)
            if applied and norm is not None:
                result.grad_norms.append(float(norm))
        window_stats.append({k: float(v) for k, v in stats.items()})
        if accelerator.sync_gradients:  # one optimizer step done
            if applied:  # a skipped step's NaN statistics stay out of the logs
                result.step_stats += window_stats
            window_stats, losses_finite = [], True
            result.global_step += 1
            if run.progress is not None:
                run.progress.update(1)
            if ema is not None:
                ema.step(result.global_step)
            if sampling_policy is not None:
                sampling_policy.update(
                    soft_update_decay(result.global_step, config.sampling_decay_rate, config.sampling_decay_max)
                )
            if config.max_train_steps is not None and result.global_step >= config.max_train_steps:
                result.reached_max_steps = True
                break
            if stop is not None and n + 1 < len(plan) and stop():
                partial = PartialUpdate(n + 1, prepared, result.step_stats, result.grad_norms, guard.skipped - skipped_at_start)
                raise UpdateStopped(partial, result.global_step)
    return result
