"""ZeRO-3 specifics: buffer sizes that scale with the model's width, parameters settled before
they are gathered, and frozen models built outside ``zero.Init``."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from genrl.distributed.zero_init import full_numel, full_shape

# ZeRO-3's buffer sizes, in elements, that scale with the model's width (what Accelerate fills
# for "auto" entries from a transformers config's hidden_size; diffusers configs have none).
ZERO3_WIDTH_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def zero3_bucket_sizes(width: int) -> dict[str, int]:
    """ZeRO-3's width-based buffer sizes for a transformer of width d (elements):

        reduce_bucket_size = d^2, stage3_prefetch_bucket_size = 0.9 d^2,
        stage3_param_persistence_threshold = 10 d

    A bucket of about one d x d weight: DeepSpeed's defaults (5e8 and 5e7 elements, 2 GB and
    200 MB in fp32) are allocated up front and outweigh what ZeRO-3 saves on models below a few
    billion parameters. Parameters under 10 d elements (norms, biases) stay whole on every rank."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}.")
    return {
        "reduce_bucket_size": width * width,
        "stage3_prefetch_bucket_size": int(0.9 * width * width),
        "stage3_param_persistence_threshold": 10 * width,
    }


def transformer_width(model: torch.nn.Module) -> int:
    """The width d of a diffusers (or transformers) transformer: ``hidden_size`` of its config,
    else ``num_attention_heads * attention_head_dim``, else the square root of its largest 2-D
    parameter's size."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    if hidden:
        return int(hidden)
    heads, head_dim = getattr(config, "num_attention_heads", None), getattr(config, "attention_head_dim", None)
    if heads and head_dim:
        return int(heads) * int(head_dim)
    sizes = [full_numel(p) for p in model.parameters() if len(full_shape(p)) == 2]  # ZeRO-3 shards are 1-D
    return max(1, int(max(sizes) ** 0.5)) if sizes else 1


def size_zero3_buckets(plugin, model: torch.nn.Module) -> dict[str, int]:
    """Under ZeRO-3 (``plugin``: ``accelerator.state.deepspeed_plugin``, or None), set the
    width-based buffer sizes (``zero3_bucket_sizes``) that the DeepSpeed config leaves unset or
    "auto"; values the user wrote (a ``deepspeed_config_file``) are kept. Call before
    ``accelerator.prepare``. Returns the sizes in force ({} without ZeRO-3)."""
    if plugin is None or int(plugin.zero_stage) != 3:
        return {}
    zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
    sizes = zero3_bucket_sizes(transformer_width(model))
    for key in ZERO3_WIDTH_KEYS:
        if zero.get(key, "auto") == "auto":
            zero[key] = sizes[key]
    return {key: zero[key] for key in ZERO3_WIDTH_KEYS}


def settle_zero3_params(model: torch.nn.Module) -> None:
    """Under ZeRO-3 (``model`` the DeepSpeed engine), wait for the parameters DeepSpeed is still
    prefetching and release every gathered one, so that they can be gathered and re-partitioned
    by ``GatheredParameters`` (EMA swaps, exports): re-partitioning a parameter still in flight
    fails DeepSpeed's assertion "Cannot partition a param in flight". Collective-free; a no-op
    for any other model."""
    # The optimizer's release, not the engine's ``empty_partition_cache``, which also runs
    # gc.collect() and empties the accelerator's cache: 0.7 s a call in a process holding
    # torch, diffusers and transformers, and called at every export, EMA swap and evaluation.
    release = getattr(getattr(model, "optimizer", None), "empty_partition_cache", None)
    if release is not None and getattr(model, "zero_optimization_stage", lambda: 0)() == 3:
        release()


@contextlib.contextmanager
def zero_init_disabled() -> Iterator[None]:
    """Build frozen models (text encoders, VAE, reward models) outside ZeRO-3's ``zero.Init``.

    With a ZeRO-3 config active, Accelerate registers its DeepSpeed config with transformers
    (even with ``zero3_init_flag: false``), and every ``from_pretrained`` then partitions the
    model across ranks: a frozen model sharded that way is slow, or hangs when ranks call it
    unevenly. transformers reads the weak reference below through
    ``is_deepspeed_zero3_enabled()`` (the same name on 4.52+ and 5.x); it is cleared for the
    block and restored after. Not thread-safe: build models on one thread.
    """
    import transformers.integrations.deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def under_zero3() -> bool:
    """Whether this process was launched with a ZeRO-3 config (``accelerate launch`` sets the
    stage in the environment before the script parses its arguments)."""
    return os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
