"""Per-rank memory under DeepSpeed ZeRO-2 versus ZeRO-3, two processes, a mid-size model.

For each config it runs ``bench/distributed_worker.py`` (the trainer's set-up: genrl's
Accelerator, DeepSpeed batch sizes, ``accelerator.prepare(transformer, AdamW)``, then a
``sample_rollout`` batch and PPO steps) with

    accelerate launch --config_file accelerate_configs/<config>.yaml --num_processes 2 ...

and prints each rank's report as a JSON line: RSS (CPU) or CUDA allocated (GPU) after the model
is built, peak and level after ``prepare``, peaks of the rollout and of the PPO steps, memory held
by tensors after prepare and after training, and the rollout / PPO step times. The model is an
SD3 transformer of ~73 M parameters (--scale mid: 8 joint blocks, width 512) with random
weights on the tiny SD3 pipeline's text encoders and VAE, saved once to disk and loaded by every
rank as the trainer loads it: under ZeRO-3 with ``zero3_init_flag: true`` (the shipped zero3
configs) each rank builds only its shard (``genrl.distributed.zero_init``).

    python bench/bench_zero_memory.py                   # zero2 and zero3, mid model (~2 min on 2 cores)
    python bench/bench_zero_memory.py --quick           # CI: tiny model (2 launches of 2 processes)
    python bench/bench_zero_memory.py --configs multi_gpu,zero2,zero3 --num_processes 4
    python bench/bench_zero_memory.py --scale large     # 335 M parameters (~10 min, ~17 GB on 2 cores)
    python bench/bench_zero_memory.py --ds_bucket_size 20000000   # reduce/prefetch buckets of your choice
    python bench/bench_zero_memory.py --configs zero3 --zero3_init both   # partitioned build vs whole model first

Under ZeRO-3 the workers size DeepSpeed's buckets as the trainer does
(``genrl.distributed.zero3.size_zero3_buckets``, from the transformer's width); ``--ds_bucket_size``
overrides the reduce and prefetch buckets.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import common
from common import emit

FIELDS = (
    "build_peak_mb", "after_build_mb", "tensors_after_build_mb", "prepare_peak_mb", "after_prepare_mb", "tensors_after_prepare_mb", "rollout_peak_mb",
    "train_peak_mb", "tensors_after_train_mb", "rollout_s", "train_step_s", "ds_reduce_bucket_size",
    "ds_prefetch_bucket_size", "torch_threads", "device",
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--configs", type=str, default="zero2,zero3", help="accelerate_configs/<name>.yaml, comma-separated.")
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--family", type=str, default="sd3")
    parser.add_argument("--scale", choices=common.SCALE_NAMES, default=None, help="Default mid (tiny with --quick).")
    parser.add_argument("--batch_size", type=int, default=2, help="Samples per rank.")
    parser.add_argument("--num_inference_steps", type=int, default=None, help="Default 4 (2 with --quick).")
    parser.add_argument("--train_steps", type=int, default=None, help="PPO steps per rank, the first untimed (default 3).")
    parser.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], default=None)
    parser.add_argument("--ds_bucket_size", type=int, default=None,
                        help="Set DeepSpeed's reduce_bucket_size and stage3_prefetch_bucket_size (elements); default: the "
                             "trainer's width-based sizes under ZeRO-3, DeepSpeed's own under ZeRO-2.")
    parser.add_argument("--zero3_init", choices=["config", "true", "false", "both"], default="config",
                        help="ZeRO-3 configs: build the transformer partitioned (true), whole on every rank first (false), "
                             "both one after the other, or as the config file says (default).")
    parser.add_argument("--output_dir", type=str, default=None, help="Where ranks write their reports (default: a temp dir).")
    parser.add_argument("--timeout", type=int, default=900, help="Seconds per launch.")
    args = parser.parse_args(argv)
    args.scale = args.scale or ("tiny" if args.quick else "mid")
    args.num_inference_steps = args.num_inference_steps or (2 if args.quick else 4)
    args.train_steps = args.train_steps or (2 if args.quick else 3)
    return args


def main(args) -> list[dict]:
    common.setup(args)  # threads and the machine line; the workers pick their own device
    worker_args = [
        "--family", args.family, "--scale", args.scale, "--batch_size", str(args.batch_size),
        "--num_inference_steps", str(args.num_inference_steps), "--train_steps", str(args.train_steps),
    ]
    if args.mixed_precision:
        worker_args += ["--mixed_precision", args.mixed_precision]
    if args.ds_bucket_size:
        worker_args += ["--ds_bucket_size", str(args.ds_bucket_size)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_zero_") as tmp:
        root = args.output_dir or tmp
        model_path = common.save_bench_pipeline(args.family, args.scale, os.path.join(root, "model"))
        runs = []  # (config, launch arguments, report folder)
        for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
            flags = {"both": ["true", "false"], "config": [None]}.get(args.zero3_init, [args.zero3_init])
            for flag in flags if config.startswith("zero3") else [None]:
                launch_args = ["--zero3_init_flag", flag] if flag else []
                runs.append((config, launch_args, os.path.join(root, config + (f"-init-{flag}" if flag else ""))))
        for config, launch_args, folder in runs:
            reports = common.launch_worker(
                config, args.num_processes, [*worker_args, "--model_path", model_path], folder,
                threads_per_process=args.threads, timeout=args.timeout, launch_args=launch_args,
            )
            for report in reports:
                rows.append(emit({
                    "bench": "zero_memory", "config": config, "zero3_init": report["zero3_init"],
                    "zero_stage": report["zero_stage"],
                    "rank": report["rank"], "world_size": report["world_size"], "family": args.family,
                    "scale": args.scale, "params_m": report["params_m"], "model_fp32_mb": report["params_m"] * 1e6 * 4 / 2**20,
                    **{k: report.get(k) for k in FIELDS}, "mem_kind": report["mem_kind"],
                }))
    common.print_table(rows, [
        "config", "zero3_init", "rank", "params_m", "tensors_after_build_mb", "prepare_peak_mb", "after_prepare_mb", "tensors_after_prepare_mb", "rollout_peak_mb",
        "train_peak_mb", "tensors_after_train_mb", "rollout_s", "train_step_s",
    ], title=f"Per-rank memory (MiB, {rows[0]['mem_kind'] if rows else ''}) and times (s)")
    return rows


if __name__ == "__main__":
    main(parse_args())
