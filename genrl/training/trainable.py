"""Which weights train: a LoRA adapter on the transformer, or all of its weights; and the frozen
reference that the KL term of full fine-tuning compares against (under LoRA the reference is
the adapter switched off, ``genrl.objectives.reference_model``)."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig


def frozen_copy(transformer: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen copy of ``transformer`` as it is now, in eval mode: the reference policy of full
    fine-tuning (take it before the weights train)."""
    return copy.deepcopy(transformer).to(device, dtype).requires_grad_(False).eval()


def make_trainable(
    transformer: torch.nn.Module,
    *,
    use_lora: bool,
    rank: int,
    lora_alpha: int,
    lora_target_modules: str,
    gradient_checkpointing: bool,
    float32: bool,
    seed: int = 0,
) -> list[torch.nn.Parameter]:
    """Make ``transformer`` trainable in place and return its trainable parameters: a LoRA
    adapter (``rank``, ``lora_alpha``, Gaussian init, on the comma-separated
    ``lora_target_modules``) with every base weight frozen, or (``use_lora`` False) all of its
    weights. ``float32``: the trainable weights are kept in float32 (under autocast, and for
    LoRA); ``gradient_checkpointing`` recomputes activations in the backward pass.

    The adapter's random init is drawn from torch's global generator: it is seeded here with
    ``seed`` (and restored after), so a LoRA run is reproducible and every rank starts from
    the same adapter (torch otherwise seeds that generator differently in each process)."""
    transformer.requires_grad_(not use_lora)
    if use_lora:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            transformer.add_adapter(
                LoraConfig(
                    r=rank,
                    lora_alpha=lora_alpha,
                    init_lora_weights="gaussian",
                    target_modules=[m.strip() for m in lora_target_modules.split(",") if m.strip()],
                )
            )
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    if float32:
        for p in trainable:  # trainable weights stay fp32 under autocast
            p.data = p.data.float()
    return trainable
