"""Bounded, deterministic evaluation of a policy on a prompt set, and what it writes.

Determinism: sampling is the plain ODE (noise level 0, whatever the training config says),
with its own step count and guidance. The prompts are cut into global batches of
``batch_size`` consecutive prompts, at most ``max_batches`` of them. ONE CPU generator is
built per evaluation and re-seeded with ``seed + batch_idx`` before each batch; sample j of
batch b gets the j-th draw after that re-seed. So a sample's initial noise is a function of
(seed, its global batch, its position) alone, and the global batches are the same whatever
the number of processes: process r runs batches r, r + P, r + 2P, ... and the results are
gathered back in prompt order. 1 and 8 processes give the same numbers.

Every process runs the same number of batches (one with none left re-runs its last one and
drops the result), so that collective forwards (DeepSpeed ZeRO-3 gathers parameters inside
every forward) stay in lockstep.

EMA: swap the EMA weights in before calling ``evaluate`` (the trainer's EMA context);
``evaluate`` samples with whatever weights ``transformer`` holds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import cv2
import numpy as np
import torch
from tqdm.auto import tqdm

from genrl.policies.base import FlowPolicy
from genrl.rewards.layouts import prepare_images_tensor
from genrl.rewards.video_io import write_video
from genrl.rollout import SamplingConfig, sample_rollout
from genrl.scores import drop_repeated_total


def make_eval_generator() -> torch.Generator:
    """The one generator of an evaluation, on the CPU (identical noise on every machine).

    A module-level function so that a test can count how often it is called: once per
    ``evaluate``, never once per batch.
    """
    return torch.Generator(device="cpu")


@dataclass
class EvalResult:
    """What an evaluation measured.

    metrics: ``{reward: {"mean": m, "std": s, "count": n}}`` over the evaluated samples the reward
        applies to (see ``score_stats``), "total" included.
    per_prompt: ``[{"index": i, "prompt": p, "scores": {reward: score or None}}]`` in prompt
        order; None where the reward does not apply (it returned NaN).
    samples: uint8 ``(N, F, H, W, C)`` on the CPU, ``keep_samples`` samples spread evenly over
        the evaluated prompts (for grids and videos), or None when none were kept.
    settings: how it was sampled (seed, batch size, batches, steps, guidance, size, ...).
    sample_indices: the prompt index of each kept sample (empty: the first ``len(samples)``).
    """

    metrics: dict[str, dict[str, float]]
    per_prompt: list[dict[str, Any]]
    samples: torch.Tensor | None
    settings: dict[str, Any] = field(default_factory=dict)
    sample_indices: list[int] = field(default_factory=list)

    def sample_rows(self) -> list[dict[str, Any]]:
        """The ``per_prompt`` rows of the kept samples, in the order of ``samples``."""
        if self.samples is None:
            return []
        rows = {r["index"]: r for r in self.per_prompt}
        return [rows[i] for i in self.sample_indices or [r["index"] for r in self.per_prompt[: len(self.samples)]]]

    def to_json(self) -> dict[str, Any]:
        """The JSON-able part: metrics, per-prompt scores, settings (no samples)."""
        return {"metrics": self.metrics, "per_prompt": self.per_prompt, "settings": self.settings}

    def log_dict(self, prefix: str = "eval") -> dict[str, float]:
        """``{"eval/<reward>_mean": m, "eval/<reward>_std": s, ...}`` for ``accelerator.log``."""
        out = {}
        for name, stats in self.metrics.items():
            if stats["mean"] is not None:
                out[f"{prefix}/{name}_mean"] = stats["mean"]
                out[f"{prefix}/{name}_std"] = stats["std"]
        return out


def eval_batches(num_prompts: int, batch_size: int, max_batches: int | None) -> list[range]:
    """Global batches: consecutive ranges of ``batch_size`` prompt indices (the last may be
    shorter), the first ``max_batches`` of them (all when None)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}.")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be at least 1, or None for every prompt; got {max_batches}.")
    batches = [range(i, min(i + batch_size, num_prompts)) for i in range(0, num_prompts, batch_size)]
    return batches if max_batches is None else batches[:max_batches]


