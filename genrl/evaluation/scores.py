"""Helpers over ``{reward name: score}`` dicts, shared by the console lines, the sample
captions, the training curves and the model card (no torch: the card writer imports it)."""

from __future__ import annotations

import math
from typing import Callable, Mapping, TypeVar

T = TypeVar("T")


def drop_repeated_total(scores: Mapping[str, T], same: Callable[[T, T], bool] = math.isclose) -> dict[str, T]:
    """``scores`` without "total" when it is the same as another entry: with a single weighted
    reward (weight-0 ones are reported, not summed), the total is that reward again."""
    out = dict(scores)
    total = out.get("total")
    if total is not None and any(v is not None and same(total, v) for k, v in out.items() if k != "total"):
        del out["total"]
    return out


def reward_means(values: Mapping[str, float], prefix: str) -> dict[str, float]:
    """``{name: mean}`` of the ``<prefix>/<name>_mean`` keys, without "total" when it repeats the
    one reward it sums (it then carries no news)."""
    return drop_repeated_total(
        {k[len(prefix) + 1 : -len("_mean")]: v for k, v in values.items() if k.startswith(prefix + "/") and k.endswith("_mean")}
    )


def format_score(value: float | None, spec: str = ".4g", missing: str = "n/a") -> str:
    """A score as text: ``format(value, spec)``, or ``missing`` when there is none."""
    return missing if value is None else format(value, spec)
