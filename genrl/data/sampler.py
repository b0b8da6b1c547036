"""Prompt-group sampling: every rank gets whole groups of K copies of a prompt.

GRPO normalises a sample's reward against the other samples of its prompt, so the K
copies of a prompt are generated on one rank (group statistics never need a partial
group) and every rank runs the same number of equally sized batches (collectives stay in
step). The epoch's draw of prompts is the same on every rank; ranks take contiguous
blocks of it.
"""

from __future__ import annotations

import math

import torch

from genrl.data.seeding import mix_seeds

# What the trainer calls each size: errors name the flag to change, not this function's argument.
FLAGS = {
    "group_size": "--group_size",
    "train_batch_size": "--rollout_batch_size",
    "batches_per_epoch": "--rollout_batches_per_epoch",
    "num_processes": "the number of processes (--num_processes)",
}


def check_batch_sizes(
    *,
    group_size: int,
    train_batch_size: int,
    num_processes: int,
    batches_per_epoch: int,
    num_prompts: int | None = None,
    train_micro_batch_size: int | None = None,
    train_samples_per_group: int | None = None,
) -> None:
    """Refuse batch sizes under which prompt groups would be split or ranks would drift.

    ``train_batch_size`` is the number of samples per rollout batch per process (the trainer's
    ``--rollout_batch_size``), so one rank produces ``train_batch_size * batches_per_epoch``
    samples per epoch. That count must be a multiple of ``group_size`` (whole groups per rank)
    and, when given, of ``train_micro_batch_size`` (``--train_batch_size`` ×
    ``--gradient_accumulation_steps``: whole optimizer steps in the update); with
    ``train_samples_per_group`` m (2 <= m <= ``group_size``), the m trained samples of each group
    are what must make whole optimizer steps. Each error is one
    sentence naming the trainer flag to change and a value that passes every check.
    """
    for name, value in (
        ("group_size", group_size),
        ("train_batch_size", train_batch_size),
        ("num_processes", num_processes),
        ("batches_per_epoch", batches_per_epoch),
    ):
        if value < 1:
            raise ValueError(f"{FLAGS[name]} must be a positive integer, got {value}.")
    if group_size < 2:
        raise ValueError(
            f"--group_size must be at least 2 (GRPO compares the samples of one prompt), got {group_size}; 8 is the default."
        )
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"The prompt set is empty (num_prompts={num_prompts}); give at least one prompt.")
    if train_micro_batch_size is not None and train_micro_batch_size < 1:
        raise ValueError(
            f"--train_batch_size × --gradient_accumulation_steps must be a positive integer, got {train_micro_batch_size}."
        )

    per_rank = train_batch_size * batches_per_epoch
    rollout = f"--rollout_batch_size {train_batch_size} × --rollout_batches_per_epoch {batches_per_epoch} = {per_rank}"
    if per_rank % group_size:
        suggestion = suggest_rollout_batch_size(group_size, train_batch_size, batches_per_epoch, train_micro_batch_size)
        raise ValueError(
            f"{rollout} samples per process per epoch is not a multiple of --group_size {group_size}, so a prompt's "
            f"group would be split; use e.g. --rollout_batch_size {suggestion}."
        )
    if train_samples_per_group is not None:
        m = train_samples_per_group
        if not 2 <= m <= group_size:
            raise ValueError(
                f"--train_samples_per_group must be between 2 (a group's advantages need two samples) and --group_size "
                f"{group_size} (which trains every sample), got {m}."
            )
        trained = trained_samples_per_epoch(train_batch_size, batches_per_epoch, group_size, m)
        if train_micro_batch_size is not None and trained % train_micro_batch_size:
            raise ValueError(
                f"--train_samples_per_group {m} of each of the {per_rank // group_size} groups per process per epoch "
                f"is {trained} samples, not a multiple of --train_batch_size × --gradient_accumulation_steps = "
                f"{train_micro_batch_size}; change one of them or --rollout_batches_per_epoch."
            )
        return
    if train_micro_batch_size is not None and per_rank % train_micro_batch_size:
        below = max(d for d in range(1, train_micro_batch_size) if per_rank % d == 0)
        raise ValueError(
            f"--train_batch_size × --gradient_accumulation_steps = {train_micro_batch_size} does not divide the "
            f"{rollout} samples per process per epoch; use e.g. --train_batch_size {below} --gradient_accumulation_steps 1."
        )


def trained_samples_per_epoch(
    rollout_batch_size: int, batches_per_epoch: int, group_size: int, train_samples_per_group: int | None = None
) -> int:
    """Samples one process trains per epoch: its groups (``rollout_batch_size`` ×
    ``batches_per_epoch`` / ``group_size``) × ``train_samples_per_group``, or every sample without it."""
    groups = rollout_batch_size * batches_per_epoch // group_size
    return groups * (train_samples_per_group or group_size)


