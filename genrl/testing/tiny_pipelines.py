"""Tiny random-init diffusers pipelines (Wan and HunyuanVideo 1.5 video; SD3, FLUX.1, Z-Image, FLUX.2,
Qwen-Image and Qwen-Image-Edit images) built offline, for tests and benchmarks (training does not use them: the trainer's
no-argument run uses the shipped toy model in ``genrl/assets/toy-shapes-t2i``).

They are real ``WanPipeline`` / ``StableDiffusion3Pipeline`` / ``FluxPipeline`` / ... objects with
the same components as the published models, shrunk to a few hundred thousand parameters,
so that tests and benchmarks exercise the exact code paths of the full-size models on a
CPU. Tokenizers are word-level over ``TINY_VOCAB`` (lower-cased,
split on whitespace and punctuation; other words map to ``<unk>``), built in memory by
``genrl.data.word_tokenizer``; the chat-templated text encoders' (Qwen, Mistral) add their control
tokens and template.

``save_tiny_pipeline`` also writes ``sampling_defaults.json`` (height, width, num_frames),
which ``genrl.policies.load_policy`` reads, so a loaded tiny pipeline samples at its own
small resolution instead of the full-size pipeline's default.
"""

from __future__ import annotations

import json
import os

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    ClassifierFreeGuidance,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxPipeline,
    FluxTransformer2DModel,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from tokenizers import AddedToken, Regex, pre_tokenizers
