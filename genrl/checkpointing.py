"""Training checkpoints (resume) and diffusers-format exports (inference, Hub).

Layout of an export (the final ``--output_dir`` and every ``checkpoint-<step>/`` alike)::

    genrl_config.json                      base model, family, LoRA or not, EMA or not, run settings
    transformer/                           full fine-tuning: diffusers ``save_pretrained`` folder
    transformer_ema/                       ... its EMA weights, with --use_ema
    pytorch_lora_weights.safetensors       LoRA: diffusers-format adapter (``pipe.load_lora_weights``)
    pytorch_lora_weights_ema.safetensors   ... its EMA weights, with --use_ema

A checkpoint also holds Accelerate's ``save_state`` files (model, optimizer, scheduler, RNG
states), ``genrl_state.json`` (step and epoch) and ``ema/rank<r>.pt`` (each rank's shadow).
A checkpoint is written to ``<name>.tmp`` and renamed when complete, so a run killed while
saving never leaves a half checkpoint that ``--resume_from_checkpoint latest`` would pick.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Any

import torch

from genrl.ema import EMA
from genrl.policies import FlowPolicy, load_policy

CONFIG_FILE = "genrl_config.json"
STATE_FILE = "genrl_state.json"
LORA_FILE = "pytorch_lora_weights.safetensors"
LORA_EMA_FILE = "pytorch_lora_weights_ema.safetensors"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dirs(output_dir: str) -> list[str]:
    """Complete ``checkpoint-<step>`` folders in ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), d) for d in os.listdir(output_dir) if (m := _CHECKPOINT_RE.match(d))]
    return [os.path.join(output_dir, d) for _, d in sorted(found)]


def resolve_resume_path(output_dir: str, resume_from_checkpoint: str | None) -> str | None:
    """``latest`` -> the newest checkpoint in ``output_dir`` (None if there is none yet);
    a path -> that path, which must exist."""
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint == "latest":
        found = checkpoint_dirs(output_dir)
        return found[-1] if found else None
    if not os.path.isfile(os.path.join(resume_from_checkpoint, STATE_FILE)):
        raise FileNotFoundError(
            f"--resume_from_checkpoint {resume_from_checkpoint!r} is not a genrl checkpoint folder "
            f"(no {STATE_FILE}); pass 'latest' or a checkpoint-<step> folder."
        )
    return resume_from_checkpoint


def prune_checkpoints(output_dir: str, total_limit: int | None) -> None:
    """Remove the oldest checkpoints so that, with the one about to be saved, at most
    ``total_limit`` remain (the diffusers examples' rule). Main process only."""
    if not total_limit:
        return
    found = checkpoint_dirs(output_dir)
    for path in found[: max(0, len(found) - total_limit + 1)]:
        shutil.rmtree(path, ignore_errors=True)


