"""The loss of one micro batch at one trained timestep, for each training objective.

``--objective grpo`` trains on the recorded SDE transitions of a rollout (their log-probs);
``nft`` and ``awm`` train on its clean final latents, noised again by the forward process
(``genrl.nft``). The update loop (``genrl.update``) is the same for all three: it picks the
samples of a micro batch and a timestep column, calls ``grpo_step_loss`` or
``forward_step_loss``, and steps the optimizer.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from genrl.errors import SetupError
from genrl.grpo import grpo_loss, guard_timestep_weights, guarded_log_ratio
from genrl.nft import awm_loss, forward_noise, nft_loss, velocity_kl
from genrl.policies.base import FlowPolicy, unwrap_module
from genrl.rollout import Rollout, SamplingConfig, step_log_prob
from genrl.sde import kl_between_means, kl_in_form
from genrl.seeding import forward_generator


@contextmanager
def reference_model(model: torch.nn.Module, frozen_copy: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
    """The reference policy of the KL term: ``frozen_copy`` for full fine-tuning, else
    ``model`` with its LoRA adapter switched off (and on again, even if the body raises)."""
    if frozen_copy is not None:
        yield frozen_copy
        return
    inner = unwrap_module(model)
    inner.disable_adapters()
    try:
        yield model
    finally:
        inner.enable_adapters()


def grpo_step_loss(
    policy: FlowPolicy,
    model: torch.nn.Module,
    rollout: Rollout,
    idx: torch.Tensor,
    steps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    config: SamplingConfig,
    clip_range: float,
    beta: float = 0.0,
    frozen_reference: torch.nn.Module | None = None,
    kl_form: str = "transition",
    guard: bool = False,
    reweight: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of samples ``idx`` ``(b,)`` at their recorded steps ``steps`` ``(b,)`` (column
    indices into the rollout's ``(B, S)`` records); ``advantages`` ``(B,)`` of the whole rollout.
    With ``beta`` > 0 the KL to the reference policy's SDE mean is added, in ``kl_form``
    (``genrl.sde.kl_in_form``). ``guard``: GRPO-Guard's normalised ratio
    (``genrl.grpo.guarded_log_ratio``; needs the rollout's recorded means, flow_sde steps).
    ``reweight``: GRPO-Guard's per-timestep weights 1 / (T dt) (``genrl.grpo.guard_timestep_weights``)."""
    embeds = {k: v[idx.to(v.device)] for k, v in rollout.embeds.items()}
    transition = (
        rollout.latents[idx, steps], rollout.next_latents[idx, steps], rollout.timesteps[idx, steps],
        rollout.sigmas[idx, steps], rollout.sigmas_next[idx, steps], embeds,
    )
    out = step_log_prob(policy, model, *transition, config=config, sigma_max=rollout.sigma_max)
    kl = None
    if beta > 0:
        with torch.no_grad(), reference_model(model, frozen_reference) as ref:
            ref_out = step_log_prob(policy, ref, *transition, config=config, sigma_max=rollout.sigma_max)
        kl = kl_in_form(kl_between_means(out.mean, ref_out.mean, out.std), transition[3], transition[4], kl_form)
    old = rollout.log_probs[idx, steps].to(out.log_prob.device)
    log_ratio = None
    if guard:
        if rollout.means is None or config.sde_type != "flow_sde":
            raise ValueError("GRPO-Guard's ratio needs the rollout's recorded SDE means of flow_sde steps.")
        old_mean = rollout.means[idx, steps].to(out.mean.device)
        log_ratio = guarded_log_ratio(out.log_prob, old, out.mean, old_mean, out.std)
    weights = None
    if reweight:
        weights = guard_timestep_weights(transition[3], transition[4], config.num_inference_steps).to(out.log_prob.device)
    adv = advantages[idx].to(out.log_prob.device)
    return grpo_loss(out.log_prob, old, adv, clip_range, kl=kl, beta=beta, log_ratio=log_ratio, weights=weights)


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
    depend on (seed, epoch, prompt, index in its group) alone, not on the batch layout.

    ``sigma_range`` = (lo, hi) draws among the steps whose sigma lies in [lo, hi] only
    (``steps_in_sigma_range``); None: among all T."""
    candidates = steps_in_sigma_range(schedule_sigmas, sigma_range)
    if not 1 <= num_timesteps <= len(candidates):
        raise ValueError(
            f"num_timesteps must be between 1 and the {len(candidates)} sampling steps it is drawn from, got {num_timesteps}."
        )
    if rollout.final_latents is None:
        raise ValueError("The rollout kept no final latents; sample it with genrl.rollout.sample_rollout.")
    clean = rollout.final_latents.float()
    steps, noise = [], []
    for prompt, index in zip(rollout.prompts, rollout.group_indices):
        generator = forward_generator(prompt, seed, epoch, index)
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
    *,
    objective: str,
    guidance_scale: float,
    adv_clip_max: float,
    nft_beta: float = 1.0,
    beta: float = 0.0,
    frozen_reference: torch.nn.Module | None = None,
    old_is_current: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """NFT or AWM loss of samples ``idx`` ``(b,)`` at their ``column``-th drawn timestep, from
    the conditional velocity; ``advantages`` ``(B,)``. With ``beta`` > 0, + beta mean (v - v_ref)^2.

    ``old_is_current``: the weights are still those that sampled the rollout (on-policy, before
    the epoch's first optimizer step), so NFT's old velocity is this forward's, detached, and
    needs no recorded one."""
    sub = {k: v[idx.to(v.device)] for k, v in embeds.items()}
    noisy, t, sigma = batch.noisy[idx, column], batch.timesteps[idx, column], batch.sigmas[idx, column]
    guidance = policy.conditional_guidance(guidance_scale)
    velocity = policy.predict_velocity(model, noisy, t, sub, guidance)
    adv = advantages[idx].to(velocity.device)
    if objective == "nft":
        if old_is_current:
            old_velocity = velocity.detach()
        elif batch.old_velocity is None:
            raise ValueError("NFT needs the sampling policy's velocities; call fill_old_velocity first.")
        else:
            old_velocity = batch.old_velocity[idx, column]
        loss, stats = nft_loss(
            velocity, old_velocity, noisy, batch.clean[idx], sigma, adv,
            nft_beta=nft_beta, adv_clip_max=adv_clip_max,
        )
    elif objective == "awm":
        loss, stats = awm_loss(velocity, noisy, batch.clean[idx], batch.noise[idx, column], adv)
    else:
        raise ValueError(f"forward_step_loss trains 'nft' or 'awm', not {objective!r}.")
    if beta > 0:
        with torch.no_grad(), reference_model(model, frozen_reference) as ref:
            ref_velocity = policy.predict_velocity(ref, noisy, t, sub, guidance)
        kl = velocity_kl(velocity, ref_velocity).mean()
        loss = loss + beta * kl
        stats["kl"] = kl.detach()
    return loss, stats
