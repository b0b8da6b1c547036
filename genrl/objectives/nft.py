"""``--objective nft`` (DiffusionNFT): the trained velocity pulled towards an implicit positive
policy on good samples and away from an implicit negative one on bad samples, both around the
sampling ("old") policy's velocity (``genrl.math.nft.nft_loss``), on the clean samples noised again.

The old velocities are recorded in ``prepare``, before the epoch's first optimizer step moves
the weights; the passes of that first step (on-policy) take them from their own forward."""

from __future__ import annotations

import argparse

import torch

from genrl.math.nft import nft_loss
from genrl.objectives.base import EpochUpdate, UpdateConfig
from genrl.objectives.forward import ForwardBatch, ForwardObjective, fill_old_velocity, forward_step_loss
from genrl.policies.base import FlowPolicy
from genrl.training.rollout import Rollout


def nft_step_loss(
    policy: FlowPolicy,
    model: torch.nn.Module,
    batch: ForwardBatch,
    embeds: dict[str, torch.Tensor],
    idx: torch.Tensor,
    column: int,
    advantages: torch.Tensor,
    *,
    guidance_scale: float,
    adv_clip_max: float,
    nft_beta: float = 1.0,
    beta: float = 0.0,
    frozen_reference: torch.nn.Module | None = None,
    old_is_current: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """NFT loss of samples ``idx`` ``(b,)`` at their ``column``-th drawn timestep, from the
    conditional velocity; ``advantages`` ``(B,)``. With ``beta`` > 0, + beta mean (v - v_ref)^2.

    ``old_is_current``: the weights are still those that sampled the rollout (on-policy, before
    the epoch's first optimizer step), so the old velocity is this forward's, detached, and
    needs no recorded one."""

    def loss_of(velocity: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if old_is_current:
            old_velocity = velocity.detach()
        elif batch.old_velocity is None:
            raise ValueError("NFT needs the sampling policy's velocities; call fill_old_velocity first.")
        else:
            old_velocity = batch.old_velocity[idx, column]
        return nft_loss(
            velocity, old_velocity, batch.noisy[idx, column], batch.clean[idx], batch.sigmas[idx, column], adv,
            nft_beta=nft_beta, adv_clip_max=adv_clip_max,
        )

    return forward_step_loss(policy, model, batch, embeds, idx, column, advantages, loss_of,
                             guidance_scale=guidance_scale, beta=beta, frozen_reference=frozen_reference)


class NFTObjective(ForwardObjective):
    uses_sampling_outputs = True
    own_args = (*ForwardObjective.own_args, "nft_beta")

    def check_args(self, args: argparse.Namespace) -> None:
        super().check_args(args)
        if not args.nft_beta > 0:
            raise ValueError(f"--nft_beta must be > 0, got {args.nft_beta}; 1.0 is DiffusionNFT's default.")

    def prepare(
        self, policy: FlowPolicy, model: torch.nn.Module, rollout: Rollout, record: list[torch.Tensor], *,
        config: UpdateConfig, seed: int, epoch: int, device: torch.device,
    ) -> ForwardBatch:
        """The noised samples, with the sampling policy's velocities there recorded in the micro
        batches ``record``."""
        batch = super().prepare(policy, model, rollout, record, config=config, seed=seed, epoch=epoch, device=device)
        model.eval()  # the sampling policy's velocities, before the weights move
        fill_old_velocity(policy, model, batch, rollout.embeds, record, config.guidance_scale)
        model.train()
        return batch

    def loss(
        self, update: EpochUpdate, idx: torch.Tensor, timestep: int, *, old_is_current: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        config = update.config
        return nft_step_loss(
            update.policy, update.model, update.prepared, update.rollout.embeds, idx, timestep, update.advantages,
            guidance_scale=config.guidance_scale, adv_clip_max=config.adv_clip_max, nft_beta=config.nft_beta,
            beta=config.beta, frozen_reference=update.frozen_reference, old_is_current=old_is_current,
        )
