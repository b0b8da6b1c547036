"""Prompt embeddings of varying length as the trainer keeps them: right-padded batch-first
tensors with a mask beside them, so that rows can be sliced and concatenated like any other
embedding (Z-Image's pipeline hands out one tensor per prompt, Qwen-Image's pads to the
batch's longest prompt)."""

from __future__ import annotations

from typing import Sequence

import torch


def pad_token_rows(rows: Sequence[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[(L_i, D)]`` -> embeddings ``(B, width, D)``, zero after row i's L_i tokens, and the mask
    ``(B, width)`` bool, True on the L_i tokens; fails if a row is longer than ``width``."""
    longest = max(len(row) for row in rows)
    if longest > width:
        raise ValueError(f"A prompt has {longest} tokens, more than the {width} the embeddings are padded to.")
    embeds = rows[0].new_zeros(len(rows), width, rows[0].shape[-1])
    mask = torch.zeros(len(rows), width, dtype=torch.bool, device=rows[0].device)
    for i, row in enumerate(rows):
        embeds[i, : len(row)] = row
        mask[i, : len(row)] = True
    return embeds, mask


def valid_lengths(mask: torch.Tensor) -> list[int]:
    """Tokens per row of a right-padded mask ``(B, L)`` (a host sync: the lengths shape the
    transformer's input)."""
    return mask.sum(dim=1).tolist()


def token_rows(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The inverse of ``pad_token_rows``: ``(B, L, D)`` and its mask -> ``[(L_i, D)]``."""
    return [row[:length] for row, length in zip(embeds, valid_lengths(mask))]


def pad_to_width(embeds: torch.Tensor, mask: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(B, L, D)`` embeddings and their mask ``(B, L)`` (None: every token; a
    pipeline's "no padding") -> ``(B, width, D)`` and ``(B, width)`` bool, zero past each row's tokens."""
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
    return pad_token_rows(token_rows(embeds, mask.bool()), width)
