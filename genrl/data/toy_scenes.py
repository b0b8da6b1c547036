"""Procedural scenes of coloured shapes and their captions: the toy world of the default run.

The grammar is kept small enough for a tiny model to learn on a CPU:

- count scenes: ``"a red circle"``, ``"two blue squares"``, ``"three yellow triangles"``
  (one colour and shape, 1 to 3 copies);
- position scenes: ``"a red circle left of a blue square"`` (two different objects and
  one of ``left of``, ``right of``, ``above``, ``below``).

A scene is described by a ``SceneSpec``; ``caption`` writes it, ``parse_caption`` reads it
back (the toy GenEval reward parses prompts with it), ``render_scene`` draws it with OpenCV
on a white background. The prompt splits hold out whole combinations (a position scene and
its mirrored wording go to the same side), chosen by a digest of the caption, so they are
the same on every machine.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import cv2
import numpy as np

# Saturated colours with well separated hues, so a hue threshold tells them apart.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 35, 35),
    "green": (35, 175, 55),
    "blue": (40, 80, 235),
    "yellow": (245, 205, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
MAX_COUNT = 3
BACKGROUND = (255, 255, 255)

_COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
_WORD_COUNTS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}
_PLURALS = {shape + "s": shape for shape in SHAPES}
_MIRROR = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


@dataclass(frozen=True)
class ToyObject:
    """``count`` copies of a shape in one colour."""

    color: str
    shape: str
    count: int = 1


@dataclass(frozen=True)
class SceneSpec:
    """One object group (count scene), or two single objects and ``relation`` between them:
    ``objects[0] <relation> objects[1]`` (position scene)."""

    objects: tuple[ToyObject, ...]
    relation: str | None = None

    def __post_init__(self) -> None:
        for obj in self.objects:
            if obj.color not in COLORS or obj.shape not in SHAPES or not 1 <= obj.count <= MAX_COUNT:
                raise ValueError(
                    f"Unknown object {obj}: colours are {list(COLORS)}, shapes {list(SHAPES)}, counts 1-{MAX_COUNT}."
                )
        if self.relation is None:
            if len(self.objects) != 1:
                raise ValueError(f"A count scene has exactly one object group, got {len(self.objects)}.")
        else:
            if self.relation not in RELATIONS:
                raise ValueError(f"Unknown relation {self.relation!r}; expected one of {list(RELATIONS)}.")
            a, b = self.objects if len(self.objects) == 2 else (None, None)
            if a is None or a.count != 1 or b.count != 1 or (a.color, a.shape) == (b.color, b.shape):
                raise ValueError(f"A position scene relates two different single objects, got {self.objects}.")


# ---------------------------------------------------------------------------- captions


def _object_phrase(obj: ToyObject) -> str:
    noun = obj.shape if obj.count == 1 else obj.shape + "s"
    return f"{_COUNT_WORDS[obj.count]} {obj.color} {noun}"


def caption(spec: SceneSpec) -> str:
    """``"two red circles"`` or ``"a red circle left of a blue square"``."""
    if spec.relation is None:
        return _object_phrase(spec.objects[0])
    return f"{_object_phrase(spec.objects[0])} {spec.relation} {_object_phrase(spec.objects[1])}"


def _parse_object(words: list[str], text: str) -> ToyObject:
    if len(words) != 3 or words[0] not in _WORD_COUNTS or words[1] not in COLORS:
        raise ValueError(f"Cannot read an object in {text!r}: expected '<a|two|three> <colour> <shape>'.")
    count, color, noun = _WORD_COUNTS[words[0]], words[1], words[2]
    shape = noun if count == 1 else _PLURALS.get(noun)
    if shape not in SHAPES:
        raise ValueError(f"Cannot read the shape {noun!r} in {text!r}: expected one of {list(SHAPES)} (plural after 2, 3).")
    return ToyObject(color, shape, count)


def parse_caption(text: str) -> SceneSpec:
    """The ``SceneSpec`` a caption describes; inverse of ``caption`` (case and extra spaces
    are ignored). Raises ``ValueError`` for text outside the toy grammar."""
    words = text.lower().replace(",", " ").replace(".", " ").split()
    for i in range(len(words)):
        two = " ".join(words[i : i + 2])
        if two in RELATIONS or words[i] in RELATIONS:
            width = 2 if two in RELATIONS else 1
            relation = " ".join(words[i : i + width])
            return SceneSpec(
                (_parse_object(words[:i], text), _parse_object(words[i + width :], text)), relation
            )
    return SceneSpec((_parse_object(words, text),))


def vocabulary() -> list[str]:
    """Every word the grammar writes or reads, sorted (the toy model's tokenizer vocabulary)."""
    words = set(_WORD_COUNTS) | set(COLORS) | set(SHAPES) | set(_PLURALS)
    for relation in RELATIONS:
        words.update(relation.split())
    return sorted(words)


# ---------------------------------------------------------------------------- prompt splits


def all_specs() -> list[SceneSpec]:
    """Every scene the grammar can describe, count scenes first, in a fixed order."""
    objects = [(c, s) for c in COLORS for s in SHAPES]
    specs = [SceneSpec((ToyObject(c, s, n),)) for c, s in objects for n in range(1, MAX_COUNT + 1)]
    for relation in RELATIONS:
        for a in objects:
            for b in objects:
                if a != b:
                    specs.append(SceneSpec((ToyObject(*a), ToyObject(*b)), relation))
    return specs


def _combination_key(spec: SceneSpec) -> str:
    """Caption of the canonical wording: "A right of B" is the scene "B left of A"."""
    if spec.relation in ("right of", "below"):
        spec = SceneSpec(spec.objects[::-1], _MIRROR[spec.relation])
    return caption(spec)


def is_test_combination(spec: SceneSpec, test_every: int = 5) -> bool:
    """About one combination in ``test_every`` is held out, chosen by blake2b of its
    canonical caption (stable across processes and machines, unlike ``hash()``)."""
    digest = hashlib.blake2b(_combination_key(spec).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % test_every == 0


def prompt_splits(test_every: int = 5) -> tuple[list[str], list[str]]:
    """(train prompts, test prompts): disjoint, together every caption of the grammar."""
    train, test = [], []
    for spec in all_specs():
        (test if is_test_combination(spec, test_every) else train).append(caption(spec))
    return train, test


def write_prompt_files(directory: str) -> tuple[str, str]:
    """Write ``toy_train.txt`` and ``toy_test.txt`` (one prompt a line) into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, prompts in zip(("toy_train.txt", "toy_test.txt"), prompt_splits()):
        path = os.path.join(directory, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(prompts) + "\n")
        paths.append(path)
    return paths[0], paths[1]


# ---------------------------------------------------------------------------- geometry


def relation_holds(
    center_a: tuple[float, float],
    center_b: tuple[float, float],
    relation: str,
    min_offset: float = 0.0,
    min_cos: float = 0.5,
) -> bool:
    """Whether A is ``relation`` B, from the centres (x right, y down).

    With ``d`` the unit direction of the relation (left: (-1, 0), above: (0, -1), ...) and
    ``o = center_a - center_b``: holds iff ``o . d > min_offset`` and ``o . d >= min_cos |o|``
    (A lies within acos(min_cos) of the named direction; 0.5 allows 60 degrees).
    """
    directions = {"left of": (-1.0, 0.0), "right of": (1.0, 0.0), "above": (0.0, -1.0), "below": (0.0, 1.0)}
    if relation not in directions:
        raise ValueError(f"Unknown relation {relation!r}; expected one of {list(RELATIONS)}.")
    ox, oy = center_a[0] - center_b[0], center_a[1] - center_b[1]
    dx, dy = directions[relation]
    along = ox * dx + oy * dy
    return along > min_offset and along >= min_cos * float(np.hypot(ox, oy))


def _apart(a: tuple[float, float, float], b: tuple[float, float, float], gap: float) -> bool:
    """Bounding squares (cx, cy, side) do not touch: separated by ``gap`` on some axis."""
    reach = (a[2] + b[2]) / 2 + gap
    return abs(a[0] - b[0]) >= reach or abs(a[1] - b[1]) >= reach


def _place(spec: SceneSpec, rng: np.random.Generator, resolution: int) -> list[tuple[float, float, float]]:
    """Random (cx, cy, side) per drawn object: inside the image, apart, and, for a position
    scene, clearly in the named relation (within 30 degrees, at least one side apart)."""
    if resolution < 16:
        raise ValueError(f"resolution must be at least 16 pixels, got {resolution}.")
    n = sum(obj.count for obj in spec.objects)
    gap = resolution / 16
    for attempt in range(10_000):
        # Shrink objects a little if crowded scenes keep failing.
        scale = 1.0 if attempt < 2_000 else 0.85
        boxes = []
        for _ in range(n):
            side = float(rng.uniform(0.28, 0.38)) * resolution * scale
            margin = side / 2 + 1
            boxes.append((float(rng.uniform(margin, resolution - margin)), float(rng.uniform(margin, resolution - margin)), side))
        if not all(_apart(boxes[i], boxes[j], gap) for i in range(n) for j in range(i)):
            continue
        if spec.relation is not None:
            a, b = boxes
            if not relation_holds(a[:2], b[:2], spec.relation, min_offset=(a[2] + b[2]) / 2, min_cos=0.85):
                continue
        return boxes
    raise RuntimeError(f"Could not place {caption(spec)!r} at resolution {resolution}.")


def _draw(canvas: np.ndarray, shape: str, box: tuple[float, float, float], color: tuple[int, int, int], scale: int) -> None:
    cx, cy, side = (v * scale for v in box)
    half = side / 2
    if shape == "circle":
        cv2.circle(canvas, (round(cx), round(cy)), round(half), color, thickness=-1)
    elif shape == "square":
        cv2.rectangle(canvas, (round(cx - half), round(cy - half)), (round(cx + half) - 1, round(cy + half) - 1), color, -1)
    else:  # upright isosceles triangle filling half of its bounding square
        points = np.array([[cx, cy - half], [cx - half, cy + half], [cx + half, cy + half]], dtype=np.float64)
        cv2.fillPoly(canvas, [np.round(points).astype(np.int32)], color)


def render_scene(spec: SceneSpec, rng: np.random.Generator, resolution: int = 32) -> np.ndarray:
    """Draw ``spec`` at random sizes and places: uint8 RGB image of shape (H, W, 3).

    Drawn at 4x and area-downsampled, so edges are anti-aliased at any small resolution.
    """
    return _render_boxes(spec, _place(spec, rng, resolution), resolution)


def _render_boxes(spec: SceneSpec, boxes: list[tuple[float, float, float]], resolution: int) -> np.ndarray:
    """``spec``'s objects drawn in ``boxes`` (one per copy, in order) at 4x, area-downsampled."""
    supersample = 4
    canvas = np.full((resolution * supersample, resolution * supersample, 3), BACKGROUND, dtype=np.uint8)
    drawn = iter(boxes)
    for obj in spec.objects:
        for _ in range(obj.count):
            _draw(canvas, obj.shape, next(drawn), COLORS[obj.color], supersample)
    return cv2.resize(canvas, (resolution, resolution), interpolation=cv2.INTER_AREA)


def sample_scene(
    rng: np.random.Generator, specs: list[SceneSpec] | None = None, resolution: int = 32, count_fraction: float = 0.4
) -> tuple[np.ndarray, SceneSpec]:
    """A random scene and its spec, drawn from ``specs`` (default: the whole grammar).

    A count scene is drawn with probability ``count_fraction`` (when ``specs`` has both
    kinds), so the few count prompts are not drowned by the many position prompts.
    """
    specs = all_specs() if specs is None else specs
    counts = [s for s in specs if s.relation is None]
    positions = [s for s in specs if s.relation is not None]
    pool = counts if (counts and (not positions or rng.random() < count_fraction)) else positions
    spec = pool[int(rng.integers(len(pool)))]
    return render_scene(spec, rng, resolution), spec


def render_clip(
    spec: SceneSpec, rng: np.random.Generator, num_frames: int, resolution: int = 32, max_speed: float = 0.08,
    jumpy: bool = False,
) -> np.ndarray:
    """A clip of ``spec``: uint8 RGB frames of shape (F, H, W, 3).

    Smooth: each object starts where ``render_scene`` would place it and drifts at a constant
    random velocity of up to ``max_speed`` * resolution pixels a frame (it may leave the frame
    in part). Jumpy: every frame is a fresh placement, so consecutive frames differ as much as
    two scenes do. A video VAE trained on both learns to draw motion and its absence.
    """
    if num_frames < 1:
        raise ValueError(f"num_frames must be at least 1, got {num_frames}.")
    start = _place(spec, rng, resolution)
    velocity = rng.uniform(-max_speed, max_speed, size=(len(start), 2)) * resolution
    frames = []
    for f in range(num_frames):
        boxes = _place(spec, rng, resolution) if jumpy and f else [(x + vx * f, y + vy * f, side) for (x, y, side), (vx, vy) in zip(start, velocity)]
        frames.append(_render_boxes(spec, boxes, resolution))
    return np.stack(frames)
