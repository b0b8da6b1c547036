"""VideoAlign / VideoReward (Qwen2-VL-2B + a linear reward head), on transformers >= 4.52.

Model: Qwen2-VL with ``rm_head = Linear(hidden, 1, bias=False)`` read at three special
tokens of the prompt template: ``<|VQ_reward|>`` for visual quality (VQ), ``<|MQ_reward|>``
for motion quality (MQ), ``<|TA_reward|>`` for text alignment (TA), wherever the template
puts them. The upstream template puts the prompt after the VQ and MQ tokens, so with causal
attention only TA depends on the prompt. The forward is the one VideoAlign was trained
with (`qwen2vl_compat.reward_hidden_states`). Scores are normalised per dimension,
``(r - mean) / std``, and ``Overall = VQ + MQ + TA`` (normalised).

Sources (defaults in brackets):

- ``checkpoint``: the VideoReward folder or repo id [``KwaiVGI/VideoReward``], holding
  ``model_config.json`` and ``checkpoint-<step>/model.pth`` (a PEFT state dict: LoRA r64 /
  alpha 128 on every LLM linear, merged here as ``W + alpha / r * B A``; the latest step unless
  ``checkpoint_step`` is given). A weights file or a plain folder also works, in the old,
  new or PEFT layout.
- ``base_model``: config, tokenizer and chat template [``model_config.model_name_or_path``,
  else ``Qwen/Qwen2-VL-2B-Instruct``; only json/tokenizer files are fetched].
- reward token ids: the embedding rows of the three tokens were learned under the ids
  VideoAlign's tokenizer gave them. When the checkpoint has its own tokenizer (tokenizer
  files in ``checkpoint-<step>`` or beside ``model_config.json``), it is used and must hold
  the three tokens; else they are added to the base tokenizer in VideoAlign's fixed order
  VQ, MQ, TA, as its training code did (never in the order a template mentions them).
- ``template_path``: the prompt template (json / text / VideoAlign's ``prompt_template.py``);
  else a ``prompt_template.*`` file in the checkpoint folder; else an importable
  ``prompt_template`` module (the VideoAlign repository on ``sys.path``), read as text.
  For ``.py`` sources the constant is chosen by ``data_config.prompt_template_type``
  (only ``detailed_special``, the one with reward tokens, can be read out).

Keys read from ``model_config.json`` (all optional):

- ``data_config``: ``fps`` (frames sampled per second, 2.0), ``num_frames`` (a fixed count
  instead), ``max_frame_pixels`` (256 * 28 * 28), ``sample_type`` (``uniform`` / ``multi_pts``),
  ``prompt_template_type``;
- ``model_config``: ``model_name_or_path``, ``output_dim`` (1; 3 = one output per dimension,
  read on the diagonal);
- ``peft_lora_config``: ``lora_alpha``, ``lora_r``, ``use_rslora`` (scale alpha / sqrt(r));
- normalisation: ``inference_config.{VQ,MQ,TA}_{mean,std}``, or the same six keys at the top
  level. Without them the raw scores are returned (as VideoAlign does), with a warning.

Frame rate of the scored videos: ``metadata[i]["fps"]`` when present, else the ``video_fps``
option (default 16, Wan's rate). Frames are chosen by
`genrl.rewards.frame_selection.select_frame_indices` and resized to between 128 * 28 * 28 and
``max_frame_pixels`` pixels.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from genrl.rewards.frame_selection import select_frame_indices
from genrl.rewards.model_reward import FILE, FILE_OR_FOLDER, FOLDER, ScorerFamily, build_scorer_reward, resolve_folder
from genrl.rewards.qwen2vl_compat import BASE_FOLDER_PATTERNS
from genrl.rewards.qwen2vl_preprocess import (
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    PromptTemplate,
    VisionSpec,
    add_special_tokens,
    load_chat_template,
    resolve_prompt_template,
)
from genrl.rewards.qwen2vl_scorer import Qwen2VLScorer, load_reward_model

logger = logging.getLogger(__name__)

DEFAULT_CHECKPOINT_REPO = "KwaiVGI/VideoReward"
DEFAULT_BASE_MODEL = "Qwen/Qwen2-VL-2B-Instruct"
UPSTREAM_TEMPLATE = (("prompt_template", "prompt_template.py"),)
TEMPLATE_CONSTANTS = {"detailed_special": ("DETAILED_PROMPT_WITH_SPECIAL_TOKEN",)}
DIMENSIONS = ("VQ", "MQ", "TA")
VIDEOALIGN_NAMES = {"videoalign_vq": "VQ", "videoalign_mq": "MQ", "videoalign_ta": "TA", "videoalign_overall": "Overall"}
DEFAULT_VIDEO_FPS = 16.0
REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")  # one per DIMENSIONS, in upstream's order
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
VIDEOALIGN = ScorerFamily(
    family="VideoAlign",
    cache_name="videoalign",
    rewards=tuple(VIDEOALIGN_NAMES),
    options=frozenset({"checkpoint", "base_model", "dtype", "template_path", "checkpoint_step", "on_meta",
                       "attn_implementation", "batch_size", "video_fps", "lora_alpha", "min_pixels", "max_pixels",
                       "use_norm"}),
    cache_fields=("checkpoint", "base_model", "checkpoint_step", "template_path", "attn_implementation", "lora_alpha",
                  "min_pixels", "max_pixels", "video_fps", "batch_size"),
    sources={"checkpoint": DEFAULT_CHECKPOINT_REPO, "base_model": DEFAULT_BASE_MODEL},
    paths={"checkpoint": FILE_OR_FOLDER, "base_model": FOLDER, "template_path": FILE},
)


@dataclass
class VideoAlignConfig:
    """What the scorer reads from ``model_config.json`` (defaults = VideoReward's)."""

    sample_fps: float = 2.0
    num_frames: Optional[int] = None
    max_frame_pixels: int = VIDEO_MAX_PIXELS
    sample_type: str = "uniform"
    prompt_template_type: str = "detailed_special"
    base_model: Optional[str] = None
    output_dim: int = 1
    lora_alpha: Optional[float] = None
    lora_r: Optional[int] = None
    use_rslora: bool = False
    norm: Optional[dict[str, tuple[float, float]]] = None  # dimension -> (mean, std)


def read_videoalign_config(folder: Optional[str]) -> VideoAlignConfig:
    """Parse ``folder/model_config.json`` (keys in the module doc); defaults when absent."""
    path = os.path.join(folder, "model_config.json") if folder else None
    if not path or not os.path.isfile(path):
        return VideoAlignConfig()
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    data, model, lora = raw.get("data_config") or {}, raw.get("model_config") or {}, raw.get("peft_lora_config") or {}
    stats = raw.get("inference_config") or raw
    norm = None
    if all(f"{d}_{s}" in stats for d in DIMENSIONS for s in ("mean", "std")):
        norm = {d: (float(stats[f"{d}_mean"]), float(stats[f"{d}_std"])) for d in DIMENSIONS}
        bad = [d for d, (_, std) in norm.items() if not std > 0]
        if bad:
            raise ValueError(f"{path}: normalisation std of {bad} must be positive.")
    default = VideoAlignConfig()
    return VideoAlignConfig(
        sample_fps=float(data.get("fps") or default.sample_fps),
        num_frames=data.get("num_frames"),
        max_frame_pixels=int(data.get("max_frame_pixels") or default.max_frame_pixels),
        sample_type=data.get("sample_type") or default.sample_type,
        prompt_template_type=data.get("prompt_template_type") or default.prompt_template_type,
        base_model=model.get("model_name_or_path"),
        output_dim=int(model.get("output_dim") or default.output_dim),
        lora_alpha=lora.get("lora_alpha"),
        lora_r=lora.get("lora_r"),
        use_rslora=bool(lora.get("use_rslora", False)),
        norm=norm,
    )


def find_checkpoint(path: str, step: Optional[int] = None) -> tuple[str, str]:
    """``(weights, config folder)``: ``checkpoint-<step>/model.pth`` under a VideoReward folder
    (the highest step unless ``step`` is given), else the folder or file itself."""
    if os.path.isfile(path):
        parent = os.path.dirname(os.path.abspath(path))
        root = parent if os.path.isfile(os.path.join(parent, "model_config.json")) else os.path.dirname(parent)
        return path, root
    steps = {}
    for candidate in glob.glob(os.path.join(path, "checkpoint-*")):
        match = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(candidate))
        if match and os.path.isdir(candidate):
            steps[int(match.group(1))] = candidate
    if step is not None:
        if step not in steps:
            raise FileNotFoundError(f"No checkpoint-{step} in {path!r}; found steps {sorted(steps)}.")
        return steps[step], path
    if steps:
        return steps[max(steps)], path
    return path, path


