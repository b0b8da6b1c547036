"""The GRPO clipped-ratio loss and the choice of timesteps to train on."""

from __future__ import annotations

import torch


def guarded_log_ratio(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: torch.Tensor,
) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio of one Gaussian SDE step (Wang et al. 2025, "GRPO-Guard:
    Mitigating Implicit Over-Optimization in Flow Matching via Regulated Clipping", arXiv:2510.22319),
    ``(B,)`` float32.

    With s the step's std and logp the mean over dims of log N(x'; mu, s^2):

        logp - logp_old = mean((x' - mu_old)^2 - (x' - mu)^2) / (2 s^2)
                        = mean((mu - mu_old) eps) / s - mean((mu - mu_old)^2) / (2 s^2),  x' = mu_old + s eps

    The second term is never positive: the plain ratio is biased below 1, more so at the
    low-noise steps (small s), so clipping acts unevenly over the timesteps. GRPO-Guard removes
    the bias and rescales by s, which also evens out the gradient across timesteps:

        log r = s (logp - logp_old) + mean((mu - mu_old)^2) / (2 s) = mean((mu - mu_old) eps)

    ``log_prob`` and ``mean`` ``(B, ...)`` carry the gradient; ``old_log_prob`` ``(B,)``,
    ``old_mean`` (the rollout's) and ``std`` ``(B,)`` are constants. A deterministic step (s = 0)
    has log r = 0.
    """
    s = std.detach().float()
    safe = s.clamp_min(1e-12)
    drift = (mean.float() - old_mean.detach().float()) ** 2
    bias = drift.mean(dim=tuple(range(1, drift.ndim))) / (2 * safe)
    log_ratio = s * (log_prob.float() - old_log_prob.detach().float()) + bias
    return torch.where(s > 0, log_ratio, torch.zeros_like(log_ratio))


def guard_timestep_weights(sigmas: torch.Tensor, sigmas_next: torch.Tensor, num_steps: int) -> torch.Tensor:
    """GRPO-Guard's per-timestep gradient reweighting (arXiv:2510.22319, Sec. 3.2.3), ``(B,)`` float32.

    A flow_sde step's mean moves with the velocity as d mu / d v = -(1 + a^2 / 2) dt (a the noise
    level, dt = sigma - sigma_next), so the normalised log-ratio's gradient
    (``guarded_log_ratio``) shrinks with the step, and a shifted schedule trains its short steps
    less. The paper weights each step's loss by 1 / dt; here that is divided by the mean step of
    a T-step schedule from 1 to 0, so a uniform schedule has every weight 1 and the loss keeps
    plain GRPO's scale (the gradient-clipping threshold means the same):

        w = 1 / (T dt)

    ``sigmas``, ``sigmas_next`` ``(B,)``: each sample's trained step; a zero-length step weighs 0.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}.")
    dt = (sigmas.float() - sigmas_next.float()).detach()
    return torch.where(dt > 0, 1.0 / (num_steps * dt.clamp_min(1e-12)), torch.zeros_like(dt))


def grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
    log_ratio: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-ratio loss for one trained timestep of B samples, in float32.

    ratio = exp(logp - logp_old)      (or exp(log_ratio) when given: GRPO-Guard's)
    L = mean(w max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps))) + beta mean(kl)

    ``weights`` w (B,) are constants, 1 when not given (GRPO-Guard's ``guard_timestep_weights``).

    ``log_prob`` (B,) carries the gradient; ``old_log_prob`` (B,) (from the rollout),
    ``advantages`` (B,) are constants. ``kl`` (B,) is the per-sample KL to the reference.
    ``log_ratio`` (B,), with gradient, replaces logp - logp_old (``guarded_log_ratio``).

    Stats (detached float32 scalars): ``policy_loss``, ``kl`` (when given),
    ``approx_kl`` = 0.5 mean(log(ratio)^2), ``clipfrac`` (|ratio - 1| > eps),
    ``clipfrac_high`` (ratio > 1 + eps), ``clipfrac_low`` (ratio < 1 - eps),
    ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``adv_abs_mean``.
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}.")
    if log_prob.ndim != 1 or old_log_prob.shape != log_prob.shape or advantages.shape != log_prob.shape:
        raise ValueError(
            f"log_prob, old_log_prob and advantages must all be (B,), got {tuple(log_prob.shape)}, "
            f"{tuple(old_log_prob.shape)} and {tuple(advantages.shape)}."
        )
    if log_ratio is not None and log_ratio.shape != log_prob.shape:
        raise ValueError(f"log_ratio must be (B,) like log_prob {tuple(log_prob.shape)}, got {tuple(log_ratio.shape)}.")
    if beta != 0 and kl is None:
        raise ValueError(f"beta={beta} weights a KL term, but no kl was given; pass kl or set beta to 0.")
    if weights is not None and weights.shape != log_prob.shape:
        raise ValueError(f"weights must be (B,) like log_prob {tuple(log_prob.shape)}, got {tuple(weights.shape)}.")

    log_prob = log_prob.float()
    old = old_log_prob.detach().float()
    adv = advantages.detach().float()
    delta = log_prob - old if log_ratio is None else log_ratio.float()
    ratio = torch.exp(delta)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_sample = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_sample = weights.detach().float() * per_sample
    policy_loss = per_sample.mean()
    loss = policy_loss

    stats = {"policy_loss": policy_loss.detach()}
    if kl is not None:
        if kl.shape != log_prob.shape:
            raise ValueError(f"kl must be (B,) like log_prob {tuple(log_prob.shape)}, got {tuple(kl.shape)}.")
        kl_mean = kl.float().mean()
        loss = loss + beta * kl_mean
        stats["kl"] = kl_mean.detach()

    with torch.no_grad():
        r = ratio.detach()
        stats["approx_kl"] = 0.5 * (delta.detach() ** 2).mean()
        stats["clipfrac"] = ((r - 1.0).abs() > clip_range).float().mean()
        stats["clipfrac_high"] = (r > 1.0 + clip_range).float().mean()
        stats["clipfrac_low"] = (r < 1.0 - clip_range).float().mean()
        stats["ratio_mean"] = r.mean()
        stats["ratio_min"] = r.min()
        stats["ratio_max"] = r.max()
        stats["adv_abs_mean"] = adv.abs().mean()
    return loss, stats


def select_train_timesteps(
    num_samples: int,
    num_steps: int,
    fraction: float,
    generator: torch.Generator | None,
    shuffle: bool = True,
) -> torch.Tensor:
    """Indices of the recorded timesteps each sample trains on, long ``(B, n_train)``.

    n_train = max(1, floor(num_steps * fraction)); the floor forgives float error of 1e-6,
    so 0.29 * 100 counts as 29, not 28. With ``shuffle`` every sample gets its own random
    permutation of 0..num_steps-1 (argsort of uniform noise from ``generator``)
    and keeps its first n_train entries, in that random order; without it every row is
    0..n_train-1. The result is on the CPU.
    """
    if num_samples < 1 or num_steps < 1:
        raise ValueError(f"num_samples and num_steps must be >= 1, got {num_samples} and {num_steps}.")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}.")
    n_train = max(1, int(num_steps * fraction + 1e-6))
    if not shuffle:
        return torch.arange(n_train).expand(num_samples, n_train).clone()
    device = generator.device if generator is not None else "cpu"
    noise = torch.rand(num_samples, num_steps, generator=generator, device=device)
    return noise.argsort(dim=1)[:, :n_train].cpu()
