"""A tiny Wan whose VAE has learned the toy world's clips, for the video learning benchmark.

``tiny_pipelines``' random Wan VAE decodes every latent to nearly the same video, so no policy
could move a reward computed on its decodes (``bench/bench_learning.py --setting video`` prints
how far). Here the same pipeline gets a wider ``AutoencoderKLWan`` trained as an autoencoder on
clips of ``genrl.data.toy_scenes`` (shapes drifting smoothly, or jumping every frame), with its
``latents_mean`` / ``latents_std`` set from the encoded clips as Wan's are: standard-normal
latents then decode to plausible, varied clips, and what the transformer samples decides how
smooth they are. The transformer and text encoder stay random: the benchmark's reward
(``temporal_smoothness``) does not read the prompt.

Training loss: ``mean (D(z) - x)^2 + kl_weight * KL(q(z|x) || N(0, I)) / numel(z)``, pixels
scaled to [-0.9, 0.9] because ``AutoencoderKLWan.decode`` clamps to [-1, 1] and a target on the
clamp's edge (the white background) gives the decoder no gradient.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from diffusers import AutoencoderKLWan

from genrl.data.toy_scenes import all_specs, render_clip
from genrl.testing.tiny_pipelines import TINY_SAMPLING_DEFAULTS, build_tiny_pipeline, write_sampling_defaults

PIXEL_RANGE = 0.9


def build_video_vae(base_dim: int = 8, z_dim: int = 4) -> AutoencoderKLWan:
    """Wan's VAE at toy width: 8x spatial and 4x temporal compression, like the full model."""
    return AutoencoderKLWan(base_dim=base_dim, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def clip_batch(rng: np.random.Generator, batch_size: int, num_frames: int, resolution: int,
               jumpy_fraction: float = 0.3) -> torch.Tensor:
    """Toy clips as a video batch ``(B, 3, F, H, W)`` in [-PIXEL_RANGE, PIXEL_RANGE]; a
    ``jumpy_fraction`` of them re-place their objects every frame."""
    specs = all_specs()
    clips = [render_clip(specs[int(rng.integers(len(specs)))], rng, num_frames, resolution,
                         jumpy=bool(rng.random() < jumpy_fraction)) for _ in range(batch_size)]
    video = torch.from_numpy(np.stack(clips)).float()  # (B, F, H, W, 3) in [0, 255]
    return (video / 127.5 - 1).mul(PIXEL_RANGE).permute(0, 4, 1, 2, 3).contiguous()


def train_video_vae(vae: AutoencoderKLWan, steps: int, seed: int = 0, batch_size: int = 16,
                    learning_rate: float = 2e-3, kl_weight: float = 1e-4, num_frames: int = 5,
                    resolution: int = 32, log_every: int = 0) -> dict:
    """Fit ``vae`` to fresh toy clips for ``steps`` AdamW steps (the module docstring's loss),
    then set its latent statistics; returns ``{"mse", "train_s"}`` (``mse``: held-out clips,
    posterior mode)."""
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=learning_rate, weight_decay=0.0)
    start = time.perf_counter()
    vae.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            clips = clip_batch(rng, batch_size, num_frames, resolution)
            posterior = vae.encode(clips).latent_dist
            z = posterior.sample()
            mse = (vae.decode(z).sample - clips).pow(2).mean()
            loss = mse + kl_weight * posterior.kl().mean() / z[0].numel()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            optimizer.step()
            if log_every and (step % log_every == 0 or step == steps - 1):
                print(f"video vae step {step:5d}  mse {mse.item():.4f}  {time.perf_counter() - start:5.0f}s", flush=True)
    vae.eval().requires_grad_(False)
    held_out = clip_batch(np.random.default_rng(seed + 1), 32, num_frames, resolution)
    with torch.no_grad():
        z = vae.encode(held_out).latent_dist.mode()  # (B, C, F', H', W')
        mse = (vae.decode(z).sample - held_out).pow(2).mean().item()
        # Per channel, as Wan's config holds them: decoding computes z * std + mean.
        vae.register_to_config(latents_mean=z.mean(dim=(0, 2, 3, 4)).tolist(),
                               latents_std=z.std(dim=(0, 2, 3, 4)).tolist())
    return {"mse": mse, "train_s": time.perf_counter() - start}


def save_toy_video_pipeline(path: str | os.PathLike, vae_steps: int, seed: int = 0, log_every: int = 0) -> tuple[str, dict]:
    """The tiny Wan pipeline (``seed``) with a ``train_video_vae``-trained VAE, saved under
    ``path`` with its sampling defaults (5 frames of 32x32); returns ``(path, training figures)``."""
    path = os.fspath(path)
    tiny = build_tiny_pipeline("wan", seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipeline = type(tiny)(**{**tiny.components, "vae": build_video_vae(z_dim=tiny.vae.config.z_dim)})
    sizes = TINY_SAMPLING_DEFAULTS["wan"]
    figures = train_video_vae(pipeline.vae, vae_steps, seed=seed, num_frames=sizes["num_frames"],
                              resolution=sizes["height"], log_every=log_every)
    pipeline.save_pretrained(path)
    write_sampling_defaults(path, "wan")
    return path, figures
