"""What the likelihood-free objectives (``nft``, ``awm``) share: they train on a rollout's clean
final latents, noised again by the forward process at drawn steps of the sampling schedule
(``genrl.math.nft.forward_noise``), so they need no log-probs and work with any sampler.

``ForwardObjective`` draws those noised samples once per epoch (``draw_forward_batch``) and
computes a loss of the trained policy's conditional velocity there (``forward_step_loss``);
each subclass gives the loss of that velocity.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from genrl.data.seeding import forward_generator
from genrl.errors import SetupError
from genrl.math.nft import forward_noise, velocity_kl
from genrl.objectives.base import Objective, UpdateConfig, check_soft_update_flags, reference_model
from genrl.policies.base import FlowPolicy
from genrl.training.rollout import Rollout, SamplingConfig


@dataclass
class ForwardBatch:
    """Clean samples noised again at ``n`` timesteps each, for the likelihood-free objectives.

    clean: ``(B, ...)`` the rollout's final latents x0.
    noise, noisy: ``(B, n, ...)`` eps and x_t = (1 - sigma) x0 + sigma eps.
    timesteps, sigmas: ``(B, n)`` float32, drawn from the sampling schedule (scheduler units / [0, 1]).
    old_velocity: ``(B, n, ...)`` the sampling policy's conditional velocity at (x_t, t), or None
        until ``fill_old_velocity`` ran (NFT needs it, AWM does not).
    """

    clean: torch.Tensor
    noise: torch.Tensor
    noisy: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    old_velocity: torch.Tensor | None = None

    @property
    def num_timesteps(self) -> int:
        return self.sigmas.shape[1]


def steps_in_sigma_range(sigmas: torch.Tensor, sigma_range: tuple[float, float] | None) -> torch.Tensor:
    """The sampling steps i (of T) whose sigma_i lies in [lo, hi] of ``sigma_range``, ``(k,)``
    int64 in schedule order; None: all T. ``sigmas`` is the schedule's ``(T + 1,)``, final 0 last."""
    num_steps = sigmas.numel() - 1
    if sigma_range is None:
        return torch.arange(num_steps)
    lo, hi = sigma_range
    if not 0 <= lo < hi <= 1:
        raise ValueError(f"sigma_range must satisfy 0 <= lo < hi <= 1, got {sigma_range}.")
    inside = (sigmas[:-1] >= lo) & (sigmas[:-1] <= hi)
    return torch.nonzero(inside.cpu()).flatten()


def rollout_sigmas(policy: FlowPolicy, config: SamplingConfig) -> torch.Tensor:
    """The sigmas of the rollouts' schedule, ``(T + 1,)`` with the final 0, from the policy at
    ``config``'s sample size (which decides the shift of a dynamic-shift schedule, e.g. FLUX's)."""
    size = policy.resolve_size(config.height, config.width, config.num_frames)
    latents = torch.zeros((1, *policy.latent_shape(*size)))
    return policy.timesteps_and_sigmas(config.num_inference_steps, latents, "cpu")[1]


def check_sigma_range_holds(
    policy: FlowPolicy, config: SamplingConfig, num_timesteps: int, sigma_range: tuple[float, float]
) -> None:
    """Start-up check of ``--train_sigma_range``: the rollouts' schedule must have at least
    ``num_timesteps`` steps with sigma in the range, else one sentence (``SetupError``) before
    any rollout."""
    sigmas = rollout_sigmas(policy, config)
    inside = steps_in_sigma_range(sigmas, sigma_range)
    if len(inside) < num_timesteps:
        shown = ", ".join(f"{v:.3f}" for v in sigmas[:-1].tolist())
        raise SetupError(
            f"--train_sigma_range {sigma_range[0]} {sigma_range[1]} holds {len(inside)} of the {len(sigmas) - 1} sampling "
            f"steps (sigmas {shown}), fewer than the {num_timesteps} trained timesteps per sample; widen the range or "
            "lower --timestep_fraction."
        )


def draw_forward_batch(
    rollout: Rollout,
    schedule_timesteps: torch.Tensor,
    schedule_sigmas: torch.Tensor,
    num_timesteps: int,
    *,
    seed: int,
    epoch: int,
    sigma_range: tuple[float, float] | None = None,
) -> ForwardBatch:
    """For every sample of ``rollout``, ``num_timesteps`` distinct steps of the sampling
    schedule (``schedule_timesteps`` ``(T,)``, ``schedule_sigmas`` ``(T + 1,)``, the final 0
    excluded) and one noise draw per step, from the sample's own forward generator: the draws
    depend on (seed, epoch, prompt, conditioning image if any, index in its group) alone, not on
    the batch layout.

    ``sigma_range`` = (lo, hi) draws among the steps whose sigma lies in [lo, hi] only
    (``steps_in_sigma_range``); None: among all T."""
    candidates = steps_in_sigma_range(schedule_sigmas, sigma_range)
    if not 1 <= num_timesteps <= len(candidates):
        raise ValueError(
            f"num_timesteps must be between 1 and the {len(candidates)} sampling steps it is drawn from, got {num_timesteps}."
        )
    if rollout.final_latents is None:
        raise ValueError("The rollout kept no final latents; sample it with genrl.training.rollout.sample_rollout.")
    clean = rollout.final_latents.float()
    steps, noise = [], []
    image_ids = rollout.image_ids or [None] * len(rollout.prompts)
    for prompt, index, image_id in zip(rollout.prompts, rollout.group_indices, image_ids):
        generator = forward_generator(prompt, seed, epoch, index, image_id)
        steps.append(candidates[torch.randperm(len(candidates), generator=generator)[:num_timesteps]])
        noise.append(torch.randn((num_timesteps, *clean.shape[1:]), generator=generator))
    steps = torch.stack(steps).to(schedule_timesteps.device)
    noise = torch.stack(noise).to(clean.device)
    sigmas = schedule_sigmas[steps].float()
    noisy = forward_noise(clean.unsqueeze(1).expand_as(noise).flatten(0, 1), noise.flatten(0, 1), sigmas.flatten())
    return ForwardBatch(
        clean=clean, noise=noise, noisy=noisy.view_as(noise), timesteps=schedule_timesteps[steps].float(), sigmas=sigmas
    )


