"""Throughput of an epoch in the trainer's own logs: samples per second, the transformer's FLOPs
and TFLOP/s, and MFU against a peak the user gives (``--peak_tflops``).

FLOPs are counted, not derived from a formula, so they hold for every family, LoRA included:

1. Once per run, ``count_transformer_flops`` runs torch's ``FlopCounterMode`` over one forward,
   and one forward + backward, of the real transformer module (its LoRA adapter and trainable
   parameters as they are) for one sequence at the rollouts' real shapes: latents
   ``(1, *latent_shape)`` and one prompt's embeddings, the conditional branch alone (CFG runs
   two such sequences). It runs on the meta device: no compute and no memory, the shapes alone
   give the counts. Attention is counted as the two batched matmuls of its math (4 b h s s' d),
   whatever kernel runs it later (torch's fused CPU kernel and external kernels such as
   flash-attn are not in ``FlopCounterMode``'s table, which would leave attention out).
2. ``TransformerTally`` counts, during the epoch, the sequences that go through the
   transformer (and the frozen reference copy), by grad mode: a forward under no_grad
   (rollout steps, NFT's old velocities, KL references) costs ``forward``; one with grad (the
   update's training forwards, each followed by its backward) costs ``train``.

Conventions: 2 FLOPs per multiply-add, matmuls, convolutions and attention only (norms,
activations, the SDE step are left out, as is usual for MFU); the recomputation of gradient
checkpointing is not counted (the backward is counted without it); a LoRA reference forward (the
adapter switched off) is counted at the adapter's cost (slightly more than it does). Backward
of frozen weights computes input gradients only, so a LoRA training sequence costs about 2
forwards, full fine-tuning about 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import PIL.Image
import torch
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from genrl.distributed.zero_init import full_shape
from genrl.policies.base import FlowPolicy
from genrl.training.rollout import SamplingConfig


@dataclass(frozen=True)
class TransformerCost:
    """FLOPs of one sequence (batch 1, one CFG branch) through the transformer.

    forward: one forward.
    train: one forward and its backward (gradients of the trainable parameters, and of
        whatever the backward must pass through to reach them).
    """

    forward: int
    train: int

    def flops(self, no_grad_sequences: int, grad_sequences: int) -> int:
        """FLOPs of ``no_grad_sequences`` forwards and ``grad_sequences`` forwards with backward."""
        return no_grad_sequences * self.forward + grad_sequences * self.train


class _MetaModule:
    """Calls ``module`` with meta copies of its parameters (``requires_grad`` kept; full-size
    where ZeRO-3 has partitioned them) and buffers (``torch.func.functional_call``); ``.module``
    lets ``genrl.policies.base.module_dtype`` read the real module's dtype."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.tensors = {name: torch.empty(full_shape(p), dtype=p.dtype, device="meta").requires_grad_(p.requires_grad)
                        for name, p in module.named_parameters()}
        self.tensors.update({name: torch.empty_like(b, device="meta") for name, b in module.named_buffers()})

    def __call__(self, *args, **kwargs):
        return functional_call(self.module, self.tensors, args, kwargs, strict=False)


def count_transformer_flops(
    policy: FlowPolicy, transformer: torch.nn.Module, config: SamplingConfig, prompt: str, device: torch.device | str
) -> TransformerCost:
    """``FlopCounterMode``'s count of one sequence through ``transformer`` (the bare module,
    before ``--attention_backend``, ``--compile`` or ``accelerator.prepare``): the conditional
    velocity (``policy.predict_velocity``) of latents ``(1, *latent_shape)`` at the size
    ``config`` samples, with ``prompt``'s embeddings (encoded on ``device``: the real text
    length; an image-to-video policy's image conditioning too), on the meta device. Gradient checkpointing is switched off while counting (and on
    again after): its recomputation is not counted. Draws nothing from any random generator."""
    height, width, num_frames = policy.resolve_size(config.height, config.width, config.num_frames)
    guidance = policy.conditional_guidance(config.guidance_scale)
    # The FLOPs do not depend on the pixels: an image-conditioned policy gets a gray image of the size sampled.
    images = [PIL.Image.new("RGB", (width, height), (128, 128, 128))] if policy.image_conditioned else None
    encoded = policy.encode_conditioning([prompt], images, height, width, num_frames, device, guidance,
                                         config.negative_prompt)
    # Token masks stay real: their lengths shape the transformer's input (Z-Image, Qwen-Image).
    embeds = {k: v if v.dtype == torch.bool else torch.empty_like(v, device="meta") for k, v in encoded.items()}
    latents = torch.zeros((1, *policy.latent_shape(height, width, num_frames)), device="meta")
    timestep = torch.zeros(1, device="meta")
    module = _MetaModule(transformer)
    checkpointing = bool(getattr(transformer, "is_gradient_checkpointing", False))
    if checkpointing:
        transformer.disable_gradient_checkpointing()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            policy.predict_velocity(module, latents, timestep, embeds, guidance)
        forward = counter.get_total_flops()
        with torch.enable_grad(), FlopCounterMode(display=False) as counter:
            velocity = policy.predict_velocity(module, latents, timestep, embeds, guidance)
            if velocity.requires_grad:  # nothing trainable: the forward alone
                velocity.sum().backward()
        train = counter.get_total_flops()
    finally:
        if checkpointing:
            transformer.enable_gradient_checkpointing()
    return TransformerCost(forward=int(forward), train=int(train))


