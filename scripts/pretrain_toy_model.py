"""Pretrain the toy text-to-image model shipped in genrl/assets/toy-shapes-t2i.

A real diffusers ``StableDiffusion3Pipeline`` at toy scale, trained from scratch on the
procedural scenes of ``genrl.data.toy_scenes`` (fresh scenes every step, train prompts only):

  (a) the VAE (``AutoencoderKL``, 32x32 RGB <-> 4x8x8 latents): reconstruction + small KL;
  (b) the transformer (``SD3Transformer2DModel``) and both CLIP text encoders together,
      with the rectified-flow objective
          x_s = (1 - s) x0 + s eps,   v_target = eps - x0,   timestep = 1000 s,
      s ~ logit-normal(0, 1), captions dropped to "" 10% of the time (for CFG).

Prompts are encoded with the pipeline's own ``encode_prompt`` (CLIP hidden_states[-2] of
both encoders, pooled outputs concatenated, then all-zero T5 tokens from a stand-in
text_encoder_3), so the saved folder runs unchanged under
``StableDiffusion3Pipeline.from_pretrained(folder)(prompt)``.

    python scripts/pretrain_toy_model.py                        # writes genrl/assets/toy-shapes-t2i
    python scripts/pretrain_toy_model.py --steps 200 --output_dir /tmp/toy   # quick try
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from diffusers import (  # noqa: E402
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from diffusers.models.attention_processor import JointAttnProcessor2_0  # noqa: E402
from transformers import (  # noqa: E402
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)

from genrl.data.toy_scenes import (  # noqa: E402
    all_specs,
    caption,
    is_test_combination,
    prompt_splits,
    sample_scene,
    vocabulary,
)
from genrl.data.word_tokenizer import word_level_tokenizer  # noqa: E402
from genrl.rewards.toy_geneval import toy_geneval_scores  # noqa: E402

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default=os.path.join(ROOT, "genrl", "assets", "toy-shapes-t2i"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--vae_steps", type=int, default=600)
    parser.add_argument("--vae_batch_size", type=int, default=32)
    parser.add_argument("--vae_learning_rate", type=float, default=2e-3)
    parser.add_argument("--kl_weight", type=float, default=1e-5)
    parser.add_argument("--steps", type=int, default=2000, help="transformer + text-encoder steps")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--warmup_steps", type=int, default=100)
    parser.add_argument("--caption_dropout", type=float, default=0.1)
    parser.add_argument(
        "--caption_noise",
        type=float,
        default=0.0,
        help="probability that a scene is captioned with another random train caption (loose alt-text)",
    )
    parser.add_argument(
        "--caption_noise_from",
        type=int,
        default=0,
        help="flow step from which --caption_noise applies (earlier steps see exact captions)",
    )
    parser.add_argument("--width", type=int, default=96, help="transformer width (heads x 32)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--patch_size", type=int, default=2)
    parser.add_argument("--text_width", type=int, default=64)
    parser.add_argument(
        "--max_length", type=int, default=12, help="tokenizer model_max_length (the longest caption is 10 tokens)"
    )
    parser.add_argument(
        "--num_threads", type=int, default=1, help="torch threads (1 is fastest on a busy machine: no spin-waiting)"
    )
    parser.add_argument("--eval_steps", type=int, default=20, help="inference steps of the final evaluation")
    parser.add_argument("--eval_prompts", type=int, default=16, help="prompts per split in the final evaluation (x 2 seeds)")
    parser.add_argument("--log_every", type=int, default=100)
    parser.add_argument("--eval_every", type=int, default=0, help="score both splits at CFG 2 every N flow steps (0: only at the end)")
    args = parser.parse_args(argv)
    if args.resolution % 16 != 0:
        parser.error(f"--resolution must be a multiple of 16 (VAE x4, then 8x8 latents or larger), got {args.resolution}.")
    if args.width % 32 != 0:
        parser.error(f"--width must be a multiple of the head size 32, got {args.width}.")
    return args


# ---------------------------------------------------------------------------- building blocks


def build_tokenizer(max_length: int, stand_in_t5: bool = False) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the toy grammar: ``<bos> words <eos> <pad>...``.

    ``stand_in_t5``: the stand-in T5's tokenizer, which reads a whole prompt as one token
    and adds no special tokens, so a prompt always fits ``max_sequence_length`` >= 1 (the
    pipeline then never warns about truncation); the zero T5 ignores the ids anyway.
    """
    vocab = SPECIAL_TOKENS + tuple(vocabulary())
    if stand_in_t5:
        return word_level_tokenizer(vocab, max_length, template=None, split_words=False)
    return word_level_tokenizer(vocab, max_length)


