"""Likelihood-free policy improvement on the forward (noising) process.

Two objectives that train on the *clean* samples of a rollout and their advantages, with
the plain flow-matching parameterisation, so they need no log-probs and work with any
sampler (ODE, SDE, CFG or not):

- DiffusionNFT (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with
  Forward Process", arXiv:2509.16117): the policy is pulled towards an implicit positive
  policy on good samples and away from an implicit negative one on bad samples.
- AWM (Xue et al. 2025, "Advantage Weighted Matching: Aligning RL with Pretraining in
  Diffusion Models"): the pretraining flow-matching loss weighted by the advantage.

At the sampling policy (v_theta = v_old) NFT's gradient equals AWM's: both are
A * grad ||v_theta - v_target||^2 (up to constants). They differ off-policy: NFT's loss
bounds how far v_theta moves from v_old along the improvement direction.

Convention (diffusers' ``FlowMatchEulerDiscreteScheduler``): x_t = (1 - sigma) x0 + sigma eps,
the model predicts v, the flow-matching target is v* = eps - x0, and x0 is recovered as
x0_hat = x_t - sigma v. Everything below runs in float32.
"""

from __future__ import annotations

import torch

from genrl.math.sde import expand_per_sample


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over every dim but the batch: ``(B, ...)`` -> ``(B,)``."""
    return x.mean(dim=tuple(range(1, x.ndim)))


def forward_noise(clean: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The forward process: x_t = (1 - sigma) x0 + sigma eps.

    ``clean`` and ``noise`` are ``(B, ...)``, ``sigma`` is ``(B,)`` in [0, 1]."""
    s = expand_per_sample(sigma.float(), clean)
    return (1 - s) * clean.float() + s * noise.float()


def optimality_weight(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """NFT's reward as an optimality probability: r = clip(A / (2 A_max) + 1/2, 0, 1), ``(B,)``.

    A = 0 gives 1/2 (the positive and negative terms cancel); |A| >= A_max is fully
    positive or fully negative."""
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}.")
    return (advantages.float() / (2 * adv_clip_max) + 0.5).clamp(0, 1)


