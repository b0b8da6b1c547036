"""Toy GenEval: a rule-based compositional reward for the toy shapes world.

For each image it finds the coloured blobs (HSV thresholds, connected components per
colour), names each blob's shape from two numbers (an upright triangle's mass sits low:
its vertical skewness is about -0.56, a circle's and a square's 0; a square fills its
bounding box, a circle ~pi/4 of it), and checks them against the prompt, read with
``genrl.data.toy_scenes.parse_caption``. Checks, one group per category:

- colour:   for every named object, some blob has its colour;
- shape:    for every named object, some blob has its colour and shape;
- count:    for every named object, the number of blobs of its colour and shape equals
            its count ("a" means exactly one);
- position: for a position prompt, the largest blob of the first object lies in the
            named direction from the largest blob of the second.

A category's sub-score is the fraction of its checks passed (NaN where the prompt has no
such check: position on a count prompt). The score is the mean of the prompt's category
sub-scores (partial credit, in [0, 1]: a blank image scores 0, a correct one 1); the
GenEval-style ``strict`` score is 1 when every check passes and 0 otherwise. Multi-frame
samples get the mean over frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import cv2
import numpy as np
import torch

from genrl.data.toy_scenes import COLORS, SceneSpec, parse_caption, relation_holds
from genrl.rewards.registry import unknown_option

CATEGORIES = ("color", "shape", "count", "position")
SCORE_NAMES = ("overall", "strict") + CATEGORIES
TOY_GENEVAL_OPTIONS = ("min_area_fraction",)

# A pixel is part of an object when it is clearly coloured: saturation and value (0-255)
# above these; its colour is the palette hue nearest to its own, within _MAX_HUE_DISTANCE
# (OpenCV hue units, 0-180).
_MIN_SATURATION = 90
_MIN_VALUE = 70
_MAX_HUE_DISTANCE = 14
# Shape thresholds, from the ranges measured on 3000 rendered objects at 32 px: vertical
# skewness triangle -0.64..-0.49, circle and square -0.07..0.07 (the main cue for a
# triangle); bounding-box fill ratio triangle 0.50..0.67, circle 0.72..0.86, square 0.96..1
# (a blob that fills little of its box is a triangle even if a generator drew it lopsided).
_TRIANGLE_SKEW_BELOW = -0.3
_TRIANGLE_FILL_BELOW = 0.62
_CIRCLE_FILL_BELOW = 0.91


@dataclass(frozen=True)
class Detection:
    """One coloured blob: centre (x right, y down) and size in pixels."""

    color: str
    shape: str
    center: tuple[float, float]
    size: float
    area: int


def _palette_hues() -> dict[str, float]:
    rgb = np.array([list(COLORS.values())], dtype=np.uint8)
    hsv = cv2.cvtColor(rgb, cv2.COLOR_RGB2HSV)[0]
    return {name: float(h) for name, (h, _, _) in zip(COLORS, hsv)}


_HUES = _palette_hues()


def classify_shape(mask: np.ndarray) -> str:
    """Shape of one blob, a binary mask (H, W) cropped to its bounding box.

    skew = mu03 sqrt(m00) / mu02^1.5 (standardised vertical skewness of the blob's pixels,
    y down; an upright triangle's is about -0.56) and fill = area / bounding-box area: triangle if skew <= -0.3 or fill < 0.62, else circle
    if fill < 0.91, else square.
    """
    moments = cv2.moments(mask, binaryImage=True)
    area = moments["m00"]
    skew = moments["mu03"] / max(moments["mu02"], 1e-6) ** 1.5 * math.sqrt(area)
    fill = area / float(mask.shape[0] * mask.shape[1])
    if skew <= _TRIANGLE_SKEW_BELOW or fill < _TRIANGLE_FILL_BELOW:
        return "triangle"
    return "circle" if fill < _CIRCLE_FILL_BELOW else "square"


def detect_objects(image: np.ndarray, min_area_fraction: float = 0.01) -> list[Detection]:
    """Coloured blobs of a uint8 RGB image (H, W, 3); blobs smaller than
    ``min_area_fraction`` of the image are noise and dropped."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"detect_objects takes a uint8 (H, W, 3) RGB image, got {image.dtype} {image.shape}.")
    hsv = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2HSV)
    hue = hsv[..., 0].astype(np.float32)
    coloured = (hsv[..., 1] >= _MIN_SATURATION) & (hsv[..., 2] >= _MIN_VALUE)
    names = list(_HUES)
    # Circular hue distance to every palette colour: (len(names), H, W).
    distance = np.stack([np.minimum(np.abs(hue - h), 180 - np.abs(hue - h)) for h in _HUES.values()])
    nearest = distance.argmin(0)
    close = distance.min(0) <= _MAX_HUE_DISTANCE
    min_area = max(2, int(round(min_area_fraction * image.shape[0] * image.shape[1])))

    detections = []
    for index, name in enumerate(names):
        mask = (coloured & close & (nearest == index)).astype(np.uint8)
        count, labels, stats, centroids = cv2.connectedComponentsWithStats(mask, connectivity=8)
        for label in range(1, count):
            x, y, w, h, area = stats[label]
            if area < min_area:
                continue
            shape = classify_shape((labels[y : y + h, x : x + w] == label).astype(np.uint8))
            cx, cy = centroids[label]
            detections.append(Detection(name, shape, (float(cx), float(cy)), float(max(w, h)), int(area)))
    return detections