from transformers import (
    ByT5Tokenizer,
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPVisionConfig,
    CLIPVisionModel,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2VLImageProcessorPil,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    SiglipImageProcessorPil,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from genrl.data.word_tokenizer import BOS_EOS_TEMPLATE, word_level_tokenizer
from genrl.policies import SAMPLING_DEFAULTS_FILE, FlowPolicy, policy_for_pipeline
from genrl.policies.qwenimage_edit import ImageTextQwen2VLProcessor

FAMILIES = ("wan", "sd3", "flux", "zimage", "flux2-klein", "qwenimage", "flux2", "hunyuanvideo15")
# Layouts of a family beyond its first, built by name too, loading as that family: "wan2.2" is
# Wan 2.2 TI2V-5B's (a 16x VAE that patchifies its frames, one timestep per latent token), "sd3.5"
# SD3.5-Medium's (a second, image-only attention in the first blocks; RMS-normed queries and keys),
# "wan2.2-a14b" Wan 2.2 A14B's (two experts split at a boundary timestep); image-to-video
# (``WanImageToVideoPipeline``): "wan2.1-i2v" Wan 2.1 I2V's (a CLIP image encoder, the image's
# latents and mask concatenated to the noise), "wan2.2-i2v-a14b" Wan 2.2 I2V A14B's (two such
# experts, no CLIP), "wan2.2-i2v" Wan 2.2 TI2V-5B's sampling from an image (its first latent frame);
# "hunyuanvideo15-i2v" HunyuanVideo 1.5 I2V's (``HunyuanVideo15ImageToVideoPipeline``: a SigLIP image
# encoder, the image's latents and mask concatenated to the noise);
# image editing: "qwenimage-edit" Qwen-Image-Edit's (``QwenImageEditPipeline``), "qwenimage-edit-plus"
# Qwen-Image-Edit-2511's (``QwenImageEditPlusPipeline``, the image's tokens at timestep 0).
VARIANTS = ("wan2.2", "sd3.5", "wan2.2-a14b", "wan2.1-i2v", "wan2.2-i2v-a14b", "wan2.2-i2v", "hunyuanvideo15-i2v",
            "qwenimage-edit", "qwenimage-edit-plus")

# Default sampling size of the tiny pipelines: 32x32 images; Wan 5 frames -> 2 latent frames
# (Wan 2.2: 64x64, the smallest size with more than one token per frame at 16x times patch 2).
TINY_SAMPLING_DEFAULTS = {
    "wan": {"height": 32, "width": 32, "num_frames": 5},
    "wan2.2": {"height": 64, "width": 64, "num_frames": 5},
    "wan2.2-a14b": {"height": 32, "width": 32, "num_frames": 5},
    "wan2.1-i2v": {"height": 32, "width": 32, "num_frames": 5},
    "wan2.2-i2v-a14b": {"height": 32, "width": 32, "num_frames": 5},
    "wan2.2-i2v": {"height": 64, "width": 64, "num_frames": 5},
    "sd3": {"height": 32, "width": 32, "num_frames": 1},
    "sd3.5": {"height": 32, "width": 32, "num_frames": 1},
    "flux": {"height": 32, "width": 32, "num_frames": 1},
    "zimage": {"height": 32, "width": 32, "num_frames": 1},
    "flux2-klein": {"height": 32, "width": 32, "num_frames": 1},
    "qwenimage": {"height": 32, "width": 32, "num_frames": 1},
    "flux2": {"height": 32, "width": 32, "num_frames": 1},
    # 16x VAE: 2x3 latent pixels (not square, so that height and width cannot be swapped unseen).
    "hunyuanvideo15": {"height": 32, "width": 48, "num_frames": 5},
    "hunyuanvideo15-i2v": {"height": 32, "width": 48, "num_frames": 5},
    # Conditioning images of 64 x 64 pixels (the pipelines' 1024 x 1024 take the tiny VAE seconds).
    "qwenimage-edit": {"height": 32, "width": 32, "num_frames": 1, "condition_image_area": 64 * 64},
    "qwenimage-edit-plus": {"height": 32, "width": 32, "num_frames": 1, "condition_image_area": 64 * 64},
}

# Special tokens first; ids follow T5's convention (pad 0, eos 1) so a CLIP text model
# pools at the eos token (CLIP treats eos_token_id == 2 as a legacy special case).
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>", "<bos>")
TINY_VOCAB = tuple(dict.fromkeys(SPECIAL_TOKENS + tuple(
    """
    a an the of in on at with and or under over near by from to for its their
    , . ! ? - '
    one two three four many some small big large tiny huge tall short long round square
    red orange yellow green blue purple pink brown black white gray grey golden silver
    dark bright light colorful
    cat dog bird fish horse cow sheep rabbit fox bear lion tiger elephant monkey owl
    person man woman child people robot car bus bike boat train plane ship
    apple banana orange cake cup bowl bottle chair table bed book lamp clock vase
    flower tree forest mountain river lake sea ocean beach sky cloud clouds sun moon star
    stars snow rain city street house building bridge road field garden desert
    circle triangle square cube sphere ball box circles triangles squares cubes spheres balls boxes
    cats dogs birds fish horses trees flowers cars houses
    left right above below behind front next top bottom middle center inside outside
    photo picture painting drawing video scene view portrait landscape close-up
    sitting standing running walking flying swimming jumping playing dancing
    morning evening night sunset sunrise day
    is are
    """.split()
)))  # deduplicated, order kept: a token's id is its position

TINY_MAX_LENGTH = 16  # tokens per prompt, including bos/eos


def tiny_tokenizer(max_length: int = TINY_MAX_LENGTH, add_bos: bool = True) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``TINY_VOCAB`` that pads/truncates to ``max_length``.

    ``add_bos``: CLIP-style ``<bos> words <eos>``; otherwise T5-style ``words <eos>``.
    """
    return word_level_tokenizer(TINY_VOCAB, max_length, template=BOS_EOS_TEMPLATE if add_bos else "$A <eos>")


# The chat-template tokens of the Qwen tokenizers (Z-Image's and FLUX.2 [klein]'s Qwen3, Qwen-Image's
# Qwen2.5-VL). "\n" is a token of its own, as it is in theirs, so that a template keeps the token
# count of the real one (Qwen-Image drops its template's first 34 tokens).
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "\n", "<think>", "</think>")
TINY_CHAT_VOCAB = TINY_VOCAB + CHAT_TOKENS + ("system", "user", "assistant")
# Qwen3's chat template, cut to text messages: with enable_thinking=False the answer starts with
# an empty thought.
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
TINY_CHAT_MAX_LENGTH = 32  # tokens per templated prompt

# Mistral Small 3.1's control tokens (FLUX.2 [dev]'s text encoder) and its template for text
# messages, whose content is a list of parts: [SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]user[/INST].
MISTRAL_TOKENS = ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]", "[IMG]")
TINY_MISTRAL_VOCAB = TINY_VOCAB + MISTRAL_TOKENS
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set text = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]{% endif %}{% endfor %}"
)
TINY_MISTRAL_MAX_LENGTH = 64  # FLUX.2 [dev]'s system message alone is about 30 tokens


def _chat_tokenizer(vocab: tuple[str, ...], special: tuple[str, ...], template: str, max_length: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``vocab`` that reads each of ``special`` whole, applies the chat
    ``template``, adds no tokens itself (the template does) and pads on the right."""
    tokenizer = word_level_tokenizer(vocab, max_length, template=None)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, normalized=False, special=True) for t in special]}
    )
    tokenizer.chat_template = template
    return tokenizer


