"""What a checkpoint taken in the middle of an epoch's update keeps, so that the resumed run
finishes that update as the uninterrupted one would.

A stop signal during the update ends it after the current optimizer step. The weights then
are those of a step inside the epoch, and its samples cannot be drawn again (the sampling
weights have moved): each rank keeps its own experience of the epoch (the rollout, advantages and
kept samples, what the objective prepared from them such as NFT's recorded old velocities), how
far the update got and its statistics so far. The resumed run loads it, skips the epoch's
rollouts and advantages, and continues the same plan of micro steps after the ones done.

Each rank's experience is one safetensors file (``experience/rank<r>.safetensors``: tensors, with
the plain values as JSON in its header), so reading it runs no code. It holds the epoch's
latents, so it is about as large as the rollout in memory (decoded samples are not kept).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from genrl.objectives.forward import ForwardBatch
from genrl.training.experience import EpochAdvantages, EpochExperience
from genrl.training.rollout import Rollout

EXPERIENCE_DIR = "experience"
# What an objective may prepare (besides nothing): rebuilt by name, never by an import path.
PREPARED_TYPES = {"ForwardBatch": ForwardBatch}


@dataclasses.dataclass
class PartialUpdate:
    """An epoch's update stopped after ``micro_steps`` backward passes (an optimizer step's end).

    prepared: what the objective prepared for the epoch (``Objective.prepare``).
    step_stats, grad_norms: those of the optimizer steps done (``genrl.training.update.UpdateResult``).
    skipped_steps: optimizer steps of them skipped as non-finite.
    """

    micro_steps: int
    prepared: Any
    step_stats: list[dict[str, float]]
    grad_norms: list[float]
    skipped_steps: int = 0


@dataclasses.dataclass
class UpdateInProgress(EpochExperience):
    """An epoch whose update a checkpoint interrupted, as one rank holds it: the epoch's
    experience (:class:`~genrl.training.experience.EpochExperience`) and ``update``, how far the update
    got (a checkpoint keeps the rollout without its decoded samples)."""

    update: PartialUpdate

    @classmethod
    def of(cls, experience: EpochExperience, update: PartialUpdate) -> UpdateInProgress:
        """``experience`` with its update stopped at ``update``."""
        fields = {f.name: getattr(experience, f.name) for f in dataclasses.fields(EpochExperience)}
        return cls(**fields, update=update)


def _flatten(prefix: str, record: Any, tensors: dict[str, torch.Tensor], values: dict[str, Any]) -> None:
    """The fields of dataclass ``record`` as ``tensors[prefix.field]`` (a dict of tensors as
    ``prefix.field.key``) and plain ``values[prefix.field]``; a tensor off the CPU records
    that it goes back to the run's device."""
    for f in dataclasses.fields(record):
        value, key = getattr(record, f.name), f"{prefix}.{f.name}"
        items = value.items() if isinstance(value, dict) and value and all(torch.is_tensor(v) for v in value.values()) else None
        if torch.is_tensor(value):
            items = [(None, value)]
        if items is None:
            values[key] = value
            continue
        values[key] = {"tensors": [k for k, _ in items], "on_device": any(t.device.type != "cpu" for _, t in items)}
        for name, tensor in items:
            # A copy: safetensors refuses views that share memory (the rollout's joined batches).
            tensors[key if name is None else f"{key}.{name}"] = tensor.detach().to("cpu", copy=True).contiguous()


def _restore(cls: type, prefix: str, tensors: dict[str, torch.Tensor], values: dict[str, Any], device) -> Any:
    """The dataclass ``cls`` that :func:`_flatten` wrote under ``prefix``."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        value = values.get(key)
        if isinstance(value, dict) and "tensors" in value:
            target = device if value["on_device"] else "cpu"
            names = value["tensors"]
            if names == [None]:
                value = tensors[key].to(target)
            else:
                value = {name: tensors[f"{key}.{name}"].to(target) for name in names}
        kwargs[f.name] = value
    return cls(**kwargs)


def experience_path(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, EXPERIENCE_DIR, f"rank{rank}.safetensors")


def save_update_in_progress(checkpoint: str, rank: int, state: UpdateInProgress) -> None:
    """Write rank ``rank``'s ``state`` into ``checkpoint`` (its folder being written)."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {
        "epoch": state.epoch, "step_at_epoch_start": state.step_at_epoch_start, "timings": state.timings,
        "rollout_flops": state.rollout_flops, "advantages.logs": state.advantages.logs,
        "update": {"micro_steps": state.update.micro_steps, "step_stats": state.update.step_stats,
                   "grad_norms": state.update.grad_norms, "skipped_steps": state.update.skipped_steps},
        "prepared": None if state.update.prepared is None else type(state.update.prepared).__name__,
    }
    _flatten("rollout", dataclasses.replace(state.rollout, samples=None), tensors, values)
    tensors["advantages.advantages"] = state.advantages.advantages.detach().cpu().contiguous()
    tensors["advantages.kept"] = state.advantages.kept.detach().cpu().contiguous()
    if state.update.prepared is not None:
        if type(state.update.prepared).__name__ not in PREPARED_TYPES:
            raise TypeError(f"Cannot checkpoint an update whose objective prepared a {type(state.update.prepared).__name__}.")
        _flatten("prepared", state.update.prepared, tensors, values)
    path = experience_path(checkpoint, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path, metadata={"genrl": json.dumps(values)})


def load_update_in_progress(checkpoint: str, rank: int, device: torch.device) -> UpdateInProgress:
    """Rank ``rank``'s :class:`UpdateInProgress` from ``checkpoint``; its tensors that were on the
    device go to ``device``."""
    path = experience_path(checkpoint, rank)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint {checkpoint!r} stopped inside an epoch's update but has no {path}.")
    with safe_open(path, framework="pt") as f:
        values = json.loads(f.metadata()["genrl"])
    tensors = load_file(path)
    rollout = _restore(Rollout, "rollout", tensors, values, device)
    prepared = None
    if values["prepared"] is not None:
        if values["prepared"] not in PREPARED_TYPES:
            raise ValueError(f"Checkpoint {checkpoint!r}: {path} holds an unknown prepared type {values['prepared']!r}.")
        prepared = _restore(PREPARED_TYPES[values["prepared"]], "prepared", tensors, values, device)
    update = values["update"]
    return UpdateInProgress(
        epoch=values["epoch"], step_at_epoch_start=values["step_at_epoch_start"], rollout=rollout,
        advantages=EpochAdvantages(tensors["advantages.advantages"], tensors["advantages.kept"], values["advantages.logs"]),
        timings=values["timings"], rollout_flops=values["rollout_flops"],
        update=PartialUpdate(update["micro_steps"], prepared, update["step_stats"], update["grad_norms"],
                             update["skipped_steps"]),
    )
