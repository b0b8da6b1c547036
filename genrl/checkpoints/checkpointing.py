"""Training checkpoints (resume) and diffusers-format exports (inference, Hub).

Layout of an export (the final ``--output_dir`` and every ``checkpoint-<step>/`` alike)::

    genrl_config.json                      base model, family, LoRA or not, EMA or not, run settings
    transformer/                           full fine-tuning: diffusers ``save_pretrained`` folder
    transformer_ema/                       ... its EMA weights, with --use_ema
    pytorch_lora_weights.safetensors       LoRA: diffusers-format adapter (``pipe.load_lora_weights``)
    pytorch_lora_weights_ema.safetensors   ... its EMA weights, with --use_ema

A checkpoint also holds Accelerate's ``save_state`` files (model, optimizer, scheduler, RNG
states), ``genrl_state.json`` (step and epoch), ``ema/rank<r>.pt`` (each rank's shadow) and, with
a soft-updated sampling policy, ``sampling_policy/rank<r>.pt``.
A checkpoint is written to ``<name>.tmp`` and renamed when complete, so a run killed while
saving never leaves a half checkpoint that ``--resume_from_checkpoint latest`` would pick.
Older checkpoints are pruned to ``--checkpoints_total_limit`` only after that rename, and only
once the new checkpoint's weights have sampled finite rollouts (the trainer prunes after the
next epoch's rollouts): a checkpoint whose weights then give NaN samples is set aside, and the one
before it must still be there. A save that fails (a full disk included) removes its ``.tmp``: the
last good checkpoint is never lost to a save that did not finish.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shlex
import shutil
from typing import TYPE_CHECKING, Any

import torch

from genrl.checkpoints.node_storage import STATE_FILE, agree_on_resume, checkpoint_step, checkpoint_writer
from genrl.checkpoints.safe_load import load_weights_only, verify_checkpoint
from genrl.checkpoints.update_checkpoint import EXPERIENCE_DIR, UpdateInProgress, save_update_in_progress
from genrl.distributed.zero3 import settle_zero3_params
from genrl.errors import SetupError
from genrl.hub.redact import redact_args
from genrl.policies import FlowPolicy, guidance_options_of, load_policy
from genrl.training.ema import EMA

if TYPE_CHECKING:
    from genrl.training.run import Run

CONFIG_FILE = "genrl_config.json"
LORA_FILE = "pytorch_lora_weights.safetensors"
LORA_EMA_FILE = "pytorch_lora_weights_ema.safetensors"
SAMPLING_POLICY_DIR = "sampling_policy"
EMA_DIR = "ema"
# A checkpoint whose weights then gave non-finite samples is renamed with this suffix: ``latest``
# skips it, and it stays for inspection.
NONFINITE_SUFFIX = ".nonfinite"
logger = logging.getLogger(__name__)


def checkpoint_dirs(output_dir: str) -> list[str]:
    """Complete ``checkpoint-<step>`` folders in ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(step, d) for d in os.listdir(output_dir) if (step := checkpoint_step(d)) is not None]
    return [os.path.join(output_dir, d) for _, d in sorted(found)]


# The arguments that decide a run's trajectory (model, data, seed, group and batch layout,
# rewards, sampling, objective): a checkpoint records them, and only a run that sets them
# alike may resume it or write next to it. Learning rate and the like may change on resume.
RUN_IDENTITY_ARGS = (
    "pretrained_model_name_or_path", "revision", "variant", "prompt_dataset", "prompt_column", "seed",
    "group_size", "rollout_batch_size", "rollout_batches_per_epoch", "train_batch_size", "gradient_accumulation_steps",
    "reward_fn", "reward_options", "reward_combine", "num_inference_steps", "guidance_scale", "negative_prompt",
    "noise_level", "sde_type", "sde_window_size", "sde_window_range", "same_latent", "height", "width", "num_frames",
    "objective", "use_lora", "rank", "max_sequence_length",
)


def run_identity(args) -> dict[str, Any]:
    """The :data:`RUN_IDENTITY_ARGS` of ``args`` as JSON values; local paths made absolute, so
    the same run launched from another folder is the same run."""
    identity = {}
    for name in RUN_IDENTITY_ARGS:
        value = getattr(args, name, None)
        if name in ("pretrained_model_name_or_path", "prompt_dataset") and value and os.path.exists(value):
            value = os.path.abspath(value)
        identity[name] = list(value) if isinstance(value, tuple) else value
    return identity


