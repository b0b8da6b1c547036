"""The video benchmark's tiny Wan: a VAE trained on toy clips, whose decodes depend on the latents."""

import numpy as np
import pytest
import torch

from genrl.policies import load_policy
from genrl.testing.toy_video import PIXEL_RANGE, build_video_vae, clip_batch, save_toy_video_pipeline, train_video_vae


def test_clip_batch_is_a_video_batch_inside_the_decoders_clamp():
    clips = clip_batch(np.random.default_rng(0), 3, num_frames=5, resolution=32)
    assert clips.shape == (3, 3, 5, 32, 32) and clips.dtype == torch.float32
    # The white background sits at +PIXEL_RANGE, inside decode's clamp to [-1, 1].
    assert clips.max().item() == pytest.approx(PIXEL_RANGE) and clips.min().item() >= -PIXEL_RANGE
    assert torch.equal(clips, clip_batch(np.random.default_rng(0), 3, num_frames=5, resolution=32))


def test_training_sets_the_latent_statistics_from_the_encoded_clips():
    torch.manual_seed(0)
    vae = build_video_vae(base_dim=4)
    figures = train_video_vae(vae, steps=2, seed=3, batch_size=2)
    assert np.isfinite(figures["mse"]) and figures["train_s"] > 0
    with torch.no_grad():
        z = vae.encode(clip_batch(np.random.default_rng(4), 32, 5, 32)).latent_dist.mode()
    assert vae.config.latents_mean == pytest.approx(z.mean(dim=(0, 2, 3, 4)).tolist(), abs=1e-5)
    assert vae.config.latents_std == pytest.approx(z.std(dim=(0, 2, 3, 4)).tolist(), abs=1e-5)
    assert not any(p.requires_grad for p in vae.parameters())


def test_training_fits_the_clips_and_saves_a_loadable_pipeline(tmp_path):
    """A short training already beats the untrained decoder on held-out clips (the benchmark
    trains 800 steps and prints how far the trained decodes' smoothness can move)."""
    torch.manual_seed(0)
    untrained = build_video_vae()
    clips = clip_batch(np.random.default_rng(1), 32, 5, 32)  # train_video_vae's held-out clips for seed 0
    with torch.no_grad():
        before = (untrained.decode(untrained.encode(clips).latent_dist.mode()).sample - clips).pow(2).mean().item()
    path, figures = save_toy_video_pipeline(tmp_path / "toy-wan", vae_steps=12)
    assert figures["mse"] < 0.5 * before
    policy = load_policy(path).to("cpu")
    assert policy.resolve_size(None, None, None) == (32, 32, 5)
    assert policy.pipeline.vae.config.base_dim == 8
    latents = torch.randn((2, *policy.latent_shape(32, 32, 5)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        video = policy.decode(latents)
    assert video.shape[0] == 2 and torch.isfinite(video).all()