def tiny_chat_tokenizer(max_length: int = TINY_CHAT_MAX_LENGTH) -> PreTrainedTokenizerFast:
    """Qwen's: ``TINY_CHAT_VOCAB`` with ``QWEN_CHAT_TEMPLATE``."""
    return _chat_tokenizer(TINY_CHAT_VOCAB, CHAT_TOKENS, QWEN_CHAT_TEMPLATE, max_length)


# Qwen2's pre-tokenizer on whitespace, beside the word-level split: a run of spaces, all but its last
# (which joins the next word), is a token, and a space before a digit is a token of its own. With it the
# tiny tokenizer gives HunyuanVideo 1.5's system message the 108 tokens its pipeline crops, as Qwen2.5-VL's does.
QWEN_WHITESPACE = r"\w+|[^\w\s]+|\s+(?=\s)|\s(?=\d)"


def tiny_qwen25_tokenizer(max_length: int = TINY_CHAT_MAX_LENGTH) -> PreTrainedTokenizerFast:
    """Qwen2.5-VL's: ``tiny_chat_tokenizer`` whose words split on whitespace as Qwen2's (``QWEN_WHITESPACE``)."""
    tokenizer = tiny_chat_tokenizer(max_length)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(QWEN_WHITESPACE), behavior="removed",
                                                                     invert=True)
    return tokenizer


# Qwen2.5-VL's vision tokens, and "'s" read as one token as Qwen's tokenizer reads it, so that the
# Qwen-Image-Edit template's system part keeps the 64 tokens its pipeline drops.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TINY_VL_VOCAB = TINY_CHAT_VOCAB + VISION_TOKENS + ("'s",)
TINY_VL_MAX_LENGTH = 128  # a templated instruction with its image's tokens


def tiny_qwen_vl_tokenizer(max_length: int = TINY_VL_MAX_LENGTH) -> PreTrainedTokenizerFast:
    """Qwen2.5-VL's: ``TINY_VL_VOCAB`` with ``QWEN_CHAT_TEMPLATE``."""
    tokenizer = _chat_tokenizer(TINY_VL_VOCAB, CHAT_TOKENS + VISION_TOKENS, QWEN_CHAT_TEMPLATE, max_length)
    tokenizer.add_tokens([AddedToken("'s", normalized=False)])
    return tokenizer


def tiny_mistral_tokenizer(max_length: int = TINY_MISTRAL_MAX_LENGTH) -> PreTrainedTokenizerFast:
    """Mistral Small 3.1's: ``TINY_MISTRAL_VOCAB`` with ``MISTRAL_CHAT_TEMPLATE``."""
    return _chat_tokenizer(TINY_MISTRAL_VOCAB, MISTRAL_TOKENS, MISTRAL_CHAT_TEMPLATE, max_length)


def _qwen3_config(hidden_size: int, num_hidden_layers: int) -> Qwen3Config:
    """A Qwen3 of two heads (one key/value head) over ``TINY_CHAT_VOCAB``."""
    return Qwen3Config(
        vocab_size=len(TINY_CHAT_VOCAB),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden_size // 2,
        max_position_embeddings=128,
        pad_token_id=0,
        initializer_range=0.2,  # prompts far enough apart that guidance visibly moves the velocity
    )


def _clip_text_config(hidden_size: int, projection_dim: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(TINY_VOCAB),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        projection_dim=projection_dim,
        num_hidden_layers=2,  # SD3 reads hidden_states[-2]: the output of the first layer
        num_attention_heads=2,
        max_position_embeddings=TINY_MAX_LENGTH,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=3,
    )


# The sizes of every tiny T5-family encoder (SD3's and FLUX's T5, Wan's UMT5).
_TINY_T5 = dict(
    vocab_size=len(TINY_VOCAB),
    d_model=32,
    d_kv=8,
    d_ff=32,
    num_layers=1,
    num_heads=2,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
    pad_token_id=0,
    eos_token_id=1,
)


def _t5_encoder() -> T5EncoderModel:
    """T5 v1.1-style encoder (gated-gelu), d_model 32: SD3's third and FLUX's second text encoder."""
    config = T5Config(**_TINY_T5, feed_forward_proj="gated-gelu")
    return T5EncoderModel(config)


