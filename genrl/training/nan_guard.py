"""NaN and Inf are caught where they appear, never trained on, checkpointed or exported.

A non-finite loss or gradient norm skips that optimizer step (the weights stay those of the
last finite step), and ``limit`` such steps in a row stop the run with one sentence naming
the step and the likely cause. Samples that come out of the policy non-finite stop the run at
once: the weights themselves no longer give finite outputs. Every decision is taken on a flag
reduced over all ranks, so all ranks take the same branch and ZeRO's collectives stay in step.
"""

from __future__ import annotations

import logging
import math

import torch

from genrl.errors import SetupError

logger = logging.getLogger(__name__)

MAX_NONFINITE_STEPS = 3


class NonFiniteError(SetupError):
    """Training produced NaN or Inf and was stopped before the weights were saved; the scripts
    print the one sentence (a setting to change, usually the learning rate), no traceback."""


def all_ranks(accelerator, flag: bool) -> bool:
    """True when ``flag`` is True on every rank; every rank gets the same answer (one gather)."""
    gathered = accelerator.gather(torch.tensor([float(flag)], device=accelerator.device))
    return bool(gathered.min().item() > 0)


def is_finite(value) -> bool:
    """Whether a loss or norm (tensor, float or None) is finite; None (nothing computed) is."""
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value.detach()).all())
    return math.isfinite(float(value))


class NonFiniteGuard:
    """Counts consecutive optimizer steps with a non-finite loss or gradient norm.

    Args:
        learning_rate: named in the stop message (the usual cause of diverged weights).
        limit: non-finite steps in a row that stop the run.
    """

    def __init__(self, learning_rate: float, limit: int = MAX_NONFINITE_STEPS):
        self.learning_rate = learning_rate
        self.limit = limit
        self.consecutive = 0
        self.skipped = 0  # in total, for the logs
        self.what = "loss"  # of the last non-finite step

    def check_step(self, accelerator, step: int, loss_finite: bool, grad_norm) -> bool:
        """Call at every optimizer step (the accumulation boundary), on every rank, after the
        gradient norm is known. ``loss_finite``: every loss of the step's micro batches was.

        Returns whether the step may be applied. Raises :class:`NonFiniteError` when this is
        the ``limit``-th non-finite step in a row.
        """
        if all_ranks(accelerator, loss_finite and is_finite(grad_norm)):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped += 1
        self.what = "loss" if not all_ranks(accelerator, loss_finite) else "gradient norm"
        if self.consecutive >= self.limit:
            raise NonFiniteError(self.stop_message(step))
        if accelerator.is_main_process:
            logger.warning(
                f"Step {step}: non-finite {self.what}; the optimizer step was skipped "
                f"({self.consecutive} in a row, the run stops at {self.limit})."
            )
        return False

    def stop_message(self, step: int) -> str:
        """One sentence: where it stopped, what was non-finite, the likely cause, what was kept."""
        steps = f"{self.consecutive} optimizer steps" if self.consecutive > 1 else "optimizer step"
        return (
            f"Stopped at step {step}: the last {steps} had a non-finite {self.what}, "
            f"so the weights diverged, most likely because --learning_rate {self.learning_rate:g} is too high "
            "for these rewards; nothing after the last finite step was saved."
        )

    def check_samples(self, accelerator, samples: torch.Tensor, epoch: int, step: int) -> None:
        """Stop (on every rank) when the policy's decoded samples hold NaN or Inf: the weights
        no longer give finite outputs, and no reward should score them."""
        if all_ranks(accelerator, is_finite(samples)):
            return
        raise NonFiniteSamples(samples_stop_message(epoch, step, self.learning_rate), epoch=epoch, step=step)


class NonFiniteSamples(NonFiniteError):
    """The policy's samples in ``epoch``, from the weights after optimizer step ``step``, were NaN or infinite."""

    def __init__(self, message: str, *, epoch: int, step: int):
        super().__init__(message)
        self.epoch, self.step = epoch, step


def samples_stop_message(epoch: int, step: int, learning_rate: float, *, set_aside: str | None = None,
                         resumed_from: str | None = None, last_good: str | None = None) -> str:
    """One sentence for weights that gave non-finite samples. ``resumed_from``: they are the
    weights of that checkpoint, untrained since (a checkpoint of diverged weights, not this run's
    learning rate); ``set_aside``: the checkpoint of these weights was renamed so that ``latest``
    skips it; ``last_good``: the newest checkpoint left."""
    kept = f"; the last good checkpoint is {last_good}" if last_good else ""
    if resumed_from is not None:
        aside = f" (set aside as {set_aside})" if set_aside else ""
        return (f"Stopped in epoch {epoch}: the weights resumed from {resumed_from} give NaN or infinite samples before any "
                f"training step, so that checkpoint holds diverged weights{aside}{kept}: resume from an earlier checkpoint "
                "or start afresh.")
    saved = (f"{set_aside.removesuffix('.nonfinite')}, written from these weights, was set aside as {set_aside} so that "
             f"--resume_from_checkpoint latest skips it{kept}") if set_aside else f"nothing from these weights was saved{kept}"
    return (f"Stopped in epoch {epoch} after step {step}: the policy's samples are NaN or infinite, so the weights diverged, "
            f"most likely because --learning_rate {learning_rate:g} is too high; {saved}.")
