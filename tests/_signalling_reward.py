"""A user reward (``--reward_fn tests._signalling_reward:brightness``) that also plays the cluster:
on its ``at_call``-th call in a process it sends that process ``signal`` (repeated ``times``), once
per ``marker`` file, so that a resumed run of the same arguments is not signalled again; with
``rank``, only in that process of a launch (the others learn of it from the ranks' agreement)."""

import os
import signal as signals
import time

import torch

_calls = 0


def brightness(samples, prompts, metadata, *, marker: str, at_call: int = 1, signal: str = "SIGTERM", times: int = 1,
               rank: int | None = None):
    """The mean pixel value of each sample, ``(B,)``: a deterministic score of the samples alone."""
    global _calls
    _calls += 1
    here = rank is None or int(os.environ.get("RANK", "0")) == rank
    if _calls == at_call and here and not os.path.exists(marker):
        open(marker, "w").close()
        for i in range(times):
            time.sleep(0.3 if i else 0)  # apart, so that the interpreter does not merge them into one
            os.kill(os.getpid(), getattr(signals, signal))
    return torch.as_tensor(samples).float().flatten(1).mean(1)
