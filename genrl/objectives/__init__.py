"""The training objectives and ``OBJECTIVES``, the registry ``--objective`` chooses from.

``grpo`` trains on the recorded SDE transitions of a rollout (their log-probs); ``nft`` and
``awm`` train on its clean final latents, noised again by the forward process
(``genrl.objectives.forward``). The update loop (``genrl.training.update``) is the same for all: it asks
the objective what to prepare from the epoch's samples, which timesteps to train, and the loss
of each micro batch at each of them (``genrl.objectives.base.Objective``). An objective is one
module; registering an instance here (or ``OBJECTIVES[name] = ...`` before the flags are
parsed) makes it a ``--objective`` choice.
"""

from __future__ import annotations

from genrl.objectives.awm import AWMObjective, awm_step_loss
from genrl.objectives.base import EpochUpdate, Objective, UpdateConfig, reference_model
from genrl.objectives.forward import (
    ForwardBatch,
    ForwardObjective,
    check_sigma_range_holds,
    draw_forward_batch,
    fill_old_velocity,
    rollout_sigmas,
    steps_in_sigma_range,
)
from genrl.objectives.grpo import GRPOObjective, grpo_step_loss
from genrl.objectives.nft import NFTObjective, nft_step_loss

# --objective name -> the objective it trains.
OBJECTIVES: dict[str, Objective] = {
    "grpo": GRPOObjective(),
    "nft": NFTObjective(),
    "awm": AWMObjective(),
}

__all__ = [
    "EpochUpdate",
    "OBJECTIVES", "Objective", "ForwardObjective", "GRPOObjective", "NFTObjective", "AWMObjective", "UpdateConfig",
    "get_objective", "reference_model", "ForwardBatch", "check_sigma_range_holds", "draw_forward_batch",
    "fill_old_velocity", "rollout_sigmas", "steps_in_sigma_range", "grpo_step_loss", "nft_step_loss", "awm_step_loss",
]


def get_objective(name: str) -> Objective:
    """The registered objective ``name``."""
    if name not in OBJECTIVES:
        raise ValueError(f"Unknown objective {name!r}; registered: {sorted(OBJECTIVES)}.")
    return OBJECTIVES[name]
