"""Qwen2-VL reward models written for transformers 4.45, run on transformers >= 4.52 (4.x and 5.x).

HPSv3 and VideoAlign were trained on the old module layout: ``visual`` at the top and the
text model at ``model``. Since 4.52 it is ``model.visual`` + ``model.language_model`` +
``lm_head``, and their checkpoints still carry the old keys. This module holds what both
scorers need to load such a checkpoint and run the original forward on today's classes:

- key remapping (plain and PEFT layouts) and LoRA merging,
- checkpoint reading (safetensors, .pth/.bin, sharded folders),
- a strict loader that names missing/unexpected keys and handles meta-device models,
- ``embed_tokens`` aliases written without registering duplicate submodules,
- the vision output accessor (``pooler_output`` on 5.x, the tensor itself on 4.x),
- model construction outside DeepSpeed ZeRO-3's ``zero.Init``,
- the original reward forward: sequential positions on the three M-RoPE axes.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import re
from typing import Iterator, Mapping, Optional

import torch
from torch import nn

# Reward models are frozen: they are built outside ZeRO-3's partitioning (see genrl.distributed.zero3).
from genrl.distributed.zero3 import zero_init_disabled as zero3_init_disabled

PEFT_PREFIX = "base_model.model."
_TEXT_PARTS = ("embed_tokens", "layers", "norm")
# Old key -> new key; each pattern matches old keys only, so remapping new keys is a no-op.
_PLAIN_RULES = (
    (re.compile(r"^visual\."), "model.visual."),
    (re.compile(r"^model\.(?=(?:%s)\.)" % "|".join(_TEXT_PARTS)), "model.language_model."),
)
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?:(?P<adapter>[^.]+)\.)?weight$")
_SAVED_COPY_KEY = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<param>.+)$")
_ORIGINAL_KEY = re.compile(r"^(?P<module>.+)\.original_module\.(?P<param>.+)$")
_UNSUPPORTED_PEFT = ("lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
_SHOWN_KEYS = 8


# ----------------------------------------------------------------------------- key layouts


def _remap_plain_key(key: str) -> str:
    for pattern, replacement in _PLAIN_RULES:
        if pattern.match(key):
            return pattern.sub(replacement, key, count=1)
    return key


def remap_qwen2vl_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename transformers-4.45 Qwen2-VL keys to the >= 4.52 layout; other keys pass unchanged.

    Plain: ``visual.`` -> ``model.visual.``; ``model.(embed_tokens|layers|norm).`` ->
    ``model.language_model.(...)``; ``lm_head.`` and ``rm_head.`` unchanged.
    PEFT: the same rules after the ``base_model.model.`` prefix, e.g.
    ``base_model.model.visual.`` -> ``base_model.model.model.visual.``.
    Idempotent: keys already in the new layout are left alone.
    """
    remapped: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        prefix = PEFT_PREFIX if key.startswith(PEFT_PREFIX) else ""
        new_key = prefix + _remap_plain_key(key[len(prefix):])
        if new_key in remapped:
            raise ValueError(f"Checkpoint holds key {new_key!r} in both the old and the new Qwen2-VL layout; keep one.")
        remapped[new_key] = value
    return remapped