# The blocks of every tiny KL autoencoder (SD3's, FLUX's, FLUX.2's): 4x spatial compression.
_TINY_KL_BLOCKS = dict(
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(8, 8, 16),
    layers_per_block=1,
    norm_num_groups=4,
    sample_size=32,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=False,
)


def _image_vae(latent_channels: int, scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    """SD3/FLUX-style KL autoencoder with 4x spatial compression (3 blocks)."""
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, scaling_factor=scaling_factor,
        shift_factor=shift_factor, **_TINY_KL_BLOCKS,
    )


def _wan_pipeline(vae: AutoencoderKLWan, shift: float, **config) -> WanPipeline:
    """A ``WanPipeline`` around ``vae`` with a tiny transformer of its latent width and UMT5."""
    transformer = _wan_transformer(vae.config.z_dim)  # before the text encoder: the weights of a seed stay put
    return WanPipeline(
        tokenizer=tiny_tokenizer(add_bos=False),
        text_encoder=UMT5EncoderModel(UMT5Config(**_TINY_T5)),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        transformer=transformer,
        **config,
    )


def _wan_transformer(z_dim: int) -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z_dim, out_channels=z_dim,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def _build_wan() -> WanPipeline:
    vae = AutoencoderKLWan(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],  # 8x spatial, 4x temporal compression, like the full model
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        # Non-trivial statistics so that decoding must undo them the way WanPipeline does.
        latents_mean=[-0.75, -0.7, -0.9, 0.1],
        latents_std=[2.8, 1.45, 2.3, 2.65],
    )
    return _wan_pipeline(vae, shift=3.0)


def _build_wan22_a14b() -> WanPipeline:
    """Wan 2.2 A14B's layout: two experts of one architecture over Wan 2.1's VAE, ``transformer``
    for timesteps from ``boundary_ratio`` x 1000 up (the high-noise steps), ``transformer_2`` below;
    of 4 steps the boundary 875 gives the first to the high-noise expert and the others to the low-noise one."""
    vae = AutoencoderKLWan(
        base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[-0.75, -0.7, -0.9, 0.1], latents_std=[2.8, 1.45, 2.3, 2.65],
    )
    pipeline = _wan_pipeline(vae, shift=3.0, boundary_ratio=0.875)
    pipeline.register_modules(transformer_2=_wan_transformer(vae.config.z_dim))
    return pipeline


def _build_wan22() -> WanPipeline:
    """Wan 2.2 TI2V-5B's layout: its VAE patchifies RGB 2x2 (12 channels in and out), has
    residual down blocks and a wider decoder, and compresses 16x in space; the pipeline gives
    the transformer one timestep per latent token (``expand_timesteps``)."""
    vae = AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=8,
        z_dim=8,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[-0.75, -0.7, -0.9, 0.1, 0.2, -0.3, 0.5, 0.0],
        latents_std=[2.8, 1.45, 2.3, 2.65, 1.0, 1.5, 0.9, 2.0],
    )
    return _wan_pipeline(vae, shift=5.0, expand_timesteps=True)


def _wan21_vae() -> AutoencoderKLWan:
    return AutoencoderKLWan(
        base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[-0.75, -0.7, -0.9, 0.1], latents_std=[2.8, 1.45, 2.3, 2.65],
    )


def _wan_i2v_transformer(z_dim: int, **image_attention) -> WanTransformer3DModel:
    """Channel conditioning: the noise, a 4-channel first-frame mask and the image's latents."""
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=2 * z_dim + 4, out_channels=z_dim,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32, **image_attention,
    )


def _build_wan21_i2v() -> WanImageToVideoPipeline:
    """Wan 2.1 I2V's layout: a CLIP vision encoder whose penultimate hidden states (17 tokens of
    width 16 here; 257 of 1280) the transformer attends to, beside the text, through added
    key/value projections."""
    vae = _wan21_vae()
    transformer = _wan_i2v_transformer(vae.config.z_dim, image_dim=16, added_kv_proj_dim=24)
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=32, patch_size=8))
    return WanImageToVideoPipeline(
        tokenizer=tiny_tokenizer(add_bos=False), text_encoder=UMT5EncoderModel(UMT5Config(**_TINY_T5)), vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer, image_encoder=encoder,
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
    )


