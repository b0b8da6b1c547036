"""Word-level tokenizers built in memory, for small models whose prompts use a known word list.

One builder for the shipped toy model's tokenizers (``scripts/pretrain_toy_model.py``, over
the toy grammar of ``genrl.data.toy_scenes``) and the tiny test pipelines' (over
``genrl.testing.tiny_pipelines.TINY_VOCAB``).
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

BOS_EOS_TEMPLATE = "<bos> $A <eos>"  # CLIP-style; "$A <eos>" is T5-style


def word_level_tokenizer(
    vocab: Sequence[str],
    max_length: int,
    *,
    template: str | None = BOS_EOS_TEMPLATE,
    split_words: bool = True,
) -> PreTrainedTokenizerFast:
    """A tokenizer that lower-cases a text, reads each word of ``vocab`` as one token and any
    other word as ``<unk>``, and pads/truncates to ``max_length`` (``model_max_length``).

    ``vocab``: the tokens, a token's id being its position; it holds ``<pad>``, ``<unk>``,
    ``<bos>`` and ``<eos>``. ``template``: the special tokens around a text, as a
    ``tokenizers`` ``TemplateProcessing`` (``$A`` is the text), or ``None`` to add none.
    ``split_words``: split on whitespace and punctuation; ``False`` reads the whole text as
    one token (``<unk>`` unless it is in ``vocab``).
    """
    ids = {token: i for i, token in enumerate(vocab)}
    backend = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    if split_words:
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if template is not None:
        special = [("<bos>", ids["<bos>"]), ("<eos>", ids["<eos>"])]
        backend.post_processor = processors.TemplateProcessing(single=template, special_tokens=special)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_length,
    )
