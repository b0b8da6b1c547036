"""Rewards that need no model weights: cheap, deterministic, CPU-only.

They are the embedded default's rewards and the test rewards of the project. Each factory
follows the registry's contract: ``factory(name=..., device=..., **options)`` returns
``fn(samples, prompts, metadata) -> Tensor (N,)`` float32.
"""

from __future__ import annotations

from typing import Any, Callable

import cv2
import numpy as np
import torch

from genrl.rewards.layouts import prepare_images


def jpeg_size_kb(frames: np.ndarray, quality: int = 95) -> np.ndarray:
    """Mean JPEG size in kB (1000 bytes) over frames, per sample.

    frames: uint8 RGB ``(N, F, H, W, 3)`` -> ``(N,)`` float64.
    """
    params = [cv2.IMWRITE_JPEG_QUALITY, int(quality)]
    sizes = np.empty(frames.shape[:2], dtype=np.float64)
    for n, video in enumerate(frames):
        for f, frame in enumerate(video):
            ok, buf = cv2.imencode(".jpg", cv2.cvtColor(frame, cv2.COLOR_RGB2BGR), params)
            if not ok:
                raise RuntimeError(f"OpenCV could not JPEG-encode a frame of shape {frame.shape}.")
            sizes[n, f] = buf.size / 1000.0
    return sizes.mean(axis=1)


def mean_abs_frame_difference(frames: np.ndarray) -> np.ndarray:
    """mean_{t,h,w,c} |x[t+1] - x[t]| with x in [0, 1], per sample; 0 for a one-frame sample
    (nothing moves).

    frames: uint8 ``(N, F, H, W, C)`` -> ``(N,)`` float64.
    """
    if frames.shape[1] < 2:
        return np.zeros(frames.shape[0])
    diffs = np.abs(np.diff(frames.astype(np.int16), axis=1))  # int16: uint8 differences wrap
    return diffs.reshape(frames.shape[0], -1).mean(axis=1) / 255.0


RewardCallable = Callable[..., torch.Tensor]


def build_jpeg_reward(name: str = "jpeg_compressibility", device: Any = "cpu", quality: int = 95) -> RewardCallable:
    """``jpeg_compressibility``: -(mean JPEG kB per frame); ``jpeg_incompressibility``: +(same)."""
    signs = {"jpeg_compressibility": -1.0, "jpeg_incompressibility": 1.0}
    if name not in signs:
        raise ValueError(f"build_jpeg_reward serves {sorted(signs)}, not {name!r}.")
    if not 1 <= int(quality) <= 100:
        raise ValueError(f"JPEG quality must be in [1, 100], got {quality!r}.")
    sign = signs[name]

    def reward(samples: Any, prompts: Any = None, metadata: Any = None) -> torch.Tensor:
        return torch.as_tensor(sign * jpeg_size_kb(prepare_images(samples), quality), dtype=torch.float32)

    return reward


def build_temporal_smoothness_reward(name: str = "temporal_smoothness", device: Any = "cpu") -> RewardCallable:
    """``temporal_smoothness``: -(mean absolute difference of consecutive frames), in [-1, 0];
    a one-frame sample scores 0."""
    if name != "temporal_smoothness":
        raise ValueError(f"build_temporal_smoothness_reward serves 'temporal_smoothness', not {name!r}.")

    def reward(samples: Any, prompts: Any = None, metadata: Any = None) -> torch.Tensor:
        return torch.as_tensor(0.0 - mean_abs_frame_difference(prepare_images(samples)), dtype=torch.float32)  # no -0.0

    return reward
