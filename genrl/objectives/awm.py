"""``--objective awm`` (advantage-weighted matching): the pretraining flow-matching loss of the
clean samples noised again, weighted by their advantages (``genrl.math.nft.awm_loss``)."""

from __future__ import annotations

import torch

from genrl.math.nft import awm_loss
from genrl.objectives.base import EpochUpdate
from genrl.objectives.forward import ForwardBatch, ForwardObjective, forward_step_loss
from genrl.policies.base import FlowPolicy


def awm_step_loss(
    policy: FlowPolicy,
    model: torch.nn.Module,
    batch: ForwardBatch,
    embeds: dict[str, torch.Tensor],
    idx: torch.Tensor,
    column: int,
    advantages: torch.Tensor,
    *,
    guidance_scale: float,
    beta: float = 0.0,
    frozen_reference: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AWM loss of samples ``idx`` ``(b,)`` at their ``column``-th drawn timestep, from the
    conditional velocity; ``advantages`` ``(B,)``. With ``beta`` > 0, + beta mean (v - v_ref)^2."""

    def loss_of(velocity: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return awm_loss(velocity, batch.noisy[idx, column], batch.clean[idx], batch.noise[idx, column], adv)

    return forward_step_loss(policy, model, batch, embeds, idx, column, advantages, loss_of,
                             guidance_scale=guidance_scale, beta=beta, frozen_reference=frozen_reference)


class AWMObjective(ForwardObjective):
    def loss(
        self, update: EpochUpdate, idx: torch.Tensor, timestep: int, *, old_is_current: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return awm_step_loss(
            update.policy, update.model, update.prepared, update.rollout.embeds, idx, timestep, update.advantages,
            guidance_scale=update.config.guidance_scale, beta=update.config.beta,
            frozen_reference=update.frozen_reference,
        )
