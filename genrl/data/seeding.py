"""Seeds that agree across processes, machines and batch layouts.

A sample's whole trajectory (initial noise, SDE noise, SDE-window start) is a function of
``(run seed, epoch, record, index in its group)`` alone, a record being its prompt and, for an
image-conditioned prompt set, its conditioning image (``image_id``, a digest of the image's
content: two records of one text and different images draw different noise). Python's ``hash()``
is salted per process (PYTHONHASHSEED) and is never used here; digests are blake2b.

Generators live on the CPU: CPU and CUDA random streams differ, and drawing on the CPU
keeps a sample's noise identical on every machine. Noise is moved to the device after,
without waiting for the GPU (``host_to_device``).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

_MASK63 = (1 << 63) - 1  # torch.Generator.manual_seed takes a non-negative int64


def prompt_digest(prompt: str) -> int:
    """blake2b(prompt as UTF-8, digest_size=8), read big-endian."""
    return int.from_bytes(hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest(), "big")


def mix_seeds(*parts: int) -> int:
    """One 63-bit seed from integers: blake2b over their signed 8-byte big-endian forms."""
    data = b"".join(int(p & ((1 << 64) - 1)).to_bytes(8, "big") for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") & _MASK63


def prompt_seed(prompt: str, seed: int, epoch: int, image_id: int | None = None) -> int:
    """The seed of a record's group in an epoch: mix(digest(prompt), seed, epoch) for a text-only
    record, mix(digest(prompt), image_id, seed, epoch) for one with a conditioning image
    (``image_id``: a 64-bit digest of it, ``genrl.data.prompt_images.image_digest``)."""
    if image_id is None:
        return mix_seeds(prompt_digest(prompt), seed, epoch)
    return mix_seeds(prompt_digest(prompt), image_id, seed, epoch)


# Salts separating the independent random streams of one sample.
_LATENT, _NOISE, _WINDOW, _FORWARD = 1, 2, 3, 4


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (on the CPU) on ``device``. To a GPU through pinned memory with a non-blocking
    copy: a plain copy from pageable memory waits for the GPU to finish its queue, which in the
    denoising loop left it idle while Python prepared every next step. The values are the same."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def latent_generator(
    prompt: str, seed: int, epoch: int, index: int, same_latent: bool, image_id: int | None = None
) -> torch.Generator:
    """Generator of a sample's initial noise. With ``same_latent`` all K samples of a prompt
    share it (the index is left out)."""
    base = prompt_seed(prompt, seed, epoch, image_id)
    return _generator(mix_seeds(base, _LATENT) if same_latent else mix_seeds(base, _LATENT, index))


def noise_generator(prompt: str, seed: int, epoch: int, index: int, image_id: int | None = None) -> torch.Generator:
    """Generator of a sample's SDE noise: distinct for every sample of a group."""
    return _generator(mix_seeds(prompt_seed(prompt, seed, epoch, image_id), _NOISE, index))


def window_generator(prompt: str, seed: int, epoch: int, image_id: int | None = None) -> torch.Generator:
    """Generator of a prompt's SDE-window start: shared by its group, so that the K samples
    compared by GRPO are stochastic on the same steps."""
    return _generator(mix_seeds(prompt_seed(prompt, seed, epoch, image_id), _WINDOW))


def forward_generator(prompt: str, seed: int, epoch: int, index: int, image_id: int | None = None) -> torch.Generator:
    """Generator of a sample's forward-process draws (trained timesteps and noise) in the
    likelihood-free objectives: distinct for every sample, independent of the batch layout."""
    return _generator(mix_seeds(prompt_seed(prompt, seed, epoch, image_id), _FORWARD, index))


def randn_per_sample(
    shape: Sequence[int], generators: Sequence[torch.Generator], device: torch.device | str, dtype=torch.float32
) -> torch.Tensor:
    """``(len(generators), *shape)`` standard normal noise, row i drawn from generator i on
    the CPU, then moved to ``device``."""
    rows = [torch.randn(tuple(shape), generator=g, dtype=torch.float32) for g in generators]
    return torch.stack(rows).to(device=device, dtype=dtype)