def build_text_encoder(tokenizer: PreTrainedTokenizerFast, width: int) -> CLIPTextModelWithProjection:
    # Three layers: the pipeline reads hidden_states[-2], the output of the second.
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2 * width,
        projection_dim=width,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # pooled output is read at the first <eos>
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config)


def build_zero_t5(tokenizer: PreTrainedTokenizerFast, joint_attention_dim: int) -> T5EncoderModel:
    """A stand-in ``text_encoder_3`` that outputs zeros: no layers, all-zero embeddings
    (T5's final RMS norm maps 0 to 0). The pipeline then appends exactly the zero tokens it
    appends when ``text_encoder_3`` is None, but the folder needs no ``text_encoder_3=None``
    to load: a plain ``from_pretrained`` works, as for any Hub model."""
    config = T5Config(vocab_size=len(tokenizer), d_model=joint_attention_dim, d_kv=8, d_ff=8, num_layers=0, num_heads=1)
    model = T5EncoderModel(config)
    torch.nn.init.zeros_(model.shared.weight)
    model.requires_grad_(False)
    return model


def build_vae(resolution: int, channels: tuple[int, int, int] = (16, 32, 64)) -> AutoencoderKL:
    """3 levels: 2 ** (3 - 1) = x4 downsampling, as the pipeline computes vae_scale_factor."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=channels,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=16,
        sample_size=resolution,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )


def build_transformer(latent_size: int, width: int, layers: int, text_width: int, patch_size: int = 2) -> SD3Transformer2DModel:
    return SD3Transformer2DModel(
        sample_size=latent_size,  # the pipeline's default height is sample_size * vae_scale_factor
        patch_size=patch_size,
        in_channels=4,
        out_channels=4,
        num_layers=layers,
        attention_head_dim=32,
        num_attention_heads=width // 32,
        joint_attention_dim=2 * text_width,  # both CLIP hidden states side by side
        caption_projection_dim=width,
        pooled_projection_dim=2 * text_width,
        pos_embed_max_size=latent_size,
    )


# ---------------------------------------------------------------------------- data


def scene_batch(rng: np.random.Generator, specs: list, batch_size: int, resolution: int) -> tuple[torch.Tensor, list[str]]:
    """Fresh scenes: images (B, 3, H, W) in [-1, 1] and their captions."""
    images, captions = [], []
    for _ in range(batch_size):
        image, spec = sample_scene(rng, specs, resolution)
        images.append(image)
        captions.append(caption(spec))
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return pixels, captions


def loosen_captions(captions: list[str], specs: list, rng: np.random.Generator, noise: float) -> list[str]:
    """Each caption replaced, with probability ``noise``, by the caption of a random scene of
    ``specs`` (its image unchanged): loosely captioned data, as web alt-text often is. With
    ``noise`` 0 nothing is drawn from ``rng``, so runs without it stay bit-identical."""
    if noise <= 0:
        return list(captions)
    return [caption(specs[rng.integers(len(specs))]) if rng.random() < noise else c for c in captions]


def caption_noise_at(step: int, args: argparse.Namespace) -> float:
    """--caption_noise from flow step --caption_noise_from on, 0 before: the steps before draw
    nothing from the RNG, so they are those of a clean run of the same --steps."""
    return args.caption_noise if step >= args.caption_noise_from else 0.0


def lr_lambda(warmup: int, total: int):
    """Linear warm-up, then cosine decay to 10% of the peak."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