def run_record(args, family: str, argv: list[str], reward_models: dict[str, dict] | None = None) -> dict[str, Any]:
    """What an export records of its run (``genrl_config.json``, the model card): the base model
    (a local folder made absolute), the model family, the reward spec and what identifies its
    reward models (``reward_models``: ``genrl.rewards.lifecycle.describe_reward_models``, e.g.
    the HPSv3 template's sha256), the launch command (``argv``, already redacted) and every
    argument, tokens redacted."""
    model = args.pretrained_model_name_or_path
    return {
        "base_model": os.path.abspath(model) if os.path.isdir(model) else model,
        "family": family,
        "reward_fn": args.reward_fn,
        "reward_models": dict(reward_models or {}),
        "launch_command": "accelerate launch " + shlex.join(argv),
        "args": redact_args(vars(args)),
    }


def identity_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``--name <recorded> there, <current> here`` for each argument the two runs set differently
    (arguments one side did not record are not compared)."""
    return [
        f"--{name} {recorded[name]!r} there, {current[name]!r} here"
        for name in current
        if name in recorded and recorded[name] != current[name]
    ]


FRESH_START = "start afresh with --overwrite_output_dir or a new --output_dir"


def check_output_dir(output_dir: str, identity: dict[str, Any], resuming: bool) -> None:
    """Refuse, in one sentence, to write into an ``output_dir`` that holds another run's
    checkpoints, or (``resuming`` False) to start over on top of this run's own checkpoints."""
    found = checkpoint_dirs(output_dir)
    for path in found:
        differences = identity_differences(read_state(path).get("run", {}), identity)
        if differences:
            raise ValueError(
                f"--output_dir {output_dir} holds {os.path.basename(path)} of another run "
                f"({'; '.join(differences)}): {FRESH_START}."
            )
    if found and not resuming:
        raise ValueError(
            f"--output_dir {output_dir} already holds this run's checkpoints up to {os.path.basename(found[-1])}: "
            f"continue it with --resume_from_checkpoint latest, or {FRESH_START}."
        )


def check_resumable(path: str, identity: dict[str, Any]) -> None:
    """Refuse, in one sentence, to resume checkpoint ``path`` of a run with other arguments
    (a checkpoint written before runs were recorded is accepted)."""
    differences = identity_differences(read_state(path).get("run", {}), identity)
    if differences:
        raise ValueError(
            f"Cannot resume from {path}: it belongs to another run ({'; '.join(differences)}); "
            f"resume with that run's arguments, or {FRESH_START}."
        )


def prepare_output_dir(
    accelerator, output_dir: str, identity: dict[str, Any], *, resume_from_checkpoint: str | None, overwrite: bool,
    node_local: bool = False,
) -> str | None:
    """Before any model loads: empty ``output_dir`` of its checkpoints when ``overwrite``
    (``--overwrite_output_dir``), then return the checkpoint every rank resumes
    (:func:`genrl.checkpoints.node_storage.agree_on_resume`; None: a new run) after refusing, with one
    sentence (ValueError, FileNotFoundError), an ``output_dir`` that holds another run's
    checkpoints (or this run's, when not resuming), a checkpoint of another run or written under
    another distributed set-up, and one with a file that could run code or cannot be read.
    ``node_local``: each node has its own ``output_dir`` (its local main process clears it)."""
    if overwrite and checkpoint_writer(accelerator, node_local):
        clear_output_dir(output_dir)
    accelerator.wait_for_everyone()
    resume_path = None
    if resume_from_checkpoint:
        latest = resume_from_checkpoint == "latest"
        candidates = checkpoint_dirs(output_dir) if latest else [resume_from_checkpoint]
        per_rank = {path: per_rank_dirs(path) for path in candidates if os.path.isfile(os.path.join(path, STATE_FILE))}
        resume_path = agree_on_resume(accelerator, candidates, per_rank, latest=latest, output_dir=output_dir)
    check_output_dir(output_dir, identity, resuming=resume_path is not None)
    if resume_path is not None:
        check_resumable(resume_path, identity)
        check_checkpoint_layout(resume_path, accelerator)
        verify_checkpoint(resume_path, accelerator.process_index)
    return resume_path


def per_rank_dirs(path: str) -> list[str]:
    """genrl's per-rank state folders of checkpoint ``path`` (EMA, sampling policy): those its
    state file records, or (an older checkpoint) those present."""
    recorded = read_state(path).get("per_rank_dirs")
    if isinstance(recorded, list):
        return recorded
    return [d for d in (EMA_DIR, SAMPLING_POLICY_DIR) if os.path.isdir(os.path.join(path, d))]


