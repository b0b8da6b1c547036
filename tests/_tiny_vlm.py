"""A tiny random LLaVA (CLIP vision tower, Llama text model) saved as a folder that an
OpenAI-compatible server (``transformers serve``) loads offline: a real VLM judge endpoint whose
answers are nonsense. LLaVA's processor needs no video processor (Qwen2-VL's needs torchvision)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] in ('image', 'image_url') %}<image>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def clip_image_processor(size: int):
    try:  # transformers 5.x without torchvision: the PIL one
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as Processor
    except ImportError:
        from transformers import CLIPImageProcessor as Processor
    return Processor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def save_tiny_llava(path: str, seed: int = 0) -> str:
    """Byte-level tokenizer, 28x28 images in 4 tokens, 2 text layers of width 64."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"], special_tokens=True)
    tokenizer.pad_token, tokenizer.eos_token = "<|endoftext|>", "<|im_end|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"), bos_token_id=None)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=ids("<image>"), vision_feature_layer=-1,
                         image_seq_length=4)
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    LlavaProcessor(image_processor=clip_image_processor(28), tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                   patch_size=14, vision_feature_select_strategy="full", num_additional_image_tokens=0).save_pretrained(path)
    return path
