"""What every training objective implements (``Objective``), the settings of the update it
trains in (``UpdateConfig``), and what the objectives share: the KL reference
(``reference_model``) and the checks of the sampling policy's soft update."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from genrl.policies.base import FlowPolicy, unwrap_module
from genrl.training.rollout import Rollout, SamplingConfig


@dataclass(frozen=True)
class UpdateConfig:
    """How the update trains (the flags of the same names).

    objective: the ``--objective``, a name in ``genrl.objectives.OBJECTIVES``.
    micro_batch_size: samples per micro batch (``--train_batch_size``).
    num_timesteps: trained timesteps per sample (``num_trained_timesteps``).
    num_inner_epochs: passes over the epoch's kept samples.
    timestep_fraction, shuffle_timesteps: GRPO's choice of recorded steps per sample.
    num_inference_steps: the sampling schedule the forward process draws from (nft, awm).
    train_sigma_range: (lo, hi): nft and awm draw their trained timesteps among the sampling
        steps whose sigma lies in [lo, hi] (None: all of them).
    max_train_steps: stop when the global step reaches it (None: never).
    guidance_scale: the rollouts' CFG scale (GRPO recomputes guided log-probs; nft and awm
        train the conditional velocity).
    clip_range, kl_form, grpo_guard, grpo_guard_reweight: GRPO's. adv_clip_max, nft_beta: NFT's. beta: the KL weight of all three.
    sampling_decay_rate, sampling_decay_max: the soft update of the sampling policy (nft, awm;
        ``genrl.math.nft.soft_update_decay``).
    """

    objective: str
    micro_batch_size: int
    num_timesteps: int
    num_inference_steps: int
    guidance_scale: float
    max_grad_norm: float
    clip_range: float
    adv_clip_max: float
    num_inner_epochs: int = 1
    timestep_fraction: float = 1.0
    shuffle_timesteps: bool = True
    max_train_steps: int | None = None
    beta: float = 0.0
    kl_form: str = "transition"
    nft_beta: float = 1.0
    grpo_guard: bool = False
    grpo_guard_reweight: bool = False
    sampling_decay_rate: float = 0.0
    sampling_decay_max: float = 0.5
    train_sigma_range: tuple[float, float] | None = None


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


def check_soft_update_flags(args: argparse.Namespace) -> None:
    """The range of ``--sampling_policy_decay_rate`` and ``--sampling_policy_decay_max``
    (``genrl.math.nft.soft_update_decay``), whatever the objective."""
    if args.sampling_policy_decay_rate < 0 or not 0 <= args.sampling_policy_decay_max < 1:
        raise ValueError(
            f"--sampling_policy_decay_rate must be >= 0 and --sampling_policy_decay_max in [0, 1), got "
            f"{args.sampling_policy_decay_rate} and {args.sampling_policy_decay_max}."
        )


@dataclass(frozen=True)
class EpochUpdate:
    """What every loss of one epoch's update reads.

    policy: the model family's adapter; model: the trained transformer (with its current weights).
    rollout: the epoch's B samples; prepared: what the objective's ``prepare`` made of them.
    advantages: ``(B,)`` the whole rollout's. config: how the update trains; sampling: how the
    rollout was sampled. frozen_reference: the KL reference of full fine-tuning
    (``reference_model``), else None.
    """

    policy: FlowPolicy
    model: torch.nn.Module
    rollout: Rollout
    prepared: Any
    advantages: torch.Tensor
    config: UpdateConfig
    sampling: SamplingConfig
    frozen_reference: torch.nn.Module | None = None


class Objective:
    """One ``--objective``: how the update (``genrl.training.update.update_policy``) trains on an epoch's
    samples. Registered by name in ``genrl.objectives.OBJECTIVES``, which ``--objective`` offers.

    Per epoch the update calls ``prepare`` once, then per inner epoch ``draw_timesteps`` after
    shuffling the kept samples, then ``loss`` once per (micro batch, trained timestep), each a
    backward pass of the accumulation. Before any model loads, ``genrl.config.checks`` calls
    ``check_args`` of the chosen objective and ``check_unused_args`` of every other one, and
    ``num_trained_timesteps`` sizes the accumulation.
    """

    # The loss compares the trained forward with the sampling policy's at the same point (NFT's
    # old velocity): ``prepare`` records the sampling policy's, except in the micro batches whose
    # passes still run on the sampling weights, which take it from their own forward
    # (``old_is_current``; ``genrl.training.update.micro_steps_before_the_weights_move``).
    uses_sampling_outputs: bool = False
    # The flags only this objective reads: a config file's values of them are dropped, not
    # refused, when a command-line flag chooses another objective (``genrl.config.sources``).
    own_args: tuple[str, ...] = ()

    def check_args(self, args: argparse.Namespace) -> None:
        """The checks of the flags when this objective trains that need no model: a
        ``ValueError`` of one sentence for the first that fails."""

    def check_unused_args(self, args: argparse.Namespace) -> None:
        """The checks when another objective trains: flags of this one only, refused with one
        sentence (``ValueError``) when given."""

    def timestep_pool(self, args: argparse.Namespace) -> int:
        """How many timesteps of a sample the trained ones are chosen from."""
        raise NotImplementedError

    def num_trained_timesteps(self, args: argparse.Namespace) -> int:
        """Timesteps each sample trains on: ``--timestep_fraction`` of ``timestep_pool``, at
        least 1 (the floor forgives float error of 1e-6: 0.29 of 100 is 29)."""
        return max(1, int(self.timestep_pool(args) * args.timestep_fraction + 1e-6))

    def draw_timesteps(
        self, num_samples: int, num_recorded_steps: int, config: UpdateConfig, generator: torch.Generator
    ) -> torch.Tensor | None:
        """The trained timesteps of one inner epoch's shuffled samples, ``(k, num_timesteps)``
        indices into the rollout's ``num_recorded_steps`` recorded steps, drawn from the update's
        ``generator`` after the shuffle. None: the j-th trained timestep of every sample is
        column j of what ``prepare`` returned."""
        return None

    def prepare(
        self, policy: FlowPolicy, model: torch.nn.Module, rollout: Rollout, record: list[torch.Tensor], *,
        config: UpdateConfig, seed: int, epoch: int, device: torch.device,
    ) -> Any:
        """What the losses of the epoch read besides ``rollout`` (B samples), made once before
        the first optimizer step, with the sampling policy's weights in ``model``. ``record``:
        the micro batches (sample indices ``(b,)`` each, the same number on every rank) whose
        sampling outputs to record, when ``uses_sampling_outputs``. None: nothing."""
        return None

    def loss(
        self, update: EpochUpdate, idx: torch.Tensor, timestep: torch.Tensor | int, *, old_is_current: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, stats)`` of samples ``idx`` ``(b,)`` of ``update.rollout`` at ``timestep``: a
        row of ``draw_timesteps`` ``(b,)``, or the column j. ``old_is_current``: the weights are
        still those that sampled the rollout. Stats are detached scalars, logged as ``train/<name>``."""
        raise NotImplementedError
