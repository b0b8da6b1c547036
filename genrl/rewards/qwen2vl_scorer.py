"""What the Qwen2-VL reward models (HPSv3, VideoAlign) share: loading and batched scoring (their registry
factory is `genrl.rewards.model_reward`'s).

Both are a Qwen2-VL with a head, ``rm_head``, read at the special reward tokens of a prompt
template, with the forward they were trained with (`qwen2vl_compat.reward_hidden_states`).
A model file (`genrl.rewards.hpsv3`, `genrl.rewards.videoalign`) adds only what differs: its
head and how the head's outputs become scores, its prompt template and reward tokens, the
media it was trained on (images or videos), its sources and options.

- `Qwen2VLScorer`: a loaded model with its tokenizer and template; ``score_clips`` runs the
  batched loop (frames preprocessed in memory -> chat texts -> right-padded tokens -> the
  original forward -> hidden states at the reward tokens -> ``head_scores``);
- `load_reward_model`: checkpoint -> remapped, strictly loaded model with its head, built
  on the meta device without allocating the skeleton;
- `template_sha256`: which prompt template text a scorer uses, as a digest logged at load
  (the text itself is read from its upstream source at run time, never copied here).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from genrl.rewards import lifecycle
from genrl.rewards.model_reward import resolve_dtype
from genrl.rewards.qwen2vl_compat import (
    alias_embed_tokens,
    build_qwen2vl_model,
    embedding_rows,
    load_base_parts,
    load_checkpoint_state_dict,
    load_state_dict_strict,
    normalize_qwen2vl_state_dict,
    reward_hidden_states,
    set_vocab_size,
)
from genrl.rewards.qwen2vl_preprocess import (
    PromptTemplate,
    VisionSpec,
    build_reward_texts,
    preprocess_clips,
    token_positions,
    tokenize_right_padded,
)

logger = logging.getLogger(__name__)

# media -> (config field of its pad token id, pixel keyword, grid keyword) of the Qwen2-VL forward
MEDIA_INPUTS = {
    "image": ("image_token_id", "pixel_values", "image_grid_thw"),
    "video": ("video_token_id", "pixel_values_videos", "video_grid_thw"),
}
SHORT_HASH = 12  # hex digits of a template's sha256 shown in logs


def template_sha256(text: str) -> str:
    """Hex sha256 of a prompt template's UTF-8 text: names the text without holding it."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Qwen2VLScorer:
    """A loaded Qwen2-VL reward model with its tokenizer and template. ``.device`` is where the
    model is; ``.to(device)`` moves both (and the lifecycle cache key) together.

    A subclass sets ``family`` (its name in messages) and ``media`` ("image" or "video": the
    placeholder and vision inputs its model was trained with), and writes :meth:`head_scores`.
    ``reward_token_ids`` are the ids the head is read at, in the order ``head_scores`` expects.
    ``template_sha256`` names the template text in use; its first 12 hex digits are logged.
    """

    family = "Qwen2-VL"
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
        reward_token_ids: Sequence[int],
        batch_size: int,
        min_pixels: int,
        max_pixels: int,
    ):
        self.model, self.tokenizer, self.chat_template = model, tokenizer, chat_template
        self.template, self.spec = template, spec
        self.device = torch.device(device)
        self.batch_size, self.min_pixels, self.max_pixels = int(batch_size), int(min_pixels), int(max_pixels)
        self.reward_token_ids = list(reward_token_ids)
        pad_field, self._pixel_key, self._grid_key = MEDIA_INPUTS[self.media]
        self.media_token_id = getattr(model.config, pad_field)
        self.media_pad_token = tokenizer.convert_ids_to_tokens(self.media_token_id)
        # The template comes from whatever source was found at run time: say which text it was.
        self.template_sha256 = template_sha256(template.text)
        logger.info("%s prompt template from %s: sha256 %s", self.family, template.source, self.template_sha256[:SHORT_HASH])

    def to(self, device: Union[str, torch.device]) -> "Qwen2VLScorer":
        lifecycle.move(self, device)
        return self

    @torch.no_grad()
    def score_clips(self, clips: Union[torch.Tensor, Sequence[torch.Tensor]], prompts: Sequence[str]) -> torch.Tensor:
        """Clips uint8 ``(F_i, H, W, 3)`` (a ``(N, F, H, W, 3)`` batch or a list) and N prompts ->
        float32 CPU ``(N, ...)``: :meth:`head_scores` of every batch of ``batch_size``."""
        if len(clips) != len(prompts):
            raise ValueError(f"Got {len(clips)} {self.media}s for {len(prompts)} prompts.")
        outputs = []
        for start in range(0, len(clips), self.batch_size):
            chunk, chunk_prompts = clips[start : start + self.batch_size], prompts[start : start + self.batch_size]
            outputs.append(self.head_scores(self.reward_token_states(chunk, chunk_prompts)).cpu())
        return torch.cat(outputs)

    def reward_token_states(self, clips: Union[torch.Tensor, Sequence[torch.Tensor]], prompts: Sequence[str]) -> torch.Tensor:
        """One batch of B clips -> hidden states ``(B, K, hidden)`` at the K reward tokens."""
        vision = preprocess_clips(clips, self.spec, min_pixels=self.min_pixels, max_pixels=self.max_pixels, device=self.device)
        texts = build_reward_texts(
            self.tokenizer, self.chat_template, self.template, prompts, self.media, self.media_pad_token, vision.num_tokens
        )
        input_ids, attention_mask = tokenize_right_padded(
            self.tokenizer, texts, forbidden_pad_ids=(self.media_token_id, *self.reward_token_ids)
        )
        positions = token_positions(input_ids, self.reward_token_ids).to(self.device)  # (B, K)
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        hidden = reward_hidden_states(
            self.model, input_ids, attention_mask, **{self._pixel_key: vision.pixel_values, self._grid_key: vision.grid_thw}
        )
        return hidden[torch.arange(len(prompts), device=self.device)[:, None], positions]

    def head_scores(self, states: torch.Tensor) -> torch.Tensor:
        """``(B, K, hidden)`` states at the reward tokens -> ``(B, ...)`` scores (the model's head)."""
        raise NotImplementedError


