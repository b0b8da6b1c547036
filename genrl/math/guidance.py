"""Refinements of classifier-free guidance that some pipelines apply on top of
v = v_c + g (v_c - v_u): guidance switched off late in sampling, and the guided velocity's norm
capped. Per sample, so that a batch may hold samples at different timesteps."""

from __future__ import annotations

import torch


def truncated_guidance_scale(guidance_scale: float, progress: torch.Tensor, truncation: float) -> torch.Tensor:
    """Per-sample scale ``(B,)``: g while the sample's progress p = 1 - t / T (0 at pure noise,
    1 at the clean end) is at most ``truncation``, 0 after it:

        g_i = g  if p_i <= truncation  else 0

    ``progress``: ``(B,)``. A truncation of 1 or more guides every step."""
    scale = torch.full_like(progress, float(guidance_scale), dtype=torch.float32)
    return torch.where(progress.float() > truncation, torch.zeros_like(scale), scale)


def renormalized_guidance(guided: torch.Tensor, conditional: torch.Tensor, max_ratio: float) -> torch.Tensor:
    """The guided velocity with its norm capped at ``max_ratio`` times the conditional one's,
    each sample over all of its elements:

        v_i <- v_i * min(1, r ||v_c,i|| / ||v_i||)

    ``guided``, ``conditional``: ``(B, ...)``; r <= 0 leaves ``guided`` as it is."""
    if max_ratio <= 0:
        return guided
    dims = tuple(range(1, guided.ndim))
    norm = torch.linalg.vector_norm(guided, dim=dims, keepdim=True)
    cap = max_ratio * torch.linalg.vector_norm(conditional, dim=dims, keepdim=True)
    return torch.where(norm > cap, guided * (cap / norm), guided)