def nft_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    noisy: torch.Tensor,
    clean: torch.Tensor,
    sigma: torch.Tensor,
    advantages: torch.Tensor,
    *,
    nft_beta: float,
    adv_clip_max: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT loss of B noised clean samples at one timestep each, float32.

    v+ = beta v_theta + (1 - beta) v_old            (implicit positive policy)
    v- = (1 + beta) v_old - beta v_theta            (implicit negative policy)
    x0+ = x_t - sigma v+,  x0- = x_t - sigma v-
    w+ = mean|x0+ - x0|,  w- = mean|x0- - x0|       (detached: adaptive per-sample weights)
    r = clip(A / (2 A_max) + 1/2, 0, 1)
    L = A_max / beta * mean_B[ r mean(x0+ - x0)^2 / w+ + (1 - r) mean(x0- - x0)^2 / w- ]

    The A_max / beta factor keeps the on-policy gradient at A * (x0_hat - x0) / w whatever
    the clip and beta (r - 1/2 = A / (2 A_max)). Shapes: ``velocity`` (with gradient),
    ``old_velocity`` (the sampling policy's, constant), ``noisy`` x_t and ``clean`` x0 are
    ``(B, ...)``; ``sigma`` and ``advantages`` are ``(B,)``.

    Stats (detached scalars): ``policy_loss``, ``old_deviation`` = mean (v_theta - v_old)^2,
    ``x0_error`` = mean (x0_hat - x0)^2 under v_theta, ``positive_weight`` = mean r,
    ``adv_abs_mean``.
    """
    if nft_beta <= 0:
        raise ValueError(f"nft_beta must be > 0, got {nft_beta}.")
    if velocity.shape != old_velocity.shape or velocity.shape != clean.shape or noisy.shape != clean.shape:
        raise ValueError(
            f"velocity, old_velocity, noisy and clean must have one shape; got {tuple(velocity.shape)}, "
            f"{tuple(old_velocity.shape)}, {tuple(noisy.shape)} and {tuple(clean.shape)}."
        )
    v = velocity.float()
    v_old = old_velocity.detach().float()
    x_t, x0 = noisy.detach().float(), clean.detach().float()
    s = expand_per_sample(sigma.detach().float(), x0)
    r = optimality_weight(advantages.detach(), adv_clip_max)

    x0_pos = x_t - s * (nft_beta * v + (1 - nft_beta) * v_old)
    x0_neg = x_t - s * ((1 + nft_beta) * v_old - nft_beta * v)
    w_pos = _per_sample_mean((x0_pos - x0).abs()).detach().clamp_min(1e-5)
    w_neg = _per_sample_mean((x0_neg - x0).abs()).detach().clamp_min(1e-5)
    per_sample = r * _per_sample_mean((x0_pos - x0) ** 2) / w_pos + (1 - r) * _per_sample_mean((x0_neg - x0) ** 2) / w_neg
    loss = (adv_clip_max / nft_beta) * per_sample.mean()

    with torch.no_grad():
        stats = {
            "policy_loss": loss.detach(),
            "old_deviation": ((v - v_old) ** 2).mean(),
            "x0_error": ((x_t - s * v - x0) ** 2).mean(),
            "positive_weight": r.mean(),
            "adv_abs_mean": advantages.detach().float().abs().mean(),
        }
    return loss, stats


def awm_loss(
    velocity: torch.Tensor,
    noisy: torch.Tensor,
    clean: torch.Tensor,
    noise: torch.Tensor,
    advantages: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantage-weighted flow matching of B noised clean samples at one timestep each, float32.

    L = mean_B[ A mean((v_theta - (eps - x0))^2) ]

    Good samples (A > 0) are fitted like pretraining data, bad ones (A < 0) pushed away;
    the clipped advantages bound the push. Shapes: ``velocity`` (with gradient), ``noisy``,
    ``clean`` and ``noise`` ``(B, ...)``; ``advantages`` ``(B,)``.

    Stats (detached scalars): ``policy_loss``, ``fm_error`` = mean (v_theta - v*)^2, ``adv_abs_mean``.
    """
    if velocity.shape != clean.shape or noise.shape != clean.shape or noisy.shape != clean.shape:
        raise ValueError(
            f"velocity, noisy, clean and noise must have one shape; got {tuple(velocity.shape)}, "
            f"{tuple(noisy.shape)}, {tuple(clean.shape)} and {tuple(noise.shape)}."
        )
    target = noise.detach().float() - clean.detach().float()
    error = _per_sample_mean((velocity.float() - target) ** 2)
    adv = advantages.detach().float()
    loss = (adv * error).mean()
    with torch.no_grad():
        stats = {"policy_loss": loss.detach(), "fm_error": error.mean(), "adv_abs_mean": adv.abs().mean()}
    return loss, stats


def soft_update_decay(step: int, rate: float, cap: float) -> float:
    """DiffusionNFT's soft update of the sampling ("old") policy: after optimizer step ``step``
    (1-based), theta_old <- eta theta_old + (1 - eta) theta with

        eta_i = min(rate * i, cap).

    ``rate`` 0 keeps the sampling policy equal to the trained one (fully on-policy, eta = 0);
    early steps follow the trained weights closely and later ones lag them by up to ``cap``,
    which DiffusionNFT found both faster and steadier than either extreme (rate 0.001, cap 0.5)."""
    if rate < 0 or not 0 <= cap < 1:
        raise ValueError(f"the soft update needs rate >= 0 and 0 <= cap < 1, got rate {rate} and cap {cap}.")
    return min(rate * step, cap)


def velocity_kl(velocity: torch.Tensor, ref_velocity: torch.Tensor) -> torch.Tensor:
    """Per-sample squared distance to the reference velocity, mean((v_theta - v_ref)^2), ``(B,)``:
    the KL of the two forward-process policies up to a sigma-dependent factor."""
    return _per_sample_mean((velocity.float() - ref_velocity.detach().float()) ** 2)