@torch.no_grad()
def fill_old_velocity(
    policy: FlowPolicy,
    model: torch.nn.Module,
    batch: ForwardBatch,
    embeds: dict[str, torch.Tensor],
    order: Sequence[torch.Tensor],
    guidance_scale: float,
) -> None:
    """Record the sampling policy's velocity at every (x_t, t) of ``batch``, before the first
    optimizer step of the epoch changes the weights. ``order`` lists the micro batches of
    sample indices to record (the same number of forwards on every rank: ZeRO-3 gathers
    parameters in each); the other rows stay NaN, so a loss that used one would show it."""
    old = torch.full_like(batch.noise, float("nan"))
    for idx in order:
        sub = {k: v[idx.to(v.device)] for k, v in embeds.items()}
        for j in range(batch.num_timesteps):
            old[idx, j] = policy.predict_velocity(
                model, batch.noisy[idx, j], batch.timesteps[idx, j], sub, policy.conditional_guidance(guidance_scale)
            ).to(old.dtype)
    batch.old_velocity = old


def forward_step_loss(
    policy: FlowPolicy,
    model: torch.nn.Module,
    batch: ForwardBatch,
    embeds: dict[str, torch.Tensor],
    idx: torch.Tensor,
    column: int,
    advantages: torch.Tensor,
    velocity_loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    *,
    guidance_scale: float,
    beta: float = 0.0,
    frozen_reference: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of samples ``idx`` ``(b,)`` at their ``column``-th drawn timestep:
    ``velocity_loss(velocity, adv)`` of the conditional velocity ``(b, ...)`` at x_t and their
    advantages ``(b,)`` (of ``advantages`` ``(B,)``). With ``beta`` > 0, + beta mean (v - v_ref)^2."""
    sub = {k: v[idx.to(v.device)] for k, v in embeds.items()}
    noisy, t = batch.noisy[idx, column], batch.timesteps[idx, column]
    guidance = policy.conditional_guidance(guidance_scale)
    velocity = policy.predict_velocity(model, noisy, t, sub, guidance)
    loss, stats = velocity_loss(velocity, advantages[idx].to(velocity.device))
    if beta > 0:
        with torch.no_grad(), reference_model(model, frozen_reference) as ref:
            ref_velocity = policy.predict_velocity(ref, noisy, t, sub, guidance)
        kl = velocity_kl(velocity, ref_velocity).mean()
        loss = loss + beta * kl
        stats["kl"] = kl.detach()
    return loss, stats


class ForwardObjective(Objective):
    """An objective on the clean samples noised again at ``num_timesteps`` drawn steps of the
    sampling schedule (``--timestep_fraction`` of them, among those in ``--train_sigma_range``),
    sampled by the trained weights or a soft-updated copy (``--sampling_policy_decay_rate``)."""

    own_args = ("train_sigma_range", "sampling_policy_decay_rate", "sampling_policy_decay_max")

    def check_args(self, args: argparse.Namespace) -> None:
        check_soft_update_flags(args)
        if args.train_sigma_range is not None:
            lo, hi = args.train_sigma_range
            if not 0 <= lo < hi <= 1:
                raise ValueError(f"--train_sigma_range {lo} {hi} must satisfy 0 <= LO < HI <= 1 (noise levels, 1: pure noise).")

    def timestep_pool(self, args: argparse.Namespace) -> int:
        return args.num_inference_steps

    def prepare(
        self, policy: FlowPolicy, model: torch.nn.Module, rollout: Rollout, record: list[torch.Tensor], *,
        config: UpdateConfig, seed: int, epoch: int, device: torch.device,
    ) -> ForwardBatch:
        """The rollout's clean samples noised again at ``config.num_timesteps`` steps of the
        sampling schedule each."""
        schedule = policy.timesteps_and_sigmas(config.num_inference_steps, rollout.final_latents, device)
        return draw_forward_batch(
            rollout, *schedule, config.num_timesteps, seed=seed, epoch=epoch, sigma_range=config.train_sigma_range
        )