def _build_wan22_i2v_a14b() -> WanImageToVideoPipeline:
    """Wan 2.2 I2V A14B's layout: two channel-conditioned experts split at a boundary, no image encoder."""
    vae = _wan21_vae()
    high, low = _wan_i2v_transformer(vae.config.z_dim), _wan_i2v_transformer(vae.config.z_dim)
    return WanImageToVideoPipeline(
        tokenizer=tiny_tokenizer(add_bos=False), text_encoder=UMT5EncoderModel(UMT5Config(**_TINY_T5)), vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=high, transformer_2=low, boundary_ratio=0.875,
    )


def _build_wan22_i2v() -> WanImageToVideoPipeline:
    """Wan 2.2 TI2V-5B's pipeline (the "wan2.2" weights) as the image-to-video pipeline that
    ``load_policy`` makes of it for prompts with images."""
    components = {k: v for k, v in _build_wan22().components.items() if k in ("tokenizer", "text_encoder", "vae",
                                                                             "scheduler", "transformer")}
    return WanImageToVideoPipeline(**components, expand_timesteps=True)


def _build_sd3(**transformer_config) -> StableDiffusion3Pipeline:
    latent_channels = 4
    transformer = SD3Transformer2DModel(
        sample_size=8,  # 32 px / 4x VAE compression: sets the default resolution
        patch_size=2,
        in_channels=latent_channels,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,  # T5 d_model, = the two CLIP hidden sizes concatenated (16 + 16)
        caption_projection_dim=16,  # = heads * head_dim
        pooled_projection_dim=32,  # the two CLIP projections concatenated (16 + 16)
        out_channels=latent_channels,
        pos_embed_max_size=16,
        **transformer_config,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_image_vae(latent_channels, scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=CLIPTextModelWithProjection(_clip_text_config(16, 16)),
        tokenizer=tiny_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(_clip_text_config(16, 16)),
        tokenizer_2=tiny_tokenizer(),
        # A (tiny) T5 as in SD3-medium: with text_encoder_3=None the pipeline could not be
        # reloaded by a plain DiffusionPipeline.from_pretrained.
        text_encoder_3=_t5_encoder(),
        tokenizer_3=tiny_tokenizer(add_bos=False),
    )


def _build_flux() -> FluxPipeline:
    latent_channels = 4
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,  # latents are packed in 2x2 patches
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,  # T5 d_model
        pooled_projection_dim=16,  # CLIP hidden size (FLUX uses the pooled CLIP output)
        guidance_embeds=True,  # like FLUX.1-dev: guidance is an input, not true CFG
        axes_dims_rope=(4, 4, 8),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=_image_vae(latent_channels, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=CLIPTextModel(_clip_text_config(16, 16)),
        tokenizer=tiny_tokenizer(),
        text_encoder_2=_t5_encoder(),
        tokenizer_2=tiny_tokenizer(add_bos=False),
        transformer=transformer,
    )


def _build_zimage() -> ZImagePipeline:
    """Z-Image's layout: a single-stream DiT (noise and caption refiners, then joint layers) over
    FLUX's 16-channel VAE (here 4), captions from Qwen3's second-to-last hidden states."""
    latent_channels = 4
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=latent_channels,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=32,  # the Qwen3 width
        axes_dims=[4, 6, 6],  # sums to the head dim
        axes_lens=[64, 16, 16],
    )
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_image_vae(latent_channels, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=Qwen3Model(_qwen3_config(hidden_size=32, num_hidden_layers=2)),
        tokenizer=tiny_chat_tokenizer(),
        transformer=transformer,
    )


def _flux2_vae(latent_channels: int) -> AutoencoderKLFlux2:
    """FLUX.2's KL autoencoder with 4x spatial compression (3 blocks); its batch norm over the
    2x2-patchified latents has non-trivial statistics, so that decoding must undo them."""
    vae = AutoencoderKLFlux2(latent_channels=latent_channels, **_TINY_KL_BLOCKS)
    patched = 4 * latent_channels
    vae.bn.running_mean.copy_(torch.linspace(-0.5, 0.5, patched))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, patched))
    return vae


def _scale_flux2_timestep_embedding(transformer: Flux2Transformer2DModel) -> None:
    """At these widths the default init leaves FLUX.2's timestep (and guidance) embedding near 0.1, and the
    modulation gates it drives (bias-free) would all but shut the attention, where the prompt comes
    in: scaled to about unit size, the prompt (and the guidance) visibly moves the velocity."""
    with torch.no_grad():
        embed = transformer.time_guidance_embed
        for embedder in (embed.timestep_embedder, embed.guidance_embedder):
            if embedder is not None:
                embedder.linear_2.weight.mul_(10.0)


