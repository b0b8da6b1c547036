"""Stochastic sampling steps for flow-matching models, with exact Gaussian log-probs.

The scheduler convention is diffusers' ``FlowMatchEulerDiscreteScheduler``:
``x_t = (1 - sigma) * x0 + sigma * eps`` and the model predicts the velocity ``v``.
A denoising step goes from ``sigma`` to ``sigma_next < sigma``; ``dt = sigma_next - sigma``.

Every line here runs in float32 whatever the model dtype: log-prob ratios of bf16
arithmetic are noise, not signal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from genrl.data.seeding import host_to_device

SDE_TYPES = ("flow_sde", "flow_cps")
# How deterministic (noise 0) steps integrate the ODE: Euler (diffusers' scheduler) or the
# two-step Adams-Bashforth method (second order, still one model call per step).
ODE_SOLVERS = ("euler", "ab2")
# transition: the KL of the two Gaussian transitions, divided by 2 (std_t sqrt|dt|)^2 (Flow-GRPO's
# Wan script, Flash-GRPO). sde_variance: divided by 2 std_t^2 (Flow-GRPO's SD3 script), i.e. the
# transition KL times |dt|: 5-20x weaker at 10 steps for the same beta.
KL_FORMS = ("transition", "sde_variance")

# Smallest std that may reach a division: its square is still a normal float32.
# (Clamping at `tiny` itself does not help: tiny**2 underflows to 0.)
MIN_STD = math.sqrt(torch.finfo(torch.float32).tiny)

Generators = Union[torch.Generator, Sequence[torch.Generator], None]


@dataclass
class SDEStepOutput:
    """Result of one step. Shapes: ``next_sample``/``mean`` like the input ``(B, ...)``;
    ``log_prob`` and ``std`` are ``(B,)``. ``std`` is the std of ``next_sample`` given the
    input (0 for a deterministic step)."""

    next_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def _per_sample(value: Union[float, torch.Tensor], batch: int, device: torch.device) -> torch.Tensor:
    """A scalar or ``(B,)`` sigma as a float32 ``(B,)`` tensor."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    return t.expand(batch).clone() if t.ndim == 0 else t.reshape(batch)


