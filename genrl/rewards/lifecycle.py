"""Where reward models live: one cache entry per (model name, checkpoint, device).

A *scorer* is the object a reward factory builds around a frozen model: either a
``torch.nn.Module`` itself, or any object with a ``.model`` module. It carries a ``.device``
field. `move` moves the model, its ``.device`` and its cache key together, so the cache
never claims a model sits where it does not.

Reward callables should fetch their scorer with `get_reward_model` at call time (a dict
look-up), not hold it from build time: then a model freed by `clear_reward_models` (before
PPO, when memory is tight) is simply rebuilt on its next use.

Synchronous scoring on the training GPU:

    with on_device(cached_reward_models(), accelerator.device):
        rewards = reward_fn(samples, prompts, metadata)
    # models are back where they were; gc.collect() + empty_cache() ran once

All functions are thread-safe (the async scorer builds and calls rewards in a thread pool).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any, Callable, Iterable, Iterator

import torch

CacheKey = tuple[str, str, str]  # (model name, checkpoint, device)

_CACHE: dict[CacheKey, Any] = {}
_LOCK = threading.RLock()
# What reward services report of their reward models (served rewards hold none here).
_SERVED: dict[str, dict[str, Any]] = {}


def canonical_device(device: str | torch.device) -> torch.device:
    """``torch.device``, with a bare "cuda" pinned to the current CUDA index (as parameters report it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def cache_key(model_name: str, checkpoint: str, device: str | torch.device) -> CacheKey:
    return (str(model_name), str(checkpoint), str(canonical_device(device)))


def free_memory() -> None:
    """``gc.collect()`` then ``torch.cuda.empty_cache()`` (the latter only where CUDA is available).

    Looked up at call time by the functions below, so tests may patch it to count calls.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _cleanup(cleanup: Callable[[], None] | None) -> None:
    (cleanup or free_memory)()


def _module_of(scorer: Any) -> torch.nn.Module | None:
    if isinstance(scorer, torch.nn.Module):
        return scorer
    model = getattr(scorer, "model", None)
    return model if isinstance(model, torch.nn.Module) else None


def get_reward_model(
    model_name: str, checkpoint: str, device: str | torch.device, build: Callable[[torch.device], Any]
) -> Any:
    """The cached scorer for ``(model_name, checkpoint, device)``, built with ``build(device)`` once.

    The build runs under the cache lock, so two rewards asking for the same model at the
    same time (e.g. videoalign_vq and videoalign_ta) load it once. The scorer's ``.device``
    is set to the key's device.
    """
    key = cache_key(model_name, checkpoint, device)
    with _LOCK:
        if key not in _CACHE:
            scorer = build(canonical_device(device))
            scorer.device = canonical_device(device)
            _CACHE[key] = scorer
        return _CACHE[key]


def reward_model_handle(
    model_name: str, checkpoint: str, device: str | torch.device, build: Callable[[torch.device], Any]
) -> Callable[[], Any]:
    """Build (or fetch) the cached scorer now and return a getter for it.

    The getter keeps the scorer it has while `move` / `on_device` carry it between devices
    (a fresh cache lookup by the original device would build a second copy), and fetches a
    new one only after `clear_reward_models` freed it (its device is then ``meta``).
    """
    scorer = get_reward_model(model_name, checkpoint, device, build)

    def get() -> Any:
        nonlocal scorer
        if canonical_device(scorer.device).type == "meta":
            scorer = get_reward_model(model_name, checkpoint, device, build)
        return scorer

    return get


def describe_reward_models() -> dict[str, dict[str, str]]:
    """``{model name: {"template_sha256": digest, ...}}`` for each cached scorer that names the
    prompt template it uses (the Qwen2-VL scorers, the VLM judge, whose ``description`` adds its
    endpoint, model and template), and those of the reward services its served rewards use
    (`record_served_models`): what a run records of its reward models, so that a score can be
    traced to the template text and model that produced it."""
    with _LOCK:
        local = {key[0]: {"template_sha256": scorer.template_sha256, **getattr(scorer, "description", {})}
                 for key, scorer in _CACHE.items() if getattr(scorer, "template_sha256", None)}
        return {**local, **_SERVED}


def record_served_models(url: str, models: dict[str, dict[str, Any]]) -> None:
    """Record what the reward service at ``url`` reports of its reward models (its own
    `describe_reward_models`), each with ``"service": url``, beside this process's own."""
    with _LOCK:
        _SERVED.update({name: {**description, "service": url} for name, description in models.items()})


def cache_key_of(scorer: Any) -> CacheKey | None:
    """The key a scorer is cached under, or None if it is not cached."""
    with _LOCK:
        return next((k for k, v in _CACHE.items() if v is scorer), None)


def cached_reward_models() -> list[Any]:
    """Every cached scorer (e.g. to pass to `on_device`)."""
    with _LOCK:
        return list(_CACHE.values())


def move(scorer: Any, device: str | torch.device) -> Any:
    """Move a scorer's model to ``device``, and update its ``.device`` and its cache key with it."""
    device = canonical_device(device)
    with _LOCK:
        old_key = cache_key_of(scorer)
        new_key = None if old_key is None else (old_key[0], old_key[1], str(device))
        if new_key is not None and new_key != old_key and new_key in _CACHE:
            raise ValueError(f"Cannot move reward model {old_key[0]!r} to {device}: another copy is cached there.")
        module = _module_of(scorer)
        if module is not None:
            module.to(device)
        scorer.device = device
        if new_key is not None and new_key != old_key:
            del _CACHE[old_key]
            _CACHE[new_key] = scorer
    return scorer


@contextlib.contextmanager
def on_device(
    scorers: Iterable[Any], device: str | torch.device, *, cleanup: Callable[[], None] | None = None
) -> Iterator[list[Any]]:
    """Move scorers onto ``device`` for the block, then each back to where it was.

    Cleanup (default `free_memory`: gc.collect() + empty_cache()) runs once, at the end,
    after the models left the device; also when the block raises.
    """
    scorers = list(scorers)
    origins = [getattr(s, "device", None) for s in scorers]
    try:
        for s in scorers:
            move(s, device)
        yield scorers
    finally:
        for s, origin in zip(scorers, origins):
            if origin is not None:
                move(s, origin)
        _cleanup(cleanup)


def clear_reward_models(*, cleanup: Callable[[], None] | None = None) -> int:
    """Free every cached reward model and empty the cache (and the services' records); returns
    how many were freed.

    Each model is moved to the meta device, which releases its memory even where a stale
    reference survives (using one afterwards fails loudly instead of silently keeping GPU
    memory). Cleanup runs once at the end.
    """
    with _LOCK:
        scorers = list(_CACHE.values())
        _CACHE.clear()
        _SERVED.clear()
    count = len(scorers)
    for scorer in scorers:
        _free(scorer)
    del scorers
    _cleanup(cleanup)
    return count


def _free(scorer: Any) -> None:
    module = _module_of(scorer)
    if module is not None:
        module.to("meta")
    scorer.device = torch.device("meta")
