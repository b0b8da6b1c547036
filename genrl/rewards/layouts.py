"""Image and video batches in any common layout -> ``(N, F, H, W, C)`` uint8 RGB.

Accepted layouts (torch or numpy, float in [0, 1] or uint8):

    (N, H, W, C)  (N, C, H, W)                       images, F = 1
    (N, F, H, W, C)  (N, F, C, H, W)  (N, C, F, H, W)  videos; (N, C, F, H, W) is the rollout's own

C must be 1 or 3; one channel is repeated to RGB, since every reward model here reads RGB.

Which layout wins when a shape could be read several ways (`infer_layout`):

1. Channels-last, whenever the last dim is 1 or 3. A channels-first reading would make the
   image 1 or 3 pixels wide; such images are not supported. So (N, 1, H, W, 3) is one RGB
   frame and (N, 3, H, W, 1) three grey frames.
2. Otherwise the channel dim is dim 1 or dim 2 (5-D). A reading with C = 3 beats one with
   C = 1, and between two equal readings the rollout's (N, C, F, H, W) wins:
   (N, 3, 1, H, W) -> one RGB frame (C, F); (N, 1, 3, H, W) -> one RGB frame (F, C);
   (N, 3, 3, H, W) -> three RGB frames (C, F); (N, 1, 1, H, W) -> one grey frame.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

ArrayLike = Union[torch.Tensor, np.ndarray]

# Permutation from each layout to (N, F, H, W, C); 4-D layouts get F = 1 inserted first.
_TO_NFHWC = {
    "NHWC": (0, 1, 2, 3, 4),  # after inserting F at dim 1
    "NCHW": (0, 1, 3, 4, 2),  # (N, 1, C, H, W) after inserting F
    "NFHWC": (0, 1, 2, 3, 4),
    "NFCHW": (0, 1, 3, 4, 2),
    "NCFHW": (0, 2, 3, 4, 1),
}

# Floats a little outside [0, 1] (VAE overshoot) are clamped; far outside means another scale.
_FLOAT_TOLERANCE = 0.05


def infer_layout(shape: tuple[int, ...]) -> str:
    """The layout of a batch shape: "NHWC", "NCHW", "NFHWC", "NFCHW" or "NCFHW" (rules above)."""
    shape = tuple(int(s) for s in shape)
    channels = (1, 3)
    if len(shape) == 4:
        if shape[3] in channels:
            return "NHWC"
        if shape[1] in channels:
            return "NCHW"
    elif len(shape) == 5:
        if shape[4] in channels:
            return "NFHWC"
        c1, c2 = shape[1], shape[2]
        if c1 == 3 or (c1 == 1 and c2 != 3):
            return "NCFHW"
        if c2 in channels:
            return "NFCHW"
    raise ValueError(
        f"Cannot read an image/video batch of shape {shape}: expected (N, H, W, C), (N, C, H, W), "
        "(N, F, H, W, C), (N, F, C, H, W) or (N, C, F, H, W) with C in {1, 3}."
    )


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """uint8 as is; other integers must lie in [0, 255]; floats in [0, 1] -> round(255 x)."""
    if x.dtype == torch.uint8:
        return x
    if x.dtype == torch.bool or x.is_complex():
        raise ValueError(f"Images must be uint8, integers in [0, 255] or floats in [0, 1], got dtype {x.dtype}.")
    if x.numel() == 0:
        return x.to(torch.uint8)
    lo, hi = x.min().item(), x.max().item()
    if not x.is_floating_point():
        if lo < 0 or hi > 255:
            raise ValueError(f"Integer images must lie in [0, 255], got values in [{lo}, {hi}].")
        return x.to(torch.uint8)
    if not (lo >= -_FLOAT_TOLERANCE and hi <= 1 + _FLOAT_TOLERANCE):  # also catches NaN
        raise ValueError(
            f"Float images must lie in [0, 1], got values in [{lo:.4g}, {hi:.4g}] "
            "(map [-1, 1] with x / 2 + 0.5; pass [0, 255] data as uint8)."
        )
    return (x.float().clamp(0, 1) * 255).round().to(torch.uint8)


def prepare_images_tensor(x: ArrayLike) -> torch.Tensor:
    """Any accepted batch -> uint8 tensor ``(N, F, H, W, 3)``, on ``x``'s device (CPU for numpy)."""
    t = x
    if isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x)
        t = torch.from_numpy(a if a.flags.writeable else a.copy())  # torch warns on read-only arrays
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"Images must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}.")
    layout = infer_layout(tuple(t.shape))
    if t.ndim == 4:
        t = t.unsqueeze(1)  # F = 1
    t = t.detach().permute(*_TO_NFHWC[layout])
    t = to_uint8(t)
    if t.shape[-1] == 1:
        t = t.expand(*t.shape[:-1], 3)
    return t.contiguous()


def prepare_images(x: ArrayLike) -> np.ndarray:
    """Any accepted batch -> numpy uint8 ``(N, F, H, W, 3)`` (copied to the CPU if needed)."""
    return prepare_images_tensor(x).cpu().numpy()


def prepare_video(x: ArrayLike) -> np.ndarray:
    """One sample (a batch layout without N, e.g. (F, H, W, C), (C, F, H, W) or (H, W, C))
    -> numpy uint8 ``(F, H, W, 3)``."""
    return prepare_images(x[None])[0]
