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


def format_score(value: float | None, spec: str = ".4g", missing: str = "n/a") -> str:
    """A score as text: ``format(value, spec)``, or ``missing`` when there is none."""
    return missing if value is None else format(value, spec)