# ---------------------------------------------------------------------------- (a) VAE


def train_vae(vae: AutoencoderKL, specs: list, args: argparse.Namespace, rng: np.random.Generator) -> None:
    """loss = mean((decode(z) - x)^2) + kl_weight * mean(KL(q(z|x) || N(0, I))), z ~ q(z|x)."""
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.vae_learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, args.vae_steps))
    vae.train()
    start = time.time()
    for step in range(args.vae_steps):
        pixels, _ = scene_batch(rng, specs, args.vae_batch_size, args.resolution)
        posterior = vae.encode(pixels).latent_dist
        recon = vae.decode(posterior.sample()).sample
        mse = F.mse_loss(recon, pixels)
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        loss = mse + args.kl_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % args.log_every == 0 or step == args.vae_steps - 1:
            print(f"vae step {step:5d}  mse {mse.item():.5f}  kl {kl.item():.3f}  {time.time() - start:6.0f}s", flush=True)
    vae.eval()


@torch.no_grad()
def set_latent_normalisation(vae: AutoencoderKL, specs: list, args: argparse.Namespace, rng: np.random.Generator) -> None:
    """shift_factor = mean(z), scaling_factor = 1 / std(z) over fresh scenes, so that the
    diffusion model sees (z - shift) * scale with zero mean and unit variance."""
    latents = torch.cat([vae.encode(scene_batch(rng, specs, 64, args.resolution)[0]).latent_dist.sample() for _ in range(8)])
    vae.register_to_config(shift_factor=latents.mean().item(), scaling_factor=1.0 / latents.std().item())
    print(f"latents: shift_factor {vae.config.shift_factor:.4f}  scaling_factor {vae.config.scaling_factor:.4f}")


@torch.no_grad()
def vae_reconstruction_reward(vae: AutoencoderKL, specs: list, args: argparse.Namespace, rng: np.random.Generator) -> float:
    """Toy GenEval of VAE reconstructions: the ceiling of what the generator can score."""
    pixels, captions = scene_batch(rng, specs, 128, args.resolution)
    recon = vae.decode(vae.encode(pixels).latent_dist.mode()).sample
    return toy_geneval_scores((recon[:, :, None] / 2 + 0.5).clamp(0, 1), captions)["overall"].mean().item()


# ---------------------------------------------------------------------------- (b) transformer


