"""The reward-hacking watch: signs, at each evaluation, that the policy is learning to please the
trained reward rather than to do the task.

Three signals, all from the in-training evaluation (``genrl.training.train_logging``):

- held-out rewards (``--eval_reward_fn`` names with weight 0 that are not trained on): the alarm
  fires when a trained reward rose at each of the last N evaluations while a held-out one fell
  at each (``diverging``);
- diversity within a prompt group (``group_diversity``): K samples of the same prompt from K
  initial noises; the alarm fires when it drops below a fraction of its first value (collapse
  onto one image that the reward likes);
- drift from the reference policy (``eval/velocity_kl``): the mean squared velocity difference
  along the evaluation trajectories, logged and plotted (no alarm: how much drift is too much
  depends on the task).

``RewardWatch`` keeps the history (rebuilt from ``metrics.jsonl`` on resume, so a resumed run
raises the same alarms) and says which alarms a new evaluation raises; the trainer warns,
lists them in the model card, and with ``--stop_on_reward_hacking`` stops.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from genrl.rewards import parse_reward_spec

DIVERSITY_SIZE = 32  # samples are compared at most 32x32 per frame: layout and colour, not pixel noise


def group_diversity(samples: torch.Tensor) -> float:
    """Mean pairwise RMS distance between the K samples of a prompt, averaged over prompts.

    samples: ``(G, K, C, F, H, W)`` float in [0, 1] (G prompts, K samples each). Each frame is
    area-averaged down to at most 32x32 first, so that the distance measures what a viewer sees
    change (layout, colour, content), not pixel noise. For one prompt,
        d = mean_{i<j} sqrt(mean((x_i - x_j)^2)),
    0 when every sample is the same image, 1 between an all-black and an all-white image.
    """
    if samples.dim() != 6 or samples.shape[1] < 2:
        raise ValueError(f"group_diversity needs (G, K >= 2, C, F, H, W) samples, got {tuple(samples.shape)}.")
    g, k, c, f, h, w = samples.shape
    frames = samples.float().permute(0, 1, 3, 2, 4, 5).reshape(g * k * f, c, h, w)
    small = F.adaptive_avg_pool2d(frames, (min(h, DIVERSITY_SIZE), min(w, DIVERSITY_SIZE)))
    flat = small.reshape(g, k, -1)
    d = torch.cdist(flat, flat) / flat.shape[-1] ** 0.5  # (G, K, K) RMS distances
    pairs = torch.triu_indices(k, k, offset=1)
    return d[:, pairs[0], pairs[1]].mean().item()


def diverging(trained: Sequence[float], held_out: Sequence[float], patience: int) -> bool:
    """Whether, over the last ``patience`` evaluations, the trained reward rose at each while the
    held-out reward fell at each: ``trained[-i] > trained[-i-1]`` and ``held_out[-i] <
    held_out[-i-1]`` for i = 1..patience (the two series are aligned, oldest first)."""
    if patience < 1:
        raise ValueError(f"patience must be >= 1, got {patience}.")
    if len(trained) != len(held_out):
        raise ValueError(f"The series must be aligned, got {len(trained)} and {len(held_out)} values.")
    if len(trained) < patience + 1:
        return False
    rose = all(trained[-i] > trained[-i - 1] for i in range(1, patience + 1))
    fell = all(held_out[-i] < held_out[-i - 1] for i in range(1, patience + 1))
    return rose and fell


@dataclass
class RewardWatch:
    """The alarms of a run, from its evaluations (``eval/<name>_mean``, ``eval/diversity``).

    trained: the reward names trained on that the evaluation also reports.
    held_out: the evaluation's weight-0 names not trained on.
    patience: N of "rose while a held-out one fell for N evaluations" (``--watch_patience``).
    diversity_fraction: the diversity alarm's threshold, a fraction of the first evaluation's
        diversity (``--watch_diversity_fraction``).
    history: ``(step, eval values)`` of every evaluation so far, oldest first.
    alarms: ``(step, sentence)`` of every alarm raised so far; each kind (a trained/held-out pair,
        diversity) is raised once.
    """

    trained: list[str]
    held_out: list[str]
    patience: int = 3
    diversity_fraction: float = 0.5
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    alarms: list[tuple[int, str]] = field(default_factory=list)
    _raised: set = field(default_factory=set, repr=False)  # the kinds raised: (trained, held-out) pairs, "diversity"

    def observe(self, step: int, values: dict[str, float]) -> list[str]:
        """Record the evaluation at ``step`` and return the alarms it raises (new ones only)."""
        self.history.append((step, dict(values)))
        new = []
        for t in self.trained:
            for h in self.held_out:
                key = f"eval/{t}_mean", f"eval/{h}_mean"
                series = [(v[key[0]], v[key[1]]) for _, v in self.history if key[0] in v and key[1] in v]
                if (t, h) in self._raised or not diverging([a for a, _ in series], [b for _, b in series], self.patience):
                    continue
                self._raised.add((t, h))
                new.append(
                    f"the trained reward {t} rose at each of the last {self.patience} evaluations "
                    f"({series[-self.patience - 1][0]:.4g} -> {series[-1][0]:.4g}) while the held-out {h} fell at each "
                    f"({series[-self.patience - 1][1]:.4g} -> {series[-1][1]:.4g})"
                )
        diversity = [v["eval/diversity"] for _, v in self.history if "eval/diversity" in v]
        if "diversity" not in self._raised and len(diversity) > 1 and diversity[-1] < self.diversity_fraction * diversity[0]:
            self._raised.add("diversity")
            new.append(
                f"the diversity within a prompt's samples fell to {diversity[-1]:.4g}, below "
                f"{self.diversity_fraction:g} x its first value {diversity[0]:.4g} (the samples of a prompt are collapsing)"
            )
        self.alarms.extend((step, sentence) for sentence in new)
        return new

    @classmethod
    def from_metrics(cls, metrics_path: str, **kwargs) -> "RewardWatch":
        """A watch that has seen every evaluation in ``metrics_path`` (a resumed run's history;
        the alarms they raised are raised again, into ``alarms``)."""
        watch = cls(**kwargs)
        if os.path.isfile(metrics_path):
            with open(metrics_path) as f:
                for line in f:
                    record = json.loads(line)
                    values = {k: v for k, v in record.items() if k.startswith("eval/")}
                    if values:
                        watch.observe(record["step"], values)
        return watch


def watched_rewards(train_spec: str, eval_spec: str) -> tuple[list[str], list[str]]:
    """``(trained, held_out)`` reward names: the ``--reward_fn`` names (weight != 0) and the
    ``--eval_reward_fn`` names of weight 0 that are not trained on."""
    trained = [name for name, weight in parse_reward_spec(train_spec) if weight != 0]
    held_out = [name for name, weight in parse_reward_spec(eval_spec) if weight == 0 and name not in trained]
    return trained, held_out
