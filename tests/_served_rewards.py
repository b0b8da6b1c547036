"""User rewards that break the reward contract, for a reward service to serve: the client must
refuse their scores as it refuses an in-process reward's."""

import torch


def wrong_count(samples, prompts, metadata):
    """One score too many: ``(N + 1,)``."""
    return torch.zeros(len(samples) + 1)


def nan_scores(samples, prompts, metadata):
    """NaN for every sample: ``(N,)``."""
    return torch.full((len(samples),), float("nan"))
