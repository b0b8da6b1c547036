"""Reward scoring throughput: in-memory preprocessing vs a temp-file round trip.

The Qwen2-VL rewards (HPSv3 on images, VideoAlign on videos) preprocess frames as tensors on
the reward device. The upstream pipelines went through files instead: write a PNG / MP4,
read it back, then preprocess. This script scores the same inputs both ways with the same
tiny random Qwen2-VL reward models and prints samples per second, for preprocessing alone and
end to end, plus the machine it ran on. Figures are printed, never asserted.

    python bench/bench_reward_preprocessing.py            # a few seconds to a minute on a CPU
    python bench/bench_reward_preprocessing.py --quick    # CI: seconds
    python bench/bench_reward_preprocessing.py --device cuda --samples 32
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import cv2
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from genrl.rewards.hpsv3 import HPSv3Scorer, build_rank_head  # noqa: E402
from genrl.rewards.qwen2vl_compat import build_qwen2vl_model  # noqa: E402
from genrl.rewards.qwen2vl_preprocess import (  # noqa: E402
    HPSV3_PIXELS,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    VisionSpec,
    preprocess_clips,
    template_from_text,
)
from genrl.rewards.video_io import read_video  # noqa: E402
from genrl.rewards.videoalign import VideoAlignConfig, VideoAlignScorer  # noqa: E402

CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(reward_tokens):
    """Byte-level tokenizer (no merges) with Qwen2-VL's control tokens and the reward tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_tokens(list(CONTROL) + list(reward_tokens), special_tokens=True)
    tokenizer.pad_token = "<|endoftext|>"
    return tokenizer


def tiny_model(tokenizer, head):
    from transformers import Qwen2VLConfig

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=None,
                         eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = build_qwen2vl_model(config, on_meta=False, dtype=torch.float32)
    model.rm_head = head.eval().requires_grad_(False)
    return model


def sample_images(n, height, width, seed=0):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width] / max(height, width)
    out = [np.stack([127 + 120 * np.sin(rng.uniform(2, 9) * (yy + xx) + k) for k in range(3)], -1) for _ in range(n)]
    return np.clip(np.stack(out), 0, 255).astype(np.uint8)


def png_round_trip(images, folder):
    """Write each RGB image as PNG with OpenCV, read it back (what the upstream pipelines did)."""
    out = []
    for i, image in enumerate(images):
        path = os.path.join(folder, f"{i}.png")
        cv2.imwrite(path, cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
        out.append(cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB))
    return np.stack(out)


def mp4_round_trip(videos, folder, fps):
    """Write each RGB video as MP4 (mp4v) with OpenCV, read it back with video_io.read_video."""
    out = []
    for i, video in enumerate(videos):
        path = os.path.join(folder, f"{i}.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (video.shape[2], video.shape[1]))
        for frame in video:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
        out.append(read_video(path)[0])
    return np.stack(out)


def rate(fn, samples, repeats):
    """Samples per second of fn(), best of ``repeats`` runs after one warm-up."""
    fn()
    best = min(_timed(fn) for _ in range(repeats))
    return samples / best


def _timed(fn):
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny inputs and one repeat (CI, seconds)")
    parser.add_argument("--samples", type=int, default=None, help="images / videos per batch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.samples or (2 if args.quick else 8)
    repeats = 1 if args.quick else 3
    height, width, frames = (240, 416, 8) if args.quick else (480, 832, 16)
    image_pixels = 112 * 112 if args.quick else HPSV3_PIXELS
    video_pixels = (56 * 84, 56 * 84) if args.quick else (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    device = torch.device(args.device)

    print(f"machine: {platform.platform()} | python {platform.python_version()} | cpus {os.cpu_count()} | "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads) | opencv {cv2.__version__} | device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(f"inputs: {n} images {height}x{width} (budget {image_pixels} px), {n} videos of {frames} frames "
          f"(frame bounds {video_pixels}); tiny random Qwen2-VL reward models; best of {repeats}")

    spec = VisionSpec()
    hps_tok = tiny_tokenizer(["<|Reward|>"])
    hps = HPSv3Scorer(tiny_model(hps_tok, build_rank_head(64)).to(device), hps_tok, CHAT,
                      template_from_text("Rate how well it shows: {text_prompt}\nScore <|Reward|>", "bench"),
                      spec, device, batch_size=n, pixels=image_pixels)
    va_tokens = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
    va_tok = tiny_tokenizer(va_tokens)
    videoalign = VideoAlignScorer(
        tiny_model(va_tok, torch.nn.Linear(64, 1, bias=False)).to(device), va_tok, CHAT,
        template_from_text("Look <|VQ_reward|> motion <|MQ_reward|> text {text_prompt} fit <|TA_reward|>", "bench"),
        spec, VideoAlignConfig(), device, batch_size=n, min_pixels=video_pixels[0], max_pixels=video_pixels[1],
    )

    images = sample_images(n, height, width)
    videos = sample_images(n * frames, height, width, seed=1).reshape(n, frames, height, width, 3)
    prompts = [f"prompt {i} with {{braces}}" for i in range(n)]
    fps = [16.0] * n

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        rows.append(("HPSv3 images", "preprocess", "in-memory",
                     rate(lambda: preprocess_clips(images[:, None], spec, min_pixels=image_pixels, max_pixels=image_pixels, device=device), n, repeats)))
        rows.append(("HPSv3 images", "preprocess", "PNG round trip",
                     rate(lambda: preprocess_clips(png_round_trip(images, folder)[:, None], spec, min_pixels=image_pixels, max_pixels=image_pixels, device=device), n, repeats)))
        rows.append(("HPSv3 images", "score", "in-memory", rate(lambda: hps.score_images(torch.from_numpy(images), prompts), n, repeats)))
        rows.append(("HPSv3 images", "score", "PNG round trip",
                     rate(lambda: hps.score_images(torch.from_numpy(png_round_trip(images, folder)), prompts), n, repeats)))
        rows.append(("VideoAlign videos", "score", "in-memory", rate(lambda: videoalign.rewards(torch.from_numpy(videos), prompts, fps), n, repeats)))
        rows.append(("VideoAlign videos", "score", "MP4 round trip",
                     rate(lambda: videoalign.rewards(torch.from_numpy(mp4_round_trip(videos, folder, fps[0])), prompts, fps), n, repeats)))

    print(f"{'reward':<18} {'stage':<11} {'path':<15} {'samples/s':>10}")
    for reward, stage, path, value in rows:
        print(f"{reward:<18} {stage:<11} {path:<15} {value:>10.2f}")
    for reward, stage in dict.fromkeys((r, s) for r, s, _, _ in rows):
        memory, files = (v for r, s, _, v in rows if (r, s) == (reward, stage))
        print(f"{reward} {stage}: in-memory is {memory / files:.2f}x the file round trip")


if __name__ == "__main__":
    main()
