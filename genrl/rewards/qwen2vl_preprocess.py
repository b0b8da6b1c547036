"""Qwen2-VL reward inputs built in memory: frames -> ``pixel_values`` + ``grid_thw``, prompts -> token ids.

Vision, on tensors on the reward device (no PNG/MP4 round trip):

1. ``smart_resize``: a size with both sides multiples of ``factor = patch * merge = 28`` and
   ``min_pixels <= h * w <= max_pixels``, aspect ratio kept as well as it can be;
2. resize with torch's antialiased bicubic (PIL's filter; both originals resized uint8
   frames, so results are rounded back to integers in [0, 255]);
3. ``(x / 255 - mean) / std`` with the CLIP mean/std (or the folder's preprocessor config);
4. pad the frame count to a multiple of the temporal patch (2) by repeating the last frame
   (an image becomes two identical frames), then cut into patches exactly like
   ``Qwen2VLImageProcessor``: rows ordered (t, h-block, w-block, h-in-block, w-in-block), each
   row flattened as (C, t, P, P).

HPSv3 scores images at exactly 256 * 28 * 28 pixels; VideoAlign frames lie between
128 * 28 * 28 and its ``max_frame_pixels`` (256 * 28 * 28 by default).

Text: the reward model's prompt template (read at run time, see `resolve_prompt_template`)
is filled with the prompt, wrapped by the tokenizer's chat template with one image/video
placeholder, the placeholder is expanded to one pad token per merged vision token, and the
batch is tokenized and right-padded.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import string
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HPSV3_PIXELS = 256 * 28 * 28
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 256 * 28 * 28
MAX_ASPECT_RATIO = 200
TEMPLATE_FIELD = "text_prompt"
_SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]+\|>")

ArrayLike = Union[torch.Tensor, np.ndarray]


# ----------------------------------------------------------------------------- vision


@dataclass(frozen=True)
class VisionSpec:
    """Patch geometry and normalisation of a Qwen2-VL vision tower (Qwen2-VL defaults)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_folder(cls, folder: Optional[str]) -> "VisionSpec":
        """Read ``preprocessor_config.json`` of a Qwen2-VL folder when there is one."""
        path = os.path.join(folder, "preprocessor_config.json") if folder else None
        if not path or not os.path.isfile(path):
            return cls()
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        default = cls()
        return cls(
            patch_size=int(cfg.get("patch_size", default.patch_size)),
            merge_size=int(cfg.get("merge_size", default.merge_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", default.temporal_patch_size)),
            image_mean=tuple(cfg.get("image_mean", default.image_mean)),
            image_std=tuple(cfg.get("image_std", default.image_std)),
        )


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280
) -> tuple[int, int]:
    """The (h, w) Qwen2-VL resizes an image of (height, width) to.

    h, w = round(height / f) * f, round(width / f) * f; if h * w > max_pixels, both sides
    shrink by s = sqrt(height * width / max_pixels) and round down to multiples of f (at
    least f); if h * w < min_pixels, both grow by s = sqrt(min_pixels / (height * width)) and
    round up. The aspect ratio must stay below 200. So a shrunk size never exceeds
    ``max_pixels`` and a grown one never falls below ``min_pixels``; with
    ``min_pixels == max_pixels`` (HPSv3) a grown size may pass the budget by the rounding up,
    exactly as in the original preprocessing.
    """
    if height < 1 or width < 1:
        raise ValueError(f"Cannot resize an image of size {height}x{width}; both sides must be positive.")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"Image of size {height}x{width} has aspect ratio above {MAX_ASPECT_RATIO}, which Qwen2-VL does not accept."
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``(T, C, H, W)`` values in [0, 255] -> float32 ``(T, C, height, width)``, integer-valued.

    Antialiased bicubic (the filter PIL uses), rounded and clamped to [0, 255] as the originals'
    uint8 resizes were. uint8 frames on the CPU use torch's uint8 kernel (fixed point, like
    PIL's, and an order of magnitude faster on channels-last frames); elsewhere the resize runs
    in float32 and is rounded after. Same size: returned unchanged (as float32).
    """
    if tuple(frames.shape[-2:]) == (height, width):
        return frames.float()
    if frames.dtype == torch.uint8 and frames.device.type == "cpu":
        frames = frames.contiguous(memory_format=torch.channels_last)
        return F.interpolate(frames, size=(height, width), mode="bicubic", antialias=True, align_corners=False).float()
    resized = F.interpolate(frames.float(), size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return resized.round_().clamp_(0, 255)


def normalize_frames(frames: torch.Tensor, spec: VisionSpec) -> torch.Tensor:
    """``(T, C, H, W)`` in [0, 255] -> ``(x / 255 - mean) / std`` per channel, float32."""
    mean = torch.tensor(spec.image_mean, dtype=torch.float32, device=frames.device).view(1, -1, 1, 1)
    std = torch.tensor(spec.image_std, dtype=torch.float32, device=frames.device).view(1, -1, 1, 1)
    return (frames.float() / 255.0 - mean) / std


def patchify(frames: torch.Tensor, spec: VisionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, C, H, W)`` -> ``pixel_values (gt * gh * gw, C * tp * P * P)`` and ``grid_thw (3,)``.

    gt = ceil(T / tp) after padding with the last frame, gh = H / P, gw = W / P. Rows run over
    (t, h // m, w // m, h % m, w % m) with m the merge size, so that every m x m block of
    patches the merger fuses is contiguous; each row is one (C, tp, P, P) patch.
    """
    t, c, h, w = frames.shape
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    if h % (p * m) or w % (p * m):
        raise ValueError(f"Frame size {h}x{w} is not a multiple of {p * m}; resize with smart_resize first.")
    if t % tp:
        frames = torch.cat([frames, frames[-1:].expand(tp - t % tp, -1, -1, -1)], dim=0)
    gt, gh, gw = frames.shape[0] // tp, h // p, w // p
    patches = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, C, tp, P, P)
    pixel_values = patches.reshape(gt * gh * gw, c * tp * p * p)
    return pixel_values, torch.tensor([gt, gh, gw], dtype=torch.long)


