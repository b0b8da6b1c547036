"""Pre-emption: SIGTERM, SIGUSR1 and SIGINT end a run in a checkpoint, not in lost work.

Clusters signal a job before they kill it (SLURM: SIGTERM, or the signal of
``--signal=USR1@N``; Kubernetes: SIGTERM, then ``terminationGracePeriodSeconds``). The handler
only notes the signal; the trainer asks :meth:`PreemptionWatch.agreed` at its safe points (before
each rollout batch, after each optimizer step), a collective, so that every rank stops at the same
point even when the signal reached only some of them, and no rank ever saves alone.

At a safe point the weights are those after a whole optimizer step: during the rollouts, those of
the last finished epoch (the rollout is dropped and redone on resume, with the global random state
of the epoch's start restored first, so the resumed run is the uninterrupted one); inside an
update, the step's, and the checkpoint keeps the epoch's samples to finish the update on resume
(:mod:`genrl.checkpoints.update_checkpoint`). A second signal while the run is stopping is noted and ignored: the checkpoint is
written to ``<name>.tmp`` and renamed when complete, so only SIGKILL can cut it short, and then the
earlier checkpoints are intact.
"""

from __future__ import annotations

import logging
import random
import signal
from typing import Any

import numpy as np
import torch

from genrl.training.nan_guard import all_ranks

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def preempted_exit_code(signum: int) -> int:
    """The exit status of a run stopped by signal ``signum``: 128 + signum (143 for SIGTERM, 138 for
    SIGUSR1, 130 for SIGINT), what a shell, ``accelerate launch`` and torchrun report for it."""
    return 128 + int(signum)


class Preempted(Exception):
    """Raised at a safe point inside a phase (the rollouts) when every rank agreed to stop."""


class PreemptionWatch:
    """Notes the first stop signal; :meth:`agreed` tells every rank whether any rank got one.

    Args:
        signals: the signals to catch (installed by :meth:`install`, restored by :meth:`restore`).
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = signals
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "PreemptionWatch":
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._note)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _note(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            logger.warning(f"Received {name}: stopping after the current optimizer step with a checkpoint.")
        else:  # a second signal must not cut the checkpoint short
            logger.warning(f"Received {name} again: already stopping; the checkpoint is being written.")

    def agreed(self, accelerator) -> bool:
        """Whether any rank received a stop signal; every rank gets the same answer (one gather),
        and once it is True every rank's :attr:`signum` is set (the lowest signal received)."""
        if all_ranks(accelerator, self.signum is None):
            return False
        received = torch.tensor([float(self.signum or 1e9)], device=accelerator.device)
        self.signum = int(accelerator.gather(received).min().item())
        return True

    @property
    def exit_code(self) -> int:
        return preempted_exit_code(self.signum or signal.SIGTERM)


def capture_rng_states() -> dict[str, Any]:
    """The global random states a checkpoint records (Python, NumPy, torch, CUDA), so that a run
    stopped in the middle of a phase can save those of the phase's start."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Set the global random states to ``states`` (:func:`capture_rng_states`)."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def preempted_message(step: int, checkpoint: str | None, signum: int) -> str:
    """The one sentence a pre-empted run prints: the step it stopped at and the checkpoint holding
    it (None: none was saved, as no optimizer step was taken yet or the last one was non-finite)."""
    name = signal.Signals(signum).name
    if checkpoint is None:
        return (f"Pre-empted by {name} at step {step}: no checkpoint of this step was saved (no optimizer step was taken, "
                "or the last one was non-finite); continue with --resume_from_checkpoint latest.")
    return f"Pre-empted by {name} at step {step}: saved {checkpoint}; continue with --resume_from_checkpoint latest."