_FLUX2_TEXT_WIDTH = 16  # the tiny text encoders' width; FLUX.2 reads three of their layers side by side


def _flux2_parts(guidance_embeds: bool) -> dict:
    """The transformer, scheduler and VAE both FLUX.2 pipelines share: double- and single-stream
    blocks over 2x2-patchified latents, the pipelines' dynamically shifted schedule."""
    latent_channels = 4
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,  # the 2x2 patches' channels
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * _FLUX2_TEXT_WIDTH,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )
    _scale_flux2_timestep_embedding(transformer)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096, time_shift_type="exponential",
    )
    return {"transformer": transformer, "scheduler": scheduler, "vae": _flux2_vae(latent_channels)}


def _build_flux2_klein() -> Flux2KleinPipeline:
    """FLUX.2 [klein]'s layout: no guidance embedding (true CFG), prompts as the Qwen3 hidden
    states of layers 9, 18 and 27 (so the tiny Qwen3 has 28 layers)."""
    text_encoder = Qwen3ForCausalLM(_qwen3_config(hidden_size=_FLUX2_TEXT_WIDTH, num_hidden_layers=28))
    return Flux2KleinPipeline(text_encoder=text_encoder, tokenizer=tiny_chat_tokenizer(), **_flux2_parts(False))


def _build_flux2() -> Flux2Pipeline:
    """FLUX.2 [dev]'s layout: a guidance embedding (guidance-distilled, no true CFG), prompts as the
    hidden states of layers 10, 20 and 30 of Mistral Small 3.1's language model (so a 31-layer tiny
    one, beside a one-layer Pixtral vision tower) after FLUX.2's system message. Its tokenizer is a
    tokenizer, not the real checkpoint's PixtralProcessor, whose image half needs torchvision: the
    pipeline hands it text alone, which the processor passes on to its tokenizer."""
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(
            model_type="mistral", vocab_size=len(TINY_MISTRAL_VOCAB), hidden_size=_FLUX2_TEXT_WIDTH,
            intermediate_size=32, num_hidden_layers=31, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
            max_position_embeddings=128, pad_token_id=0, bos_token_id=TINY_VOCAB.index("<bos>"),
            eos_token_id=TINY_VOCAB.index("<eos>"), initializer_range=0.2,
        ),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=32, patch_size=8),
        image_token_index=TINY_MISTRAL_VOCAB.index("[IMG]"),
    ))
    return Flux2Pipeline(text_encoder=text_encoder, tokenizer=tiny_mistral_tokenizer(), **_flux2_parts(True))


_QWEN_TEXT_WIDTH = 32


def _qwen25_vl(vocab: tuple[str, ...], **token_ids) -> Qwen2_5_VLForConditionalGeneration:
    """A Qwen2.5-VL of a two-layer language model over ``vocab`` beside a one-block vision tower
    (14-pixel patches merged 2x2, as the real one's); ``token_ids``: its vision tokens' ids."""
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(vocab), hidden_size=_QWEN_TEXT_WIDTH, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, initializer_range=0.2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            pad_token_id=0, bos_token_id=None, eos_token_id=vocab.index("<|im_end|>"),
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=_QWEN_TEXT_WIDTH,
                           fullatt_block_indexes=[0]),
        **token_ids,
    ))


