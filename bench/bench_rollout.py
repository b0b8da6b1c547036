"""Rollout throughput: genrl.training.rollout.sample_rollout against the bare transformer forwards.

For each model family it times one rollout batch (prompt encoding, the denoising loop with the
SDE step and trajectory recording at every step, decoding to the CPU) and, on the same machine
and in alternation with it, the same number of transformer forwards replayed on exactly the
inputs the loop gave the transformer at its first step (captured with a forward pre-hook;
with true CFG that is one call on the [uncond; cond] batch of 2B per step). It prints samples/s,
frames/s and the ratios

    overhead_ratio      = rollout_s / bare_forwards_s
    loop_overhead_ratio = (rollout_s - encode_s - decode_s) / bare_forwards_s

(the second leaves out prompt encoding and VAE decoding, timed on their own), plus peak memory
of the rollout and of the bare forwards. Models: the tiny pipelines of genrl.testing.tiny_pipelines
with a transformer of the chosen --scale, random weights.

    python bench/bench_rollout.py                    # wan, sd3, flux; small transformers (~1 min on 2 cores)
    python bench/bench_rollout.py --quick            # CI: tiny models, seconds
    python bench/bench_rollout.py --families wan --scale mid --device cuda --num_inference_steps 20
"""

from __future__ import annotations

import argparse

import torch

import common
from common import PeakMemory, capture_forward_inputs, emit, group_prompts, time_interleaved

# (height, width, frames) per family for a full run; --height/--width/--num_frames override.
FULL_SIZES = {"wan": (64, 64, 9), "sd3": (128, 128, 1), "flux": (128, 128, 1)}
QUICK_SIZES = {"wan": (32, 32, 5), "sd3": (32, 32, 1), "flux": (32, 32, 1)}


def measure_rollout(
    policy,
    transformer: torch.nn.Module,
    *,
    batch_size: int,
    group_size: int,
    config,
    device: torch.device,
    repeats: int,
    seed: int = 0,
) -> dict:
    """Time ``sample_rollout`` of ``batch_size`` samples (groups of ``group_size``) and the
    bare forwards of the same steps; one untimed warm-up run of each gives the peak memory.

    Returns rollout_s, encode_s, decode_s, bare_forwards_s, loop_s, overhead ratios,
    samples_per_s, frames_per_s (None for images), peak_mem_mb, bare_peak_mem_mb, start_mem_mb.
    """
    from genrl.policies.base import unwrap_module
    from genrl.training.rollout import SampleBatch, sample_rollout

    prompts, indices = group_prompts(batch_size, group_size)
    height, width, frames = policy.resolve_size(config.height, config.width, config.num_frames)

    def rollout():
        return sample_rollout(policy, transformer, SampleBatch(prompts, indices, seed=seed, epoch=0),
                              config=config, device=device)

    with PeakMemory(device) as mem, capture_forward_inputs(unwrap_module(transformer)) as calls:
        rollout()
    args, kwargs = calls[0]

    @torch.no_grad()
    def bare_forwards():
        for _ in range(config.num_inference_steps):
            transformer(*args, **kwargs)

    def encode():
        policy.encode_prompts(prompts, device, config.guidance_scale, config.negative_prompt)

    latents = torch.randn(batch_size, *policy.latent_shape(height, width, frames), device=device)

    def decode():  # as sample_rollout decodes: one sample at a time, straight to the CPU
        for b in range(batch_size):
            policy.decode(latents[b : b + 1]).detach().cpu()

    with PeakMemory(device) as bare_mem:
        bare_forwards()
    times = time_interleaved(
        {"rollout": rollout, "bare": bare_forwards, "encode": encode, "decode": decode}, device, repeats
    )
    loop_s = times["rollout"] - times["encode"] - times["decode"]
    return {
        "rollout_s": times["rollout"],
        "encode_s": times["encode"],
        "decode_s": times["decode"],
        "loop_s": loop_s,
        "bare_forwards_s": times["bare"],
        "overhead_ratio": times["rollout"] / times["bare"],
        "loop_overhead_ratio": loop_s / times["bare"],
        "samples_per_s": batch_size / times["rollout"],
        "frames_per_s": batch_size * frames / times["rollout"] if policy.is_video else None,
        "peak_mem_mb": mem.peak_mb,
        "bare_peak_mem_mb": bare_mem.peak_mb,
        "start_mem_mb": mem.start_mb,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--families", type=str, default="wan,sd3,flux",
                        help="Comma-separated, of wan, sd3, flux, zimage, flux2-klein, qwenimage, flux2.")
    parser.add_argument("--scale", choices=common.SCALE_NAMES, default=None, help="Transformer size (default small; tiny with --quick).")
    parser.add_argument("--batch_size", type=int, default=None, help="Samples per rollout batch (default 4; 2 with --quick).")
    parser.add_argument("--group_size", type=int, default=None, help="Samples per prompt (default: the batch size).")
    parser.add_argument("--num_inference_steps", type=int, default=None, help="Denoising steps (default 10; 3 with --quick).")
    parser.add_argument("--guidance_scale", type=float, default=4.5)
    parser.add_argument("--noise_level", type=float, default=0.7)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--num_frames", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(common.DTYPES), default="float32", help="Transformer, text encoder and VAE dtype.")
    args = parser.parse_args(argv)
    args.scale = args.scale or ("tiny" if args.quick else "small")
    args.batch_size = args.batch_size or (2 if args.quick else 4)
    args.group_size = args.group_size or args.batch_size
    args.num_inference_steps = args.num_inference_steps or (3 if args.quick else 10)
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


def main(args) -> list[dict]:
    from genrl.training.rollout import SamplingConfig

    device = common.setup(args)
    dtype = common.DTYPES[args.dtype]
    rows = []
    for family in [f.strip() for f in args.families.split(",") if f.strip()]:
        policy = common.build_bench_policy(family, args.scale).to(device, dtype)
        transformer = policy.transformer.to(device, dtype).eval().requires_grad_(False)
        h, w, f = (QUICK_SIZES if args.quick else FULL_SIZES)[family]
        height, width, frames = policy.resolve_size(args.height or h, args.width or w, args.num_frames or f)
        config = SamplingConfig(
            num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale,
            noise_level=args.noise_level, height=height, width=width, num_frames=frames,
        )
        figures = measure_rollout(
            policy, transformer, batch_size=args.batch_size, group_size=args.group_size, config=config,
            device=device, repeats=args.repeats,
        )
        rows.append(emit({
            "bench": "rollout", "family": family, "scale": args.scale,
            "params_m": common.count_parameters(transformer) / 1e6, "dtype": args.dtype,
            "batch": args.batch_size, "group_size": args.group_size, "steps": args.num_inference_steps,
            "height": height, "width": width, "frames": frames, "guidance_scale": args.guidance_scale,
            "forward_batch": 2 * args.batch_size if policy.use_cfg(args.guidance_scale) else args.batch_size,
            **figures, "mem_kind": common.memory_kind(device), "repeats": args.repeats,
        }))
        del policy, transformer
    common.print_table(rows, [
        "family", "params_m", "batch", "steps", "height", "width", "frames", "rollout_s", "bare_forwards_s",
        "encode_s", "decode_s", "overhead_ratio", "loop_overhead_ratio", "samples_per_s", "frames_per_s", "peak_mem_mb",
    ], title="Rollout throughput (times: median seconds per rollout batch)")
    return rows


if __name__ == "__main__":
    main(parse_args())
