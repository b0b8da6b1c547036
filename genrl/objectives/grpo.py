"""``--objective grpo`` (Flow-GRPO / DanceGRPO): the clipped-ratio loss of the recorded SDE
transitions of a rollout (``genrl.math.grpo.grpo_loss`` of their recomputed log-probs), at each
sample's own shuffled ``--timestep_fraction`` of its stochastic steps."""

from __future__ import annotations

import argparse

import torch

from genrl.math.grpo import grpo_loss, guard_timestep_weights, guarded_log_ratio, select_train_timesteps
from genrl.math.sde import kl_between_means, kl_in_form
from genrl.objectives.base import EpochUpdate, Objective, UpdateConfig, check_soft_update_flags, reference_model
from genrl.policies.base import FlowPolicy
from genrl.training.rollout import Rollout, SamplingConfig, step_log_prob


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
    (``genrl.math.sde.kl_in_form``). ``guard``: GRPO-Guard's normalised ratio
    (``genrl.math.grpo.guarded_log_ratio``; needs the rollout's recorded means, flow_sde steps).
    ``reweight``: GRPO-Guard's per-timestep weights 1 / (T dt) (``genrl.math.grpo.guard_timestep_weights``)."""
    batch = rollout.transitions(idx, steps)
    out = step_log_prob(policy, model, batch, config=config)
    kl = None
    if beta > 0:
        with torch.no_grad(), reference_model(model, frozen_reference) as ref:
            ref_out = step_log_prob(policy, ref, batch, config=config)
        kl = kl_in_form(kl_between_means(out.mean, ref_out.mean, out.std), batch.sigmas, batch.sigmas_next, kl_form)
    old = rollout.log_probs[idx, steps].to(out.log_prob.device)
    log_ratio = None
    if guard:
        if rollout.means is None or config.sde_type != "flow_sde":
            raise ValueError("GRPO-Guard's ratio needs the rollout's recorded SDE means of flow_sde steps.")
        old_mean = rollout.means[idx, steps].to(out.mean.device)
        log_ratio = guarded_log_ratio(out.log_prob, old, out.mean, old_mean, out.std)
    weights = None
    if reweight:
        weights = guard_timestep_weights(batch.sigmas, batch.sigmas_next, config.num_inference_steps).to(out.log_prob.device)
    adv = advantages[idx].to(out.log_prob.device)
    return grpo_loss(out.log_prob, old, adv, clip_range, kl=kl, beta=beta, log_ratio=log_ratio, weights=weights)


def informative_rows(
    idx: torch.Tensor, steps: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """GRPO without a KL term: the samples of micro batch ``idx`` ``(b,)`` whose advantage is
    non-zero, their recorded ``steps`` ``(b,)``, and the factor b'/b that keeps the loss the
    micro batch's mean (``advantages`` ``(B,)``, the whole rollout's):

        L = (1/b) sum_i l_i = (b'/b) (1/b') sum_{i: A_i != 0} l_i,

    since l_i = max(-A_i r_i, -A_i clip(r_i)) and its gradient are 0 when A_i = 0, whatever the
    ratio r_i. So the zero-advantage samples (the padding of ``--filter_zero_advantage``, whole
    groups of equal rewards) cost no forward pass. With no informative sample: the first one
    and factor 0, so that every rank still runs its backward pass (DDP and ZeRO reduce there)."""
    nonzero = advantages[idx] != 0
    if not bool(nonzero.any()):
        return idx[:1], steps[:1], 0.0
    return idx[nonzero], steps[nonzero], int(nonzero.sum()) / len(idx)



def check_guard_flags(args: argparse.Namespace, *, chosen: bool) -> None:
    """``--grpo_guard`` and ``--grpo_guard_reweight`` act on GRPO's ratio of flow_sde steps:
    refused with another objective (``chosen`` False) or another ``--sde_type``."""
    usable = chosen and args.sde_type == "flow_sde"
    if args.grpo_guard and not usable:
        raise ValueError(
            f"--grpo_guard normalises GRPO's ratio of flow_sde steps; it does not apply to --objective {args.objective} "
            f"with --sde_type {args.sde_type} (use --objective grpo --sde_type flow_sde, or drop --grpo_guard)."
        )
    if args.grpo_guard_reweight and not usable:
        raise ValueError(
            f"--grpo_guard_reweight weights GRPO's flow_sde steps by 1 / (T dt); it does not apply to --objective "
            f"{args.objective} with --sde_type {args.sde_type} (use --objective grpo --sde_type flow_sde, or drop it)."
        )


class GRPOObjective(Objective):
    """Trains on the rollout's recorded SDE transitions: needs ``--noise_level`` > 0 and samples
    from the trained weights (the ratio's old policy is the rollout's)."""

    own_args = ("clip_range", "kl_form", "no_timestep_shuffle", "grpo_guard", "grpo_guard_reweight")

    def check_args(self, args: argparse.Namespace) -> None:
        if args.num_inference_steps < 2:
            raise ValueError(
                "--objective grpo trains on stochastic steps and the last sampling step is always deterministic, "
                f"so it needs --num_inference_steps >= 2 (got {args.num_inference_steps})."
            )
        if not args.noise_level > 0:
            raise ValueError(
                f"--objective grpo trains on stochastic steps and needs --noise_level > 0 (got {args.noise_level}); "
                "--objective nft or awm train with any sampler, deterministic included."
            )
        check_guard_flags(args, chosen=True)
        check_soft_update_flags(args)
        if args.sampling_policy_decay_rate > 0:
            raise ValueError(
                "--sampling_policy_decay_rate soft-updates the sampling policy of --objective nft or awm; GRPO samples "
                "from the trained weights (its ratio's old policy is the rollout's)."
            )
        if args.train_sigma_range is not None:
            raise ValueError(
                "--train_sigma_range chooses the re-noised timesteps of --objective nft or awm; GRPO trains on its recorded "
                "SDE steps (choose them with --sde_window_size and --sde_window_range)."
            )

    def check_unused_args(self, args: argparse.Namespace) -> None:
        check_guard_flags(args, chosen=False)

    def timestep_pool(self, args: argparse.Namespace) -> int:
        """The recorded steps: the SDE window, or every step but the last (sigma' = 0)."""
        return args.sde_window_size or args.num_inference_steps - 1

    def draw_timesteps(
        self, num_samples: int, num_recorded_steps: int, config: UpdateConfig, generator: torch.Generator
    ) -> torch.Tensor:
        return select_train_timesteps(
            num_samples, num_recorded_steps, config.timestep_fraction, generator, shuffle=config.shuffle_timesteps
        )

    def loss(
        self, update: EpochUpdate, idx: torch.Tensor, timestep: torch.Tensor, *, old_is_current: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        config, advantages = update.config, update.advantages
        # Without a KL term a zero-advantage sample adds nothing to the loss or its gradient.
        rows, row_steps, scale = (idx, timestep, 1.0) if config.beta > 0 else informative_rows(idx, timestep, advantages)
        loss, stats = grpo_step_loss(
            update.policy, update.model, update.rollout, rows, row_steps, advantages, config=update.sampling,
            clip_range=config.clip_range, beta=config.beta, frozen_reference=update.frozen_reference,
            kl_form=config.kl_form, guard=config.grpo_guard, reweight=config.grpo_guard_reweight,
        )
        return loss * scale, stats