def _trainable_state_dict(accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (gathered) values of the trainable parameters, on every rank, on CPU."""
    unwrapped = accelerator.unwrap_model(model)
    named = [(n, p) for n, p in unwrapped.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if any(hasattr(p, "ds_tensor") for p in params):  # ZeRO-3: gather only what we need
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {n: p.detach().cpu().clone() for n, p in named}
    return {n: p.detach().cpu().clone() for n, p in named}


def _save_full_transformer(accelerator, model: torch.nn.Module, path: str) -> None:
    """diffusers ``save_pretrained`` of the whole transformer; under ZeRO-3 the 16-bit
    weights are gathered first (collective: every rank must call this)."""
    state_dict = accelerator.get_state_dict(model)  # gathers under ZeRO-3
    if not accelerator.is_main_process:
        return
    unwrapped = accelerator.unwrap_model(model)
    # Rebuild on the meta device and assign the gathered tensors: no second full copy.
    with torch.device("meta"):
        fresh = type(unwrapped).from_config(unwrapped.config)
    fresh.load_state_dict({k: v.contiguous() for k, v in state_dict.items()}, strict=True, assign=True)
    fresh.save_pretrained(path, safe_serialization=True)


def _save_lora(accelerator, model: torch.nn.Module, policy: FlowPolicy, path: str, weight_name: str) -> None:
    from peft.utils import get_peft_model_state_dict

    state_dict = _trainable_state_dict(accelerator, model)
    if not accelerator.is_main_process:
        return
    lora_layers = get_peft_model_state_dict(accelerator.unwrap_model(model), state_dict=state_dict)
    type(policy.pipeline).save_lora_weights(path, transformer_lora_layers=lora_layers, weight_name=weight_name)


def export_model(
    accelerator,
    model: torch.nn.Module,
    policy: FlowPolicy,
    export_dir: str,
    *,
    config: dict[str, Any],
    use_lora: bool,
    ema: EMA | None = None,
) -> None:
    """Write the trained weights (and their EMA) in diffusers format to ``export_dir``.
    Collective under ZeRO-3: call on every rank."""
    if accelerator.is_main_process:
        os.makedirs(export_dir, exist_ok=True)
        with open(os.path.join(export_dir, CONFIG_FILE), "w") as f:
            json.dump({**config, "use_lora": use_lora, "has_ema": ema is not None}, f, indent=2, default=str)
    variants = [("", None)] + ([("_ema", ema)] if ema is not None else [])
    for suffix, shadow in variants:
        with shadow.swapped_in() if shadow is not None else contextlib.nullcontext():
            if use_lora:
                _save_lora(accelerator, model, policy, export_dir, LORA_EMA_FILE if suffix else LORA_FILE)
            else:
                _save_full_transformer(accelerator, model, os.path.join(export_dir, "transformer" + suffix))
    accelerator.wait_for_everyone()


def save_checkpoint(
    accelerator,
    model: torch.nn.Module,
    policy: FlowPolicy,
    output_dir: str,
    *,
    global_step: int,
    epoch: int,
    config: dict[str, Any],
    use_lora: bool,
    ema: EMA | None = None,
    total_limit: int | None = None,
) -> str:
    """Save everything needed to resume after ``epoch`` (and an export for evaluation).
    Written to ``checkpoint-<step>.tmp`` and renamed when complete. Returns the path."""
    final = os.path.join(output_dir, f"checkpoint-{global_step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        prune_checkpoints(output_dir, total_limit)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    if ema is not None:
        os.makedirs(os.path.join(tmp, "ema"), exist_ok=True)
        torch.save(ema.state_dict(), os.path.join(tmp, "ema", f"rank{accelerator.process_index}.pt"))
    export_model(accelerator, model, policy, tmp, config=config, use_lora=use_lora, ema=ema)
    if accelerator.is_main_process:
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump({"global_step": global_step, "epoch": epoch, "num_processes": accelerator.num_processes}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: str, ema: EMA | None = None) -> tuple[int, int]:
    """Restore model, optimizer, scheduler, RNG and EMA from ``path``; returns
    ``(global_step, epoch)`` of the checkpoint (training continues at ``epoch + 1``)."""
    with open(os.path.join(path, STATE_FILE)) as f:
        state = json.load(f)
    if state.get("num_processes", accelerator.num_processes) != accelerator.num_processes:
        raise ValueError(
            f"Checkpoint {path!r} was written by {state['num_processes']} processes but this run has "
            f"{accelerator.num_processes}; resume with the same --num_processes."
        )
    accelerator.load_state(path)
    if ema is not None:
        ema_path = os.path.join(path, "ema", f"rank{accelerator.process_index}.pt")
        if not os.path.exists(ema_path):
            raise FileNotFoundError(f"Checkpoint {path!r} has no EMA state ({ema_path}) but --use_ema is set.")
        ema.load_state_dict(torch.load(ema_path, map_location="cpu", weights_only=True))
    return state["global_step"], state["epoch"]


def load_trained_policy(path: str, *, use_ema: bool = False, dtype: torch.dtype = torch.float32) -> FlowPolicy:
    """A policy from a base model (folder or Hub id), a genrl export, or a checkpoint folder.

    With ``use_ema`` the EMA weights are loaded; asking for them where there are none is an error.
    """
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        if use_ema:
            raise ValueError(f"{path!r} is a base model, not a genrl export: it has no EMA weights.")
        return load_policy(path, dtype=dtype)
    with open(config_path) as f:
        config = json.load(f)
    if use_ema and not config.get("has_ema"):
        raise ValueError(f"{path!r} was trained without --use_ema: it has no EMA weights.")
    policy = load_policy(config["base_model"], dtype=dtype)
    suffix = "_ema" if use_ema else ""
    if config["use_lora"]:
        policy.pipeline.load_lora_weights(path, weight_name=LORA_EMA_FILE if use_ema else LORA_FILE)
        policy.pipeline.fuse_lora()
        policy.pipeline.unload_lora_weights()
    else:
        transformer = type(policy.transformer).from_pretrained(os.path.join(path, "transformer" + suffix))
        policy.pipeline.transformer = transformer
        policy.transformer = transformer
    return policy