class NullTokenJointAttnProcessor:
    """SD3 joint attention where the last context token stands for n identical tokens.

    The toy pipeline appends ``max_sequence_length`` (default 256) all-zero T5 tokens (as
    SD3 does without text_encoder_3). Identical tokens have the same key k0 and value v0 in every block,
    so n of them enter the softmax as one token whose logit is raised by log n:
        sum over the n copies of exp(q.k0) v0 = exp(q.k0 + log n) v0.
    Training with one such token and that bias is the model the pipeline runs with n zero
    tokens, at a fraction of the cost; drawing n per sample makes any
    ``max_sequence_length`` work. ``null_token_log_count``: log n, shape (B,).
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, null_token_log_count=None):
        batch, image_tokens = hidden_states.shape[:2]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)

        query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        context = encoder_hidden_states
        query = torch.cat([query, heads(attn.add_q_proj(context))], dim=2)
        key = torch.cat([key, heads(attn.add_k_proj(context))], dim=2)
        value = torch.cat([value, heads(attn.add_v_proj(context))], dim=2)
        bias = torch.zeros(batch, 1, 1, key.shape[2], dtype=query.dtype, device=query.device)
        bias[:, 0, 0, -1] = null_token_log_count
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias)
        out = out.transpose(1, 2).reshape(batch, -1, query.shape[-1] * attn.heads)
        image_out, context_out = out[:, :image_tokens], out[:, image_tokens:]
        image_out = attn.to_out[1](attn.to_out[0](image_out))
        if attn.context_pre_only:
            return image_out, context_out
        return image_out, attn.to_add_out(context_out)


@torch.no_grad()
def check_null_token_processor(transformer: SD3Transformer2DModel, latent_size: int, joint_dim: int, pooled_dim: int) -> None:
    """The training shortcut must give what the pipeline computes with n real zero tokens."""
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 4, latent_size, latent_size, generator=generator)
    clip_tokens = torch.randn(2, 5, joint_dim, generator=generator)
    pooled = torch.randn(2, pooled_dim, generator=generator)
    timestep = torch.tensor([300.0, 800.0])
    n = 37
    transformer.set_attn_processor(JointAttnProcessor2_0())
    full = torch.cat([clip_tokens, torch.zeros(2, n, joint_dim)], dim=1)
    expected = transformer(latents, full, pooled, timestep, return_dict=False)[0]
    transformer.set_attn_processor(NullTokenJointAttnProcessor())
    short = torch.cat([clip_tokens, torch.zeros(2, 1, joint_dim)], dim=1)
    log_n = torch.full((2,), math.log(n))
    got = transformer(latents, short, pooled, timestep, joint_attention_kwargs={"null_token_log_count": log_n}, return_dict=False)[0]
    error = (got - expected).abs().max().item()
    if error > 1e-4:
        raise RuntimeError(f"NullTokenJointAttnProcessor differs from the pipeline's attention by {error:.2e}.")


def sample_null_token_log_count(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """log n per sample: a third n = 1 (genrl's SD3 adapter, capped by tokenizer_3's
    model_max_length), a third n = 256 (the pipeline's default), a third log-uniform in [1, 512]."""
    choice = torch.randint(0, 3, (batch_size,), generator=generator)
    log_uniform = torch.rand(batch_size, generator=generator) * math.log(512)
    return torch.where(choice == 0, 0.0, torch.where(choice == 1, math.log(256), log_uniform))


def train_transformer(pipe: StableDiffusion3Pipeline, specs: list, args: argparse.Namespace, rng: np.random.Generator,
                      progress: Callable[[int], None] | None = None) -> None:
    """Rectified flow: loss = mean((v_theta(x_s, 1000 s, text) - (eps - x0))^2), s ~ logit-normal.

    Every ``args.eval_every`` flow steps (before the last) ``progress(step)`` runs, in sampling
    mode (``sampling_mode``); by default it prints both splits' scores at CFG 2."""
    transformer, vae = pipe.transformer, pipe.vae
    text_encoders = [pipe.text_encoder, pipe.text_encoder_2]
    params = list(transformer.parameters()) + [p for te in text_encoders for p in te.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, args.steps))
    generator = torch.Generator().manual_seed(args.seed + 1)
    transformer.set_attn_processor(NullTokenJointAttnProcessor())
    transformer.train()
    for te in text_encoders:
        te.train()
    start, running = time.time(), 0.0
    for step in range(args.steps):
        pixels, captions = scene_batch(rng, specs, args.batch_size, args.resolution)
        captions = loosen_captions(captions, specs, rng, caption_noise_at(step, args))
        captions = ["" if rng.random() < args.caption_dropout else c for c in captions]
        with torch.no_grad():
            z = vae.encode(pixels).latent_dist.sample(generator=generator)
            x0 = (z - vae.config.shift_factor) * vae.config.scaling_factor
        prompt_embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=captions, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False, max_sequence_length=1
        )
        s = torch.sigmoid(torch.randn(args.batch_size, generator=generator))
        noise = torch.randn(x0.shape, generator=generator)
        s4 = s.view(-1, 1, 1, 1)
        x_s = (1 - s4) * x0 + s4 * noise
        v = transformer(
            x_s,
            prompt_embeds,
            pooled,
            s * 1000.0,
            joint_attention_kwargs={"null_token_log_count": sample_null_token_log_count(args.batch_size, generator)},
            return_dict=False,
        )[0]
        loss = F.mse_loss(v, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        running = loss.item() if step == 0 else 0.98 * running + 0.02 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"flow step {step:5d}  loss {running:.4f}  lr {scheduler.get_last_lr()[0]:.2e}  {time.time() - start:6.0f}s", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            with sampling_mode(pipe):
                (progress or (lambda at: print_progress_scores(pipe, args, at)))(step + 1)
    transformer.set_attn_processor(JointAttnProcessor2_0())
    transformer.eval()
    for te in text_encoders:
        te.eval()


# ---------------------------------------------------------------------------- evaluation


@contextlib.contextmanager
def sampling_mode(pipe: StableDiffusion3Pipeline) -> Iterator[None]:
    """Mid-training sampling: eval mode and the pipeline's own attention inside, training mode and
    the null-token attention after; the global torch RNG (training's stream) is left as it was."""
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    for m in modules:
        m.eval()
    pipe.transformer.set_attn_processor(JointAttnProcessor2_0())
    pipe.set_progress_bar_config(disable=True)
    cpu_state = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_state)
        pipe.transformer.set_attn_processor(NullTokenJointAttnProcessor())
        for m in modules:
            m.train()


