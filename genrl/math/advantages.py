"""GRPO advantages over one epoch's rewards, gathered from all ranks, and the choice of the
samples to train on.

Inputs are the already-gathered ``(N,)`` rewards of the epoch and the ``(N,)`` id of the
prompt group each sample belongs to. Standard deviations are population stds
(``unbiased=False``: divide by the group size, not size - 1), so a group of identical
rewards has std 0 and a group of two rewards {a, b} has std |a - b| / 2.
"""

from __future__ import annotations

import torch

STD_MODES = ("group", "global", "max_group")
# "sum": weighted sum of the raw rewards, then normalise the sum.
# "normalize_each": normalise every reward on its own, then take the weighted sum.
COMBINE_MODES = ("sum", "normalize_each")


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    """Per-sample group mean, per-group population std and per-group "all equal" flag.

    Returns ``(mean (N,), std (G,), constant (G,), inverse (N,))`` with G distinct groups and
    ``inverse`` mapping each sample to its group.
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be (N,), got {tuple(rewards.shape)} and {tuple(group_ids.shape)}."
        )
    if rewards.numel() == 0:
        raise ValueError("Got no rewards; an epoch needs at least one sample.")
    if not torch.isfinite(rewards).all():
        bad = int((~torch.isfinite(rewards)).sum())
        raise ValueError(f"{bad} of {rewards.numel()} rewards are NaN or infinite; fix the reward function.")
    r = rewards.detach().double()  # N is small; float64 keeps the group means exact enough
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    sums = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, r)
    mean = sums / counts
    sq = torch.zeros_like(sums).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    std = torch.sqrt(sq / counts)
    # Exact test: float rounding can make the std of equal rewards a hair above 0.
    lo = torch.full_like(sums, float("inf")).scatter_reduce(0, inverse, r, reduce="amin")
    hi = torch.full_like(sums, float("-inf")).scatter_reduce(0, inverse, r, reduce="amax")
    return mean[inverse], std, lo == hi, inverse


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, std_mode: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """GRPO advantages, float32 ``(N,)``.

    A_i = (r_i - mean_g(i)) / (s + eps), with mean_g the mean reward of sample i's group and
    s the population std of
      - ``"group"``: sample i's group,
      - ``"global"``: all N rewards,
      - ``"max_group"``: the group with the largest std.
    A group whose rewards are all equal carries no signal: its advantages are exactly 0.
    """
    if std_mode not in STD_MODES:
        raise ValueError(f"Unknown std_mode {std_mode!r}; expected one of {STD_MODES}.")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}.")
    mean, group_std, constant, inverse = _group_stats(rewards, group_ids)
    r = rewards.detach().double()
    if std_mode == "group":
        std = group_std[inverse]
    elif std_mode == "global":
        std = r.std(unbiased=False).expand_as(r)
    else:
        std = group_std.max().expand_as(r)
    adv = (r - mean) / (std + eps)
    adv = torch.where(constant[inverse], torch.zeros_like(adv), adv)
    return adv.float()


def combine_rewards(
    rewards: dict[str, torch.Tensor],
    weights: dict[str, float],
    group_ids: torch.Tensor,
    mode: str,
    std_mode: str = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Advantages ``(N,)`` from several named ``(N,)`` rewards with weights w_k.

    ``"sum"``:            A = adv(sum_k w_k r_k)
    ``"normalize_each"``: A = sum_k w_k adv(r_k)
    where adv is :func:`group_advantages` with ``std_mode`` and ``eps``.
    """
    if mode not in COMBINE_MODES:
        raise ValueError(f"Unknown reward combine mode {mode!r}; expected one of {COMBINE_MODES}.")
    if not rewards:
        raise ValueError("Got no rewards to combine; give at least one named reward.")
    if set(weights) != set(rewards):
        raise ValueError(
            f"Reward weights are given for {sorted(weights)} but the rewards are {sorted(rewards)}; "
            "give exactly one weight per reward."
        )
    if mode == "sum":
        total = sum(weights[name] * r.detach().double() for name, r in rewards.items())
        return group_advantages(total, group_ids, std_mode=std_mode, eps=eps)
    return sum(
        weights[name] * group_advantages(r, group_ids, std_mode=std_mode, eps=eps) for name, r in rewards.items()
    )