def expand_per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``(B,)`` -> ``(B, 1, ..., 1)`` broadcastable against ``like``."""
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def randn_like_per_sample(x: torch.Tensor, generator: Generators) -> torch.Tensor:
    """Standard normal noise shaped like ``x`` (float32, on ``x.device``).

    With a list of generators, sample ``i`` draws its own noise from ``generator[i]`` on
    the generator's device, so a sample's noise does not depend on the batch it sits in.
    """
    if isinstance(generator, (list, tuple)):
        if len(generator) != x.shape[0]:
            raise ValueError(f"Got {len(generator)} generators for a batch of {x.shape[0]} samples.")
        noise = [torch.randn(x.shape[1:], generator=g, device=g.device, dtype=torch.float32) for g in generator]
        return host_to_device(torch.stack(noise), x.device)
    device = generator.device if generator is not None else x.device
    return host_to_device(torch.randn(x.shape, generator=generator, device=device, dtype=torch.float32), x.device)


def flow_sde_std(sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float, sigma_max: float) -> torch.Tensor:
    """Diffusion coefficient of the Flow-GRPO SDE, ``(B,)``.

    std_t = a * sqrt(sigma / (1 - sigma_hat)), sigma_hat = sigma except sigma == 1 -> sigma_max
    (the schedule's second sigma, so the first step stays finite). A step to sigma_next == 0
    is deterministic: std_t = 0.
    """
    sigma_hat = torch.where(sigma >= 1.0, torch.full_like(sigma, sigma_max), sigma)
    std = noise_level * torch.sqrt(sigma / (1.0 - sigma_hat))
    return torch.where(sigma_next > 0, std, torch.zeros_like(std))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Mean over non-batch dims of log N(x; mean, s^2):
    -(x - mean)^2 / (2 s^2) - log s - log sqrt(2 pi).

    ``std`` is ``(B,)``; a zero std (deterministic step) gives log-prob 0 and is never divided
    by; a tiny nonzero std is clamped at ``MIN_STD`` so s^2 cannot underflow.
    """
    s = expand_per_sample(std.clamp_min(MIN_STD), x)
    lp = -((x - mean) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    lp = lp.mean(dim=tuple(range(1, x.ndim)))
    return torch.where(std > 0, lp, torch.zeros_like(lp))


def sde_step_with_logprob(
    velocity: torch.Tensor,
    sigma: Union[float, torch.Tensor],
    sigma_next: Union[float, torch.Tensor],
    sample: torch.Tensor,
    *,
    noise_level: float,
    sde_type: str = "flow_sde",
    sigma_max: float = 1.0,
    next_sample: torch.Tensor | None = None,
    generator: Generators = None,
) -> SDEStepOutput:
    """One stochastic step ``sample`` (sigma) -> ``next_sample`` (sigma_next) and its log-prob.

    Args:
        velocity: model output v, ``(B, ...)``.
        sigma, sigma_next: scalars or ``(B,)``.
        sample: current latents x, ``(B, ...)``.
        noise_level: ``a`` in the formulas; 0 gives the deterministic Euler / DDIM step.
        sde_type: ``"flow_sde"`` or ``"flow_cps"``.
        sigma_max: the schedule's second sigma, replacing sigma == 1 in ``flow_sde``.
        next_sample: when given, it is scored instead of drawing a new sample.
        generator: one generator, one per sample, or None.

    flow_sde: mean = x + [v + std_t^2 / (2 sigma) * (x + (1 - sigma) v)] * dt,
              x' = mean + std_t * sqrt(-dt) * eps, s = std_t * sqrt(-dt).
    flow_cps: s = sigma' sin(a pi / 2), x0 = x - sigma v, x1 = x + (1 - sigma) v,
              mean = x0 (1 - sigma') + x1 sqrt(sigma'^2 - s^2), x' = mean + s eps,
              log p = -mean((x' - mean)^2)   (constants dropped).
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"Unknown sde_type {sde_type!r}; expected one of {SDE_TYPES}.")
    x = sample.float()
    v = velocity.float()
    batch = x.shape[0]
    sigma_t = _per_sample(sigma, batch, x.device)
    sigma_n = _per_sample(sigma_next, batch, x.device)
    sig, sig_n = expand_per_sample(sigma_t, x), expand_per_sample(sigma_n, x)

    if sde_type == "flow_sde":
        dt = sig_n - sig
        std_t = expand_per_sample(flow_sde_std(sigma_t, sigma_n, noise_level, sigma_max), x)
        mean = x + (v + std_t**2 / (2 * sig) * (x + (1 - sig) * v)) * dt
        std = (std_t * torch.sqrt(-dt)).reshape(batch)
    else:
        std = sigma_n * math.sin(noise_level * math.pi / 2)
        s = expand_per_sample(std, x)
        x0 = x - sig * v
        x1 = x + (1 - sig) * v
        mean = x0 * (1 - sig_n) + x1 * torch.sqrt((sig_n**2 - s**2).clamp_min(0))

    if next_sample is None:
        next_sample = mean + expand_per_sample(std, x) * randn_like_per_sample(x, generator)
    next_sample = next_sample.float()

    if sde_type == "flow_sde":
        log_prob = gaussian_log_prob(next_sample, mean, std)
    else:
        log_prob = -((next_sample - mean) ** 2).mean(dim=tuple(range(1, x.ndim)))
        log_prob = torch.where(std > 0, log_prob, torch.zeros_like(log_prob))
    return SDEStepOutput(next_sample=next_sample, log_prob=log_prob, mean=mean, std=std)


def adams_bashforth2_velocity(
    velocity: torch.Tensor, prev_velocity: torch.Tensor, dt: float | torch.Tensor, dt_prev: float | torch.Tensor
) -> torch.Tensor:
    """The velocity an Euler step should take to make a two-step Adams-Bashforth step of the
    ODE dx/dsigma = v on a non-uniform grid (second order, one model call per step):

        x_{n+1} = x_n + dt_n [(1 + r/2) v_n - (r/2) v_{n-1}],   r = dt_n / dt_{n-1},

    i.e. v_eff = v_n + (r/2) (v_n - v_{n-1}). ``velocity`` v_n and ``prev_velocity`` v_{n-1}
    are ``(B, ...)``; ``dt`` and ``dt_prev`` (sigma_next - sigma of this and of the previous
    step, both negative when denoising) are scalars or 0-d tensors (kept on the device: no sync
    in the denoising loop). Float32."""
    v = velocity.float()
    r = torch.as_tensor(dt, dtype=torch.float32, device=v.device) / torch.as_tensor(dt_prev, dtype=torch.float32, device=v.device)
    return v + 0.5 * r * (v - prev_velocity.float())


def kl_between_means(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL of two Gaussians sharing std s, per sample ``(B,)``:
    mean over non-batch dims of (mean - ref_mean)^2 / (2 s^2), s clamped at ``MIN_STD``."""
    s = expand_per_sample(std.float().clamp_min(MIN_STD), mean)
    kl = ((mean.float() - ref_mean.float()) ** 2) / (2 * s**2)
    kl = kl.mean(dim=tuple(range(1, mean.ndim)))
    return torch.where(std > 0, kl, torch.zeros_like(kl))


def kl_in_form(kl: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, form: str) -> torch.Tensor:
    """The per-sample transition KL ``(B,)`` (``kl_between_means``) in the convention ``form``:
    ``transition`` leaves it, KL = mean((mean - ref_mean)^2) / (2 (std_t sqrt|dt|)^2);
    ``sde_variance`` gives mean((mean - ref_mean)^2) / (2 std_t^2) = KL |dt|, dt = sigma' - sigma."""
    if form not in KL_FORMS:
        raise ValueError(f"Unknown KL form {form!r}; expected one of {KL_FORMS}.")
    if form == "transition":
        return kl
    return kl * (sigma.float() - sigma_next.float()).abs().to(kl.device)