def print_progress_scores(pipe: StableDiffusion3Pipeline, args: argparse.Namespace, step: int) -> None:
    """Both splits at CFG 2 during training (called in ``sampling_mode``)."""
    train_prompts, test_prompts = prompt_splits()
    for split, prompts in (("train", train_prompts), ("test", test_prompts)):
        scores = evaluate(pipe, evenly_spaced(prompts, args.eval_prompts), 2.0, args.eval_steps)
        print(f"  step {step} cfg 2 {split:5s}: " + "  ".join(f"{k} {v:.3f}" for k, v in scores.items()), flush=True)


@torch.no_grad()
def evaluate(pipe: StableDiffusion3Pipeline, prompts: list[str], guidance_scale: float, steps: int, seeds=(0, 1)) -> dict:
    """Mean toy GenEval scores of ``prompts`` x ``seeds`` generated by the pipeline's own call."""
    images = []
    for seed in seeds:
        out = pipe(
            prompts,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            generator=torch.Generator().manual_seed(seed),
            output_type="pt",
        ).images
        images.append(out)
    images = torch.cat(images)
    scores = toy_geneval_scores(images[:, :, None], prompts * len(seeds))
    return {name: float(np.nanmean(value.numpy())) for name, value in scores.items()}


def evenly_spaced(prompts: list[str], count: int) -> list[str]:
    return [prompts[i] for i in np.linspace(0, len(prompts) - 1, count).round().astype(int)]