def checkpoint_format(accelerator) -> str:
    """How this run's distributed set-up writes the model and optimizer states of a checkpoint:
    "deepspeed_zero<stage>" under DeepSpeed, else "torch" (one process or DDP)."""
    plugin = accelerator.state.deepspeed_plugin
    return f"deepspeed_zero{int(plugin.zero_stage)}" if plugin is not None else "torch"


def recorded_format(path: str) -> str:
    """The format (:func:`checkpoint_format`) checkpoint ``path`` was written in: recorded in its
    state file, or (an older checkpoint) read from its files."""
    recorded = read_state(path).get("format")
    if isinstance(recorded, str):
        return recorded
    deepspeed_dir = os.path.join(path, "pytorch_model")
    if not os.path.isdir(deepspeed_dir):
        return "torch"
    zero3 = any(n.startswith("zero_pp_rank_") and n.endswith("_model_states.pt") for n in os.listdir(deepspeed_dir))
    return "deepspeed_zero3" if zero3 else "deepspeed_zero2"


# What to name a format in a sentence, and the shipped config that writes it.
_FORMATS = {
    "torch": ("one process or DDP, without DeepSpeed", "accelerate_configs/multi_gpu.yaml, or no config for one process"),
    "deepspeed_zero1": ("DeepSpeed ZeRO-1", "a DeepSpeed config with zero_stage: 1"),
    "deepspeed_zero2": ("DeepSpeed ZeRO-2", "accelerate_configs/zero2.yaml"),
    "deepspeed_zero3": ("DeepSpeed ZeRO-3", "accelerate_configs/zero3.yaml or zero3_offload.yaml"),
}


def check_checkpoint_layout(path: str, accelerator) -> None:
    """Refuse, in one sentence, to resume checkpoint ``path`` with another number of processes, or
    under a distributed set-up whose model and optimizer states are laid out otherwise (DDP and
    each ZeRO stage write their own)."""
    written_by = read_state(path).get("num_processes", accelerator.num_processes)
    if written_by != accelerator.num_processes:
        raise ValueError(
            f"Checkpoint {path!r} was written by {written_by} processes but this run has "
            f"{accelerator.num_processes}; resume with the same --num_processes."
        )
    written, current = recorded_format(path), checkpoint_format(accelerator)
    if written == current:
        return
    (was, config), (now, _) = _FORMATS.get(written, (written, "its config")), _FORMATS.get(current, (current, ""))
    raise ValueError(
        f"Cannot resume from {path}: it was written under {was} and this run uses {now}, whose optimizer states are "
        f"laid out otherwise: resume it with the config it was written with (--config_file {config}), or {FRESH_START}."
    )


def clear_output_dir(output_dir: str) -> None:
    """``--overwrite_output_dir``: remove the checkpoints (complete, incomplete or set aside) a fresh run must not
    resume or mix with. Main process only; the export and samples are overwritten as written."""
    if not os.path.isdir(output_dir):
        return
    for name in os.listdir(output_dir):
        if checkpoint_step(name.removesuffix(".tmp").removesuffix(NONFINITE_SUFFIX)) is not None:
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


