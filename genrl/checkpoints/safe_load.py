"""Resuming reads nothing that can run code.

A torch file is a pickle, and a pickle may name any Python callable to be called while it
loads (``__reduce__``). Checkpoints travel through the Hub, so ``--resume_from_checkpoint``
treats them as untrusted. Accelerate reads its own states weights-only, but DeepSpeed reads
its model and optimizer states with ``weights_only=False``. Rather than depend on how each
library calls ``torch.load``, :func:`verify_checkpoint` first reads every pickle file of the
checkpoint with torch's weights-only unpickler, tensors mapped to the meta device (so no
tensor data is read and the check costs little). That unpickler builds tensors, containers
and plain values, plus the short allow-list of :func:`allowed_globals`, and nothing else; a
file naming anything outside it is refused before any library opens it.
"""

from __future__ import annotations

import codecs
import os
import pickle
import re
from typing import Any

import numpy as np
import torch

# File names under which torch.save / pickle output is stored (safetensors and JSON are
# parsed by code that cannot call anything, so they need no check).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_RNG_STATE_RE = re.compile(r"^random_states_(\d+)\.pkl$")


class UnsafeCheckpointError(ValueError):
    """A checkpoint file could run code when loaded, or cannot be read at all."""


def allowed_globals() -> list:
    """The non-tensor types a genrl checkpoint needs, and nothing else.

    - numpy arrays and dtypes, and ``codecs.encode`` (how numpy pickles its bytes): the
      NumPy random state in Accelerate's ``random_states_<rank>.pkl``, the same list
      Accelerate itself loads those files with;
    - DeepSpeed's loss scaler, ZeRO stage enum and fragment address: plain values stored in
      its ZeRO optimizer states (only when DeepSpeed is installed).

    Each is a plain value type: rebuilding it sets attributes, it calls nothing else.
    """
    allowed: list = [np.ndarray, np.dtype, codecs.encode]
    allowed.append(np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct)
    if hasattr(np, "dtypes"):
        allowed.append(np.dtypes.UInt32DType)  # dtype of the Mersenne Twister state
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # no DeepSpeed, no DeepSpeed states to read
        return allowed
    return allowed + [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_weights_only(path: str, map_location: Any = "cpu") -> Any:
    """``torch.load`` that builds only tensors, plain values and :func:`allowed_globals`.

    Raises:
        UnsafeCheckpointError: the file names anything else (it could run code when loaded
            by a plain ``torch.load``), or is a pickle the weights-only reader cannot follow.
        Other errors (a truncated or corrupt file) pass through as torch raised them.
    """
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if "WeightsUnpickler error" not in str(err):
            raise
        # torch's message spans a page; keep what it found.
        found = re.search(r"GLOBAL (\S+) was not an allowed global", str(err))
        if found:
            what = f"calls {found.group(1)} when unpickled, which a weights-only load refuses (it could run code)"
        else:
            what = "is not a pickle a weights-only load can read (it is corrupt, or built to run code)"
        raise UnsafeCheckpointError(f"{path} {what}") from None


def pickle_files(checkpoint: str) -> list[str]:
    """Every file under ``checkpoint`` stored as a pickle, sorted."""
    found = []
    for root, _, files in os.walk(checkpoint):
        found += [os.path.join(root, f) for f in files if f.endswith(PICKLE_SUFFIXES)]
    return sorted(found)


def verify_checkpoint(checkpoint: str, process_index: int) -> list[str]:
    """Check that resuming from ``checkpoint`` loads no code: every pickle file in it is read
    weights-only (tensors on the meta device) before Accelerate or DeepSpeed opens it.

    Returns:
        Warnings to log: this rank's RNG state is missing or unreadable (the run resumes
        with fresh random states, so it is not bit-identical to an uninterrupted one).

    Raises:
        UnsafeCheckpointError: one sentence naming the file that could run code, or that
            cannot be read (for any file but an RNG state).
    """
    warnings = []
    files = pickle_files(checkpoint)
    own_rng = os.path.join(checkpoint, f"random_states_{process_index}.pkl")
    if own_rng not in files:
        warnings.append(f"{own_rng} is missing: resuming with fresh random states.")
    for path in files:
        try:
            load_weights_only(path, map_location="meta")
        except UnsafeCheckpointError as err:
            raise UnsafeCheckpointError(
                f"Refusing to resume from {checkpoint}: {err}; resume only from checkpoints you wrote or trust."
            ) from None
        except Exception as err:  # truncated, corrupt, not a torch file
            if _RNG_STATE_RE.match(os.path.basename(path)):
                if path == own_rng:
                    warnings.append(f"Could not read {path} ({type(err).__name__}): resuming with fresh random states.")
                continue
            raise UnsafeCheckpointError(
                f"Cannot resume from {checkpoint}: {path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0]})."
            ) from err
    return warnings