@dataclass
class VisionBatch:
    """Vision inputs of a batch: ``pixel_values (S, C * tp * P * P)`` float32, ``grid_thw (N, 3)``,
    and ``num_tokens[i]`` = merged tokens of item i = gt * gh * gw / merge**2."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    num_tokens: list[int]


def preprocess_clips(
    clips: Union[ArrayLike, Sequence[ArrayLike]],
    spec: VisionSpec,
    *,
    min_pixels: int,
    max_pixels: int,
    device: Union[str, torch.device] = "cpu",
) -> VisionBatch:
    """Clips ``(F, H, W, 3)`` uint8 (a ``(N, F, H, W, 3)`` batch or a list; F = 1 for images)
    -> one :class:`VisionBatch` on ``device``.

    Every frame of a clip is resized to ``smart_resize(H, W, spec.factor, min_pixels, max_pixels)``;
    frames move to ``device`` as uint8, before any float work.
    """
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels={min_pixels} exceeds max_pixels={max_pixels}.")
    rows, grids, counts = [], [], []
    for clip in clips:
        clip = torch.as_tensor(clip)
        if clip.ndim != 4 or clip.shape[-1] != 3 or clip.shape[0] < 1:
            raise ValueError(f"Expected a clip of shape (F, H, W, 3) with F >= 1, got {tuple(clip.shape)}.")
        height, width = smart_resize(clip.shape[1], clip.shape[2], spec.factor, min_pixels, max_pixels)
        frames = clip.to(device).permute(0, 3, 1, 2)  # (F, C, H, W)
        frames = normalize_frames(resize_frames(frames, height, width), spec)
        pixel_values, grid = patchify(frames, spec)
        rows.append(pixel_values)
        grids.append(grid)
        counts.append(int(grid.prod()) // spec.merge_size**2)
    if not rows:
        raise ValueError("Got no clips to preprocess.")
    return VisionBatch(torch.cat(rows), torch.stack(grids).to(device), counts)


# ----------------------------------------------------------------------------- prompt templates


@dataclass(frozen=True)
class PromptTemplate:
    """A reward model's user-turn text with a ``{text_prompt}`` field, and the special tokens
    its score is read at, in sequence order."""

    text: str
    special_tokens: tuple[str, ...]
    source: str


def fill_template(template: str, prompt: str) -> str:
    """``template`` with its ``{text_prompt}`` field replaced by ``prompt``.

    Only the template is parsed as a format string (``{{``/``}}`` are its escapes); the prompt
    is inserted verbatim, so braces in it are harmless.
    """
    parts = []
    for literal, field, spec, conversion in string.Formatter().parse(template):
        parts.append(literal)
        if field is None:
            continue
        if field != TEMPLATE_FIELD or spec or conversion:
            raise ValueError(f"Prompt template field {{{field}}} is not supported; the only field is {{{TEMPLATE_FIELD}}}.")
        parts.append(prompt)
    return "".join(parts)


def template_from_text(text: str, source: str, special_tokens: Optional[Sequence[str]] = None) -> PromptTemplate:
    """A template from its text; without ``special_tokens`` they are the ``<|...|>`` markers in
    the text, in order of appearance (the order the original models read them)."""
    tokens = tuple(special_tokens) if special_tokens else tuple(_SPECIAL_TOKEN.findall(text))
    if not tokens:
        raise ValueError(f"Prompt template from {source} names no special reward token (e.g. '<|Reward|>').")
    fill_template(text, "")  # fail early on a malformed template
    return PromptTemplate(text=text, special_tokens=tokens, source=source)


def _module_strings(path: str) -> dict[str, str]:
    """Module-level ``NAME = "..."`` string constants of a Python file, read as text (never imported)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def read_template_file(path: str, module_parts: Sequence[str]) -> PromptTemplate:
    """A template from a file:

    - ``.json``: ``{"template": "...{text_prompt}...", "special_tokens": ["<|...|>", ...]}``
      (``special_tokens`` optional);
    - ``.py``: an upstream prompt module read as text; the template is the concatenation of
      its string constants named ``module_parts``;
    - anything else: the whole file is the template text.
    """
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        if not isinstance(spec, dict) or not isinstance(spec.get("template"), str):
            raise ValueError(f"{path} must hold a JSON object with a string 'template' (and optional 'special_tokens').")
        return template_from_text(spec["template"], path, spec.get("special_tokens"))
    if path.endswith(".py"):
        strings = _module_strings(path)
        missing = [name for name in module_parts if name not in strings]
        if missing:
            raise ValueError(f"{path} defines no string constants {missing}; expected {list(module_parts)}.")
        return template_from_text("".join(strings[name] for name in module_parts), path)
    with open(path, encoding="utf-8") as f:
        return template_from_text(f.read(), path)


