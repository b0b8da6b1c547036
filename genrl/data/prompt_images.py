"""Conditioning images of an image-to-video prompt set: each record's image is found and checked
when the prompt set loads (before any model), and read (PIL, RGB) when its batch is encoded.

An image column holds, per record, a file path (relative to the prompt file's folder), an
``http(s)`` URL, or a ``datasets.Image`` feature (a saved or Hub dataset). A path stays a path
and is read again at every encoding; a URL is fetched once, at loading, and its file's bytes
(compressed, as served) are kept in memory; an ``Image`` feature keeps its bytes (or its path).
"""

from __future__ import annotations

import hashlib
import io
import os
import urllib.error
import urllib.request
from typing import Any, Sequence, Union

import numpy as np
import PIL.Image
import torch

# What a prompt set holds per image: a local file's path or an image file's bytes.
ImageRef = Union[str, bytes]

URL_TIMEOUT_S = 60


def _is_url(value: str) -> bool:
    return value.startswith(("http://", "https://"))


def _open_checked(ref: ImageRef) -> None:
    """Open ``ref`` and check its structure (no pixel decoding: a large set checks in moments)."""
    with PIL.Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as image:
        image.verify()


def resolve_image(value: Any, base_dir: str) -> ImageRef:
    """One record's image column -> the ``ImageRef`` kept for it, checked readable.

    ``value``: a path (relative ones from ``base_dir``), a URL (fetched now), or a
    ``datasets.Image`` cell ``{"bytes": ..., "path": ...}``. Raises ``ValueError`` saying
    what is wrong with it, in words that follow "its image ...".
    """
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):  # a datasets.Image cell
        value = value["bytes"] or value["path"]
    if isinstance(value, str) and value.strip():
        value = value.strip()
        if _is_url(value):
            try:
                with urllib.request.urlopen(value, timeout=URL_TIMEOUT_S) as response:
                    value = response.read()
            except urllib.error.HTTPError as error:
                raise ValueError(f"{value!r} could not be fetched (HTTP {error.code} {error.reason})") from None
            except OSError as error:
                raise ValueError(f"{value!r} could not be fetched ({getattr(error, 'reason', error)})") from None
        else:
            value = value if os.path.isabs(value) else os.path.join(base_dir, value)
            if not os.path.isfile(value):
                raise ValueError(f"{value!r} does not exist")
    if not isinstance(value, (str, bytes)):
        raise ValueError(f"is {value!r:.60}, not a path, a URL or an image")
    try:
        _open_checked(value)
    except (OSError, SyntaxError, ValueError) as error:  # PIL raises each for some broken files
        shown = value if isinstance(value, str) else f"({len(value)} bytes)"
        raise ValueError(f"{shown!r} is not a readable image ({type(error).__name__}: {error})") from None
    return value


def read_image(image: "ImageRef | PIL.Image.Image") -> PIL.Image.Image:
    """An ``ImageRef`` (or a PIL image) as an RGB PIL image."""
    if isinstance(image, PIL.Image.Image):
        return image.convert("RGB")
    with PIL.Image.open(io.BytesIO(image) if isinstance(image, bytes) else image) as opened:
        return opened.convert("RGB")


def image_key(image: "ImageRef | PIL.Image.Image") -> Any:
    """What tells images apart in a batch: a path or bytes by value, a PIL image by identity."""
    return image if isinstance(image, (str, bytes)) else id(image)


def image_digest(image: "ImageRef | PIL.Image.Image") -> int:
    """A 64-bit digest of an image's content, the same in every process, on every machine and
    after a resume (a path's location is not: the digest is of what the file holds):
    blake2b(digest_size=8), read big-endian, of a file's bytes (a path's, or the bytes kept), or
    of a PIL image's mode, size and pixels."""
    digest = hashlib.blake2b(digest_size=8)
    if isinstance(image, PIL.Image.Image):
        digest.update(f"{image.mode} {image.size[0]}x{image.size[1]}\n".encode())
        digest.update(image.tobytes())
    elif isinstance(image, bytes):
        digest.update(image)
    else:
        with open(image, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return int.from_bytes(digest.digest(), "big")


def image_digests(images: Sequence) -> list[int]:
    """``image_digest`` of each of ``images``, each distinct one read once."""
    unique, rows = unique_images(images)
    digests = [image_digest(image) for image in unique]
    return [digests[row] for row in rows]


def unique_images(images: Sequence) -> tuple[list, list[int]]:
    """``images`` without repeats (first occurrences, in order) and, per input, its index among
    them: a prompt group's samples share one image, encoded once."""
    first: dict[Any, int] = {}
    unique, rows = [], []
    for image in images:
        key = image_key(image)
        if key not in first:
            first[key] = len(unique)
            unique.append(image)
        rows.append(first[key])
    return unique, rows


def condition_preview(image: "ImageRef | PIL.Image.Image", height: int, width: int) -> torch.Tensor:
    """uint8 ``(H, W, C)``: ``image`` resized as the diffusers pipelines resize it before encoding
    (PIL Lanczos to ``width`` x ``height``), for an evaluation grid."""
    resized = read_image(image).resize((width, height), resample=PIL.Image.LANCZOS)
    return torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy())
