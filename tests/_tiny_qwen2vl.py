"""Tiny Qwen2-VL reward models, tokenizers and folders built in tests (no network, no downloads).

The tokenizer is byte-level with no merges (every byte one token) plus the Qwen2-VL control
tokens; its chat template writes one ``<|vision_start|><|image_pad|><|vision_end|>`` (or
video) item before the user text, like Qwen2-VL's. Prompt templates here are our own text.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2VLConfig

from genrl.rewards.qwen2vl_compat import build_qwen2vl_model

CONTROL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HPS_TEMPLATE = "Judge this picture against the request: {text_prompt}\nScore: <|Reward|>\n"
VA_TEMPLATE = "Looks <|VQ_reward|> moves <|MQ_reward|> asked for: {text_prompt} fits <|TA_reward|>\n"


def make_tokenizer(reward_tokens=()) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_tokens(list(CONTROL_TOKENS), special_tokens=True)
    tokenizer.pad_token, tokenizer.eos_token = "<|endoftext|>", "<|im_end|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    if reward_tokens:
        tokenizer.add_tokens(list(reward_tokens), special_tokens=True)
    return tokenizer


def tiny_config(vocab_size: int, tokenizer, *, tie: bool = False) -> Qwen2VLConfig:
    """Text hidden 64 (2 layers), vision embed 32 (depth 1): pre- and post-merger widths differ."""
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            # 5.x reads rope_parameters, 4.52 reads rope_scaling: give both, as real configs do across versions.
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=10000.0,
            bos_token_id=None, eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
            tie_word_embeddings=tie, initializer_range=0.1,
        ),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, initializer_range=0.1),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=tie,
    )
    return config


def make_base_folder(path: str, *, tie: bool = False) -> str:
    """A base "Qwen2-VL" folder: config.json + tokenizer + chat template, no weights."""
    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(path)
    tiny_config(len(tokenizer), tokenizer, tie=tie).save_pretrained(path)
    return path


def make_reward_model(head: torch.nn.Module, vocab_size: int, tokenizer, *, seed: int = 0, tie: bool = False):
    """A random tiny Qwen2-VL with ``rm_head``; LayerNorm/RMSNorm weights randomised too."""
    torch.manual_seed(seed)
    model = build_qwen2vl_model(tiny_config(vocab_size, tokenizer, tie=tie), on_meta=False, dtype=torch.float32)
    model.rm_head = head
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or "ln_q" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.eval().requires_grad_(False)
    return model


def to_old_layout(state_dict: dict) -> dict:
    """The transformers-4.45 key layout HPSv3 / VideoAlign checkpoints carry."""
    out = {}
    for key, value in state_dict.items():
        prefix = "base_model.model." if key.startswith("base_model.model.") else ""
        rest = key[len(prefix):]
        if rest.startswith("model.visual."):
            rest = rest[len("model."):]
        elif rest.startswith("model.language_model."):
            rest = "model." + rest[len("model.language_model."):]
        out[prefix + rest] = value
    return out


def smooth_images(n: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """uint8 ``(n, height, width, 3)`` gradients with random phases (resizers agree on smooth images)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    images = []
    for _ in range(n):
        a, b, c = rng.uniform(0.5, 3.0, 3)
        phase = rng.uniform(0, 2 * np.pi, 3)
        channels = [127.5 + 127.5 * np.sin(a * yy / height * np.pi + b * xx / width * np.pi + phase[k] + k) for k in range(3)]
        images.append(np.stack(channels, axis=-1))
    return torch.from_numpy(np.clip(np.round(np.stack(images)), 0, 255).astype(np.uint8))


def write_json(path: str, obj) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    return path


