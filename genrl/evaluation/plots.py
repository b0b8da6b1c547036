"""Training curves from the trainer's ``logs/metrics.jsonl``, as one PNG.

Each line of the file is one logged step, ``{"step": int, "epoch": int, "<key>": float, ...}``
with keys such as ``reward/<name>_mean``, ``reward/<name>_std``, ``eval/<name>_mean``,
``train/approx_kl``, ``train/kl``, ``train/clipfrac``. Any key may be missing on any line
(eval is logged every N steps, KL only with beta > 0), and a run that crashed may leave a
truncated last line: both are skipped, never fatal.

Drawn with matplotlib's object API on the Agg canvas: no pyplot, no global backend switch,
no display needed.
"""

from __future__ import annotations

import json
import math
import os
import re

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from genrl.evaluation.scores import drop_repeated_total

_TRAIN_REWARD = re.compile(r"^reward/(?P<name>.+)_mean$")
_EVAL_REWARD = re.compile(r"^eval/(?P<name>.+)_mean$")
_KL_KEYS = ("train/approx_kl", "train/kl")
_CLIP_KEYS = ("train/clipfrac",)


def read_metrics(metrics_jsonl_path: str) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(step, value), ...]}`` of every finite number in the file, in file order.
    A line without ``"step"`` takes its line index."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(metrics_jsonl_path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # blank or truncated line
            if not isinstance(record, dict):
                continue
            step = record.get("step", index)
            for key, value in record.items():
                if key in ("step", "epoch") or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if math.isfinite(value):
                    series.setdefault(key, []).append((int(step), float(value)))
    return series


def _xy(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    points = sorted(points)
    return [p[0] for p in points], [p[1] for p in points]


def _plot_keys(ax, series: dict, keys, title: str) -> None:
    drawn = False
    for key in keys:
        if key in series:
            ax.plot(*_xy(series[key]), label=key)
            drawn = True
    _finish(ax, title, drawn)


def _finish(ax, title: str, drawn: bool) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if drawn:  # below the axes: inside, it covers curves (the eval points sit at the top-left)
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def reward_names(series: dict[str, list[tuple[int, float]]]) -> list[str]:
    """The rewards to draw, sorted; "total" only when it is not the same curve as one reward
    (with a single reward, the evaluation's total is that reward again)."""
    names = sorted({m["name"] for k in series for m in [_TRAIN_REWARD.match(k) or _EVAL_REWARD.match(k)] if m})
    if "reward/total_mean" in series:  # a reward of that name was trained on
        return names
    evals = {name: sorted(series[f"eval/{name}_mean"]) for name in names if f"eval/{name}_mean" in series}
    kept = drop_repeated_total(evals, same=_same_curve)
    return [name for name in names if name in kept or name not in evals]


def _same_curve(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return len(a) == len(b) and all(s == t and math.isclose(v, w) for (s, v), (t, w) in zip(a, b))


def plot_training_curves(metrics_jsonl_path: str, out_png: str) -> str:
    """Write a PNG with four panels: rewards (each reward's train mean ± std band and its
    eval mean; held-out rewards have only the latter), KL (approx_kl and kl-to-reference), clip
    fraction, and the reward watch (the evaluation's diversity within a prompt's samples and
    its drift from the reference, ``eval/velocity_kl``), over steps.

    Returns ``out_png``. Raises ``FileNotFoundError`` if the metrics file does not exist.
    """
    if not os.path.isfile(metrics_jsonl_path):
        raise FileNotFoundError(
            f"plot_training_curves got {metrics_jsonl_path!r}, which does not exist; "
            "pass the run's logs/metrics.jsonl."
        )
    series = read_metrics(metrics_jsonl_path)

    fig = training_curves_figure(series)
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png


def training_curves_figure(series: dict[str, list[tuple[int, float]]]) -> Figure:
    """The four panels of ``plot_training_curves`` from ``read_metrics``' series."""
    # constrained layout makes room for the legends below the axes
    fig = Figure(figsize=(20, 5.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_reward, ax_kl, ax_clip, ax_watch = fig.subplots(1, 4)

    names = reward_names(series)
    colors = [f"C{i % 10}" for i in range(len(names))]
    for name, color in zip(names, colors):
        train, std, evals = series.get(f"reward/{name}_mean"), series.get(f"reward/{name}_std"), series.get(f"eval/{name}_mean")
        if train:
            steps, means = _xy(train)
            ax_reward.plot(steps, means, color=color, label=f"train {name}")
            stds = dict(std or [])
            if all(s in stds for s in steps):
                ax_reward.fill_between(
                    steps, [m - stds[s] for s, m in zip(steps, means)], [m + stds[s] for s, m in zip(steps, means)],
                    color=color, alpha=0.15, linewidth=0,
                )
        if evals:
            ax_reward.plot(*_xy(evals), color=color, linestyle="--", marker="o", markersize=3, label=f"eval {name}")
    _finish(ax_reward, "reward", bool(names))
    _plot_keys(ax_kl, series, _KL_KEYS, "KL")
    _plot_keys(ax_clip, series, _CLIP_KEYS, "clip fraction")
    _plot_watch(ax_watch, series)
    return fig


def _plot_watch(ax, series: dict[str, list[tuple[int, float]]]) -> None:
    """Diversity on the left axis, the drift from the reference on a right one (other units)."""
    diversity, drift = series.get("eval/diversity"), series.get("eval/velocity_kl")
    lines = []
    if diversity:
        lines += ax.plot(*_xy(diversity), color="C0", marker="o", markersize=3, label="eval diversity")
        ax.set_ylabel("diversity (RMS distance)")
        ax.set_ylim(bottom=0)  # from 0: a drop reads as the fraction of diversity it is
    if drift:
        right = ax.twinx()
        lines += right.plot(*_xy(drift), color="C3", linestyle="--", marker="s", markersize=3, label="eval velocity_kl")
        right.set_ylabel("drift from the reference (velocity_kl)")
        right.set_ylim(bottom=0)
    _finish(ax, "reward watch", bool(lines))
    if lines:  # one legend for both axes
        ax.legend(handles=lines, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