def trim_metrics(metrics_path: str, last_epoch: int) -> None:
    """Keep the lines of ``metrics.jsonl`` up to epoch ``last_epoch`` (-1: none), so a resumed
    run that redoes the later epochs does not log their steps twice. A line cut short by a
    kill is dropped too. Main process only."""
    if not os.path.exists(metrics_path):
        return
    kept = []
    with open(metrics_path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("epoch"), int) and record["epoch"] <= last_epoch:
                kept.append(line if line.endswith("\n") else line + "\n")
    with open(metrics_path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(metrics_path + ".tmp", metrics_path)


def prune_checkpoints(output_dir: str, total_limit: int | None, keep: str | None = None) -> None:
    """Remove the oldest complete checkpoints so that at most ``total_limit`` remain, never
    ``keep`` (the one just saved). Call it after a save has completed, so that a failed save
    still leaves the previous checkpoint. Main process only."""
    if not total_limit:
        return
    found = checkpoint_dirs(output_dir)
    removable = [path for path in found if keep is None or os.path.abspath(path) != os.path.abspath(keep)]
    for path in removable[: max(0, len(found) - total_limit)]:
        shutil.rmtree(path, ignore_errors=True)


class CheckpointSaveError(SetupError, RuntimeError):
    """Saving a checkpoint failed (a full disk, a write error); its ``.tmp`` was removed and the
    older checkpoints are intact. One sentence for the console, the OS's error in its chain."""


# Write errors that mean "no room left" rather than a broken disk or path.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# torch.save and safetensors report a full disk as their own error without an errno; a write
# that failed with less than this left on the disk is taken to be one.
_NEARLY_FULL_BYTES = 1 << 20


def _disk_full(err: BaseException, path: str) -> bool:
    """Whether ``err`` (or an error it wraps) is a full disk or quota, or the disk holding
    ``path`` is all but full now (measure before cleaning up)."""
    seen = set()
    while err is not None and id(err) not in seen:  # a chain can loop back on itself
        if isinstance(err, OSError) and err.errno in _NO_SPACE:
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    try:
        return shutil.disk_usage(path).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


def _save_failed_message(err: BaseException, tmp: str, output_dir: str, disk_full: bool) -> str:
    """One sentence: what failed and where, what was kept, what to do."""
    name, where = os.path.basename(tmp[: -len(".tmp")]), os.path.abspath(output_dir)
    previous = checkpoint_dirs(output_dir)
    kept = f"{os.path.basename(previous[-1])} is kept" if previous else "there is no earlier checkpoint"
    if disk_full:
        what = f"the disk holding {where} is full ({err})"
        fix = "free room for one more checkpoint (older ones are pruned only after a new one is complete)"
    else:
        what = f"writing to {where} failed ({type(err).__name__}: {err})"
        fix = "fix that"
    return (f"Could not save {name}: {what}; the incomplete {os.path.basename(tmp)} was removed and {kept}: "
            f"{fix} and rerun with --resume_from_checkpoint latest.")


def _trainable_state_dict(accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (gathered) values of the trainable parameters, on every rank, on CPU."""
    unwrapped = accelerator.unwrap_model(model)
    named = [(n, p) for n, p in unwrapped.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if any(hasattr(p, "ds_tensor") for p in params):  # ZeRO-3: gather only what we need
        import deepspeed

        settle_zero3_params(model)

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {n: p.detach().cpu().clone() for n, p in named}
    return {n: p.detach().cpu().clone() for n, p in named}


def _save_full_transformer(accelerator, model: torch.nn.Module, path: str) -> None:
    """diffusers ``save_pretrained`` of the whole transformer; under ZeRO-3 the 16-bit
    weights are gathered first (collective: every rank must call this)."""
    settle_zero3_params(model)
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
    unwrapped = accelerator.unwrap_model(model)
    lora_layers = get_peft_model_state_dict(unwrapped, state_dict=state_dict)
    # The adapter's config goes with it: without it load_lora_weights takes lora_alpha = rank, so an
    # adapter trained at another --lora_alpha would load at the wrong scale (alpha / rank).
    metadata = unwrapped.peft_config["default"].to_dict()
    if hasattr(type(policy.pipeline), "save_lora_weights"):
        type(policy.pipeline).save_lora_weights(path, transformer_lora_layers=lora_layers, weight_name=weight_name,
                                                transformer_lora_adapter_metadata=metadata)
    else:  # a pipeline without a LoRA loader (HunyuanVideo 1.5): the same file, read by pipe.transformer.load_lora_adapter
        from diffusers.loaders.lora_base import LoraBaseMixin

        LoraBaseMixin._save_lora_weights(path, lora_layers={"transformer": lora_layers},
                                         lora_metadata={"transformer": metadata}, weight_name=weight_name)


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
                _save_full_transformer(accelerator, model, os.path.join(export_dir, policy.trained_component + suffix))
    accelerator.wait_for_everyone()


def save_checkpoint(
    run: Run, *, global_step: int, epoch: int, total_limit: int | None = None, in_progress: UpdateInProgress | None = None
) -> str:
    """Save everything needed to resume ``run`` after ``epoch`` at optimizer step
    ``global_step`` (and an export for evaluation) into ``--output_dir``; with ``in_progress``,
    also this rank's part of the next epoch, whose update stopped part-way
    (:mod:`genrl.checkpoints.update_checkpoint`), so that the resumed run finishes it.
    Written to ``checkpoint-<step>.tmp`` and renamed when every rank's files are in; only then are
    the oldest checkpoints pruned to ``total_limit`` (None: the caller prunes later,
    :func:`prune_checkpoints`). The run's identity (:func:`run_identity`) is recorded in
    ``genrl_state.json``, so that only the same run resumes it, with the distributed format and
    the per-rank folders. With ``run.node_local`` each node completes its own copy
    (:mod:`genrl.checkpoints.node_storage`). Returns the path.

    Raises:
        CheckpointSaveError: writing failed (a full disk is named as such); the ``.tmp`` was
            removed and the earlier checkpoints are untouched.
    """
    accelerator, output_dir, ema, identity = run.accelerator, run.args.output_dir, run.ema, run.identity
    final = os.path.join(output_dir, f"checkpoint-{global_step}")
    tmp = final + ".tmp"
    writer = checkpoint_writer(accelerator, run.node_local)
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
    accelerator.wait_for_everyone()
    shadows = [(EMA_DIR, ema), (SAMPLING_POLICY_DIR, run.sampling_policy)]  # each rank's own state
    try:
        accelerator.save_state(tmp)
        for folder, shadow in shadows:
            if shadow is not None:
                os.makedirs(os.path.join(tmp, folder), exist_ok=True)
                torch.save(shadow.state_dict(), os.path.join(tmp, folder, f"rank{accelerator.process_index}.pt"))
        if in_progress is not None:
            save_update_in_progress(tmp, accelerator.process_index, in_progress)
        export_model(accelerator, run.model, run.policy, tmp, config=run.record, use_lora=run.args.use_lora, ema=ema)
        accelerator.wait_for_everyone()  # every rank's files are in before the folder is complete
        if writer:
            state = {"global_step": global_step, "epoch": epoch, "num_processes": accelerator.num_processes,
                     "format": checkpoint_format(accelerator),
                     "per_rank_dirs": [folder for folder, shadow in shadows if shadow is not None]}
            if in_progress is not None:
                state["per_rank_dirs"].append(EXPERIENCE_DIR)
                state["update_in_progress"] = {"epoch": in_progress.epoch, "micro_steps": in_progress.update.micro_steps}
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump({**state, "run": identity} if identity is not None else state, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
    except Exception as err:
        disk_full = _disk_full(err, output_dir)  # before the cleanup frees the space again
        shutil.rmtree(tmp, ignore_errors=True)  # whichever rank failed: a half checkpoint must not stay
        if isinstance(err, OSError) or disk_full:
            raise CheckpointSaveError(_save_failed_message(err, tmp, output_dir, disk_full)) from err
        raise
    if writer:
        prune_checkpoints(output_dir, total_limit, keep=final)
    accelerator.wait_for_everyone()
    return final


def set_aside_checkpoint(accelerator, output_dir: str, step: int, *, node_local: bool = False) -> str | None:
    """Rename ``checkpoint-<step>`` to ``checkpoint-<step>.nonfinite`` (collective): its weights
    went on to give non-finite samples, so ``--resume_from_checkpoint latest`` must not pick it.
    Returns the new name, None when there was no such checkpoint."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    found = os.path.isdir(final)
    accelerator.wait_for_everyone()  # every rank has looked before the writer renames it
    if found and checkpoint_writer(accelerator, node_local):
        shutil.rmtree(final + NONFINITE_SUFFIX, ignore_errors=True)
        os.replace(final, final + NONFINITE_SUFFIX)
    accelerator.wait_for_everyone()
    return os.path.basename(final + NONFINITE_SUFFIX) if found else None


def read_state(path: str) -> dict:
    """``genrl_state.json`` of checkpoint ``path``: integer ``global_step`` and ``epoch``
    (and ``num_processes``), or one sentence saying what is wrong with it."""
    state_path = os.path.join(path, STATE_FILE)
    try:
        with open(state_path) as f:
            state = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"Cannot resume from {path}: {state_path} is not readable JSON ({err}).") from None
    if not isinstance(state, dict) or not all(isinstance(state.get(k), int) for k in ("global_step", "epoch")):
        raise ValueError(f"Cannot resume from {path}: {state_path} does not hold integer global_step and epoch.")
    return state


def load_checkpoint(accelerator, path: str, ema: EMA | None = None, run: dict[str, Any] | None = None,
                    sampling_policy: EMA | None = None) -> tuple[int, int]:
    """Restore model, optimizer, scheduler, RNG, EMA and soft-updated sampling policy from ``path``; returns
    ``(global_step, epoch)`` of the checkpoint (training continues at ``epoch + 1``).

    Nothing in ``path`` runs code: every pickle file is checked weights-only against a short
    allow-list first (:func:`genrl.checkpoints.safe_load.verify_checkpoint`), and a file that fails is
    refused with :class:`~genrl.checkpoints.safe_load.UnsafeCheckpointError` before Accelerate or
    DeepSpeed opens it. An unreadable RNG state is a logged warning. With ``run``, a checkpoint
    of a run with other arguments is refused (:func:`check_resumable`).
    """
    state = read_state(path)
    if run is not None:
        check_resumable(path, run)
    check_checkpoint_layout(path, accelerator)
    for warning in verify_checkpoint(path, accelerator.process_index):
        logger.warning(warning)
    accelerator.load_state(path)
    if ema is not None:
        ema_path = os.path.join(path, EMA_DIR, f"rank{accelerator.process_index}.pt")
        if not os.path.exists(ema_path):
            raise FileNotFoundError(f"Checkpoint {path!r} has no EMA state ({ema_path}) but --use_ema is set.")
        ema.load_state_dict(load_weights_only(ema_path))
    if sampling_policy is not None:
        sampling_path = os.path.join(path, SAMPLING_POLICY_DIR, f"rank{accelerator.process_index}.pt")
        if not os.path.exists(sampling_path):
            raise FileNotFoundError(
                f"Checkpoint {path!r} has no sampling-policy state ({sampling_path}) but --sampling_policy_decay_rate is set."
            )
        sampling_policy.load_state_dict(load_weights_only(sampling_path))
    return state["global_step"], state["epoch"]


def load_trained_policy(path: str, *, use_ema: bool = False, dtype: torch.dtype = torch.float32,
                        max_sequence_length: int | None = None, image_conditioned: bool | None = None,
                        guidance_options: dict[str, float] | None = None) -> FlowPolicy:
    """A policy from a base model (folder or Hub id), a genrl export, or a checkpoint folder.

    With ``use_ema`` the EMA weights are loaded; asking for them where there are none is a
    ``SetupError`` naming why (no such folder, a base model, a run without EMA).
    ``max_sequence_length``: T5/UMT5 tokens per prompt; None: the training run's, else the
    pipeline's default. ``image_conditioned``: whether the prompts come with conditioning images
    (``load_policy``; None: the pipeline's own class). ``guidance_options`` (Z-Image's
    ``cfg_truncation``, ``cfg_normalization``) override those the run trained with.
    """
    guidance_options = guidance_options or {}
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        if use_ema and not os.path.isdir(path):
            raise SetupError(f"{path!r} is not a folder here: --use_ema reads the EMA weights of a genrl export or "
                             f"checkpoint folder (one holding {CONFIG_FILE}).")
        if use_ema:
            raise SetupError(f"{path!r} holds no {CONFIG_FILE}: it is a base model, not a genrl export or checkpoint, "
                             "so it has no EMA weights; leave out --use_ema.")
        return load_policy(path, dtype=dtype, max_sequence_length=max_sequence_length, sampling_only=True,
                           image_conditioned=image_conditioned, guidance_options=guidance_options)
    with open(config_path) as f:
        config = json.load(f)
    if use_ema and not config.get("has_ema"):
        raise SetupError(f"{path!r} was trained without --use_ema, so it has no EMA weights; leave out --use_ema.")
    trained_args = config.get("args", {})
    if max_sequence_length is None:
        max_sequence_length = trained_args.get("max_sequence_length")
    experts = {k: trained_args[k] for k in ("wan_expert", "guidance_scale_2") if trained_args.get(k) is not None}
    options = {**guidance_options_of(trained_args), **guidance_options}
    policy = load_policy(config["base_model"], dtype=dtype, max_sequence_length=max_sequence_length, sampling_only=True,
                         image_conditioned=image_conditioned, guidance_options=options, **experts)
    suffix, component = "_ema" if use_ema else "", policy.trained_component
    if config["use_lora"] and not hasattr(policy.pipeline, "load_lora_weights"):  # HunyuanVideo 1.5: no LoRA loader
        policy.transformer.load_lora_adapter(path, weight_name=LORA_EMA_FILE if use_ema else LORA_FILE)
        policy.transformer.fuse_lora()
        policy.transformer.unload_lora()
    elif config["use_lora"]:
        into_second = {"load_into_transformer_2": True} if component == "transformer_2" else {}
        policy.pipeline.load_lora_weights(path, weight_name=LORA_EMA_FILE if use_ema else LORA_FILE, **into_second)
        policy.pipeline.fuse_lora(components=[component])
        policy.pipeline.unload_lora_weights()
    else:
        transformer = type(policy.transformer).from_pretrained(os.path.join(path, component + suffix))
        setattr(policy.pipeline, component, transformer)
        policy.transformer = transformer
    return policy
