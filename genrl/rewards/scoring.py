"""When rewards are computed during a rollout: overlapped with denoising, or after it.

- ``async``: reward models live on the CPU or another device; `submit` starts scoring a
  batch in a thread pool at once, so batch i is scored while batch i + 1 denoises.
- ``sync``: reward models share the training GPU; `submit` only stores the batch, and
  `collect` scores them all once every rollout is denoised, after ONE ``empty_cache()``
  (before the loop: never inside it, where it would stall every batch).

Either way `collect` returns one dict per submitted batch, in submission order, and an
exception in a reward surfaces here, in the main thread, naming the reward.

    scorer = RewardScorer(reward_fn, mode="async")
    for batch in batches:
        videos = decode(...).detach().cpu()
        scorer.submit(videos, prompts, metadata)
    rewards = scorer.collect()  # [{"hpsv3": (N,), ..., "total": (N,)}, ...]
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import torch

from genrl.rewards.registry import RewardFn

SCORING_MODES = ("sync", "async")


def _empty_device_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _to_cpu(samples: Any) -> Any:
    """Tensors leave their device here (``.detach().cpu()``), so a reward thread never holds
    the rollout's GPU memory; numpy arrays and CPU tensors are kept as they are (not copied:
    do not modify a batch in place after submitting it)."""
    if isinstance(samples, torch.Tensor):
        return samples.detach().cpu()
    return samples


class RewardScorer:
    """Scores rollout batches with ``reward_fn(samples, prompts, metadata)``, sync or async.

    ``empty_cache`` (default ``torch.cuda.empty_cache`` where CUDA is available) is called
    once per sync `collect`.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Mapping[str, torch.Tensor]],
        mode: str = "async",
        max_workers: int = 1,
        empty_cache: Callable[[], None] | None = None,
    ):
        if mode not in SCORING_MODES:
            raise ValueError(f"Unknown reward scoring mode {mode!r}; expected one of {SCORING_MODES}.")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}.")
        self.reward_fn, self.mode = reward_fn, mode
        self.empty_cache = empty_cache or _empty_device_cache
        self._pending: list[Future | tuple] = []
        self._executor = None
        if mode == "async":
            self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")

    def submit(self, samples: Any, prompts: Sequence[str], metadata: Sequence[Mapping] | None = None) -> None:
        """Queue one batch; async mode starts scoring it now."""
        batch = (_to_cpu(samples), list(prompts), metadata)
        if self._executor is not None:
            self._pending.append(self._executor.submit(self._score, *batch))
        else:
            self._pending.append(batch)

    def collect(self) -> list[dict[str, torch.Tensor]]:
        """Scores of every batch submitted since the last collect, in submission order."""
        pending, self._pending = self._pending, []
        try:
            if self._executor is not None:
                return [future.result() for future in pending]
            if not pending:
                return []
            self.empty_cache()  # once, before the loop
            return [self._score(*batch) for batch in pending]
        except BaseException:
            for item in pending:
                if isinstance(item, Future):
                    item.cancel()
            raise

    def _score(self, samples: Any, prompts: list[str], metadata: Any) -> dict[str, torch.Tensor]:
        try:
            return self.reward_fn(samples, prompts, metadata)
        except Exception as e:
            if isinstance(self.reward_fn, RewardFn):
                raise  # it already names the failing reward
            raise RuntimeError(f"Reward function {self.reward_fn!r} failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Stop the thread pool (waits for batches still being scored)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
