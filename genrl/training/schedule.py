"""The run's arithmetic: how many samples, timesteps, backward passes and optimizer steps the
flags make, computed once from the parsed arguments and logged once at start."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from genrl.data.sampler import trained_samples_per_epoch
from genrl.training.train_args import num_trained_timesteps


def backward_passes_per_step(args: argparse.Namespace) -> int:
    """Backward passes per optimizer step: ``--gradient_accumulation_steps`` × trained timesteps
    per sample, since every trained timestep of every micro batch is one backward pass of the
    accumulation. The Accelerator needs it before the process count (and so the schedule) is known."""
    return args.gradient_accumulation_steps * num_trained_timesteps(args)


@dataclass(frozen=True)
class RunSchedule:
    """What one run's flags add up to, per process unless named otherwise.

    - ``samples_per_epoch`` = ``--rollout_batch_size`` × ``--rollout_batches_per_epoch``
      (sampled by each process);
    - ``trained_samples_per_epoch`` = ``samples_per_epoch`` / ``--group_size`` groups ×
      ``--train_samples_per_group`` (every sample without it);
    - ``timesteps_per_sample``: the objective's trained timesteps per sample;
    - ``backward_passes_per_step`` = ``--gradient_accumulation_steps`` × ``timesteps_per_sample``;
    - ``steps_per_epoch`` = max(1, ``--num_inner_epochs`` × (``trained_samples_per_epoch`` //
      ``--train_batch_size``) // ``--gradient_accumulation_steps``);
    - ``planned_steps`` = min(``--num_epochs`` × ``steps_per_epoch``, ``--max_train_steps``):
      an upper bound, ``--filter_zero_advantage`` may make a run take fewer.
    """

    num_prompts: int
    num_processes: int
    group_size: int
    train_samples_per_group: int | None
    samples_per_epoch: int
    trained_samples_per_epoch: int
    timesteps_per_sample: int
    gradient_accumulation_steps: int
    backward_passes_per_step: int
    steps_per_epoch: int
    planned_steps: int

    @classmethod
    def from_args(cls, args: argparse.Namespace, num_processes: int, num_prompts: int) -> RunSchedule:
        """The schedule of a run with the parsed ``args`` over ``num_processes`` processes and a
        prompt set of ``num_prompts`` prompts."""
        samples = args.rollout_batch_size * args.rollout_batches_per_epoch
        trained = trained_samples_per_epoch(args.rollout_batch_size, args.rollout_batches_per_epoch, args.group_size,
                                            args.train_samples_per_group)
        per_epoch = max(1, args.num_inner_epochs * (trained // args.train_batch_size) // args.gradient_accumulation_steps)
        total = args.num_epochs * per_epoch
        return cls(
            num_prompts=num_prompts, num_processes=num_processes, group_size=args.group_size,
            train_samples_per_group=args.train_samples_per_group, samples_per_epoch=samples,
            trained_samples_per_epoch=trained, timesteps_per_sample=num_trained_timesteps(args),
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            backward_passes_per_step=backward_passes_per_step(args), steps_per_epoch=per_epoch,
            planned_steps=min(total, args.max_train_steps) if args.max_train_steps is not None else total,
        )

    @property
    def samples_per_epoch_all_processes(self) -> int:
        """Samples sampled per epoch by all processes together: ``samples_per_epoch`` × ``num_processes``."""
        return self.samples_per_epoch * self.num_processes

    def summary(self) -> str:
        """The block logged once at start, in the style of the diffusers training examples."""
        trained = ""
        if self.train_samples_per_group:
            trained = (f" ({self.trained_samples_per_epoch} trained: the {self.train_samples_per_group} of each group "
                       f"whose rewards vary most)")
        return "\n".join([
            "***** Running training *****",
            f"  Num prompts = {self.num_prompts}",
            f"  Num processes = {self.num_processes}",
            f"  Group size = {self.group_size}",
            f"  Samples per process per epoch = {self.samples_per_epoch}{trained}",
            f"  Trained timesteps per sample = {self.timesteps_per_sample}",
            # The lower-case phrase also marks, for the launch tests, that the models have loaded.
            f"  Backward passes per optimizer step = {self.backward_passes_per_step} (gradient accumulation "
            f"{self.gradient_accumulation_steps} × {self.timesteps_per_sample} trained "
            f"timesteps per sample)",
            f"  Optimizer steps per epoch = {self.steps_per_epoch}",
            f"  Total optimization steps = {self.planned_steps}",
        ])