def find_tokenizer_folder(folders: Sequence[str]) -> Optional[str]:
    """The first of ``folders`` holding tokenizer files (a checkpoint saved with its tokenizer), or None."""
    for folder in folders:
        if any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
            return folder
    return None


def normalize_scores(raw: torch.Tensor, norm: Optional[Mapping[str, tuple[float, float]]]) -> torch.Tensor:
    """``(N, 3)`` raw (VQ, MQ, TA) -> ``(r - mean_d) / std_d`` per dimension d (unchanged without stats)."""
    if norm is None:
        return raw
    mean = torch.tensor([norm[d][0] for d in DIMENSIONS], dtype=raw.dtype)
    std = torch.tensor([norm[d][1] for d in DIMENSIONS], dtype=raw.dtype)
    return (raw - mean) / std


def linear_head(hidden_size: int, output_dim: int = 1) -> nn.Linear:
    """VideoAlign's head (key ``rm_head.weight``): ``Linear(hidden, output_dim, bias=False)``.

    Kept in float32 whatever the model dtype (VideoAlign ran it in bf16; float32 loses nothing)."""
    return nn.Linear(hidden_size, output_dim, bias=False, dtype=torch.float32)


class VideoAlignScorer(Qwen2VLScorer):
    """A loaded VideoAlign model with its tokenizer, template and config: selected frames of a
    video between ``min_pixels`` and ``max_pixels`` each, the linear head read at the VQ, MQ
    and TA tokens. ``.device`` is where the model is; ``.to(device)`` moves both (and the
    lifecycle cache key) together. ``tokenizer_source``: the checkpoint folder ``tokenizer``
    came from, which must hold the reward tokens (none are added to a checkpoint's own)."""

    family = "VideoAlign"
    media = "video"

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        chat_template: str,
        template: PromptTemplate,
        spec: VisionSpec,
        config: VideoAlignConfig,
        device: Union[str, torch.device],
        *,
        batch_size: int = 2,
        min_pixels: int = VIDEO_MIN_PIXELS,
        max_pixels: Optional[int] = None,
        video_fps: float = DEFAULT_VIDEO_FPS,
        tokenizer_source: Optional[str] = None,
    ):
        if sorted(template.special_tokens) != sorted(REWARD_TOKENS):
            raise ValueError(
                f"VideoAlign reads VQ, MQ and TA at three special tokens {list(REWARD_TOKENS)}, but the template "
                f"from {template.source} names {list(template.special_tokens)}."
            )
        if config.output_dim not in (1, 3):
            raise ValueError(f"VideoAlign output_dim must be 1 or 3, got {config.output_dim}.")
        vocab = model.get_input_embeddings().weight.shape[0]
        source = f"the checkpoint's tokenizer in {tokenizer_source}" if tokenizer_source else "the base tokenizer"
        # In upstream's order, whatever the template's: a token's id picks its learned embedding row.
        token_ids = add_special_tokens(tokenizer, REWARD_TOKENS, vocab, add_missing=tokenizer_source is None, source=source)
        logger.info("VideoAlign reads VQ, MQ, TA at token ids %s of %s.", token_ids, source)
        super().__init__(
            model, tokenizer, chat_template, template, spec, device, reward_token_ids=token_ids, batch_size=batch_size,
            min_pixels=min_pixels, max_pixels=max_pixels if max_pixels is not None else config.max_frame_pixels,
        )
        self.config, self.video_fps = config, float(video_fps)

    def select_frames(self, clip: torch.Tensor, fps: float) -> torch.Tensor:
        """``(F, H, W, 3)`` -> the frames VideoAlign samples (``sample_type``, ``fps``, ``num_frames``)."""
        indices = select_frame_indices(
            clip.shape[0], fps, self.config.sample_type, sample_fps=self.config.sample_fps, num_frames=self.config.num_frames
        )
        return clip[torch.as_tensor(indices, dtype=torch.long)]

    def head_scores(self, states: torch.Tensor) -> torch.Tensor:
        """``(B, 3, hidden)`` at the VQ, MQ, TA tokens -> raw float32 ``(B, 3)`` (VQ, MQ, TA)."""
        logits = self.model.rm_head(states.float())  # float32 head: (B, 3, output_dim)
        return logits[..., 0] if self.config.output_dim == 1 else logits.diagonal(dim1=1, dim2=2)

    def rewards(
        self, clips: torch.Tensor, prompts: Sequence[str], fps: Sequence[float], *, use_norm: bool = True
    ) -> dict[str, torch.Tensor]:
        """uint8 ``(N, F, H, W, 3)`` videos -> ``{"VQ", "MQ", "TA", "Overall"}`` each ``(N,)``.

        Overall = VQ + MQ + TA, after per-dimension normalisation when ``use_norm``.
        """
        selected = [self.select_frames(clip, rate) for clip, rate in zip(clips, fps)]
        scores = self.score_clips(selected, prompts)
        if use_norm:
            scores = normalize_scores(scores, self.config.norm)
        out = {d: scores[:, i] for i, d in enumerate(DIMENSIONS)}
        out["Overall"] = scores.sum(dim=1)
        return out


