"""Training one expert of a two-expert model (Wan 2.2 A14B): every objective trains only the
steps that expert denoises; the frozen expert samples the others.

- nft and awm draw their trained timesteps among the sampling steps whose noise level lies in
  ``--train_sigma_range``: that range is cut to the expert's noise levels;
- grpo trains the recorded stochastic steps: its SDE window (``--sde_window_size`` steps within
  ``--sde_window_range``) must lie among the expert's steps, or a recorded step would be
  trained with a transformer that did not take it. The window is not moved silently: the
  sentence says which steps are the expert's.
"""

from __future__ import annotations

from genrl.errors import SetupError
from genrl.policies.base import FlowPolicy
from genrl.training.rollout import SamplingConfig


def intersect_sigma_ranges(given: tuple[float, float] | None, expert: tuple[float, float]) -> tuple[float, float] | None:
    """[max(lo), min(hi)] of ``given`` (None: all noise levels) and ``expert``; None when empty."""
    if given is None:
        return expert
    lo, hi = max(given[0], expert[0]), min(given[1], expert[1])
    return (lo, hi) if lo < hi else None


def expert_sigma_range(policy: FlowPolicy, objective: str, sampling: SamplingConfig,
                       train_sigma_range: list[float] | tuple[float, float] | None) -> tuple[float, float] | None:
    """The ``train_sigma_range`` the update uses: ``train_sigma_range`` itself, cut to the trained
    expert's noise levels when the policy trains one expert of two (nft, awm); for grpo, a check
    that the SDE window lies among the expert's steps. A SetupError of one sentence otherwise."""
    given = tuple(train_sigma_range) if train_sigma_range else None
    expert = policy.trained_sigma_range()
    if expert is None:
        return given
    first, end = policy.trained_steps(sampling.num_inference_steps)
    name = f"--wan_expert {getattr(policy, 'expert', '')}".rstrip()
    if objective == "grpo":
        lo, hi = sampling.sde_window_range
        hi = sampling.num_inference_steps - 1 if hi is None else hi
        last = min(end, sampling.num_inference_steps - 1)  # the final step is never stochastic
        if not sampling.sde_window_size or lo < first or hi > last or hi - lo < sampling.sde_window_size:
            raise SetupError(
                f"{name} denoises steps {first} to {end - 1} of {sampling.num_inference_steps}, so GRPO's recorded steps must "
                f"lie among them: give --sde_window_size at most {max(0, last - first)} and --sde_window_range {first} {last} "
                f"(now {sampling.sde_window_size} and {lo} {hi})."
            )
        return given
    cut = intersect_sigma_ranges(given, expert)
    if cut is None:
        raise SetupError(f"--train_sigma_range {given[0]} {given[1]} holds none of the noise levels {name} denoises "
                         f"({expert[0]:.4g} to {expert[1]:.4g}).")
    return cut