def hf_image_processor(pixels: int):
    """transformers' own Qwen2-VL image processor at a fixed pixel budget (5.x: the PIL one;
    4.x: the slow one, which is PIL-based too)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:  # transformers 4.x spells the bounds min_pixels / max_pixels
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels)
    return Qwen2VLImageProcessorPil(size={"shortest_edge": pixels, "longest_edge": pixels})


def hf_smart_resize():
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    except ImportError:  # transformers 4.x
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    return smart_resize


def merged(visual_output):
    """The merged vision features as each transformers version returns them (written out here,
    independently of genrl's own reader): 5.x an output object's pooler_output, 4.x the tensor."""
    return visual_output if isinstance(visual_output, torch.Tensor) else visual_output.pooler_output


VA_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
VA_NORM = {"VQ_mean": 0.5, "VQ_std": 2.0, "MQ_mean": -1.0, "MQ_std": 0.5, "TA_mean": 0.25, "TA_std": 4.0}


def videoalign_model_config(base: str, **data) -> dict:
    """VideoReward's model_config.json for a tiny base folder (``data``: data_config entries to change)."""
    from genrl.rewards.qwen2vl_preprocess import VIDEO_MAX_PIXELS

    return {
        "data_config": {"fps": 2.0, "num_frames": None, "max_frame_pixels": VIDEO_MAX_PIXELS, "sample_type": "uniform",
                        "prompt_template_type": "detailed_special", **data},
        "model_config": {"model_name_or_path": base, "output_dim": 1},
        "peft_lora_config": {"lora_enable": True, "lora_r": 4, "lora_alpha": 8},
        "inference_config": VA_NORM,
    }


def save_tiny_hpsv3(root) -> dict:
    """An HPSv3 checkpoint (old key layout) of a tiny Qwen2-VL under ``root``: its ``base`` folder,
    ``ckpt`` file and ``template`` file, the ``tokenizer`` and the in-memory ``model``."""
    from safetensors.torch import save_file

    from genrl.rewards.hpsv3 import build_rank_head

    root = str(root)
    base = make_base_folder(os.path.join(root, "base"))
    tokenizer = make_tokenizer(["<|Reward|>"])
    model = make_reward_model(build_rank_head(64), len(tokenizer), tokenizer, seed=0)
    ckpt_dir = os.path.join(root, "ckpt")
    os.makedirs(ckpt_dir)
    save_file(to_old_layout(model.state_dict()), os.path.join(ckpt_dir, "HPSv3.safetensors"))
    write_json(os.path.join(ckpt_dir, "prompt_template.json"), {"template": HPS_TEMPLATE})
    template = write_json(os.path.join(root, "template.json"), {"template": HPS_TEMPLATE})
    return {"root": root, "base": base, "tokenizer": tokenizer, "model": model,
            "ckpt": os.path.join(ckpt_dir, "HPSv3.safetensors"), "template": template}


def save_tiny_videoalign(root) -> dict:
    """A VideoReward folder (model_config.json + checkpoint-<step>/model.pth: a PEFT LoRA in the old
    key layout, the newest step trained, an older one not) of a tiny Qwen2-VL under ``root``: its
    ``base`` folder and ``ckpt`` folder, the ``tokenizer``, the ``original`` model and the LoRA
    ``merged`` into it."""
    import copy

    from peft import LoraConfig, get_peft_model

    root = str(root)
    base = make_base_folder(os.path.join(root, "base"), tie=True)  # Qwen2-VL-2B ties its word embeddings
    tokenizer = make_tokenizer(VA_TOKENS)
    head = torch.nn.Linear(64, 1, bias=False)
    original = make_reward_model(head, len(tokenizer), tokenizer, seed=0, tie=True)
    peft_model = get_peft_model(
        copy.deepcopy(original),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, modules_to_save=["rm_head"],
                   target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"),
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.normal_(0, 0.3)
    ckpt = os.path.join(root, "VideoReward")
    for step, state_dict in ((100, peft_model.state_dict()), (20, original.state_dict())):
        os.makedirs(os.path.join(ckpt, f"checkpoint-{step}"))
        torch.save(to_old_layout(state_dict), os.path.join(ckpt, f"checkpoint-{step}", "model.pth"))
    write_json(os.path.join(ckpt, "model_config.json"), videoalign_model_config(base))
    write_json(os.path.join(ckpt, "prompt_template.json"), {"template": VA_TEMPLATE})
    merged_model = peft_model.merge_and_unload().eval()
    return {"root": root, "base": base, "tokenizer": tokenizer, "original": original, "merged": merged_model, "ckpt": ckpt}