class TransformerTally:
    """Counts the sequences that go through ``modules`` (the trained transformer, the frozen
    reference copy), by grad mode, with a forward pre-hook on each: the batch size of the
    ``hidden_states`` of every call (their number where it is a list, one tensor a sequence).
    ``take()`` gives the FLOPs of the sequences counted since the last ``take()`` at ``cost`` per
    sequence (None without a ``cost``)."""

    def __init__(self, modules: Sequence[torch.nn.Module], cost: TransformerCost | None):
        self.cost = cost
        self.no_grad = 0  # sequences since the last take()
        self.grad = 0
        self._handles = [m.register_forward_pre_hook(self._count, with_kwargs=True) for m in modules]

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(hidden, (list, tuple)):  # one tensor per sequence (Z-Image)
            sequences = len(hidden)
        else:
            sequences = int(hidden.shape[0]) if isinstance(hidden, torch.Tensor) else 0
        if torch.is_grad_enabled():
            self.grad += sequences
        else:
            self.no_grad += sequences

    def take(self) -> int | None:
        """FLOPs of the sequences since the last call (or since the start), and the count restarts."""
        flops = None if self.cost is None else self.cost.flops(self.no_grad, self.grad)
        self.no_grad = self.grad = 0
        return flops

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


@dataclass
class PhaseFigures:
    """One phase of an epoch: its wall time and the transformer FLOPs it ran (None: not counted)."""

    seconds: float
    flops: int | None = None


def throughput_logs(
    *,
    samples: int,
    epoch_seconds: float,
    rollout: PhaseFigures,
    update: PhaseFigures,
    peak_tflops: float | None = None,
) -> dict[str, float]:
    """The epoch's throughput metrics.

    ``time/epoch_s``: ``epoch_seconds``, the wall time of phases 1-6 (rollouts, rewards,
    advantages, update; evaluation and checkpoints are not in it). ``time/samples_per_s``:
    ``samples`` (the rollout samples of every process) / ``epoch_seconds``. With counted FLOPs
    (this process's): ``perf/transformer_flops`` (rollout + update), ``perf/transformer_tflops``
    = that / ``epoch_seconds`` / 1e12, ``perf/rollout_tflops`` and ``perf/train_tflops`` (each
    phase's FLOPs over its own time: ``time/rollout_s``, ``time/train_s``), and with
    ``peak_tflops`` ``perf/mfu`` = ``perf/transformer_tflops`` / ``peak_tflops``."""
    logs = {"time/epoch_s": epoch_seconds, "time/samples_per_s": samples / epoch_seconds if epoch_seconds > 0 else 0.0}
    if rollout.flops is None or update.flops is None:
        return logs
    total = rollout.flops + update.flops
    logs["perf/transformer_flops"] = float(total)
    for key, flops, seconds in (("perf/transformer_tflops", total, epoch_seconds),
                                ("perf/rollout_tflops", rollout.flops, rollout.seconds),
                                ("perf/train_tflops", update.flops, update.seconds)):
        logs[key] = flops / seconds / 1e12 if seconds > 0 else 0.0
    if peak_tflops:
        logs["perf/mfu"] = logs["perf/transformer_tflops"] / peak_tflops
    return logs