def load_videoalign_scorer(
    checkpoint: Optional[str] = None,
    base_model: Optional[str] = None,
    *,
    device: Union[str, torch.device] = "cpu",
    dtype: Union[str, torch.dtype, None] = None,
    template_path: Optional[str] = None,
    checkpoint_step: Optional[int] = None,
    on_meta: bool = True,
    attn_implementation: Optional[str] = None,
    batch_size: int = 2,
    video_fps: float = DEFAULT_VIDEO_FPS,
    lora_alpha: Optional[float] = None,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: Optional[int] = None,
) -> VideoAlignScorer:
    """Load VideoAlign (sources, config keys and defaults in the module doc).

    ``lora_alpha`` overrides ``peft_lora_config.lora_alpha``; ``min_pixels``/``max_pixels``
    override the frame pixel bounds (for experiments and fast tests; the model was trained
    with the defaults).
    """
    if checkpoint is None:
        checkpoint = DEFAULT_CHECKPOINT_REPO
    if not os.path.exists(checkpoint):
        checkpoint = resolve_folder(checkpoint)
    weights, root = find_checkpoint(checkpoint, checkpoint_step)
    config = read_videoalign_config(root)
    base_folder = resolve_folder(base_model or config.base_model or DEFAULT_BASE_MODEL, BASE_FOLDER_PATTERNS)
    parts = TEMPLATE_CONSTANTS.get(config.prompt_template_type)
    if parts is None and template_path is None:
        raise ValueError(
            f"prompt_template_type {config.prompt_template_type!r} has no reward tokens to read; "
            f"supported: {sorted(TEMPLATE_CONSTANTS)} (or pass template_path=)."
        )
    folders = [root] + ([weights] if os.path.isdir(weights) else [os.path.dirname(weights)])
    template = resolve_prompt_template(template_path, folders, UPSTREAM_TEMPLATE, parts or ())
    own_tokenizer = find_tokenizer_folder(folders[::-1])  # the step's own first, then the run's

    alpha = lora_alpha if lora_alpha is not None else config.lora_alpha
    if alpha is not None and config.use_rslora and config.lora_r:
        alpha = alpha * math.sqrt(config.lora_r)  # rsLoRA scales by alpha / sqrt(r) = (alpha sqrt(r)) / r
    model, tokenizer = load_reward_model(
        weights, base_folder, partial(linear_head, output_dim=config.output_dim), device=device, dtype=dtype,
        on_meta=on_meta, attn_implementation=attn_implementation, lora_alpha=alpha, lora_r=config.lora_r,
        tokenizer_folder=own_tokenizer,
    )
    if config.norm is None:
        logger.warning("VideoAlign: no normalisation statistics in %s/model_config.json; scores are raw.", root)
    return VideoAlignScorer(
        model, tokenizer, load_chat_template(tokenizer, base_folder), template, VisionSpec.from_folder(base_folder),
        config, device, batch_size=batch_size, min_pixels=min_pixels, max_pixels=max_pixels, video_fps=video_fps,
        tokenizer_source=own_tokenizer,
    )