def load_reward_model(
    weights: str,
    base_folder: str,
    make_head: Callable[[int], nn.Module],
    *,
    device: Union[str, torch.device] = "cpu",
    dtype: Union[str, torch.dtype, None] = None,
    on_meta: bool = True,
    attn_implementation: Optional[str] = None,
    lora_alpha: Optional[float] = None,
    lora_r: Optional[int] = None,
    tokenizer_folder: Optional[str] = None,
):
    """``(model, tokenizer)``: the Qwen2-VL of ``base_folder`` (config, tokenizer) with
    ``rm_head = make_head(hidden_size)``, strictly loaded from ``weights`` (any layout; a PEFT
    state dict is merged as ``W + lora_alpha / lora_r * B A``), frozen, on ``device``. The
    tokenizer comes from ``tokenizer_folder`` instead when given (a checkpoint's own).

    The head is built float32 by ``make_head`` and stays so whatever ``dtype`` (bfloat16 on
    CUDA, float32 elsewhere, by default) the rest of the model takes.
    """
    state_dict = normalize_qwen2vl_state_dict(load_checkpoint_state_dict(weights), lora_alpha=lora_alpha, lora_r=lora_r)
    config, tokenizer = load_base_parts(base_folder)
    if tokenizer_folder is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    set_vocab_size(config, embedding_rows(state_dict))  # the reward tokens added rows to the base vocabulary
    model = build_qwen2vl_model(config, on_meta=on_meta, dtype=resolve_dtype(dtype, device), attn_implementation=attn_implementation)
    with torch.device("meta" if on_meta else "cpu"):
        model.rm_head = make_head(model.config.get_text_config().hidden_size)
    model.rm_head.eval().requires_grad_(False)
    load_state_dict_strict(model, state_dict)
    del state_dict  # the model holds the weights now; nothing else should keep the loaded copy alive
    alias_embed_tokens(model)
    return model.to(device), tokenizer
