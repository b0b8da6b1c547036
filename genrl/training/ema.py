"""Exponential moving average of the trainable parameters, updated on an interval.

The shadow is float32 whatever the training dtype. Under DeepSpeed ZeRO-3 each rank keeps
the shadow of its own partition (``param.ds_tensor``): updates need no communication. Swapping
the EMA weights in (for evaluation and export) and out rebuilds the parameters in groups of up
to ``WRITE_GROUP_ELEMENTS``, one all-gather and one ``GatheredParameters`` per group.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch


def ema_decay(decay: float, num_updates: int, warmup: bool) -> float:
    """Decay used for update number ``num_updates`` (0-based).

    Without warm-up: ``decay``. With warm-up: min(decay, (1 + n) / (10 + n)), so early
    updates follow the weights closely instead of averaging in the initial model.
    """
    if not warmup:
        return decay
    return min(decay, (1 + num_updates) / (10 + num_updates))


def _local_tensor(param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor this rank owns: the ZeRO-3 partition if the parameter is partitioned."""
    return param.ds_tensor if hasattr(param, "ds_tensor") else param.data


# Elements (of the full parameters) rebuilt together under ZeRO-3: 2^25 is 64 MiB in bf16 and
# 128 MiB in fp32, twice that while the pieces are gathered. One collective per parameter instead
# costs a round trip each: writing the tests' tiny SD3 transformer (66 parameters) took about
# 0.3 s over gloo, each way of a swap.
WRITE_GROUP_ELEMENTS = 1 << 25


def _write_groups(params: list[torch.nn.Parameter]) -> Iterator[list[int]]:
    """Indices of consecutive partitioned parameters of one dtype and device, each group holding
    at most ``WRITE_GROUP_ELEMENTS`` full elements (a larger parameter on its own)."""
    group, size, kind = [], 0, None
    for i, p in enumerate(params):
        this_kind = (p.ds_tensor.dtype, p.ds_tensor.device)
        if group and (this_kind != kind or size + p.ds_numel > WRITE_GROUP_ELEMENTS):
            yield group
            group, size = [], 0
        group.append(i)
        size, kind = size + p.ds_numel, this_kind
    if group:
        yield group


@torch.no_grad()
def _write_local(params: Iterable[torch.nn.Parameter], values: Iterable[torch.Tensor]) -> None:
    """Set each parameter to ``value``, given as the tensor this rank owns.

    Under ZeRO-3 a partition cannot simply be overwritten: DeepSpeed keeps gathered copies
    of recently used and of small ("persistent") parameters, which would go on serving the
    old values. So the parameters are rebuilt whole from every rank's piece, a group at a time
    (one all-gather of the group's pieces laid end to end), and written through
    ``GatheredParameters(modifier_rank=0)``, which re-partitions them everywhere.
    """
    partitioned = []
    for p, value in zip(params, values):
        if hasattr(p, "ds_tensor"):
            partitioned.append((p, value))
        else:
            p.data.copy_(value.to(device=p.device, dtype=p.dtype))
    if not partitioned:
        return
    import deepspeed
    import torch.distributed as dist

    for group in _write_groups([p for p, _ in partitioned]):
        members = [partitioned[i] for i in group]
        pieces = [value.to(device=p.ds_tensor.device, dtype=p.ds_tensor.dtype).reshape(-1) for p, value in members]
        flat = torch.cat(pieces)  # every rank's pieces have the same sizes (DeepSpeed pads the partitions)
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        with deepspeed.zero.GatheredParameters([p for p, _ in members], modifier_rank=0):
            if dist.get_rank() == 0:
                offset = 0
                for (p, _), piece in zip(members, pieces):
                    end = offset + piece.numel()
                    p.data.copy_(torch.cat([g[offset:end] for g in gathered])[: p.ds_numel].view(p.ds_shape))
                    offset = end


class EMA:
    """fp32 shadow of ``parameters``: ``shadow = d * shadow + (1 - d) * theta`` every
    ``update_interval`` optimizer steps.

    Args:
        parameters: the trainable parameters (frozen ones are skipped).
        decay: the EMA decay ``d``.
        update_interval: update on optimizer steps that are multiples of this.
        warmup: use the warm-up decay of :func:`ema_decay`.
        device: where the shadow lives (``"cpu"`` saves accelerator memory).
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        decay: float = 0.9,
        update_interval: int = 1,
        warmup: bool = False,
        device: torch.device | str | None = None,
    ):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}.")
        if update_interval < 1:
            raise ValueError(f"EMA update interval must be >= 1 optimizer step, got {update_interval}.")
        self.params = [p for p in parameters if p.requires_grad]
        # Called before weights are written (swaps): under ZeRO-3 the trainer sets it to
        # genrl.distributed.zero3.settle_zero3_params of the engine, once there is one.
        self.settle: Callable[[], None] | None = None
        self.decay = decay
        self.update_interval = update_interval
        self.warmup = warmup
        self.num_updates = 0
        self.shadow = [
            _local_tensor(p).detach().to(device=device or _local_tensor(p).device, dtype=torch.float32, copy=True)
            for p in self.params
        ]

    def step(self, optimizer_step: int) -> bool:
        """Call after every optimizer step with the global step count (1-based).
        Updates only when ``optimizer_step % update_interval == 0``; returns whether it did."""
        if optimizer_step % self.update_interval != 0:
            return False
        self.update()
        return True

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        """One EMA update: shadow = d * shadow + (1 - d) * theta, with ``d`` = ``decay`` when
        given (a schedule the caller computes), else the EMA's own decay."""
        d = ema_decay(self.decay, self.num_updates, self.warmup) if decay is None else decay
        for s, p in zip(self.shadow, self.params):
            s.mul_(d).add_(_local_tensor(p).to(device=s.device, dtype=torch.float32), alpha=1 - d)
        self.num_updates += 1

    @torch.no_grad()
    def copy_to(self, parameters: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Write the shadow into the parameters (collective under ZeRO-3: call on every rank)."""
        if self.settle is not None:
            self.settle()
        _write_local(parameters if parameters is not None else self.params, self.shadow)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Run the block with the EMA weights in the model, then restore the trained ones."""
        backup = [_local_tensor(p).detach().clone() for p in self.params]
        self.copy_to()
        try:
            yield
        finally:
            if self.settle is not None:
                self.settle()
            _write_local(self.params, backup)

    def state_dict(self) -> dict:
        return {
            "shadow": [s.cpu() for s in self.shadow],
            "num_updates": self.num_updates,
            "decay": self.decay,
            "update_interval": self.update_interval,
            "warmup": self.warmup,
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(
                f"EMA state has {len(state['shadow'])} tensors but the model has {len(self.shadow)} trainable ones."
            )
        for s, saved in zip(self.shadow, state["shadow"]):
            if s.shape != saved.shape:
                raise ValueError(f"EMA tensor of shape {tuple(saved.shape)} does not fit parameter {tuple(s.shape)}.")
            s.copy_(saved)
        self.num_updates = state["num_updates"]
