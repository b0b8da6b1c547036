"""The denoising loop that records trajectories, for every model family.

One loop, one SDE step (``genrl.math.sde.sde_step_with_logprob``) at every timestep: stochastic
steps (inside the SDE window, noise level > 0, sigma' > 0) draw noise and are recorded for
training; the others run with noise level 0 (the plain Euler / DDIM step) and are not.

Every random draw of a sample comes from its own generators (``genrl.data.seeding``), and each
sample's noise generator advances exactly once per step, so a sample's trajectory is a
function of (seed, epoch, prompt, conditioning image if any, index in its group) alone, whatever
batch it sits in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Callable, Sequence

import torch

from genrl.data.prompt_images import image_digests
from genrl.data.seeding import host_to_device, latent_generator, noise_generator, window_generator
from genrl.math.sde import ODE_SOLVERS, SDE_TYPES, SDEStepOutput, adams_bashforth2_velocity, sde_step_with_logprob
from genrl.policies.base import FlowPolicy


@dataclass
class SamplingConfig:
    """How rollouts are sampled.

    noise_level: ``a`` of the SDE (0 = deterministic sampling, nothing recorded).
    sde_window_size: number of consecutive stochastic steps per sample; 0 = every step
        (with sigma' > 0) is stochastic.
    sde_window_range: ``(lo, hi)``; the window start is drawn in ``[lo, hi - window_size]``,
        shared by a prompt's group. ``hi = None`` (or beyond) means the last step with
        sigma' > 0, i.e. ``num_inference_steps - 1``.
    sde_window_shift_every: 0 (default) draws each group's window start at random (Flow-GRPO-Fast);
        n > 0 slides one window shared by every prompt from ``lo`` towards the end, one step every
        n epochs, and leaves it at ``hi - window_size`` once there (MixGRPO's progressive window,
        ``progressive_window_start``).
    height, width, num_frames: None = the policy's defaults.
    same_latent: the K samples of a prompt start from the same initial noise.
    record_means: also keep each recorded step's SDE mean (GRPO-Guard's ratio needs it; one
        more latent per recorded step, so off unless asked).
    ode_solver: how deterministic steps integrate: "euler", or "ab2" (two-step Adams-Bashforth,
        ``genrl.math.sde.adams_bashforth2_velocity``) after a deterministic step of the same sample
        (Euler after a stochastic one, and at the first step). Stochastic steps are always the SDE's.
    decode_batch_size: samples per VAE decode call, every call of exactly this many rows (the
        last chunk padded, ``decode_in_chunks``), so a decoded sample does not depend on how the
        batch was laid out over processes, whatever the size. 1 (the default) bounds the VAE's
        memory (a video VAE's activations dwarf the transformer's at large frame counts); more is
        faster for images, with samples equal to those of size 1 to float rounding.
    """

    num_inference_steps: int = 16
    guidance_scale: float = 4.5
    noise_level: float = 0.7
    sde_type: str = "flow_sde"
    sde_window_size: int = 0
    sde_window_range: tuple[int, int | None] = (0, None)
    sde_window_shift_every: int = 0
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    same_latent: bool = True
    negative_prompt: str = ""
    record_means: bool = False
    ode_solver: str = "euler"
    decode_batch_size: int = 1

    def __post_init__(self):
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"Unknown sde_type {self.sde_type!r}; expected one of {SDE_TYPES}.")
        if self.ode_solver not in ODE_SOLVERS:
            raise ValueError(f"Unknown ode_solver {self.ode_solver!r}; expected one of {ODE_SOLVERS}.")
        if self.noise_level < 0:
            raise ValueError(f"noise_level must be >= 0; got {self.noise_level}.")
        if self.decode_batch_size < 1:
            raise ValueError(f"decode_batch_size must be >= 1; got {self.decode_batch_size}.")
        if self.sde_window_size < 0:
            raise ValueError(f"sde_window_size must be >= 0 (0 = every step); got {self.sde_window_size}.")
        if self.sde_window_shift_every < 0:
            raise ValueError(f"sde_window_shift_every must be >= 0 (0 = a random window); got {self.sde_window_shift_every}.")
        if self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be at least 1; got {self.num_inference_steps}.")


@dataclass
class Rollout:
    """Recorded trajectories of B samples, S stochastic steps each (the same S for all).

    latents, next_latents: ``(B, S, ...)`` float32, the state before / after each recorded step.
    means: ``(B, S, ...)`` float32, the sampling policy's SDE mean of each recorded step (for
        GRPO-Guard's ratio normalisation, ``genrl.math.grpo.guarded_log_ratio``); None unless the
        config's ``record_means``.
    timesteps, sigmas, sigmas_next, log_probs: ``(B, S)`` float32.
    step_indices: ``(B, S)`` long, which denoising step each record is.
    sigma_max: the schedule's second sigma (see ``genrl.math.sde.flow_sde_std``).
    embeds: the prompt embeddings, ``(B, ...)`` each.
    image_ids: each sample's conditioning-image digest (``genrl.data.prompt_images.image_digest``),
        part of its seeds as of its prompt; None for text-only samples.
    final_latents: ``(B, ...)`` float32, the clean latents x0 the sampler ended at (what the
        likelihood-free objectives train on).
    samples: decoded ``(B, C, F, H, W)`` float in [0, 1], on the CPU.
    decode_seconds: time spent in the VAE decode (summed when rollouts are joined).
    """

    prompts: list[str]
    group_indices: list[int]
    latents: torch.Tensor
    next_latents: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    sigmas_next: torch.Tensor
    log_probs: torch.Tensor
    step_indices: torch.Tensor
    sigma_max: float
    means: torch.Tensor | None = None
    embeds: dict[str, torch.Tensor] = field(default_factory=dict)
    final_latents: torch.Tensor | None = None
    samples: torch.Tensor | None = None
    decode_seconds: float = 0.0
    image_ids: list[int] | None = None

    @property
    def num_steps(self) -> int:
        """S, the number of recorded steps per sample."""
        return self.log_probs.shape[1]

    def transitions(self, idx: torch.Tensor, steps: torch.Tensor) -> "Transitions":
        """The recorded steps ``steps`` ``(b,)`` (columns of the ``(B, S)`` records) of samples
        ``idx`` ``(b,)``, one transition per pair."""
        return Transitions(
            latents=self.latents[idx, steps],
            next_latents=self.next_latents[idx, steps],
            timesteps=self.timesteps[idx, steps],
            sigmas=self.sigmas[idx, steps],
            sigmas_next=self.sigmas_next[idx, steps],
            embeds={k: v[idx.to(v.device)] for k, v in self.embeds.items()},
            sigma_max=self.sigma_max,
        )

    def all_transitions(self) -> "Transitions":
        """Every recorded step of every sample as one batch of B * S transitions, sample-major."""
        samples = torch.arange(len(self.prompts)).repeat_interleave(self.num_steps)
        return self.transitions(samples, torch.arange(self.num_steps).repeat(len(self.prompts)))


@dataclass(frozen=True)
class Transitions:
    """A batch of b recorded SDE transitions, each of its own sample and step.

    latents, next_latents: ``(b, ...)`` the state before / after the step.
    timesteps, sigmas, sigmas_next: ``(b,)`` where each transition sits in its schedule.
    embeds: the prompt embeddings of each transition's sample, ``(b, ...)`` each.
    sigma_max: the schedule's second sigma (see ``genrl.math.sde.flow_sde_std``).
    """

    latents: torch.Tensor
    next_latents: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    sigmas_next: torch.Tensor
    embeds: dict[str, torch.Tensor]
    sigma_max: float


@dataclass(frozen=True)
class StepRecord:
    """One recorded stochastic step of one sample, before it is stacked into a ``Rollout``.

    latents, next_latents: ``(...)`` the state before / after the step (one sample's).
    step: which denoising step it is (0-based, of ``num_inference_steps``).
    log_prob: ``()`` the step's log-prob.
    mean: ``(...)`` the step's SDE mean, or None unless the config's ``record_means``.
    """

    latents: torch.Tensor
    next_latents: torch.Tensor
    step: int
    log_prob: torch.Tensor
    mean: torch.Tensor | None


def progressive_window_start(epoch: int, lo: int, last_start: int, shift_every: int) -> int:
    """MixGRPO's sliding SDE window (Li et al. 2025, arXiv:2507.21802): it starts at the
    highest-noise step ``lo`` and moves one step towards the clean end every ``shift_every``
    epochs, then stays at ``last_start``:

        start = min(lo + floor(epoch / shift_every), last_start)
    """
    return min(lo + epoch // shift_every, last_start)


def sde_window_start(
    prompt: str, seed: int, epoch: int, num_inference_steps: int, config: SamplingConfig, image_id: int | None = None
) -> int:
    """First stochastic step of ``prompt``'s group (with its image, ``image_id``): uniform in
    [lo, hi - window_size], or the progressive window's start of this epoch
    (``config.sde_window_shift_every`` > 0)."""
    lo, hi = config.sde_window_range
    last = num_inference_steps - 1  # the final step goes to sigma' = 0 and is never stochastic
    hi = last if hi is None else min(hi, last)
    size = config.sde_window_size
    if lo < 0 or hi - lo < size:
        raise ValueError(
            f"sde_window_range={config.sde_window_range} cannot hold a window of {size} steps among the"
            f" {last} stochastic-capable steps of {num_inference_steps}; need 0 <= lo and hi - lo >= window size."
        )
    if config.sde_window_shift_every > 0:
        return progressive_window_start(epoch, lo, hi - size, config.sde_window_shift_every)
    generator = window_generator(prompt, seed, epoch, image_id)
    return int(torch.randint(lo, hi - size + 1, (1,), generator=generator))


def stochastic_steps(
    prompts: Sequence[str], sigmas: torch.Tensor, *, seed: int, epoch: int, config: SamplingConfig,
    image_ids: Sequence[int] | None = None,
) -> torch.Tensor:
    """``(B, T)`` bool on the CPU: step i of sample b is stochastic iff noise_level > 0,
    sigma_{i+1} > 0 and i lies in the sample's SDE window (``image_ids``: the samples' image
    digests, None for text-only ones)."""
    num_steps = sigmas.numel() - 1
    can_move = (sigmas[1:] > 0).cpu() & (config.noise_level > 0)
    mask = can_move.expand(len(prompts), num_steps).clone()
    if config.sde_window_size > 0:
        steps = torch.arange(num_steps)
        ids = [None] * len(prompts) if image_ids is None else image_ids
        for b, (prompt, image_id) in enumerate(zip(prompts, ids)):
            start = sde_window_start(prompt, seed, epoch, num_steps, config, image_id)
            mask[b] &= (steps >= start) & (steps < start + config.sde_window_size)
    return mask


@dataclass(frozen=True)
class SampleBatch:
    """The B samples to draw, and all that decides each one's noise (``genrl.data.seeding``).

    prompts: each sample's prompt; group_indices: its index within its prompt's group.
    seed, epoch: the run's seed and the epoch (evaluation: its own seed, epoch 0).
    images: image-conditioned policies' conditioning image of each sample
        (``genrl.data.prompt_images``), encoded into the embeddings (once per distinct image) and,
        by its content's digest, part of the sample's seeds, so that records of one text and
        different images draw their own noise; None for the text-only ones.
    """

    prompts: list[str]
    group_indices: list[int]
    seed: int
    epoch: int
    images: Sequence | None = None


@torch.no_grad()
def sample_rollout(
    policy: FlowPolicy,
    transformer: torch.nn.Module,
    spec: SampleBatch,
    *,
    config: SamplingConfig,
    device: torch.device | str,
    initial_latents: torch.Tensor | None = None,
    on_step: Callable[[torch.Tensor, torch.Tensor, dict, torch.Tensor], None] | None = None,
) -> Rollout:
    """Sample ``spec`` with ``transformer`` and record every stochastic step. Decoded samples
    land on the CPU.

    ``initial_latents`` ``(B, *latent_shape)`` replaces the per-sample initial noise (evaluation
    draws its own, sequentially from one generator); the SDE noise still comes from the
    per-sample generators. ``on_step(latents, timesteps, embeds, velocity)`` is called at every
    step with the state ``(B, ...)``, its timesteps ``(B,)``, the prompt embeddings and the
    model's (guided) velocity there (the reward watch measures drift from the reference there;
    with ``ode_solver="ab2"`` a deterministic step moves along a blend of it and the previous one)."""
    prompts, group_indices, seed, epoch, images = spec.prompts, spec.group_indices, spec.seed, spec.epoch, spec.images
    if len(prompts) != len(group_indices) or not prompts:
        raise ValueError(
            f"Need one group index per prompt; got {len(prompts)} prompts and {len(group_indices)} indices."
        )
    batch = len(prompts)
    height, width, num_frames = policy.resolve_size(config.height, config.width, config.num_frames)
    embeds = policy.encode_conditioning(prompts, images, height, width, num_frames, device, config.guidance_scale,
                                        config.negative_prompt)

    image_ids = image_digests(images) if images is not None else None
    sample_ids = list(zip(prompts, group_indices, image_ids or [None] * batch))
    latent_generators = [latent_generator(p, seed, epoch, k, config.same_latent, i) for p, k, i in sample_ids]
    noise_generators = [noise_generator(p, seed, epoch, k, i) for p, k, i in sample_ids]
    if initial_latents is None:
        latents = policy.prepare_latents(latent_generators, height, width, num_frames, device)
    else:
        expected = (batch, *policy.latent_shape(height, width, num_frames))
        if tuple(initial_latents.shape) != expected:
            raise ValueError(f"initial_latents must be {expected}, got {tuple(initial_latents.shape)}.")
        latents = initial_latents.to(device=device, dtype=torch.float32)
    timesteps, sigmas = policy.timesteps_and_sigmas(config.num_inference_steps, latents, device)
    sigma_max = float(sigmas[1])
    stochastic = stochastic_steps(prompts, sigmas, seed=seed, epoch=epoch, config=config, image_ids=image_ids)

    records: list[list[StepRecord]] = [[] for _ in range(batch)]
    prev_velocity = None
    for i in range(len(timesteps)):
        t = timesteps[i].expand(batch)
        velocity = policy.predict_velocity(transformer, latents, t, embeds, config.guidance_scale)
        if on_step is not None:
            on_step(latents, t, embeds, velocity)
        step_velocity = velocity
        if config.ode_solver == "ab2" and i > 0:  # after a deterministic step: second order
            multistep = (~stochastic[:, i] & ~stochastic[:, i - 1]).view(-1, *([1] * (velocity.ndim - 1)))
            ab2 = adams_bashforth2_velocity(velocity, prev_velocity, sigmas[i + 1] - sigmas[i], sigmas[i] - sigmas[i - 1])
            step_velocity = torch.where(host_to_device(multistep, velocity.device), ab2.to(velocity.dtype), velocity)
        prev_velocity = velocity
        next_latents = torch.empty_like(latents)
        for is_stochastic in (False, True):
            rows = (stochastic[:, i] == is_stochastic).nonzero().flatten().tolist()
            if not rows:
                continue
            # Every row (the usual case): whole tensors; some: an index copied to the device
            # without waiting for the GPU (a Python list would be copied with a wait).
            index = slice(None) if len(rows) == batch else host_to_device(torch.tensor(rows), latents.device)
            out = sde_step_with_logprob(
                step_velocity[index],
                sigmas[i],
                sigmas[i + 1],
                latents[index],
                noise_level=config.noise_level if is_stochastic else 0.0,
                sde_type=config.sde_type,
                sigma_max=sigma_max,
                generator=[noise_generators[r] for r in rows],  # one draw per sample per step
            )
            next_latents[index] = out.next_sample
            if is_stochastic:
                for j, r in enumerate(rows):
                    mean = out.mean[j] if config.record_means else None
                    records[r].append(StepRecord(latents[r], out.next_sample[j], i, out.log_prob[j], mean))
        latents = next_latents

    latents = policy.finish_latents(latents, embeds)
    decode_start = time.perf_counter()
    samples = decode_in_chunks(policy.decode, latents, config.decode_batch_size)
    decode_seconds = time.perf_counter() - decode_start
    state_shape = latents.shape[1:]
    del next_latents, velocity, step_velocity, prev_velocity
    recorded, next_recorded, log_probs, means, steps = _stack_records(records, state_shape, timesteps.device)
    return Rollout(
        prompts=list(prompts),
        group_indices=list(group_indices),
        latents=recorded,
        next_latents=next_recorded,
        timesteps=timesteps[steps],
        sigmas=sigmas[steps],
        sigmas_next=sigmas[steps + 1],
        log_probs=log_probs,
        step_indices=steps,
        sigma_max=sigma_max,
        means=means,
        embeds=embeds,
        final_latents=latents,
        samples=samples,
        decode_seconds=decode_seconds,
        image_ids=image_ids,
    )


def decode_in_chunks(decode: Callable[[torch.Tensor], torch.Tensor], latents: torch.Tensor, chunk: int) -> torch.Tensor:
    """``decode`` of ``latents`` ``(B, ...)`` in calls of exactly ``chunk`` rows, straight to the CPU.

    The last chunk is padded with copies of its last row and the padding dropped: every call has
    one shape, so the kernels (and their summation order) do not change with B, and a sample
    decodes to the same bits whatever rows share its call. That keeps samples independent of how
    a batch is split over processes at any ``chunk``, as one row at a time does."""
    out = []
    for start in range(0, len(latents), chunk):
        part = latents[start : start + chunk]
        rows = len(part)
        if rows < chunk:
            part = torch.cat([part, part[-1:].expand(chunk - rows, *part.shape[1:])])
        out.append(decode(part)[:rows].detach().cpu())
    return torch.cat(out)


def _stack_records(
    records: list[list[StepRecord]], state_shape: torch.Size, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-sample lists of ``StepRecord`` -> batch-first (latents, next_latents, log_probs,
    means, step indices): ``(B, S, ...)``, ``(B, S, ...)``, ``(B, S)``, ``(B, S, ...)`` or None,
    ``(B, S)`` long."""
    counts = {len(r) for r in records}
    if len(counts) != 1:
        raise RuntimeError(f"Samples recorded different numbers of stochastic steps: {sorted(counts)}.")
    steps = torch.tensor([[rec.step for rec in r] for r in records], dtype=torch.long, device=device)
    steps = steps.reshape(len(records), -1)
    if counts == {0}:  # deterministic sampling: nothing to train on, shapes kept consistent
        latents = next_latents = means = torch.empty(len(records), 0, *state_shape, device=device)
        return latents, next_latents, torch.empty(len(records), 0, device=device), means, steps
    latents = torch.stack([torch.stack([rec.latents for rec in r]) for r in records])
    next_latents = torch.stack([torch.stack([rec.next_latents for rec in r]) for r in records])
    log_probs = torch.stack([torch.stack([rec.log_prob for rec in r]) for r in records])
    means = torch.stack([torch.stack([rec.mean for rec in r]) for r in records]) if records[0][0].mean is not None else None
    return latents, next_latents, log_probs, means, steps


