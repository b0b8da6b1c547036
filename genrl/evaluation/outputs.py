"""What an evaluation writes: labelled sample grids, MP4s, ``metrics.json``, and the
side-by-side grid and ``compare.html`` of two models. OpenCV draws; no torchvision."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Sequence

import cv2
import numpy as np
import torch

from genrl.evaluation.evaluate import EvalResult
from genrl.evaluation.scores import drop_repeated_total, format_score
from genrl.rewards.layouts import prepare_images_tensor
from genrl.rewards.video_io import write_video

_FONT = cv2.FONT_HERSHEY_SIMPLEX


def _wrap(text: str, width_px: int, scale: float) -> list[str]:
    """Greedy word wrap of ``text`` (``\\n`` starts a new line) to ``width_px`` pixels."""
    lines = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}".strip()
            if line and cv2.getTextSize(candidate, _FONT, scale, 1)[0][0] > width_px:
                lines.append(line)
                line = word
            else:
                line = candidate
        lines.append(line)
    return lines


def _grid_frames(samples: torch.Tensor | np.ndarray, frame: int | None) -> np.ndarray:
    """Any accepted layout -> uint8 ``(N, H, W, 3)``: one frame per sample (the middle one
    of a video unless ``frame`` is given)."""
    video = prepare_images_tensor(samples).cpu().numpy()
    index = video.shape[1] // 2 if frame is None else frame
    if not -video.shape[1] <= index < video.shape[1]:
        raise ValueError(f"frame={frame} is out of range for samples of {video.shape[1]} frames.")
    return video[:, index]


def save_image_grid(
    samples: torch.Tensor | np.ndarray,
    path: str,
    nrow: int = 4,
    captions: Sequence[str] | None = None,
    *,
    frame: int | None = None,
    min_cell: int = 160,
) -> str:
    """Write a PNG grid of ``samples`` with OpenCV and return its path.

    samples: uint8 ``(N, F, H, W, C)``, float ``(N, C, F, H, W)`` in [0, 1], or any layout
        ``prepare_images`` accepts; a video shows its middle frame (or ``frame``).
    nrow: samples per row. captions: one text per sample, wrapped under its cell.
    Small samples are enlarged (nearest neighbour) to at least ``min_cell`` pixels wide so that
    captions stay readable.
    """
    images = _grid_frames(samples, frame)
    n, h, w = images.shape[:3]
    if n == 0:
        raise ValueError("save_image_grid got no samples.")
    if captions is not None and len(captions) != n:
        raise ValueError(f"save_image_grid got {len(captions)} captions for {n} samples; give one per sample.")
    if nrow < 1:
        raise ValueError(f"nrow must be at least 1; got {nrow}.")
    scale_up = max(1, math.ceil(min_cell / w)) if captions is not None else 1
    cell_w, cell_h = w * scale_up, h * scale_up
    font_scale, line_h, pad = 0.4, 14, 4
    wrapped = [_wrap(c, cell_w - 2 * pad, font_scale) for c in captions] if captions is not None else None
    caption_h = (max(len(lines) for lines in wrapped) * line_h + 2 * pad) if wrapped else 0
    cols, rows = min(nrow, n), math.ceil(n / nrow)
    gap = 2
    grid = np.full((rows * (cell_h + caption_h + gap) + gap, cols * (cell_w + gap) + gap, 3), 255, dtype=np.uint8)
    for k in range(n):
        r, c = divmod(k, nrow)
        y, x = gap + r * (cell_h + caption_h + gap), gap + c * (cell_w + gap)
        cell = images[k]
        if scale_up > 1:
            cell = cv2.resize(cell, (cell_w, cell_h), interpolation=cv2.INTER_NEAREST)
        grid[y : y + cell_h, x : x + cell_w] = cell
        for li, line in enumerate(wrapped[k] if wrapped else []):
            baseline = y + cell_h + pad + (li + 1) * line_h - 3
            cv2.putText(grid, line, (x + pad, baseline), _FONT, font_scale, (0, 0, 0), 1, cv2.LINE_AA)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if not cv2.imwrite(path, cv2.cvtColor(grid, cv2.COLOR_RGB2BGR)):
        raise OSError(f"OpenCV could not write the image grid to {path!r}.")
    return path


def grid_cells(result: EvalResult) -> torch.Tensor | np.ndarray:
    """What a grid shows of ``result``'s kept samples: the samples, or for image-to-video each
    sample's middle frame with its conditioning image to the left, 2 white pixels between them
    (uint8 ``(N, 1, H, 2 W + 2, C)``)."""
    if result.conditions is None:
        return result.samples
    frames = _grid_frames(result.samples, None)
    gap = np.full((*frames.shape[:2], 2, frames.shape[3]), 255, dtype=np.uint8)
    return np.concatenate([result.conditions.numpy(), gap, frames], axis=2)[:, None]


def save_videos(samples: torch.Tensor | np.ndarray, directory: str, fps: float, names: Sequence[str] | None = None) -> list[str]:
    """One MP4 per sample (``directory/<name>.mp4``, names default to ``00000`` ...)."""
    videos = prepare_images_tensor(samples).cpu().numpy()
    names = list(names) if names is not None else [f"{i:05d}" for i in range(len(videos))]
    if len(names) != len(videos):
        raise ValueError(f"save_videos got {len(names)} names for {len(videos)} samples.")
    return [write_video(os.path.join(directory, f"{name}.mp4"), video, fps) for name, video in zip(names, videos)]


def score_caption(scores: Mapping[str, float], prefix: str = "", sep: str = "  ", between: str = " ") -> str:
    """``"total 0.123  jpeg -1.2"``: the scores of one sample, total first; ``between`` goes
    between a name and its value ("=" keeps the pair on one line of a wrapped caption)."""
    ordered = sorted(scores.items(), key=lambda kv: (kv[0] != "total", kv[0]))
    return prefix + sep.join(f"{name}{between}{format_score(value)}" for name, value in ordered)


def compact_scores(scores: Mapping[str, float | None]) -> dict[str, float]:
    """The scores worth a caption line: no "n/a" (None or NaN), no "total" when it repeats the
    one reward it sums, and sub-scores named without their reward's prefix
    (``toy_geneval_color`` -> ``color``), so a caption stays smaller than a 32x32 sample."""
    kept = drop_repeated_total({k: v for k, v in scores.items() if v is not None and not math.isnan(v)})
    out = {}
    for name, value in kept.items():
        parent = next((p for p in kept if p != name and name.startswith(p + "_")), None)
        out[name[len(parent) + 1 :] if parent else name] = value
    return out


def save_eval_outputs(result: EvalResult, output_dir: str, *, fps: float = 16.0, nrow: int = 4) -> dict[str, Any]:
    """Write ``metrics.json`` (metrics, per-prompt scores, settings), ``samples.png`` (the kept
    samples, beside their conditioning images for image-to-video, captioned with prompt and total score) and, for videos, ``videos/<index>.mp4``.
    Main process only. Returns the paths written."""
    os.makedirs(output_dir, exist_ok=True)
    paths: dict[str, Any] = {"metrics": os.path.join(output_dir, "metrics.json")}
    with open(paths["metrics"], "w", encoding="utf-8") as f:
        json.dump(result.to_json(), f, indent=2, sort_keys=True)
        f.write("\n")
    if result.samples is not None and len(result.samples) > 0:
        kept = result.sample_rows()
        captions = [f"{r['prompt']}\n{score_caption({'total': r['scores']['total']}) if 'total' in r['scores'] else ''}"
                    for r in kept]
        paths["grid"] = save_image_grid(grid_cells(result), os.path.join(output_dir, "samples.png"), nrow=nrow, captions=captions)
        if result.samples.shape[1] > 1:
            names = [f"{r['index']:05d}" for r in kept]
            paths["videos"] = save_videos(result.samples, os.path.join(output_dir, "videos"), fps, names)
    return paths


def save_comparison(
    result_a: EvalResult,
    result_b: EvalResult,
    output_dir: str,
    *,
    labels: tuple[str, str] = ("A", "B"),
    video_dirs: tuple[str | None, str | None] = (None, None),
) -> dict[str, str]:
    """Side by side of two evaluations of the same prompts and seeds.

    Writes ``compare.png`` (per prompt: A's sample, B's sample, each captioned with its
    scores), ``compare_images/<index>_{a,b}.png`` and ``compare.html``, a static page with the
    mean scores and a per-prompt table (images referenced as the files next to it; MP4s
    linked when ``video_dirs`` - relative to ``output_dir`` - hold them). Main process only.
    """
    prompts_a = [(r["index"], r["prompt"]) for r in result_a.per_prompt]
    if prompts_a != [(r["index"], r["prompt"]) for r in result_b.per_prompt]:
        raise ValueError("save_comparison needs two evaluations of the same prompts in the same order.")
    if result_a.settings.get("seed") != result_b.settings.get("seed"):
        raise ValueError(
            f"save_comparison got evaluations with seeds {result_a.settings.get('seed')} and "
            f"{result_b.settings.get('seed')}; compare runs of the same seed."
        )
    os.makedirs(output_dir, exist_ok=True)
    paths: dict[str, str] = {}
    shown = 0 if result_a.samples is None or result_b.samples is None else min(len(result_a.samples), len(result_b.samples))
    image_names: dict[int, tuple[str, str]] = {}  # prompt index -> (A's image, B's image)
    if shown:
        frames_a, frames_b = _grid_frames(result_a.samples[:shown], None), _grid_frames(result_b.samples[:shown], None)
        os.makedirs(os.path.join(output_dir, "compare_images"), exist_ok=True)
        cells, captions = [], []
        for k, (row_a, row_b) in enumerate(zip(result_a.sample_rows()[:shown], result_b.sample_rows()[:shown])):
            names = (f"compare_images/{row_a['index']:05d}_a.png", f"compare_images/{row_a['index']:05d}_b.png")
            for name, frame in zip(names, (frames_a[k], frames_b[k])):
                if not cv2.imwrite(os.path.join(output_dir, name), cv2.cvtColor(frame, cv2.COLOR_RGB2BGR)):
                    raise OSError(f"OpenCV could not write {os.path.join(output_dir, name)!r}.")
            image_names[row_a["index"]] = names
            cells += [frames_a[k], frames_b[k]]
            scores_a = score_caption(compact_scores(row_a["scores"]), labels[0] + ":\n", sep="\n")
            scores_b = score_caption(compact_scores(row_b["scores"]), labels[1] + ":\n", sep="\n")
            captions += [row_a["prompt"] + "\n" + scores_a, "\n" + scores_b]
        paths["grid"] = save_image_grid(np.stack(cells), os.path.join(output_dir, "compare.png"), nrow=2, captions=captions)
    paths["html"] = os.path.join(output_dir, "compare.html")
    with open(paths["html"], "w", encoding="utf-8") as f:
        f.write(_comparison_html(result_a, result_b, labels, image_names, video_dirs, output_dir))
    return paths


def _comparison_html(result_a, result_b, labels, image_names, video_dirs, output_dir) -> str:
    from html import escape

    def scores_cell(scores: Mapping[str, float]) -> str:
        return "<br>".join(f"{escape(k)}: {format_score(v)}" for k, v in sorted(scores.items(), key=lambda kv: (kv[0] != "total", kv[0])))

    def media_cell(side: int, index: int) -> str:
        parts = []
        if index in image_names:
            parts.append(f'<img src="{escape(image_names[index][side])}" width="256">')
        if video_dirs[side] is not None:
            video = f"{video_dirs[side]}/{index:05d}.mp4"
            if os.path.isfile(os.path.join(output_dir, video)):
                parts.append(f'<br><a href="{escape(video)}">mp4</a>')
        return "".join(parts) or "&ndash;"

    la, lb = escape(labels[0]), escape(labels[1])
    settings = escape(json.dumps(result_a.settings, sort_keys=True))
    rows = [
        "<!doctype html>",
        '<html><head><meta charset="utf-8"><title>genrl comparison</title>',
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px;vertical-align:top}</style></head><body>",
        f"<h1>{la} vs {lb}</h1>",
        f"<p>{la}: <code>{escape(str(result_a.settings.get('model', labels[0])))}</code><br>"
        f"{lb}: <code>{escape(str(result_b.settings.get('model', labels[1])))}</code></p>",
        f"<p>Same prompts, same seeds. Settings: <code>{settings}</code></p>",
        "<h2>Mean scores</h2>",
        f"<table><tr><th>reward</th><th>{la} mean (std)</th><th>{lb} mean (std)</th><th>{lb} &minus; {la}</th></tr>",
    ]
    for name in result_a.metrics:
        a, b = result_a.metrics[name], result_b.metrics.get(name)
        if b is None:
            continue
        delta = None if a["mean"] is None or b["mean"] is None else b["mean"] - a["mean"]
        rows.append(
            f"<tr><td>{escape(name)}</td><td>{format_score(a['mean'])} ({format_score(a['std'], '.3g')})</td>"
            f"<td>{format_score(b['mean'])} ({format_score(b['std'], '.3g')})</td><td>{format_score(delta, '+.4g')}</td></tr>"
        )
    rows += [
        "</table>",
        "<h2>Per prompt</h2>",
        f"<table><tr><th>#</th><th>prompt</th><th>{la}</th><th>{lb}</th><th>{la} scores</th><th>{lb} scores</th></tr>",
    ]
    for row_a, row_b in zip(result_a.per_prompt, result_b.per_prompt):
        rows.append(
            f"<tr><td>{row_a['index']}</td><td>{escape(row_a['prompt'])}</td>"
            f"<td>{media_cell(0, row_a['index'])}</td><td>{media_cell(1, row_b['index'])}</td>"
            f"<td>{scores_cell(row_a['scores'])}</td><td>{scores_cell(row_b['scores'])}</td></tr>"
        )
    rows += ["</table>", "</body></html>", ""]
    return "\n".join(rows)
