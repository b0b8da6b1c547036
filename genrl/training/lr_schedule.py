"""The learning-rate flags, counted in optimizer steps.

Users give ``--lr_warmup_steps`` and ``--lr_step_rules`` in optimizer steps. Accelerate's
``AcceleratedScheduler`` steps the scheduler once per process for every optimizer step (it
assumes the batch grew with the processes), under DDP and under DeepSpeed alike (a torch
scheduler is not one DeepSpeed's engine runs itself), so the scheduler's own counts are the
user's times the number of processes.

``--lr_step_rules`` are diffusers' piecewise-constant rules: ``"m1:s1,m2:s2,...,m_last"``
multiplies the learning rate by m1 while the optimizer step is below s1, by m2 below s2, ...,
then by m_last (``diffusers.optimization.get_piecewise_constant_schedule``).
"""

from __future__ import annotations


def parse_step_rules(rules: str) -> tuple[list[tuple[float, int]], float]:
    """``([(m1, s1), (m2, s2), ...], m_last)`` of a rule string; a ``ValueError`` naming the
    expected form for anything else (boundaries must be positive and increasing, multipliers >= 0)."""
    form = '"m1:s1,m2:s2,...,m_last" (e.g. "1:200,0.5": the full rate below optimizer step 200, half after)'
    parts = [p.strip() for p in rules.split(",")]
    try:
        pairs = [(float(m), int(s)) for m, s in (p.split(":") for p in parts[:-1])]
        last = float(parts[-1])
    except ValueError:
        raise ValueError(f"--lr_step_rules {rules!r} is not of the form {form}.") from None
    steps = [s for _, s in pairs]
    if any(s <= 0 for s in steps) or steps != sorted(set(steps)) or any(m < 0 for m, _ in pairs) or last < 0:
        raise ValueError(f"--lr_step_rules {rules!r} needs increasing positive steps and multipliers >= 0: {form}.")
    return pairs, last


def scheduler_step_rules(rules: str, scheduler_steps_per_optimizer_step: int) -> str:
    """``rules`` with every boundary multiplied by ``scheduler_steps_per_optimizer_step`` (the
    number of processes), for diffusers' ``get_scheduler(step_rules=...)``."""
    pairs, last = parse_step_rules(rules)
    factor = scheduler_steps_per_optimizer_step
    return ",".join([f"{m!r}:{s * factor}" for m, s in pairs] + [repr(last)])