def upstream_module_file(package: str, relative_path: str) -> Optional[str]:
    """Path of ``relative_path`` inside an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    roots = list(spec.submodule_search_locations or []) or ([os.path.dirname(spec.origin)] if spec.origin else [])
    for root in roots:
        candidate = os.path.join(root, relative_path)
        if os.path.isfile(candidate):
            return candidate
    return None


TEMPLATE_FILE_NAMES = ("prompt_template.json", "prompt_template.txt", "prompt_template.py")


def resolve_prompt_template(
    template_path: Optional[str],
    search_folders: Sequence[Optional[str]],
    upstream: Sequence[tuple[str, str]],
    module_parts: Sequence[str],
) -> PromptTemplate:
    """The prompt template, from the first source that has one:

    1. ``template_path`` (json / py / text, see :func:`read_template_file`);
    2. a ``prompt_template.{json,txt,py}`` file in one of ``search_folders`` (checkpoint folders);
    3. the upstream package's prompt module, read as text: ``upstream`` lists
       ``(package, path inside it)`` pairs.
    """
    if template_path:
        if not os.path.isfile(template_path):
            raise FileNotFoundError(f"Prompt template file {template_path!r} does not exist.")
        return read_template_file(template_path, module_parts)
    for folder in search_folders:
        for name in TEMPLATE_FILE_NAMES:
            if folder and os.path.isfile(os.path.join(folder, name)):
                return read_template_file(os.path.join(folder, name), module_parts)
    for package, relative in upstream:
        path = upstream_module_file(package, relative)
        if path is not None:
            return read_template_file(path, module_parts)
    looked = [f for f in search_folders if f] + [f"{p}/{r}" for p, r in upstream]
    raise FileNotFoundError(
        f"No prompt template found (looked in {looked}); pass template_path= pointing to a "
        f"{'/'.join(TEMPLATE_FILE_NAMES)} file or to the upstream prompt module."
    )


# ----------------------------------------------------------------------------- tokens


def load_chat_template(tokenizer, folder: Optional[str]) -> str:
    """The chat template: the tokenizer's own, else ``chat_template.jinja`` / ``chat_template.json``."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    if folder:
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                return f.read()
        as_json = os.path.join(folder, "chat_template.json")
        if os.path.isfile(as_json):
            with open(as_json, encoding="utf-8") as f:
                return json.load(f)["chat_template"]
    raise ValueError(f"No chat template in the tokenizer or in {folder!r} (chat_template.jinja / chat_template.json).")