def step_log_prob(
    policy: FlowPolicy, transformer: torch.nn.Module, batch: Transitions, *, config: SamplingConfig
) -> SDEStepOutput:
    """Log-prob (and mean, std) of the recorded transitions ``batch`` (latents -> next_latents)
    under the current weights of ``transformer``, with gradients. The transitions may sit at
    different steps. CFG as ``config.guidance_scale`` asks."""
    velocity = policy.predict_velocity(transformer, batch.latents, batch.timesteps, batch.embeds, config.guidance_scale)
    return sde_step_with_logprob(
        velocity,
        batch.sigmas,
        batch.sigmas_next,
        batch.latents,
        noise_level=config.noise_level,
        sde_type=config.sde_type,
        sigma_max=batch.sigma_max,
        next_sample=batch.next_latents,
    )


def index_rollout(rollout: Rollout, index: Sequence[int] | torch.Tensor) -> Rollout:
    """The samples ``index`` of ``rollout`` (embeds and samples included), in that order."""
    index = torch.as_tensor(index, dtype=torch.long).flatten().tolist()
    picked = {}
    for f in fields(Rollout):
        value = getattr(rollout, f.name)
        if f.name in ("prompts", "group_indices") or (f.name == "image_ids" and value is not None):
            picked[f.name] = [value[i] for i in index]
        elif f.name == "embeds":
            picked[f.name] = {k: v[index] for k, v in value.items()}
        elif isinstance(value, torch.Tensor):
            picked[f.name] = value[index]
        else:
            picked[f.name] = value
    return Rollout(**picked)


def concat_rollouts(rollouts: Sequence[Rollout]) -> Rollout:
    """Rollouts of the same sampling config, joined along the batch."""
    if not rollouts:
        raise ValueError("concat_rollouts needs at least one rollout.")
    sigma_maxes = {r.sigma_max for r in rollouts}
    if len(sigma_maxes) != 1:
        raise ValueError(f"Cannot join rollouts of different schedules (sigma_max {sorted(sigma_maxes)}).")
    joined = {}
    for f in fields(Rollout):
        values = [getattr(r, f.name) for r in rollouts]
        if f.name in ("prompts", "group_indices"):
            joined[f.name] = [v for value in values for v in value]
        elif f.name == "embeds":
            joined[f.name] = {k: torch.cat([v[k] for v in values]) for k in values[0]}
        elif f.name in ("samples", "final_latents", "means"):
            joined[f.name] = None if values[0] is None else torch.cat(values)
        elif f.name == "image_ids":
            joined[f.name] = None if values[0] is None else [v for value in values for v in value]
        elif f.name == "decode_seconds":
            joined[f.name] = sum(values)
        elif isinstance(values[0], torch.Tensor):
            joined[f.name] = torch.cat(values)
        else:
            joined[f.name] = values[0]
    return Rollout(**joined)