def build_pipeline(args: argparse.Namespace) -> StableDiffusion3Pipeline:
    """The untrained toy pipeline (random weights, seeded by the caller)."""
    # tokenizer_3's model_max_length 1 makes genrl's SD3 adapter append a single zero T5
    # token (cheap); the pipeline's own call still appends its default 256.
    tokenizers = [build_tokenizer(args.max_length), build_tokenizer(args.max_length), build_tokenizer(1, stand_in_t5=True)]
    pipe = StableDiffusion3Pipeline(
        transformer=build_transformer(args.resolution // 4, args.width, args.layers, args.text_width, args.patch_size),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0),
        vae=build_vae(args.resolution),
        text_encoder=build_text_encoder(tokenizers[0], args.text_width),
        tokenizer=tokenizers[0],
        text_encoder_2=build_text_encoder(tokenizers[1], args.text_width),
        tokenizer_2=tokenizers[1],
        text_encoder_3=build_zero_t5(tokenizers[2], 2 * args.text_width),
        tokenizer_3=tokenizers[2],
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def name_tokenizers_portably(output_dir: str) -> None:
    """transformers 5 records the word-level tokenizers' class as ``TokenizersBackend``,
    which transformers 4 lacks; ``PreTrainedTokenizerFast`` names the same class in 5 and
    loads ``tokenizer.json`` in 4 too."""
    index_path = os.path.join(output_dir, "model_index.json")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        index[name] = ["transformers", "PreTrainedTokenizerFast"]
        config_path = os.path.join(output_dir, name, "tokenizer_config.json")
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
    with open(index_path, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")


def parameter_counts(pipe: StableDiffusion3Pipeline) -> dict[str, int]:
    """Parameters of each trained component."""
    return {
        name: sum(p.numel() for p in getattr(pipe, name).parameters())
        for name in ("transformer", "vae", "text_encoder", "text_encoder_2")
    }


def write_model_card(pipe: StableDiffusion3Pipeline, args: argparse.Namespace, report: dict, command: str) -> None:
    """README.md of the saved folder: what the model is, how it was made, how it scores.

    Not ``genrl.hub.model_card.write_model_card``: that one describes an RL fine-tune (base
    model, reward, before/after scores); this model is trained from scratch."""
    sizes = parameter_counts(pipe)
    rows = "\n".join(
        f"| {key.split('_cfg')[0]} | {key.split('_cfg')[1]} | {v['overall']:.3f} | {v['strict']:.3f} | "
        f"{v['color']:.3f} | {v['shape']:.3f} | {v['count']:.3f} | {v['position']:.3f} |"
        for key, v in report["eval"].items()
    )
    settings = "\n".join(f"- `--{k} {v}`" for k, v in vars(args).items() if k != "output_dir")
    since = f" from flow step {args.caption_noise_from} on" if args.caption_noise_from else ""
    noise_note = "" if not args.caption_noise else (
        f" It was pretrained on loosely captioned scenes{since}: {args.caption_noise:.0%} of the time a\n"
        "scene came with the caption of another random train scene, as web alt-text often does. So\n"
        "it can draw what a prompt asks but, sampled without guidance, follows the prompt only part of\n"
        "the time; classifier-free guidance recovers much of it: the gap that RL alignment closes."
    )
    card = f"""---
library_name: diffusers
pipeline_tag: text-to-image
tags: [genrl, toy, flow-matching, sd3]
---

# toy-shapes-t2i

A tiny text-to-image flow-matching model, shipped with genrl as the default policy of
`accelerate launch train_genrl.py` (no arguments): a real `StableDiffusion3Pipeline`
folder, {args.resolution}x{args.resolution} RGB images of coloured circles, squares and
triangles on white, prompted by captions such as "two red circles" or "a red circle left
of a blue square" (the grammar and the prompt splits are in `genrl/data/toy_scenes.py`; the
reward that grades it is `genrl/rewards/toy_geneval.py`).

```python
from diffusers import StableDiffusion3Pipeline
pipe = StableDiffusion3Pipeline.from_pretrained("genrl/assets/toy-shapes-t2i")
images = pipe("two red circles", num_inference_steps=20, guidance_scale=3.0).images
```

It is deliberately only partly competent (see the scores below), so that RL has
something to teach it.{noise_note}

## Components

- transformer: `SD3Transformer2DModel`, {args.layers} joint blocks, width {args.width}, patch {args.patch_size}, on
  4x{args.resolution // 4}x{args.resolution // 4} latents ({sizes['transformer'] / 1e6:.2f}M parameters);
- vae: `AutoencoderKL`, x4 downsampling, 4 latent channels ({sizes['vae'] / 1e6:.2f}M), `shift_factor` and
  `scaling_factor` measured on the training scenes;
- text_encoder, text_encoder_2: `CLIPTextModelWithProjection`, 3 layers, width {args.text_width}
  ({sizes['text_encoder'] / 1e6:.2f}M each); tokenizer, tokenizer_2: a word-level tokenizer over the
  toy grammar, `model_max_length` {args.max_length} (two identical copies: the SD3 pipeline loads
  one tokenizer per CLIP encoder);
- text_encoder_3: a stand-in `T5EncoderModel` with no layers and all-zero embeddings, so it outputs
  the all-zero T5 tokens the SD3 pipeline uses when `text_encoder_3` is None, while the folder
  loads with a plain `from_pretrained`; tokenizer_3 reads a whole prompt as one token. The
  transformer was trained to accept any number of zero tokens (`max_sequence_length` from 1
  to 512). The pipeline's default is 256; tokenizer_3's `model_max_length` 1 makes genrl's
  SD3 adapter use one, which scores the same and is about 10x faster on a CPU;
- scheduler: `FlowMatchEulerDiscreteScheduler`, shift 1.0.

## Training

Trained from scratch by `scripts/pretrain_toy_model.py`, seeded, on fresh procedural scenes
of the train prompts only (`genrl/assets/prompts/toy_train.txt`; the held-out combinations
in `toy_test.txt` were never drawn): first the VAE (MSE + KL), then the transformer and both
text encoders with the rectified-flow loss (x_s = (1 - s) x0 + s eps, target eps - x0,
s ~ logit-normal, 10% empty captions for classifier-free guidance).

```
{command}
```

Settings:
{settings}

Time: {report['train_minutes']:.1f} min of training (VAE {report['vae_minutes']:.1f} min) on a shared
2-core CPU, {report['torch_threads']} torch thread(s).

## Scores

Toy GenEval (`genrl/rewards/toy_geneval.py`) of {args.eval_prompts} evenly spaced prompts x 2 seeds per split,
{args.eval_steps} Euler steps, the pipeline's defaults otherwise. `overall` is the reward used
for training (partial credit in [0, 1]); `strict` counts images that pass every check;
position is averaged over position prompts only. VAE reconstructions of the training scenes
score {report['vae_reconstruction']:.3f}, the ceiling for this VAE.

| split | CFG | overall | strict | colour | shape | count | position |
|---|---|---|---|---|---|---|---|
{rows}
"""
    with open(os.path.join(args.output_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)


def main(args: argparse.Namespace) -> None:
    start = time.time()
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    train_specs = [s for s in all_specs() if not is_test_combination(s)]
    latent_size = args.resolution // 4
    pipe = build_pipeline(args)
    vae = pipe.vae
    for name, count in parameter_counts(pipe).items():
        print(f"{name}: {count / 1e6:.3f}M parameters")
    check_null_token_processor(pipe.transformer, latent_size, 2 * args.text_width, 2 * args.text_width)

    train_vae(vae, train_specs, args, rng)
    vae.requires_grad_(False)
    set_latent_normalisation(vae, train_specs, args, rng)
    vae_reward = vae_reconstruction_reward(vae, train_specs, args, rng)
    print(f"VAE reconstruction toy_geneval: {vae_reward:.3f}")
    vae_seconds = time.time() - start

    train_transformer(pipe, train_specs, args, rng)
    train_seconds = time.time() - start

    pipe.save_pretrained(args.output_dir, safe_serialization=True)
    name_tokenizers_portably(args.output_dir)
    print(f"saved {args.output_dir} after {train_seconds / 60:.1f} min (VAE {vae_seconds / 60:.1f} min)")

    # Score the folder as users load it.
    train_prompts, test_prompts = prompt_splits()
    loaded = StableDiffusion3Pipeline.from_pretrained(args.output_dir)
    loaded.set_progress_bar_config(disable=True)
    report = {
        "train_minutes": train_seconds / 60,
        "vae_minutes": vae_seconds / 60,
        "torch_threads": args.num_threads,
        "vae_reconstruction": vae_reward,
        "eval": {},
    }
    for guidance in (1.0, 3.0, 5.0):
        for split, prompts in (("train", train_prompts), ("test", test_prompts)):
            scores = evaluate(loaded, evenly_spaced(prompts, args.eval_prompts), guidance, args.eval_steps)
            report["eval"][f"{split}_cfg{guidance:g}"] = scores
            print(f"cfg {guidance:g} {split:5s}: " + "  ".join(f"{k} {v:.3f}" for k, v in scores.items()), flush=True)
    # Where the folder was written is no part of how it was made.
    argv = [a for i, a in enumerate(sys.argv[1:]) if not a.startswith("--output_dir") and sys.argv[i] != "--output_dir"]
    command = "python " + " ".join([os.path.relpath(__file__, ROOT)] + argv)
    write_model_card(loaded, args, report, command)
    print(json.dumps(report))
    print(f"total {(time.time() - start) / 60:.1f} min")


if __name__ == "__main__":
    main(parse_args())