def is_peft_state_dict(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """True when the keys carry PEFT's ``base_model.model.`` prefix (a ``PeftModel.state_dict()``)."""
    return any(key.startswith(PEFT_PREFIX) for key in state_dict)


def merge_lora_state_dict(
    state_dict: Mapping[str, torch.Tensor], alpha: Optional[float], r: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """A PEFT state dict as a plain one: prefix stripped, LoRA merged, saved module copies kept.

    For every LoRA pair on a linear layer: ``W' = W + (alpha / r) * B @ A`` with ``A`` of shape
    ``(r, in)`` and ``B`` of shape ``(out, r)``, computed in float32 and cast back to ``W``'s
    dtype. ``r`` defaults to the rank read from ``A``; when given it must match. PEFT's
    ``.base_layer.`` infix is dropped, ``modules_to_save.<adapter>.`` copies replace their
    ``original_module.`` twins. Keys may carry an adapter name (``lora_A.default.weight``,
    from ``PeftModel.state_dict()``) or not (``lora_A.weight``, from saved adapter files).
    The result is in whatever key layout the checkpoint used (old or new); remap it after.
    """
    stripped = {(k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k): v for k, v in state_dict.items()}
    unsupported = sorted(k for k in stripped if any(f".{name}" in k for name in _UNSUPPORTED_PEFT))
    if unsupported:
        raise ValueError(
            f"Cannot merge PEFT keys {_short_list(unsupported)}: only LoRA on linear layers "
            "(lora_A / lora_B) can be merged."
        )
    lora: dict[str, dict[str, torch.Tensor]] = {}
    saved_copies: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    adapters: set[str] = set()
    for key, value in stripped.items():
        if (m := _LORA_KEY.match(key)) is not None:
            lora.setdefault(m["module"], {})[m["ab"]] = value
            if m["adapter"]:
                adapters.add(m["adapter"])
        elif (m := _SAVED_COPY_KEY.match(key)) is not None:
            saved_copies[f"{m['module']}.{m['param']}"] = value
            adapters.add(m["adapter"])
        else:
            plain[key.replace(".base_layer.", ".")] = value
    if len(adapters) > 1:
        raise ValueError(f"Checkpoint holds several PEFT adapters {sorted(adapters)}; merge accepts exactly one.")
    merged: dict[str, torch.Tensor] = {}
    for key, value in plain.items():
        m = _ORIGINAL_KEY.match(key)
        if m is None:
            merged[key] = value
        elif f"{m['module']}.{m['param']}" not in saved_copies:
            merged[f"{m['module']}.{m['param']}"] = value
    merged.update(saved_copies)
    if lora and alpha is None:
        raise ValueError("The checkpoint holds LoRA weights but no lora_alpha was given; pass the adapter's alpha.")
    for module, pair in lora.items():
        weight_key = f"{module}.weight"
        if set(pair) != {"A", "B"} or weight_key not in merged:
            raise ValueError(
                f"LoRA module {module!r} needs lora_A, lora_B and its base weight; found "
                f"{sorted('lora_' + ab for ab in pair)}{' and the base weight' if weight_key in merged else ''}."
            )
        merged[weight_key] = merge_lora_weight(merged[weight_key], pair["A"], pair["B"], alpha, r)
    return merged


def merge_lora_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, alpha: float, r: Optional[int] = None
) -> torch.Tensor:
    """``W + (alpha / r) * B @ A`` in float32, returned in ``W``'s dtype.

    Shapes: ``W`` (out, in), ``A`` (r, in), ``B`` (out, r).
    """
    rank = lora_a.shape[0]
    if r is not None and r != rank:
        raise ValueError(f"lora_r={r} does not match the rank {rank} of the checkpoint's lora_A.")
    if lora_a.ndim != 2 or lora_b.shape != (weight.shape[0], rank) or lora_a.shape[1] != weight.shape[1]:
        raise ValueError(
            f"LoRA shapes A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit a weight of shape "
            f"{tuple(weight.shape)}; expected A (r, {weight.shape[1]}) and B ({weight.shape[0]}, r)."
        )
    delta = (lora_b.float() @ lora_a.float()) * (alpha / rank)
    return (weight.float() + delta).to(weight.dtype)


def normalize_qwen2vl_state_dict(
    state_dict: Mapping[str, torch.Tensor], *, lora_alpha: Optional[float] = None, lora_r: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """Any supported layout -> the plain >= 4.52 layout: PEFT dicts merged, old keys remapped."""
    if is_peft_state_dict(state_dict):
        state_dict = merge_lora_state_dict(state_dict, lora_alpha, lora_r)
    return remap_qwen2vl_keys(state_dict)


# ----------------------------------------------------------------------------- checkpoint files

_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin", "model.pth", "model.pt")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_WRAPPER_KEYS = ("model", "state_dict", "module")


def _load_file(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    if path.endswith((".pth", ".pt", ".bin")):
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        # Training scripts often save {"model": state_dict, ...}; HPSv3's own loader unwraps "model".
        for key in _WRAPPER_KEYS:
            if isinstance(loaded, Mapping) and isinstance(loaded.get(key), Mapping):
                loaded = loaded[key]
                break
        if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise ValueError(f"{path} does not hold a state dict (a mapping of names to tensors).")
        return dict(loaded)
    raise ValueError(f"Unknown checkpoint file type {path!r}; expected .safetensors, .pth, .pt or .bin.")


def load_checkpoint_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Read a state dict on the CPU from a file or a folder.

    Files: ``.safetensors``, or ``.pth``/``.pt``/``.bin`` (``torch.load(weights_only=True)``;
    a ``{"model": ...}`` wrapper is unwrapped). Folders: a sharded checkpoint with
    ``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``, else one of
    ``model.safetensors``, ``pytorch_model.bin``, ``model.pth``, ``model.pt``, else the
    folder's only weights file.
    """
    if os.path.isfile(path):
        return _load_file(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Checkpoint {path!r} is neither a file nor a folder.")
    for index_name in _INDEX_FILES:
        index_path = os.path.join(path, index_name)
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            state_dict: dict[str, torch.Tensor] = {}
            for shard in shards:
                state_dict.update(_load_file(os.path.join(path, shard)))
            return state_dict
    for name in _SINGLE_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return _load_file(os.path.join(path, name))
    # A folder holding one weights file under its own name (e.g. HPSv3.safetensors).
    weights = sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".pth", ".pt", ".bin")))
    if len(weights) == 1:
        return _load_file(os.path.join(path, weights[0]))
    raise FileNotFoundError(
        f"No checkpoint in folder {path!r}: expected one of {list(_INDEX_FILES) + list(_SINGLE_FILES)} "
        f"or a single weights file, found {weights}."
    )


# ----------------------------------------------------------------------------- strict loading


def _short_list(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    return f"[{shown}{f', ... and {len(keys) - _SHOWN_KEYS} more' if len(keys) > _SHOWN_KEYS else ''}]"


def _ties_word_embeddings(model: nn.Module) -> bool:
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False))


def _retie_output_embeddings(model: nn.Module) -> None:
    """lm_head shares the input embedding when the config ties them (an assign-load unties them)."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is not None and head.weight is not embedding.weight:
        head.weight = embedding.weight


def _meta_tensor_names(model: nn.Module) -> list[str]:
    named = itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    return sorted(name for name, t in named if t is not None and t.is_meta)


def _fresh_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a module computes in ``__init__`` (rotary ``inv_freq``), rebuilt on the CPU.

    Rotary modules keep their config (text rotary on 4.x and 5.x, vision rotary on 5.x): a
    fresh instance recomputes every derived buffer exactly as transformers does. The 4.x
    vision rotary keeps no config; its ``inv_freq = 1 / 10000 ** (arange(0, d, 2) / d)``.
    """
    with torch.device("cpu"):
        if getattr(module, "config", None) is not None:
            try:
                fresh = type(module)(module.config)
                return {name: buf for name, buf in fresh.named_buffers(recurse=False)}
            except TypeError:
                pass
        if "inv_freq" in module._buffers:
            dim = 2 * module._buffers["inv_freq"].shape[0]
            theta = float(getattr(module, "theta", 10000.0))
            return {"inv_freq": 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))}
    return {}


def _rebuild_meta_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        meta = [name for name, buf in module._buffers.items() if buf is not None and buf.is_meta]
        if meta:
            fresh = _fresh_buffers(module)
            for name in meta:
                if name in fresh:
                    module._buffers[name] = fresh[name].to(device)


def load_state_dict_strict(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    lora_alpha: Optional[float] = None,
    lora_r: Optional[int] = None,
) -> None:
    """Load a Qwen2-VL (reward) checkpoint in any supported layout, strictly.

    The state dict is normalised first (PEFT merged with ``lora_alpha``, old keys remapped).
    Every model key must be provided (``lm_head.weight`` may be absent when the config ties
    it to the input embedding) and every checkpoint key must exist in the model, else one
    ValueError names the keys. Rotary ``inv_freq`` buffers found in old checkpoints are
    dropped: they are derived from the config, never learned. Tensors are cast to the dtype
    of the model tensor they replace.

    A model built on the meta device is loaded with ``assign=True`` (copying into meta
    tensors is a silent no-op), then its non-persistent buffers left on meta are recomputed,
    tied weights re-tied, and nothing may remain on meta.
    """
    state_dict = normalize_qwen2vl_state_dict(state_dict, lora_alpha=lora_alpha, lora_r=lora_r)
    expected = model.state_dict()
    tied = {"lm_head.weight"} if _ties_word_embeddings(model) and "lm_head.weight" in expected else set()
    state_dict = {
        k: v for k, v in state_dict.items() if k not in tied and not (k.endswith(".inv_freq") and k not in expected)
    }
    missing = sorted(set(expected) - set(state_dict) - tied)
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"Checkpoint does not match the {type(model).__name__}: {len(missing)} missing keys "
            f"{_short_list(missing)} and {len(unexpected)} unexpected keys {_short_list(unexpected)}."
        )
    for key, value in state_dict.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"Checkpoint tensor {key!r} has shape {tuple(value.shape)} but the model expects "
                f"{tuple(expected[key].shape)}."
            )
    state_dict = {k: (v.to(expected[k].dtype) if v.is_floating_point() else v) for k, v in state_dict.items()}

    on_meta = bool(_meta_tensor_names(model))
    model.load_state_dict(state_dict, strict=False, assign=on_meta)
    if tied:
        _retie_output_embeddings(model)
    if on_meta:
        device = next(p.device for p in model.parameters() if not p.is_meta)
        _rebuild_meta_buffers(model, device)
    left = _meta_tensor_names(model)
    if left:
        raise ValueError(f"{len(left)} tensors are still on the meta device after loading: {_short_list(left)}.")


# ----------------------------------------------------------------------------- runtime compatibility


def alias_embed_tokens(model: nn.Module) -> None:
    """Give every module that owns a ``language_model`` an ``embed_tokens`` alias to its embedding.

    Old reward code calls ``self.model.embed_tokens``. The alias is written into the module's
    ``__dict__``: ``setattr`` on an ``nn.Module`` would register a second submodule, so the
    embedding would appear twice in ``named_modules()``/``state_dict()`` and its parameters
    would be yielded under two names.
    """
    for module in list(model.modules()):
        language_model = module._modules.get("language_model")
        if language_model is None or "embed_tokens" in module._modules or "embed_tokens" in module.__dict__:
            continue
        embedding = getattr(language_model, "embed_tokens", None)
        if embedding is not None:
            module.__dict__["embed_tokens"] = embedding


def vision_features(visual_output) -> torch.Tensor:
    """Merged vision features ``(num_tokens, hidden)`` from the vision tower's output.

    transformers 4.x returns the merged tensor itself; 5.x returns an output object whose
    ``pooler_output`` holds it (``last_hidden_state`` is the pre-merger sequence: four times
    as many rows, in the vision width — using it would be silently wrong or fail late).
    """
    if isinstance(visual_output, torch.Tensor):
        return visual_output
    pooled = getattr(visual_output, "pooler_output", None)
    if isinstance(pooled, torch.Tensor):
        return pooled
    if isinstance(visual_output, (tuple, list)) and len(visual_output) > 1 and isinstance(visual_output[1], torch.Tensor):
        return visual_output[1]  # return_dict=False on 5.x: (last_hidden_state, pooler_output)
    raise TypeError(f"Cannot find merged vision features in a {type(visual_output).__name__}.")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def set_vocab_size(config, vocab_size: int) -> None:
    """Set the text vocabulary size (reward checkpoints resize it to fit their special tokens)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    text_config.vocab_size = vocab_size
    if hasattr(config, "vocab_size"):
        config.vocab_size = vocab_size


def build_qwen2vl_model(
    config, *, on_meta: bool, dtype: torch.dtype = torch.float32, attn_implementation: Optional[str] = None
) -> nn.Module:
    """A ``Qwen2VLForConditionalGeneration`` from ``config``, in eval mode with gradients off.

    ``on_meta=True`` allocates nothing (load the weights with :func:`load_state_dict_strict`);
    ``on_meta=False`` builds real, randomly initialised CPU tensors. Construction runs with
    ZeRO-3 init disabled (:func:`zero3_init_disabled`); a model that still comes out
    partitioned (built inside a user's own ``deepspeed.zero.Init``) is refused.
    """
    from transformers import Qwen2VLForConditionalGeneration

    config = copy.deepcopy(config)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    device = torch.device("meta") if on_meta else torch.device("cpu")
    with zero3_init_disabled(), _default_dtype(dtype), device:
        model = Qwen2VLForConditionalGeneration(config)
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise RuntimeError("The reward model was partitioned by deepspeed.zero.Init; build it outside that context.")
    model.eval().requires_grad_(False)
    return model


# ----------------------------------------------------------------------------- original forward


def sequential_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` -> ``(3, B, L)``: token ``p`` sits at position ``p`` on each M-RoPE axis (t, h, w).

    HPSv3 and VideoAlign were trained on transformers 4.45, whose reward forward never built
    M-RoPE indices: the text model fell back to ``arange(L)`` copied to the three axes.
    """
    batch, length = input_ids.shape
    return torch.arange(length, device=input_ids.device).view(1, 1, length).expand(3, batch, length)


def reward_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    pixel_values: Optional[torch.Tensor] = None,
    image_grid_thw: Optional[torch.Tensor] = None,
    pixel_values_videos: Optional[torch.Tensor] = None,
    video_grid_thw: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Last hidden states ``(B, L, hidden)`` computed as the 4.45 reward models did.

    1. embed the tokens; 2. run the vision tower and scatter its merged features, in order,
    into the image / video pad positions; 3. run the text decoder with
    :func:`sequential_position_ids` (not M-RoPE) and the padding mask.
    """
    inner = model.model
    embeds = inner.get_input_embeddings()(input_ids)
    visual = inner.visual
    visual_dtype = next(visual.parameters()).dtype
    media = (
        ("image", pixel_values, image_grid_thw, model.config.image_token_id),
        ("video", pixel_values_videos, video_grid_thw, model.config.video_token_id),
    )
    for kind, pixels, grid_thw, token_id in media:
        if pixels is None:
            continue
        features = vision_features(visual(pixels.to(visual_dtype), grid_thw=grid_thw))
        mask = input_ids == token_id
        if int(mask.sum()) != features.shape[0]:
            raise ValueError(
                f"The text holds {int(mask.sum())} {kind} pad tokens but the vision tower gave "
                f"{features.shape[0]} {kind} features; the pad expansion and grid_thw disagree."
            )
        embeds = embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), features.to(embeds.dtype))
    outputs = inner.language_model(
        inputs_embeds=embeds,
        attention_mask=attention_mask,
        position_ids=sequential_position_ids(input_ids),
        use_cache=False,
    )
    return outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]


# ----------------------------------------------------------------------------- locating files

# Everything of a base Qwen2-VL repo but its weights: the reward checkpoints hold all weights.
BASE_FOLDER_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "tokenizer*")


def load_base_parts(base_folder: str):
    """``(config, tokenizer)`` of a base Qwen2-VL folder (no weights read)."""
    from transformers import AutoTokenizer, Qwen2VLConfig

    return Qwen2VLConfig.from_pretrained(base_folder), AutoTokenizer.from_pretrained(base_folder)


def embedding_rows(state_dict: Mapping[str, torch.Tensor]) -> int:
    """Rows of the (normalised) checkpoint's input embedding: the reward model's vocabulary size,
    which its training code resized to fit the added reward tokens."""
    key = "model.language_model.embed_tokens.weight"
    if key not in state_dict:
        raise ValueError(f"Checkpoint has no {key!r} (after remapping); is it a Qwen2-VL checkpoint?")
    return int(state_dict[key].shape[0])