def spread_indices(num_prompts: int, keep: int | None) -> list[int]:
    """``keep`` prompt indices evenly spaced over ``range(num_prompts)`` (all when None or more).

    Prompt files are often ordered by kind (the toy prompts: counts first, then positions), so
    the first few would all be of one kind; evenly spaced ones cover the whole set.
    """
    if keep is None or keep >= num_prompts:
        return list(range(num_prompts))
    return [i * num_prompts // keep for i in range(keep)]


def batches_of_process(num_batches: int, process_index: int, num_processes: int) -> list[int | None]:
    """The global batch indices process r runs: r, r + P, r + 2P, ...; padded with None to
    ``ceil(num_batches / P)`` entries so every process runs as many batches."""
    rounds = math.ceil(num_batches / num_processes)
    own = [b for b in range(process_index, num_batches, num_processes)]
    return own + [None] * (rounds - len(own))


@torch.no_grad()
def sample_deterministic(
    policy: FlowPolicy,
    transformer: torch.nn.Module,
    prompts: list[str],
    generator: torch.Generator,
    *,
    config: SamplingConfig,
    device: torch.device | str,
) -> torch.Tensor:
    """ODE-sample ``prompts`` with the trainer's denoising loop at noise level 0; sample j
    starts from the j-th draw of ``generator`` (CPU).

    Returns decoded float ``(B, C, F, H, W)`` in [0, 1] on the CPU, decoded one sample at a
    time (bounded VAE memory; no device tensor outlives the call).
    """
    batch = len(prompts)
    height, width, num_frames = policy.resolve_size(config.height, config.width, config.num_frames)
    latents = policy.prepare_latents([generator] * batch, height, width, num_frames, device)
    ode = dataclasses.replace(config, noise_level=0.0, sde_window_size=0, sde_window_range=(0, None))
    rollout = sample_rollout(
        policy, transformer, prompts, [0] * batch, seed=0, epoch=0, config=ode, device=device, initial_latents=latents
    )
    return rollout.samples


def score_stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean and population std (correction 0: one sample gives 0) over the applicable scores,
    i.e. those that are not NaN (``allow_nan`` rewards mark "not applicable" with NaN), and
    their count; mean and std are None when no sample applies."""
    applicable = torch.tensor([v for v in values if not math.isnan(v)], dtype=torch.float64)
    if applicable.numel() == 0:
        return {"mean": None, "std": None, "count": 0}
    return {"mean": float(applicable.mean()), "std": float(applicable.std(correction=0)), "count": applicable.numel()}


def _gather(records: list, accelerator) -> list:
    """Every process's records, concatenated, on every process.

    torch.distributed directly rather than ``accelerate.utils.gather_object``, which decides
    from the distributed type Accelerate reports: a DDP config on a CPU-only machine reports
    ``DistributedType.NO`` (unless the Accelerator is built with ``cpu=True``) while its gloo
    group is up, and ``gather_object`` then silently returns the local records only.
    """
    if accelerator is None or accelerator.num_processes == 1:
        return records
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError(f"evaluate runs on {accelerator.num_processes} processes but no process group is initialized.")
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, records)
    return [record for part in gathered for record in part]


def evaluate(
    policy: FlowPolicy,
    transformer: torch.nn.Module,
    prompts: list[str],
    reward_fn: Callable[..., Mapping[str, torch.Tensor]],
    *,
    seed: int,
    batch_size: int,
    max_batches: int | None,
    config: SamplingConfig,
    device: torch.device | str,
    accelerator=None,
    metadata: Sequence[Mapping] | None = None,
    keep_samples: int | None = None,
    show_progress: bool = True,
) -> EvalResult:
    """Evaluate ``transformer`` (in ``policy``'s pipeline) on the first ``max_batches`` global
    batches of ``prompts`` and score the samples with ``reward_fn``.

    Call it on every process with the same arguments (it shards the batches itself); every
    process gets the same ``EvalResult``. ``config`` gives the steps, guidance, size and
    negative prompt; its noise level and SDE settings are ignored (sampling is the ODE).
    ``keep_samples``: how many samples to keep as uint8 in the result, spread evenly over the
    evaluated prompts (``spread_indices``; None = all). Only kept samples cross processes; keep
    it small for large videos. ``show_progress``: a progress bar on the main process.
    """
    if not prompts:
        raise ValueError("evaluate got an empty prompt list; give at least one prompt.")
    if metadata is not None and len(metadata) != len(prompts):
        raise ValueError(f"evaluate got {len(metadata)} metadata entries for {len(prompts)} prompts; give one per prompt.")
    if keep_samples is not None and keep_samples < 0:
        raise ValueError(f"keep_samples must be >= 0 or None (all); got {keep_samples}.")
    config = dataclasses.replace(config, noise_level=0.0, sde_window_size=0)
    batches = eval_batches(len(prompts), batch_size, max_batches)
    shown = set(spread_indices(sum(len(b) for b in batches), keep_samples))
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    is_main = accelerator is None or accelerator.is_main_process

    was_training = transformer.training
    transformer.eval()
    generator = make_eval_generator()
    try:
        records = []  # (index, prompt, scores, uint8 sample or None)
        plan = batches_of_process(len(batches), rank, world)
        for slot in tqdm(plan, desc="eval", disable=not (is_main and show_progress)):
            # A process with no batch left re-runs its last one (or the first) and drops it.
            batch_idx = slot if slot is not None else next((b for b in reversed(plan) if b is not None), 0)
            indices = list(batches[batch_idx])
            batch_prompts = [prompts[i] for i in indices]
            generator.manual_seed(seed + batch_idx)
            samples = sample_deterministic(policy, transformer, batch_prompts, generator, config=config, device=device)
            if slot is None:
                continue
            batch_metadata = [metadata[i] for i in indices] if metadata is not None else None
            scores = reward_fn(samples, batch_prompts, batch_metadata)
            scores = {name: torch.as_tensor(value).detach().float().cpu() for name, value in scores.items()}
            kept = [i in shown for i in indices]
            images = prepare_images_tensor(samples) if any(kept) else None
            for j, i in enumerate(indices):
                sample_scores = {name: float(value[j]) for name, value in scores.items()}
                records.append((i, prompts[i], sample_scores, images[j].clone() if kept[j] else None))
            del samples, images
    finally:
        transformer.train(was_training)

    records = sorted(_gather(records, accelerator), key=lambda r: r[0])
    names = list(records[0][2])
    metrics = {name: score_stats([r[2][name] for r in records]) for name in names}
    # NaN ("not applicable to this sample") is written as null: JSON has no NaN.
    per_prompt = [
        {"index": i, "prompt": p, "scores": {k: (None if math.isnan(v) else v) for k, v in s.items()}}
        for i, p, s, _ in records
    ]
    kept_samples = [r[3] for r in records if r[3] is not None]
    height, width, num_frames = policy.resolve_size(config.height, config.width, config.num_frames)
    settings = {
        "seed": seed,
        "batch_size": batch_size,
        "max_batches": max_batches,
        "num_batches": len(batches),
        "num_samples": len(records),
        "num_inference_steps": config.num_inference_steps,
        "guidance_scale": config.guidance_scale,
        "noise_level": 0.0,
        "negative_prompt": config.negative_prompt,
        "height": height,
        "width": width,
        "num_frames": num_frames,
    }
    return EvalResult(
        metrics=metrics,
        per_prompt=per_prompt,
        samples=torch.stack(kept_samples) if kept_samples else None,
        settings=settings,
        sample_indices=[r[0] for r in records if r[3] is not None],
    )


# ------------------------------------------------------------------------------- outputs

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
    return prefix + sep.join(f"{name}{between}{_fmt(value)}" for name, value in ordered)


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


def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "n/a" if value is None else format(value, spec)


def save_eval_outputs(result: EvalResult, output_dir: str, *, fps: float = 16.0, nrow: int = 4) -> dict[str, Any]:
    """Write ``metrics.json`` (metrics, per-prompt scores, settings), ``samples.png`` (the kept
    samples, captioned with prompt and total score) and, for videos, ``videos/<index>.mp4``.
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
        paths["grid"] = save_image_grid(result.samples, os.path.join(output_dir, "samples.png"), nrow=nrow, captions=captions)
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
        return "<br>".join(f"{escape(k)}: {_fmt(v)}" for k, v in sorted(scores.items(), key=lambda kv: (kv[0] != "total", kv[0])))

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
            f"<tr><td>{escape(name)}</td><td>{_fmt(a['mean'])} ({_fmt(a['std'], '.3g')})</td>"
            f"<td>{_fmt(b['mean'])} ({_fmt(b['std'], '.3g')})</td><td>{_fmt(delta, '+.4g')}</td></tr>"
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
