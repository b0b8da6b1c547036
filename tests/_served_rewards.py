"""User rewards for a reward service to serve in tests: some break the reward contract (the client
must refuse their scores as it refuses an in-process reward's), one abstains as a judge does, one
keeps its service busy until the test lets it answer."""

import os
import time

import torch

from genrl.rewards.layouts import prepare_images
from genrl.rewards.rule_based import build_jpeg_reward

_JPEG = build_jpeg_reward("jpeg_compressibility")


def wrong_count(samples, prompts, metadata):
    """One score too many: ``(N + 1,)``."""
    return torch.zeros(len(samples) + 1)


def nan_scores(samples, prompts, metadata):
    """NaN for every sample: ``(N,)``."""
    return torch.full((len(samples),), float("nan"))


def abstains(samples, prompts, metadata):
    """The mean pixel in [0, 1] of the even samples; NaN (an abstention) for the odd ones: ``(N,)``."""
    scores = torch.from_numpy(prepare_images(samples)).flatten(1).double().mean(1).float() / 255
    scores[1::2] = float("nan")
    return scores


abstains.may_abstain = True


def held_jpeg(samples, prompts, metadata, hold=None):
    """``jpeg_compressibility``'s scores ``(N,)``, given only once the file ``hold`` is gone (at
    most 300 s later); a request that finds it there first writes ``<hold>.reached``."""
    if hold and os.path.exists(hold):
        open(hold + ".reached", "w").close()
        deadline = time.monotonic() + 300
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)
    return _JPEG(samples, prompts, metadata)
