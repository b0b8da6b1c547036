"""HPSv3 human-preference score (Qwen2-VL-7B + a small rank head), on transformers >= 4.52.

Model: Qwen2-VL with ``rm_head = Linear(hidden, 1024) - ReLU - Dropout - Linear(1024, 16) -
ReLU - Linear(16, 2)`` in float32, read at the single reward special token of the prompt
template; the two outputs are (mu, sigma) and the score is mu. The forward is the one HPSv3
was trained with (`qwen2vl_compat.reward_hidden_states`: sequential positions, not M-RoPE).
Images are scored at exactly 256 * 28 * 28 pixels.

Sources (defaults in brackets; local paths work offline, Hub ids need the network or cache):

- ``base_model``: a Qwen2-VL folder or repo for config, tokenizer and chat template
  [``Qwen/Qwen2-VL-7B-Instruct``; only its json/tokenizer files are fetched];
- ``checkpoint``: the reward weights, a ``.safetensors`` / ``.pth`` file, a sharded folder or
  a repo id, in the old, new or PEFT key layout [``MizzenAI/HPSv3``, file ``HPSv3.safetensors``];
- ``template_path``: the prompt template (json / text / the upstream prompt module); else a
  ``prompt_template.*`` file beside the checkpoint; else the installed ``hpsv3`` package's
  ``dataset/data_collator_qwen.py``, read as text (its ``INSTRUCTION`` +
  ``prompt_with_special_token``). The template text is never copied into this repository;
  the text used is logged at load as the first 12 hex digits of its sha256 (the full digest
  is ``scorer.template_sha256``), with a warning when it is not the upstream template, so that
  a fork installed under the name ``hpsv3`` or an edited template file does not pass silently.

Registry names: ``hpsv3`` = mean of the per-frame scores, ``hpsv3_top30`` = mean of the best
30 % of frames (images are one-frame videos). Both come from one forward pass.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from genrl.rewards.model_reward import (
    FILE, FILE_OR_FOLDER, FOLDER, ScorerFamily, build_scorer_reward, fetch_hub_file, resolve_folder,
)
from genrl.rewards.qwen2vl_compat import BASE_FOLDER_PATTERNS
from genrl.rewards.qwen2vl_preprocess import (
    HPSV3_PIXELS,
    PromptTemplate,
    VisionSpec,
    add_special_tokens,
    load_chat_template,
    resolve_prompt_template,
)
from genrl.rewards.qwen2vl_scorer import SHORT_HASH, Qwen2VLScorer, load_reward_model

logger = logging.getLogger(__name__)

DEFAULT_BASE_MODEL = "Qwen/Qwen2-VL-7B-Instruct"
DEFAULT_CHECKPOINT_REPO = "MizzenAI/HPSv3"
DEFAULT_CHECKPOINT_FILE = "HPSv3.safetensors"
UPSTREAM_TEMPLATE = (("hpsv3", os.path.join("dataset", "data_collator_qwen.py")),)
TEMPLATE_PARTS = ("INSTRUCTION", "prompt_with_special_token")
# sha256 of the upstream template, INSTRUCTION + prompt_with_special_token as read from
# hpsv3/dataset/data_collator_qwen.py of the authors' hpsv3 1.0.0 package (MizzenAI/HPSv3).
# Only the digest is kept: the text stays upstream.
UPSTREAM_TEMPLATE_SHA256 = "f6ee57479d4e9eee76b49c00dc962e1e696a5a2b3cc32cebd9b1fa76fe27502c"
HPSV3_NAMES = ("hpsv3", "hpsv3_top30")
TOP_FRACTION = 0.3
HPSV3 = ScorerFamily(
    family="HPSv3",
    cache_name="hpsv3",
    rewards=HPSV3_NAMES,
    options=frozenset({"checkpoint", "base_model", "dtype", "template_path", "on_meta", "attn_implementation",
                       "batch_size", "lora_alpha", "pixels"}),
    # Not the batch size: loads that differ only there share one model.
    cache_fields=("checkpoint", "base_model", "template_path", "attn_implementation", "lora_alpha", "pixels"),
    sources={"checkpoint": f"{DEFAULT_CHECKPOINT_REPO}/{DEFAULT_CHECKPOINT_FILE}", "base_model": DEFAULT_BASE_MODEL},
    paths={"checkpoint": FILE_OR_FOLDER, "base_model": FOLDER, "template_path": FILE},
)


def build_rank_head(hidden_size: int, dropout: float = 0.05) -> nn.Sequential:
    """HPSv3's head (keys ``rm_head.{0,3,5}.{weight,bias}``), float32: hidden -> 1024 -> 16 -> (mu, sigma)."""
    return nn.Sequential(
        nn.Linear(hidden_size, 1024, dtype=torch.float32),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(1024, 16, dtype=torch.float32),
        nn.ReLU(),
        nn.Linear(16, 2, dtype=torch.float32),
    )