def _qwenimage_parts(**transformer_config) -> dict:
    """The transformer, VAE and scheduler of Qwen-Image and Qwen-Image-Edit."""
    z_dim = 4
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * z_dim,  # 2x2-packed latents
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_QWEN_TEXT_WIDTH,
        axes_dims_rope=(4, 6, 6),  # sums to the head dim
        **transformer_config,
    )
    vae = AutoencoderKLQwenImage(
        base_dim=4, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[-0.75, -0.7, -0.9, 0.1], latents_std=[2.8, 1.45, 2.3, 2.65],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's: dynamic shifting, a terminal sigma of 0.02
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    return {"transformer": transformer, "vae": vae, "scheduler": scheduler}


def _build_qwenimage() -> QwenImagePipeline:
    """Qwen-Image's layout: an MMDiT over 2x2-packed latents of Wan's 8x causal VAE (one frame),
    prompts as the last hidden states of Qwen2.5-VL's language model (a one-block vision tower
    beside it, unused by text)."""
    parts = _qwenimage_parts()  # before the text encoder: the weights of a seed stay put
    return QwenImagePipeline(text_encoder=_qwen25_vl(TINY_CHAT_VOCAB), tokenizer=tiny_chat_tokenizer(), **parts)


def _build_qwenimage_edit(pipeline_class=QwenImageEditPipeline, **transformer_config):
    """Qwen-Image-Edit's layout: Qwen-Image's, and a processor through which Qwen2.5-VL reads the
    image to edit (at most 112 x 112 pixels here: 16 vision tokens) before the instruction."""
    parts = _qwenimage_parts(**transformer_config)
    tokenizer = tiny_qwen_vl_tokenizer()
    ids = {f"{name}_token_id": TINY_VL_VOCAB.index(f"<|{token}|>") for name, token in (
        ("image", "image_pad"), ("video", "video_pad"), ("vision_start", "vision_start"), ("vision_end", "vision_end"))}
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
    processor = ImageTextQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return pipeline_class(text_encoder=_qwen25_vl(TINY_VL_VOCAB, **ids), tokenizer=tokenizer, processor=processor, **parts)


def _build_qwenimage_edit_plus() -> QwenImageEditPlusPipeline:
    """Qwen-Image-Edit-2511's: Qwen-Image-Edit's, the image's tokens at timestep 0 (``zero_cond_t``)."""
    return _build_qwenimage_edit(QwenImageEditPlusPipeline, zero_cond_t=True)


def _hunyuanvideo15_components(**transformer_config) -> dict:
    """HunyuanVideo 1.5's text-to-video layout: an MMDiT over the latents of a 16x spatial, 4x temporal
    causal VAE, which it takes beside as many condition channels and a mask channel (zero without an
    image); prompts as the third-to-last hidden states of Qwen2.5-VL's language model (so three layers
    here) after the pipeline's system message, and the quoted text in them through a ByT5 encoder
    (byte-level: its real tokenizer); CFG by the pipeline's guider."""
    z_dim, text_width, glyph_width = 4, 32, 16
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * z_dim + 1, out_channels=z_dim, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_refiner_layers=1, text_embed_dim=text_width, text_embed_2_dim=glyph_width, image_embed_dim=16,
        rope_axes_dim=(4, 6, 6), **transformer_config,  # the rope axes sum to the head dim
    )
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=z_dim, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
        scaling_factor=1.5,  # (1.03682 in the real one) far from 1, so that decoding must undo it
    )
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(TINY_CHAT_VOCAB), hidden_size=text_width, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}, pad_token_id=0,
        bos_token_id=None, eos_token_id=TINY_CHAT_VOCAB.index("<|im_end|>"),
    ))
    glyph_encoder = T5EncoderModel(T5Config(**{**_TINY_T5, "vocab_size": 384, "d_model": glyph_width},
                                            feed_forward_proj="gated-gelu"))  # ByT5: 256 bytes, 3 special and 125 extra ids
    return dict(
        text_encoder=text_encoder, tokenizer=tiny_qwen25_tokenizer(), transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=glyph_encoder,
        tokenizer_2=ByT5Tokenizer(), guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )


def _build_hunyuanvideo15() -> HunyuanVideo15Pipeline:
    return HunyuanVideo15Pipeline(**_hunyuanvideo15_components(target_size=64, task_type="t2v"))


def _build_hunyuanvideo15_i2v() -> HunyuanVideo15ImageToVideoPipeline:
    """HunyuanVideo 1.5's image-to-video layout: the text-to-video one (the same weights for a seed),
    the image's latents and mask in the condition channels, and a SigLIP vision encoder whose last
    hidden states (16 tokens of width 16 here; 729 of 1152) the transformer attends to beside the
    text. Its target size of 40 pixels makes the pipeline sample an image of 3:2 (width to height; or a
    little wider) at the tiny default 32 x 48, as the 480p checkpoints sample a 16:9 one at 480 x 848."""
    components = _hunyuanvideo15_components(target_size=40, task_type="i2v")
    encoder = SiglipVisionModel(SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                   num_attention_heads=2, image_size=32, patch_size=8))
    return HunyuanVideo15ImageToVideoPipeline(**components, image_encoder=encoder,
                                              feature_extractor=SiglipImageProcessorPil(size={"height": 32, "width": 32}))


