"""Reward scoring time: each reward of the registry, built with genrl.rewards.build_reward_fn,
scoring batches laid out as the rollout hands them over (float ``(N, 3, F, H, W)`` in [0, 1]
on the CPU), as images (F = 1) and as videos.

Samples are toy-world scenes (genrl.data.toy_scenes: coloured shapes on white, what the embedded
default model learns to draw), prompts their captions; a video repeats its scene with a
horizontal drift of 2 pixels per frame. Per reward and layout it prints the time to build the
reward (build_s), the first call (first_call_s), the median of the timed calls (score_s),
samples/s, frames/s and the peak memory of scoring; a last row per layout scores every reward
together through one ``RewardFn`` (the trainer's call), and a first row times
``genrl.rewards.prepare_images`` alone, the float -> uint8 layout conversion each rule-based
reward starts with.

    python bench/bench_rewards.py                    # rule-based rewards, 512 px images and 33x240x416 videos
    python bench/bench_rewards.py --quick            # CI: small inputs, seconds
    python bench/bench_rewards.py --rewards hpsv3 --reward_options '{"hpsv3": {"checkpoint": "..."}}' --device cuda

HPSv3 and VideoAlign need their weights (see genrl/rewards); their preprocessing throughput with
tiny random Qwen2-VL models is measured by bench/bench_reward_preprocessing.py.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import common
from common import PeakMemory, emit, time_interleaved

DEFAULT_REWARDS = "jpeg_compressibility,temporal_smoothness,toy_geneval"


def toy_clips(num_samples: int, frames: int, height: int, width: int, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """``num_samples`` toy scenes as float ``(N, 3, F, H, W)`` in [0, 1] and their captions."""
    from genrl.data.toy_scenes import caption, sample_scene

    rng = np.random.default_rng(seed)
    size = max(height, width, 16)
    clips, prompts = [], []
    for _ in range(num_samples):
        image, spec = sample_scene(rng, resolution=size)
        clip = np.stack([np.roll(image, 2 * f, axis=1)[:height, :width] for f in range(frames)])  # (F, H, W, 3)
        clips.append(torch.from_numpy(clip).permute(3, 0, 1, 2))
        prompts.append(caption(spec))
    return torch.stack(clips).float() / 255.0, prompts


def measure_reward(spec: str, samples: torch.Tensor, prompts: list[str], *, options: dict, device, repeats: int) -> dict:
    """Build ``spec`` with ``build_reward_fn`` and time its calls on ``samples``."""
    from genrl.rewards import build_reward_fn, clear_reward_models

    start = time.perf_counter()
    reward_fn = build_reward_fn(spec, device=device, options={k: v for k, v in options.items() if k in spec.split(",")})
    build_s = time.perf_counter() - start

    def score():
        return reward_fn(samples, prompts)

    with PeakMemory(device) as mem:
        first_call_s = common.time_once(score, device)
    score_s = time_interleaved({"score": score}, device, repeats)["score"]
    clear_reward_models()
    n, frames = samples.shape[0], samples.shape[2]
    return {
        "build_s": build_s, "first_call_s": first_call_s, "score_s": score_s,
        "samples_per_s": n / score_s, "frames_per_s": n * frames / score_s,
        "peak_mem_mb": mem.peak_mb, "start_mem_mb": mem.start_mb,
    }


def measure_layout_conversion(samples: torch.Tensor, *, device, repeats: int) -> dict:
    """Time ``genrl.rewards.prepare_images`` (float ``(N, 3, F, H, W)`` -> uint8 ``(N, F, H, W, 3)``),
    the conversion every rule-based reward starts with."""
    from genrl.rewards import prepare_images

    def convert():
        return prepare_images(samples)

    with PeakMemory(device) as mem:
        first_call_s = common.time_once(convert, device)
    score_s = time_interleaved({"convert": convert}, device, repeats)["convert"]
    n, frames = samples.shape[0], samples.shape[2]
    return {
        "build_s": None, "first_call_s": first_call_s, "score_s": score_s,
        "samples_per_s": n / score_s, "frames_per_s": n * frames / score_s,
        "peak_mem_mb": mem.peak_mb, "start_mem_mb": mem.start_mb,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--rewards", type=str, default=DEFAULT_REWARDS, help="Registered reward names, comma-separated.")
    parser.add_argument("--reward_options", type=str, default=None, help='JSON: {"name": {option: value}}.')
    parser.add_argument("--num_samples", type=int, default=None, help="Samples per batch (default 16; 2 with --quick).")
    parser.add_argument("--image_size", type=int, default=None, help="Square image side (default 512; 32 with --quick).")
    parser.add_argument("--video", type=str, default=None, help="FxHxW of the videos (default 33x240x416; 5x32x32 with --quick).")
    parser.add_argument("--video_samples", type=int, default=None, help="Videos per batch (default 4; 2 with --quick).")
    args = parser.parse_args(argv)
    args.num_samples = args.num_samples or (2 if args.quick else 16)
    args.image_size = args.image_size or (32 if args.quick else 512)
    args.video = args.video or ("5x32x32" if args.quick else "33x240x416")
    args.video_samples = args.video_samples or (2 if args.quick else 4)
    args.repeats = args.repeats or (1 if args.quick else 3)
    try:
        args.video_shape = tuple(int(v) for v in args.video.lower().split("x"))
        assert len(args.video_shape) == 3 and min(args.video_shape) > 0
    except (ValueError, AssertionError):
        parser.error(f"--video {args.video!r} must be FxHxW with positive integers, e.g. 33x240x416.")
    return args


def main(args) -> list[dict]:
    device = common.setup(args)
    options = json.loads(args.reward_options) if args.reward_options else {}
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    frames, height, width = args.video_shape
    layouts = {
        "image": toy_clips(args.num_samples, 1, args.image_size, args.image_size),
        "video": toy_clips(args.video_samples, frames, height, width, seed=1),
    }
    rows = []
    for layout, (samples, prompts) in layouts.items():
        specs = ["prepare_images"] + names + ([",".join(names)] if len(names) > 1 else [])
        for spec in specs:
            if spec == "prepare_images":
                figures = measure_layout_conversion(samples, device=device, repeats=args.repeats)
            else:
                figures = measure_reward(spec, samples, prompts, options=options, device=device, repeats=args.repeats)
            rows.append(emit({
                "bench": "rewards", "reward": spec if spec in names + ["prepare_images"] else "all", "spec": spec,
                "layout": layout,
                "samples": samples.shape[0], "frames": samples.shape[2], "height": samples.shape[3], "width": samples.shape[4],
                **figures, "mem_kind": common.memory_kind(device),
                "repeats": args.repeats,
            }))
    common.print_table(rows, [
        "reward", "layout", "samples", "frames", "height", "width", "build_s", "first_call_s", "score_s",
        "samples_per_s", "frames_per_s", "peak_mem_mb",
    ], title="Reward scoring (median seconds per batch)")
    return rows


if __name__ == "__main__":
    main(parse_args())