def top_fraction_mean(scores: torch.Tensor, fraction: float = TOP_FRACTION) -> torch.Tensor:
    """``(N, F)`` -> ``(N,)``: mean of each row's k best values, k = max(1, floor(fraction * F)).

    The published top-30% video HPSv3 reward (Flash-GRPO's) keeps ``int(0.3 * F)`` frames,
    rounded down: 24 of 81 frames, not 25; at least one frame for short clips and images."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction}.")
    k = max(1, int(fraction * scores.shape[1] + 1e-9))  # + 1e-9: 0.3 * 10 is 3, not 2.9999
    return scores.topk(k, dim=1).values.mean(dim=1)


class HPSv3Scorer(Qwen2VLScorer):
    """A loaded HPSv3 model: images at exactly ``pixels`` pixels, the rank head read at the
    template's one reward token. ``.device`` is where the model is; ``.to(device)`` moves both
    (and the lifecycle cache key) together."""

    family = "HPSv3"
    media = "image"

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        chat_template: str,
        template: PromptTemplate,
        spec: VisionSpec,
        device: Union[str, torch.device],
        *,
        batch_size: int = 8,
        pixels: int = HPSV3_PIXELS,
    ):
        if len(template.special_tokens) != 1:
            raise ValueError(
                f"HPSv3 reads its score at one special token, but the template from {template.source} "
                f"names {list(template.special_tokens)}."
            )
        vocab = model.get_input_embeddings().weight.shape[0]
        token_ids = add_special_tokens(tokenizer, template.special_tokens, vocab)
        super().__init__(
            model, tokenizer, chat_template, template, spec, device,
            reward_token_ids=token_ids, batch_size=batch_size, min_pixels=pixels, max_pixels=pixels,
        )
        self.pixels = int(pixels)
        if self.template_sha256 != UPSTREAM_TEMPLATE_SHA256:  # e.g. a fork installed as `hpsv3`, an edited file
            logger.warning(
                "HPSv3 prompt template from %s (sha256 %s) is not the upstream one (sha256 %s), so scores may differ "
                "from the published model's.", template.source, self.template_sha256[:SHORT_HASH],
                UPSTREAM_TEMPLATE_SHA256[:SHORT_HASH],
            )

    def head_scores(self, states: torch.Tensor) -> torch.Tensor:
        """``(B, 1, hidden)`` at the reward token -> float32 ``(B, 2)``: (mu, sigma)."""
        return self.model.rm_head(states[:, 0].float())

    def score_images(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """uint8 ``(N, H, W, 3)`` images and N prompts -> float32 CPU ``(N, 2)``: (mu, sigma) per image."""
        return self.score_clips(images[:, None], prompts)

    def score_frames(self, clips: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """uint8 ``(N, F, H, W, 3)`` -> float32 CPU ``(N, F)``: mu of every frame, scored as an image."""
        n, f = clips.shape[:2]
        frame_prompts = [p for p in prompts for _ in range(f)]
        return self.score_images(clips.reshape(n * f, *clips.shape[2:]), frame_prompts)[:, 0].reshape(n, f)


def load_hpsv3_scorer(
    checkpoint: Optional[str] = None,
    base_model: Optional[str] = None,
    *,
    device: Union[str, torch.device] = "cpu",
    dtype: Union[str, torch.dtype, None] = None,
    template_path: Optional[str] = None,
    on_meta: bool = True,
    attn_implementation: Optional[str] = None,
    batch_size: int = 8,
    lora_alpha: Optional[float] = None,
    pixels: int = HPSV3_PIXELS,
) -> HPSv3Scorer:
    """Load HPSv3 (sources and defaults in the module doc).

    ``dtype`` defaults to bfloat16 on CUDA and float32 elsewhere (the head is always float32);
    ``on_meta`` builds the 7B skeleton without allocating it (weights are then assigned
    from the checkpoint); ``lora_alpha`` is only needed for a PEFT checkpoint with LoRA.
    ``pixels`` is the per-image pixel budget HPSv3 was trained with; other values are for
    experiments (and fast tests) only.
    """
    base_folder = resolve_folder(base_model or DEFAULT_BASE_MODEL, BASE_FOLDER_PATTERNS)
    if checkpoint is None:
        checkpoint = fetch_hub_file(DEFAULT_CHECKPOINT_REPO, DEFAULT_CHECKPOINT_FILE)
    elif not os.path.exists(checkpoint):
        checkpoint = resolve_folder(checkpoint)
    checkpoint_folder = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
    template = resolve_prompt_template(template_path, [checkpoint_folder], UPSTREAM_TEMPLATE, TEMPLATE_PARTS)
    model, tokenizer = load_reward_model(
        checkpoint, base_folder, build_rank_head, device=device, dtype=dtype, on_meta=on_meta,
        attn_implementation=attn_implementation, lora_alpha=lora_alpha,
    )
    return HPSv3Scorer(
        model, tokenizer, load_chat_template(tokenizer, base_folder), template,
        VisionSpec.from_folder(base_folder), device, batch_size=batch_size, pixels=pixels,
    )


def build_hpsv3_reward(name: str = "hpsv3", device: Union[str, torch.device] = "cpu", **options: Any):
    """Registry factory for ``hpsv3`` / ``hpsv3_top30``; ``options`` go to :func:`load_hpsv3_scorer`.

    The callable ``fn(samples, prompts, metadata=None)`` returns ``{"hpsv3": (N,), "hpsv3_top30": (N,)}``
    (float32, CPU) from one forward pass; the registry reads the name it was asked for. The
    model is shared through `lifecycle` by every name and option set loading the same weights.
    """

    def score(scorer: HPSv3Scorer, clips: torch.Tensor, prompts: list[str], metadata: Optional[Sequence[Mapping]]):
        frame_scores = scorer.score_frames(clips, prompts)  # (N, F)
        return {"hpsv3": frame_scores.mean(dim=1), "hpsv3_top30": top_fraction_mean(frame_scores)}

    return build_scorer_reward(HPSV3, name, device, options, load_hpsv3_scorer, score)


build_hpsv3_reward.check_options = HPSV3.check_options  # option names and paths, checked before any model loads