def add_special_tokens(
    tokenizer, tokens: Sequence[str], vocab_size: int, *, add_missing: bool = True, source: str = "the tokenizer"
) -> list[int]:
    """The ids of the reward ``tokens``, which must fall inside the checkpoint's embedding table
    of ``vocab_size`` rows and be named ``tokens`` by the tokenizer (``source`` in messages).

    Missing tokens are added in the order given, as the original training code did; without
    ``add_missing`` (a checkpoint's own tokenizer, whose ids the embeddings were trained with)
    they must all be there already.
    """
    missing = [t for t in tokens if t not in tokenizer.get_vocab()]
    if missing and not add_missing:
        raise ValueError(f"Reward tokens {missing} are not in {source}, so it is not the tokenizer this checkpoint was trained with.")
    if missing:
        tokenizer.add_tokens(list(missing), special_tokens=True)  # same call on transformers 4.x and 5.x
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    names = [None if i is None else tokenizer.convert_ids_to_tokens(i) for i in ids]
    if names != list(tokens):
        raise ValueError(f"Reward tokens {list(tokens)} map to ids {ids}, which {source} names {names}.")
    if len(set(ids)) != len(ids):
        raise ValueError(f"Special reward tokens {list(tokens)} do not map to distinct ids ({ids}).")
    if max(ids) >= vocab_size:
        raise ValueError(
            f"Reward tokens {list(tokens)} have ids {ids}, outside the checkpoint's vocabulary of "
            f"{vocab_size}; the tokenizer does not match the checkpoint."
        )
    return ids


def build_reward_texts(
    tokenizer,
    chat_template: str,
    template: PromptTemplate,
    prompts: Sequence[str],
    media: str,
    pad_token: str,
    num_tokens: Sequence[int],
) -> list[str]:
    """One chat text per sample: the filled template after one ``media`` ("image" / "video")
    item, with the single pad token the chat template writes expanded to ``num_tokens[i]``."""
    texts = []
    for prompt, count in zip(prompts, num_tokens):
        messages = [{"role": "user", "content": [{"type": media}, {"type": "text", "text": fill_template(template.text, prompt)}]}]
        text = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True
        )
        if text.count(pad_token) != 1:
            raise ValueError(
                f"Expected the chat text to hold exactly one {pad_token!r} placeholder, found {text.count(pad_token)} "
                "(check the chat template, and that the prompt does not contain it)."
            )
        texts.append(text.replace(pad_token, pad_token * count))
    return texts


def tokenize_right_padded(
    tokenizer, texts: Sequence[str], forbidden_pad_ids: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``(B, L)``, right-padded (as the originals batched).

    The pad id must not be a vision pad or reward token id, or they could be read as such.
    """
    encoded = [tokenizer(text)["input_ids"] for text in texts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = 0 if pad_id is None else pad_id
    if pad_id in set(forbidden_pad_ids):
        raise ValueError(f"The tokenizer's pad id {pad_id} is also a vision pad or reward token id.")
    length = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), length), dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask


def token_positions(input_ids: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """``(B, K)`` positions of each of the K reward tokens in each row; each must occur once."""
    positions = []
    for token_id in token_ids:
        hits = input_ids == token_id
        counts = hits.sum(dim=1)
        if not bool((counts == 1).all()):
            raise ValueError(
                f"Every sequence must hold reward token id {token_id} exactly once, found counts {counts.tolist()} "
                "(a prompt may contain the token's text)."
            )
        positions.append(hits.float().argmax(dim=1))
    return torch.stack(positions, dim=1)