def build_videoalign_reward(name: str = "videoalign_overall", device: Union[str, torch.device] = "cpu", **options: Any):
    """Registry factory for ``videoalign_vq`` / ``_mq`` / ``_ta`` / ``_overall``; options go to
    :func:`load_videoalign_scorer` (plus ``use_norm``, default True).

    The callable ``fn(samples, prompts, metadata=None)`` returns all four names, each ``(N,)``
    float32 on the CPU, from one forward pass; the registry reads the name it was asked for,
    and every name shares one model through `lifecycle`.
    """
    use_norm = bool(options.pop("use_norm", True))  # how scores are read, not which model: not a load option

    def score(scorer: VideoAlignScorer, clips: torch.Tensor, prompts: list[str], metadata: Optional[Sequence[Mapping]]):
        fps = [float((m or {}).get("fps") or scorer.video_fps) for m in (metadata or [None] * len(clips))]
        scores = scorer.rewards(clips, prompts, fps, use_norm=use_norm)
        return {registry_name: scores[dim] for registry_name, dim in VIDEOALIGN_NAMES.items()}

    return build_scorer_reward(VIDEOALIGN, name, device, options, load_videoalign_scorer, score)


build_videoalign_reward.check_options = VIDEOALIGN.check_options  # option names and paths, checked before any model loads