def suggest_rollout_batch_size(
    group_size: int, rollout_batch_size: int, batches_per_epoch: int, micro_batch_size: int | None = None
) -> int:
    """The smallest rollout batch size >= ``rollout_batch_size`` whose epoch (× ``batches_per_epoch``)
    holds whole groups and, when given, whole ``micro_batch_size`` micro batches."""
    step = group_size // math.gcd(group_size, batches_per_epoch)
    size = -(-rollout_batch_size // step) * step
    while micro_batch_size and (size * batches_per_epoch) % micro_batch_size:
        size += step  # ends by step * micro_batch_size at the latest
    return size


class PromptGroupSampler:
    """This rank's rollout batches of ``(prompt_index, index_in_group)`` pairs for an epoch.

    Per epoch, G = num_processes * batches_per_epoch * batch_size / group_size prompts are
    drawn with a generator seeded from ``mix_seeds(seed, epoch)``: the same draw on every
    rank, without replacement while prompts last (fresh permutations are appended when G
    exceeds the prompt count). Rank r takes the r-th contiguous block of G / num_processes
    groups, lays them out group after group (index_in_group 0..K-1) and cuts the list into
    ``batches_per_epoch`` batches of ``batch_size``.
    """

    def __init__(
        self,
        num_prompts: int,
        group_size: int,
        batch_size: int,
        batches_per_epoch: int,
        num_processes: int,
        rank: int,
        seed: int,
    ):
        check_batch_sizes(
            group_size=group_size,
            train_batch_size=batch_size,
            num_processes=num_processes,
            batches_per_epoch=batches_per_epoch,
            num_prompts=num_prompts,
        )
        if not 0 <= rank < num_processes:
            raise ValueError(f"rank {rank} is outside [0, {num_processes}) for {num_processes} processes.")
        self.num_prompts = num_prompts
        self.group_size = group_size
        self.batch_size = batch_size
        self.batches_per_epoch = batches_per_epoch
        self.num_processes = num_processes
        self.rank = rank
        self.seed = seed
        self.groups_per_rank = batch_size * batches_per_epoch // group_size
        self.num_groups = self.groups_per_rank * num_processes

    def repeats_warning(self) -> str | None:
        """One sentence when an epoch asks for more groups than there are prompts, else None.

        Seeds follow (run seed, epoch, prompt, index in group) alone (the design's seeding
        contract), so a prompt drawn twice in an epoch samples the same images twice: the
        repeat costs its rollouts and doubles the prompt's weight in the update, and teaches
        nothing new."""
        if self.num_groups <= self.num_prompts:
            return None
        return (
            f"Each epoch draws {self.num_groups} prompt groups ({self.num_processes} process(es) x "
            f"{self.groups_per_rank}) from {self.num_prompts} prompt{'s' if self.num_prompts != 1 else ''}, so prompts "
            f"repeat within an epoch and a repeat samples exactly the images of its first draw (seeds follow the prompt, "
            f"run seed, epoch and index in the group); give at least {self.num_groups} prompts, or fewer groups per epoch "
            f"(--rollout_batch_size x --rollout_batches_per_epoch / --group_size per process)."
        )

    def epoch_groups(self, epoch: int) -> list[int]:
        """The epoch's G prompt indices in dealing order, identical on every rank."""
        generator = torch.Generator(device="cpu").manual_seed(mix_seeds(self.seed, epoch))
        draws = []
        drawn = 0
        while drawn < self.num_groups:
            draws.append(torch.randperm(self.num_prompts, generator=generator))
            drawn += self.num_prompts
        return torch.cat(draws)[: self.num_groups].tolist()

    def batches(self, epoch: int) -> list[list[tuple[int, int]]]:
        """This rank's ``batches_per_epoch`` batches, each ``batch_size`` pairs
        ``(prompt_index, index_in_group)``."""
        start = self.rank * self.groups_per_rank
        groups = self.epoch_groups(epoch)[start : start + self.groups_per_rank]
        samples = [(prompt, k) for prompt in groups for k in range(self.group_size)]
        size = self.batch_size
        return [samples[i : i + size] for i in range(0, len(samples), size)]

    def group_ids(self) -> torch.Tensor:
        """``(B,)`` long: the epoch-wide group of each of this rank's samples, in the order of
        ``batches`` (B = batch_size * batches_per_epoch). Groups are numbered by position in the
        epoch's draw, not by prompt, so a prompt drawn twice makes two groups; rank r holds groups
        ``r * groups_per_rank`` to ``(r + 1) * groups_per_rank - 1``, ``group_size`` samples each."""
        first = self.rank * self.groups_per_rank
        return torch.arange(first, first + self.groups_per_rank).repeat_interleave(self.group_size)