def score_detections(detections: Sequence[Detection], spec: SceneSpec) -> dict[str, float]:
    """Sub-scores (see the module docstring) of one image's detections against ``spec``."""
    checks: dict[str, list[bool]] = {name: [] for name in CATEGORIES}
    for obj in spec.objects:
        same_color = [d for d in detections if d.color == obj.color]
        same_object = [d for d in same_color if d.shape == obj.shape]
        checks["color"].append(bool(same_color))
        checks["shape"].append(bool(same_object))
        checks["count"].append(len(same_object) == obj.count)
    if spec.relation is not None:
        largest = []
        for obj in spec.objects:
            matches = [d for d in detections if d.color == obj.color and d.shape == obj.shape]
            largest.append(max(matches, key=lambda d: d.area) if matches else None)
        a, b = largest
        holds = (
            a is not None
            and b is not None
            and relation_holds(a.center, b.center, spec.relation, min_offset=0.1 * (a.size + b.size))
        )
        checks["position"].append(holds)

    scores = {name: (sum(c) / len(c) if c else math.nan) for name, c in checks.items()}
    applicable = [scores[name] for name in CATEGORIES if checks[name]]
    scores["overall"] = sum(applicable) / len(applicable)
    scores["strict"] = float(all(all(c) for c in checks.values()))
    return scores


def _frames_uint8(samples: Any) -> np.ndarray:
    """(N, C, F, H, W) or (N, C, H, W) images, float in [0, 1] or uint8, tensor or array,
    as uint8 RGB frames (N, F, H, W, 3)."""
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().cpu()
        array = samples.numpy() if samples.dtype == torch.uint8 else samples.float().numpy()
    else:
        array = np.asarray(samples)
    if array.ndim == 4:
        array = array[:, :, None]
    if array.ndim != 5 or array.shape[1] != 3:
        raise ValueError(
            f"toy_geneval takes RGB samples of shape (N, 3, F, H, W) or (N, 3, H, W), got {tuple(array.shape)}."
        )
    if array.dtype != np.uint8:
        array = np.round(np.clip(array.astype(np.float32), 0.0, 1.0) * 255.0).astype(np.uint8)
    return np.ascontiguousarray(array.transpose(0, 2, 3, 4, 1))


def toy_geneval_scores(
    samples: Any, prompts: Sequence[str], min_area_fraction: float = 0.01
) -> dict[str, torch.Tensor]:
    """Named scores of N samples, each a float32 tensor (N,): ``overall``, ``strict`` and the
    category sub-scores ``color``, ``shape``, ``count``, ``position`` (NaN where not
    applicable). Samples: (N, 3, F, H, W) or (N, 3, H, W), float in [0, 1] or uint8."""
    frames = _frames_uint8(samples)
    if len(prompts) != frames.shape[0]:
        raise ValueError(f"toy_geneval got {frames.shape[0]} samples but {len(prompts)} prompts; they must match.")
    specs = [parse_caption(p) for p in prompts]
    rows = []
    for spec, sample in zip(specs, frames):
        per_frame = [score_detections(detect_objects(frame, min_area_fraction), spec) for frame in sample]
        rows.append({name: float(np.mean([s[name] for s in per_frame])) for name in SCORE_NAMES})
    return {name: torch.tensor([row[name] for row in rows], dtype=torch.float32) for name in SCORE_NAMES}


def build_toy_geneval_reward(
    name: str = "toy_geneval", device: str | torch.device = "cpu", **options: Any
) -> Callable[..., torch.Tensor]:
    """Reward callable ``(samples, prompts, metadata=None) -> Tensor (N,)`` for the registry.

    ``name``: ``toy_geneval`` (partial-credit score), ``toy_geneval_strict`` (all checks
    pass) or ``toy_geneval_<category>`` (``color``, ``shape``, ``count``, ``position``; the
    position sub-score is NaN on count prompts, so it is meant for evaluation, not training).
    Rule-based, it runs on the CPU whatever ``device``. Option: ``min_area_fraction``.
    """
    key = "overall" if name == "toy_geneval" else name.removeprefix("toy_geneval_")
    if key not in SCORE_NAMES or key == "overall" and name != "toy_geneval":
        known = ["toy_geneval"] + [f"toy_geneval_{n}" for n in SCORE_NAMES if n != "overall"]
        raise ValueError(f"Unknown toy GenEval reward {name!r}; known: {known}.")
    check_toy_geneval_options(name, options)
    min_area_fraction = float(options.get("min_area_fraction", 0.01))

    def reward(samples: Any, prompts: Sequence[str], metadata: Any = None) -> torch.Tensor:
        return toy_geneval_scores(samples, prompts, min_area_fraction)[key]

    return reward


def check_toy_geneval_options(name: str, options: Any) -> None:
    """Options of ``name`` other than ``min_area_fraction``: a ValueError of one sentence (also
    the factory's ``check_options``, run at argument parsing)."""
    unknown = sorted(set(options) - set(TOY_GENEVAL_OPTIONS))
    if unknown:
        raise ValueError(unknown_option(name, unknown[0], TOY_GENEVAL_OPTIONS))


build_toy_geneval_reward.check_options = check_toy_geneval_options