def fill_abstentions(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``(N,)`` rewards with each NaN (a reward that abstained on that sample) replaced by the mean
    of the finite rewards of its prompt group, r_i <- mean_{j in g(i), r_j finite} r_j, so that the
    sample carries no signal of this reward (its group-normalised advantage is 0, up to rounding); a group with no
    finite reward gets 0 throughout (a constant group: advantage 0). Rewards without NaN come back
    unchanged."""
    missing = rewards.isnan()
    if not missing.any():
        return rewards
    _, inverse = torch.unique(group_ids, return_inverse=True)
    known = (~missing).to(torch.float64)
    values = torch.where(missing, torch.zeros_like(rewards), rewards).to(torch.float64)
    sums = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64).index_add_(0, inverse, values)
    counts = torch.zeros_like(sums).index_add_(0, inverse, known)
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return torch.where(missing, means[inverse].to(rewards.dtype), rewards)


def clip_advantages(adv: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """A clipped to [-adv_clip_max, adv_clip_max]."""
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}.")
    return adv.clamp(-adv_clip_max, adv_clip_max)


def zero_std_ratio(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of groups whose rewards are all equal (std 0): groups that teach nothing."""
    _, _, constant, _ = _group_stats(rewards, group_ids)
    return constant.double().mean().item()


def balanced_keep_mask(advantages: torch.Tensor, micro_batch_size: int, eps: float = 1e-8) -> torch.Tensor:
    """Which samples each rank trains on, ``(P, n)`` bool for ``(P, n)`` advantages (row p =
    rank p's samples, as gathered).

    Informative samples have |A| > eps. Every rank keeps the same count
        c = min(ceil(max_p informative_p / m) * m, floor(n / m) * m), at least m,
    with m = ``micro_batch_size``, so all ranks run the same number of micro batches and
    ZeRO collectives never deadlock. A rank with fewer than c informative samples re-admits
    its zero-advantage samples, lowest index first; a rank with more (only possible through
    the cap) drops its smallest-|A| ones (ties: higher index dropped first). The padding
    samples have A = 0 and so contribute no policy gradient (a KL term, if any, still
    applies to them); they are there to keep the ranks in step.
    If no sample anywhere is informative, every rank keeps its first m samples.
    """
    if advantages.ndim != 2:
        raise ValueError(f"advantages must be (num_processes, samples_per_rank), got {tuple(advantages.shape)}.")
    num_ranks, n = advantages.shape
    if micro_batch_size < 1 or micro_batch_size > n:
        raise ValueError(
            f"micro_batch_size must be in [1, {n}] for {n} samples per rank, got {micro_batch_size}."
        )
    magnitude = advantages.detach().abs().float()
    informative = magnitude > eps
    m = micro_batch_size
    most = int(informative.sum(dim=1).max())
    count = min(-(-most // m) * m, n // m * m)
    count = max(count, m)

    keep = torch.zeros(num_ranks, n, dtype=torch.bool, device=advantages.device)
    for p in range(num_ranks):
        # Priority: informative by |A| descending, then the rest by index ascending.
        score = torch.where(informative[p], magnitude[p], torch.full_like(magnitude[p], -1.0))
        order = torch.sort(score, descending=True, stable=True).indices
        keep[p, order[:count]] = True
    return keep


def max_variance_subset(scores: torch.Tensor, group_ids: torch.Tensor, size: int) -> torch.Tensor:
    """PODS's max-variance down-sampling (Xu et al. 2025, "Not All Rollouts are Useful",
    arXiv:2504.13818): which ``size`` samples of every prompt group to train on, ``(N,)`` bool for
    ``(N,)`` ``scores`` (rewards or their advantages) and ``group_ids``.

    Of a group's n scores in order, s_(1) <= ... <= s_(n), the m = ``size`` of largest population
    variance are the j lowest and the m - j highest for some j in [0, m] (PODS's lemma), so the
    m + 1 splits are tried:

        S_j = {s_(1), ..., s_(j)} u {s_(n-m+j+1), ..., s_(n)},   j* = argmax_j Var(S_j).

    Ties go to the most even split (|2j - m| smallest), then the lower j; equal scores are
    ordered by index, so the choice is deterministic (a group of equal scores keeps its first
    floor(m / 2) and last m - floor(m / 2) samples).
    """
    if scores.ndim != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores and group_ids must both be (N,), got {tuple(scores.shape)} and {tuple(group_ids.shape)}.")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}.")
    s, gid = scores.detach().double().cpu(), group_ids.cpu()
    keep = torch.zeros(s.shape, dtype=torch.bool)
    for g in torch.unique(gid):
        members = (gid == g).nonzero().squeeze(1)
        n = len(members)
        if size > n:
            raise ValueError(f"Cannot keep {size} samples of a group of {n}.")
        ordered = members[torch.sort(s[members], stable=True).indices]
        splits = [torch.cat([ordered[:j], ordered[n - size + j :]]) for j in range(size + 1)]
        best = max(range(size + 1), key=lambda j: (float(s[splits[j]].var(unbiased=False)), -abs(2 * j - size), -j))
        keep[splits[best]] = True
    return keep.to(scores.device)
