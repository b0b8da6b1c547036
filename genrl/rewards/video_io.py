"""Read and write MP4 videos with OpenCV (torchvision is not a dependency)."""

from __future__ import annotations

import math
import os

import cv2
import numpy as np

from genrl.rewards.layouts import ArrayLike, prepare_video

DEFAULT_FPS = 30.0  # used when the container reports no frame rate


def _local_path(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    return path[len("file://") :] if path.startswith("file://") else path


def fps_or_default(fps: float | None) -> float:
    """The container's frame rate, or 30 when it reports none (None, 0, negative, NaN)."""
    return float(fps) if fps is not None and math.isfinite(fps) and fps > 0 else DEFAULT_FPS


def read_video(
    path: str | os.PathLike, start_time: float | None = None, end_time: float | None = None
) -> tuple[np.ndarray, float]:
    """Frames of a video file as uint8 RGB ``(F, H, W, 3)`` and its fps.

    ``path`` may start with ``file://``. Frame ``i`` is taken to sit at ``i / fps`` seconds
    (constant frame rate); frames with ``start_time <= t <= end_time`` are kept. A container
    reporting no (or a zero) frame rate is read at 30 fps.
    """
    local = _local_path(path)
    if start_time is not None and end_time is not None and end_time < start_time:
        raise ValueError(f"end_time {end_time} is before start_time {start_time} for video {local}.")
    if not os.path.isfile(local):
        raise FileNotFoundError(f"Video file {local} does not exist.")
    capture = cv2.VideoCapture(local)
    try:
        fps = fps_or_default(capture.get(cv2.CAP_PROP_FPS) if capture.isOpened() else None)
        frames = []
        index = 0
        while capture.isOpened():
            ok, frame = capture.read()
            if not ok:
                break
            t = index / fps
            index += 1
            if start_time is not None and t < start_time:
                continue
            if end_time is not None and t > end_time:
                break
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    finally:
        capture.release()
    if not frames:
        window = "" if start_time is None and end_time is None else f" between {start_time} s and {end_time} s"
        raise ValueError(f"No frame could be read from video {local}{window}: empty, unreadable or not a video.")
    return np.stack(frames), float(fps)


def write_video(path: str | os.PathLike, frames: ArrayLike, fps: float) -> str:
    """Write one video as MP4 (``mp4v``) and return its path.

    ``frames``: uint8 RGB ``(F, H, W, 3)``, or one sample in any layout `prepare_images`
    accepts without its N dim, e.g. float (C, F, H, W) in [0, 1]. An odd height or width is
    padded to even by repeating the last row/column (MPEG-4 needs even sizes).
    """
    if not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"fps must be a positive number, got {fps!r}.")
    local = _local_path(path)
    video = prepare_video(frames)
    # The MPEG-4 encoder silently crops odd sizes; pad by one edge row/column instead.
    pad_h, pad_w = video.shape[1] % 2, video.shape[2] % 2
    if pad_h or pad_w:
        video = np.pad(video, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    height, width = video.shape[1:3]
    os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
    writer = cv2.VideoWriter(local, cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (width, height))
    if not writer.isOpened():
        raise OSError(f"OpenCV could not open {local} for writing an mp4v video of size {width}x{height}.")
    try:
        for frame in video:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    finally:
        writer.release()
    return local
