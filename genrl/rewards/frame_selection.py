"""Which frames of a video a VideoAlign (Qwen2-VL) reward model sees.

Two modes, as in VideoAlign's own data pipeline:

- ``uniform``: ``n = total / fps * sample_fps`` frames, clamped to ``[min_frames, max_frames]``
  and to the frames there are, rounded to even (Qwen2-VL packs frames in temporal patches
  of 2), spread evenly: ``round(linspace(0, total - 1, n))``.
- ``multi_pts``: the video is re-gridded at ``multi_pts_fps`` (``g = total * multi_pts_fps //
  fps`` grid points, at least ``frames_per_point``), then ``num_points`` anchors are spread
  over the grid and each contributes ``frames_per_point`` consecutive grid frames.

Indices are computed with ``torch.linspace`` in float32 followed by round-half-to-even,
exactly as upstream: numpy's float64 linspace rounds differently at exact halves, and a
different frame is a different score.

Short videos (fewer frames than asked) are never padded past what the rules give, and
never produce negative, descending or out-of-range indices:

- ``uniform``: all frames up to the even count below ``total``; a one-frame video gives
  ``[0, 0]`` (the temporal patch needs two frames).
- ``multi_pts``: the grid ``round(linspace(0, total - 1, g))`` repeats frames when ``g > total``,
  and with ``g == frames_per_point`` (e.g. 6) every anchor is the same window ``0 .. g - 1``.
  Upstream computed the last anchor as ``g - frames_per_point // 2 - 1``, which is below
  the first anchor when ``g == 6`` (descending anchors, negative slice starts, frames lost);
  here the last anchor is clamped to the first, and elsewhere kept as upstream.

Within ``multi_pts`` each window is non-decreasing and the windows' starts are
non-decreasing; consecutive windows may overlap when the grid is short (that is the
method: four clips of consecutive frames), so the concatenated list may step back
between windows. ``uniform`` indices are non-decreasing throughout.
"""

from __future__ import annotations

import math

import torch

FRAME_FACTOR = 2  # Qwen2-VL temporal patch size
SELECTION_MODES = ("uniform", "multi_pts")


def _round_even(x: float) -> int:
    return int(round(x / FRAME_FACTOR)) * FRAME_FACTOR


def _floor_even(x: float) -> int:
    return int(math.floor(x / FRAME_FACTOR)) * FRAME_FACTOR


def _ceil_even(x: float) -> int:
    return int(math.ceil(x / FRAME_FACTOR)) * FRAME_FACTOR


def _linspace_indices(stop: int, count: int, start: int = 0) -> list[int]:
    """round(linspace(start, stop, count)) in float32, as upstream computes it."""
    return torch.linspace(start, stop, count).round().long().tolist()


def uniform_frame_count(
    total_frames: int,
    fps: float,
    *,
    sample_fps: float = 2.0,
    min_frames: int = 4,
    max_frames: int = 768,
    num_frames: int | None = None,
) -> int:
    """Frames the ``uniform`` mode takes (even, >= 2).

    n = round_even(clamp(total / fps * sample_fps, ceil_even(min_frames), cap)),
    cap = max(2, floor_even(min(max_frames, total))); ``num_frames``, when given, replaces the
    fps-based count (rounded to even, capped the same way).
    """
    _check_video(total_frames, fps)
    cap = max(FRAME_FACTOR, _floor_even(min(max_frames, total_frames)))
    if num_frames is not None:
        n = _round_even(num_frames)
    else:
        n = _round_even(min(max(total_frames / fps * sample_fps, _ceil_even(min_frames)), cap))
    return min(max(n, FRAME_FACTOR), cap)


def select_frame_indices(
    total_frames: int,
    fps: float,
    mode: str = "uniform",
    *,
    sample_fps: float = 2.0,
    min_frames: int = 4,
    max_frames: int = 768,
    num_frames: int | None = None,
    multi_pts_fps: float = 8.0,
    num_points: int = 4,
    frames_per_point: int = 6,
) -> list[int]:
    """Indices into a video of ``total_frames`` frames at ``fps`` (rules in the module doc).

    ``uniform`` returns ``uniform_frame_count(...)`` indices; ``multi_pts`` returns
    ``num_points * frames_per_point`` indices. All lie in ``[0, total_frames - 1]``.
    """
    _check_video(total_frames, fps)
    if mode == "uniform":
        count = uniform_frame_count(
            total_frames, fps, sample_fps=sample_fps, min_frames=min_frames, max_frames=max_frames,
            num_frames=num_frames,
        )
        return _linspace_indices(total_frames - 1, count)
    if mode == "multi_pts":
        if num_points < 1 or frames_per_point < 1:
            raise ValueError(
                f"multi_pts needs num_points >= 1 and frames_per_point >= 1, got {num_points}, {frames_per_point}."
            )
        grid_size = max(frames_per_point, int(total_frames * multi_pts_fps // fps))
        grid = _linspace_indices(total_frames - 1, grid_size)
        half = frames_per_point // 2
        first_anchor = half
        # Upstream's last anchor (window ends one short of the grid's end), clamped so that
        # anchors never descend: with grid_size == frames_per_point it would be half - 1.
        last_anchor = max(first_anchor, grid_size - (frames_per_point - half) - 1)
        anchors = _linspace_indices(last_anchor, num_points, start=first_anchor)
        return [grid[i] for a in anchors for i in range(a - half, a - half + frames_per_point)]
    raise ValueError(f"Unknown frame selection mode {mode!r}; expected one of {SELECTION_MODES}.")


def _check_video(total_frames: int, fps: float) -> None:
    if int(total_frames) != total_frames or total_frames < 1:
        raise ValueError(f"A video needs at least one frame, got total_frames={total_frames!r}.")
    if not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"fps must be a positive number, got {fps!r} (read_video falls back to 30).")