def _build_sd35() -> StableDiffusion3Pipeline:
    """SD3.5-Medium's layout (MMDiT-X): blocks 0-12 of its 24 add an image-only attention
    (``attn2``) beside the joint one, and every attention RMS-norms its queries and keys."""
    return _build_sd3(dual_attention_layers=(0,), qk_norm="rms_norm")


_BUILDERS = {"wan": _build_wan, "sd3": _build_sd3, "flux": _build_flux, "zimage": _build_zimage,
             "flux2-klein": _build_flux2_klein, "qwenimage": _build_qwenimage, "flux2": _build_flux2,
             "hunyuanvideo15": _build_hunyuanvideo15, "hunyuanvideo15-i2v": _build_hunyuanvideo15_i2v,
             "wan2.2": _build_wan22, "sd3.5": _build_sd35, "wan2.2-a14b": _build_wan22_a14b, "wan2.1-i2v": _build_wan21_i2v,
             "wan2.2-i2v-a14b": _build_wan22_i2v_a14b, "wan2.2-i2v": _build_wan22_i2v,
             "qwenimage-edit": _build_qwenimage_edit, "qwenimage-edit-plus": _build_qwenimage_edit_plus}


def build_tiny_pipeline(family: str, seed: int = 0) -> DiffusionPipeline:
    """A tiny random-init pipeline of ``family`` (one of ``FAMILIES``, or a layout in
    ``VARIANTS``), float32 on CPU.

    The same seed gives the same weights; the global torch RNG is left untouched.
    """
    if family not in _BUILDERS:
        raise ValueError(f"Unknown family {family!r}; expected one of {FAMILIES + VARIANTS}.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipeline = _BUILDERS[family]()
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def save_tiny_pipeline(family: str, path: str | os.PathLike, seed: int = 0) -> str:
    """Build the tiny ``family`` pipeline, save it in diffusers format under ``path`` with its
    ``sampling_defaults.json``, and return ``path`` as a string."""
    path = os.fspath(path)
    pipeline = build_tiny_pipeline(family, seed=seed)
    pipeline.save_pretrained(path)
    if isinstance(getattr(pipeline, "processor", None), ImageTextQwen2VLProcessor):
        _name_processor_as_transformers(path)
    if isinstance(getattr(pipeline, "feature_extractor", None), SiglipImageProcessorPil):
        # As the published HunyuanVideo 1.5 I2V checkpoints name it (transformers builds its PIL
        # backend for that name where torchvision is missing).
        _name_in_index(path, "feature_extractor", "SiglipImageProcessor")
    write_sampling_defaults(path, family)
    return path


def _name_in_index(path: str, component: str, class_name: str) -> None:
    """The saved pipeline folder ``path``'s ``model_index.json`` names ``component`` transformers' ``class_name``."""
    index_path = os.path.join(path, "model_index.json")
    with open(index_path) as f:
        index = json.load(f)
    index[component] = ["transformers", class_name]
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


def _name_processor_as_transformers(path: str) -> None:
    """A saved Qwen-Image-Edit folder names its processor transformers' ``Qwen2VLProcessor``, as the
    published checkpoints do (the tiny one is built as ``ImageTextQwen2VLProcessor``, whose files
    are that processor's, less the video half)."""
    _name_in_index(path, "processor", "Qwen2VLProcessor")
    for name in ("processor_config.json", "tokenizer_config.json"):
        config_path = os.path.join(path, "processor", name)
        with open(config_path) as f:
            config = json.load(f)
        config["processor_class"] = "Qwen2VLProcessor"
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)


def write_sampling_defaults(path: str, family: str) -> None:
    """``sampling_defaults.json`` in the pipeline folder ``path``: the tiny ``family``'s size."""
    with open(os.path.join(path, SAMPLING_DEFAULTS_FILE), "w") as f:
        json.dump(TINY_SAMPLING_DEFAULTS[family], f, indent=2)


def build_tiny_policy(family: str, seed: int = 0) -> FlowPolicy:
    """``build_tiny_pipeline`` wrapped in its adapter, with the tiny default sampling size
    (what ``load_policy`` gives for a folder written by ``save_tiny_pipeline``)."""
    pipeline = build_tiny_pipeline(family, seed=seed)
    return policy_for_pipeline(pipeline, **{f"default_{k}": v for k, v in TINY_SAMPLING_DEFAULTS[family].items()})
