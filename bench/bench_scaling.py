"""How rollout time, PPO step time and peak memory grow with group size, denoising steps,
frames, resolution and the number of processes.

One axis moves at a time from a base point (the others stay at the base). In-process axes use
the measurements of bench_rollout.py (``sample_rollout`` of one prompt group of K samples)
and bench_train_step.py (one PPO step on the K samples' transitions at one recorded
timestep), on one model built once. The ``processes`` axis launches bench/distributed_worker.py
with ``accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes P``
(DDP; gloo on a CPU), one group of K samples per rank, torch threads = --threads or else
cores / P: its
samples_per_s is the aggregate P K / (slowest rank's rollout time), its times the slowest rank's,
its memory the largest rank's.

    python bench/bench_scaling.py                       # wan, small transformer (~3 min on 2 cores)
    python bench/bench_scaling.py --quick               # CI: tiny model, in-process axes only
    python bench/bench_scaling.py --axes resolution,frames --family wan --scale mid --device cuda
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from bench_rollout import measure_rollout
from bench_train_step import build_single_process_accelerator, measure_ppo_step, prepare_training, record_rollout

import common
from common import emit

AXES = ("group_size", "steps", "frames", "resolution", "processes")
FULL_BASE = {"group_size": 4, "steps": 8, "frames": 9, "resolution": 64}
QUICK_BASE = {"group_size": 2, "steps": 2, "frames": 5, "resolution": 32}
FULL_VALUES = {"group_size": [1, 2, 4, 8], "steps": [4, 8, 16], "frames": [1, 5, 9, 17], "resolution": [32, 64, 96, 128],
               "processes": [1, 2]}
QUICK_VALUES = {"group_size": [1, 2], "steps": [2, 3], "frames": [1, 5], "resolution": [32, 64], "processes": [1, 2]}


def parse_values(text: str | None, default: list[int]) -> list[int]:
    return [int(v) for v in text.split(",")] if text else list(default)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--family", type=str, default="wan")
    parser.add_argument("--scale", choices=common.SCALE_NAMES, default=None, help="Default small (tiny with --quick).")
    parser.add_argument("--axes", type=str, default=None,
                        help=f"Comma-separated subset of {AXES} (default: all; --quick leaves out processes).")
    for axis in AXES:
        parser.add_argument(f"--{axis}_values", type=str, default=None, help=f"Values of the {axis} axis, comma-separated.")
    parser.add_argument("--guidance_scale", type=float, default=4.5)
    args = parser.parse_args(argv)
    args.scale = args.scale or ("tiny" if args.quick else "small")
    args.repeats = args.repeats or (1 if args.quick else 3)
    default_axes = [a for a in AXES if not (args.quick and a == "processes")]
    args.axes = [a.strip() for a in args.axes.split(",")] if args.axes else default_axes
    unknown = sorted(set(args.axes) - set(AXES))
    if unknown:
        parser.error(f"Unknown axes {unknown}; expected a subset of {list(AXES)}.")
    return args


def in_process_point(policy, model, optimizer, accelerator, point: dict, *, device, repeats, guidance_scale) -> dict:
    """Rollout and PPO-step figures at ``point`` (group_size, steps, frames, resolution)."""
    from genrl.training.rollout import SamplingConfig

    height, width, frames = policy.resolve_size(point["resolution"], point["resolution"], point["frames"])
    config = SamplingConfig(
        num_inference_steps=point["steps"], guidance_scale=guidance_scale, height=height, width=width, num_frames=frames,
    )
    k = point["group_size"]
    model.eval()
    rollout_figures = measure_rollout(
        policy, model, batch_size=k, group_size=k, config=config, device=device, repeats=repeats,
    )
    recorded = record_rollout(policy, model, batch_size=k, group_size=k, config=config, device=device)
    advantages = torch.randn(k, generator=torch.Generator().manual_seed(0))
    train_figures = measure_ppo_step(
        policy, model, optimizer, accelerator, recorded, advantages, config=config, device=device, repeats=repeats,
    )
    return {
        "height": height, "width": width, "frames": frames,
        "rollout_s": rollout_figures["rollout_s"], "samples_per_s": rollout_figures["samples_per_s"],
        "frames_per_s": rollout_figures["frames_per_s"], "overhead_ratio": rollout_figures["overhead_ratio"],
        "rollout_peak_mem_mb": rollout_figures["peak_mem_mb"],
        "train_step_s": train_figures["ppo_step_s"], "train_overhead_ratio": train_figures["overhead_ratio"],
        "train_peak_mem_mb": train_figures["peak_mem_mb"],
    }


def processes_point(args, base: dict, processes: int, output_dir: str) -> dict:
    """Figures of one DDP launch with ``processes`` ranks, each sampling one group of K."""
    worker_args = [
        "--family", args.family, "--scale", args.scale, "--batch_size", str(base["group_size"]),
        "--num_inference_steps", str(base["steps"]), "--guidance_scale", str(args.guidance_scale),
        "--height", str(base["resolution"]), "--width", str(base["resolution"]), "--num_frames", str(base["frames"]),
        "--rollout_repeats", str(args.repeats), "--train_steps", str(args.repeats + 1),
    ]
    reports = common.launch_worker("multi_gpu", processes, worker_args, output_dir, threads_per_process=args.threads)
    rollout_s = max(r["rollout_s"] for r in reports)
    frames = reports[0]["frames"]
    samples = processes * base["group_size"]
    return {
        "height": reports[0]["height"], "width": reports[0]["width"], "frames": frames,
        "rollout_s": rollout_s, "samples_per_s": samples / rollout_s,
        "frames_per_s": samples * frames / rollout_s if frames > 1 else None,
        "rollout_peak_mem_mb": max(r["rollout_peak_mb"] for r in reports),
        "train_step_s": max(r["train_step_s"] for r in reports),
        "train_peak_mem_mb": max(r["train_peak_mb"] for r in reports),
        "torch_threads_per_process": reports[0]["torch_threads"],
    }


def main(args) -> list[dict]:
    device = common.setup(args)
    base = dict(QUICK_BASE if args.quick else FULL_BASE)
    values = QUICK_VALUES if args.quick else FULL_VALUES
    policy = common.build_bench_policy(args.family, args.scale).to(device)
    if not policy.is_video:
        base["frames"] = 1
    accelerator = build_single_process_accelerator(device, "no")
    model, optimizer = prepare_training(policy, accelerator)
    params_m = common.count_parameters(model) / 1e6
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        for axis in args.axes:
            if axis == "frames" and not policy.is_video:
                continue
            for value in parse_values(getattr(args, f"{axis}_values"), values[axis]):
                if axis == "processes":
                    point = dict(base)
                    figures = processes_point(args, base, value, os.path.join(tmp, f"processes{value}"))
                else:
                    point = {**base, axis: value}
                    figures = in_process_point(
                        policy, model, optimizer, accelerator, point, device=device, repeats=args.repeats,
                        guidance_scale=args.guidance_scale,
                    )
                rows.append(emit({
                    "bench": "scaling", "axis": axis, "value": value, "family": args.family, "scale": args.scale,
                    "params_m": params_m, "group_size": point["group_size"], "steps": point["steps"],
                    "processes": value if axis == "processes" else 1, **figures,
                    "mem_kind": common.memory_kind(device), "repeats": args.repeats,
                }))
    common.print_table(rows, [
        "axis", "value", "group_size", "steps", "frames", "height", "width", "processes", "rollout_s", "samples_per_s",
        "frames_per_s", "overhead_ratio", "rollout_peak_mem_mb", "train_step_s", "train_peak_mem_mb",
    ], title="Scaling (one axis at a time from the base point; times: median seconds)")
    return rows


if __name__ == "__main__":
    main(parse_args())
