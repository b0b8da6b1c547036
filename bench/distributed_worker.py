"""One rank of a multi-process benchmark, started by bench_zero_memory.py and bench_scaling.py:

    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 \
        bench/distributed_worker.py --output_dir OUT --family sd3 --scale mid

The trainer's set-up and inner loop, without the data and reward plumbing: the Accelerator of
``genrl.distributed.launch`` (gloo on a CPU), DeepSpeed batch sizes from the arguments, frozen parts
built outside ZeRO-3, ``accelerator.prepare(transformer, AdamW)``; then one ``sample_rollout``
batch per rank (warm-up, then timed) and PPO steps (``bench_train_step.ppo_step``:
``step_log_prob`` + ``grpo_loss`` + ``accelerator.backward`` + clip + step) on its transitions. Each rank writes
``OUT/rank<r>.json`` with its times and memory per phase (MiB, see bench/common.py):

- ``build_peak_mb`` / ``after_build_mb``: peak while the model is built, held once it is, before
  prepare (on a GPU the transformer is still on the CPU then: only the frozen parts count; on a
  CPU, weights loaded from memory-mapped files count in RSS only once touched);
- ``tensors_after_build_mb``: memory held by tensors then (see below), mapped weights included;
- ``prepare_peak_mb`` / ``after_prepare_mb``: peak during ``accelerator.prepare``, held after it;
- ``rollout_peak_mb``, ``train_peak_mb``: peaks of the rollout and of the PPO steps (the first
  includes DeepSpeed's first-step allocations);
- ``tensors_after_prepare_mb``, ``tensors_after_train_mb``: memory held by tensors then (GPU:
  allocated; CPU: live tensor storages), i.e. the model states a rank keeps: parameters (or
  their shard), gradients, optimizer states, plus the frozen parts and the recorded rollout.

On a CPU every figure is the rank's RSS. With ``--model_path`` (a saved pipeline) the model loads
as the trainer loads it (``load_policy``): under ZeRO-3 with ``zero3_init_flag: true`` (the shipped
zero3 configs) already partitioned, so ``tensors_after_build_mb`` counts only this rank's shard;
otherwise (and without ``--model_path``: random weights built in the worker) each rank first builds
the whole model, and the sharding shows only from ``prepare`` on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from bench_train_step import ppo_step  # noqa: E402
from common import PeakMemory, current_memory_mb, group_prompts, synchronize, tensor_memory_mb  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="One rank of a multi-process genrl benchmark.")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--family", default="sd3")
    parser.add_argument("--scale", choices=common.SCALE_NAMES, default="tiny")
    parser.add_argument("--model_path", default=None,
                        help="A saved pipeline (common.save_bench_pipeline) to load as the trainer does; default: build "
                             "--family at --scale with random weights.")
    parser.add_argument("--batch_size", type=int, default=2, help="Samples per rank (one prompt group).")
    parser.add_argument("--num_inference_steps", type=int, default=4)
    parser.add_argument("--guidance_scale", type=float, default=4.5)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--num_frames", type=int, default=None)
    parser.add_argument("--train_steps", type=int, default=3, help="PPO steps; the first is the warm-up.")
    parser.add_argument("--rollout_repeats", type=int, default=1, help="Timed rollouts after the warm-up.")
    parser.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], default=None)
    parser.add_argument("--ds_bucket_size", type=int, default=None,
                        help="DeepSpeed reduce_bucket_size and stage3_prefetch_bucket_size in elements (default: the "
                             "trainer's, genrl.distributed.zero3.zero3_bucket_sizes, under ZeRO-3; DeepSpeed's under ZeRO-2).")
    return parser.parse_args(argv)


def main(args) -> dict:
    from genrl.distributed.launch import build_accelerator, configure_deepspeed
    from genrl.distributed.zero3 import size_zero3_buckets, zero_init_disabled
    from genrl.distributed.zero_init import zero3_init_requested
    from genrl.policies import load_policy
    from genrl.training.rollout import SampleBatch, SamplingConfig, sample_rollout

    accelerator = build_accelerator(output_dir=args.output_dir, mixed_precision=args.mixed_precision)
    configure_deepspeed(accelerator, micro_batch_size=args.batch_size, max_grad_norm=1.0)
    if args.ds_bucket_size and accelerator.state.deepspeed_plugin is not None:
        zero = accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("zero_optimization", {})
        zero["reduce_bucket_size"] = zero["stage3_prefetch_bucket_size"] = args.ds_bucket_size
    device = accelerator.device
    report = {
        "rank": accelerator.process_index, "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1], "zero_stage": _zero_stage(accelerator),
        "device": str(device), "mem_kind": common.memory_kind(device), "torch_threads": torch.get_num_threads(),
    }

    plugin = accelerator.state.deepspeed_plugin
    report["zero3_init"] = zero3_init_requested(plugin)
    with zero_init_disabled(), PeakMemory(device) as mem:  # as the trainer: frozen parts are never sharded
        if args.model_path:
            policy = load_policy(args.model_path, zero3_init_config=plugin.deepspeed_config if report["zero3_init"] else None)
        else:
            policy = common.build_bench_policy(args.family, args.scale)
        policy.to(device)
    transformer = policy.transformer.requires_grad_(True)
    report["params_m"] = common.count_parameters(transformer) / 1e6
    report["build_peak_mb"], report["after_build_mb"] = mem.peak_mb, current_memory_mb(device)
    report["tensors_after_build_mb"] = tensor_memory_mb(device)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-6)
    size_zero3_buckets(accelerator.state.deepspeed_plugin, transformer)  # as the trainer; --ds_bucket_size wins
    with PeakMemory(device) as mem:
        model, optimizer = accelerator.prepare(transformer, optimizer)
    report["prepare_peak_mb"], report["after_prepare_mb"] = mem.peak_mb, current_memory_mb(device)
    report["tensors_after_prepare_mb"] = tensor_memory_mb(device)
    if accelerator.state.deepspeed_plugin is not None:
        # DeepSpeed's bucket sizes (elements) set the size of buffers ZeRO allocates up front.
        report["ds_reduce_bucket_size"] = model.zero_reduce_bucket_size()
        if report["zero_stage"] == 3:
            report["ds_prefetch_bucket_size"] = model.zero_prefetch_bucket_size()

    height, width, frames = policy.resolve_size(args.height, args.width, args.num_frames)
    config = SamplingConfig(
        num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale,
        height=height, width=width, num_frames=frames,
    )
    prompts, indices = group_prompts(args.batch_size, args.batch_size)
    prompts = [f"{p} {accelerator.process_index}" for p in prompts]  # a different prompt per rank
    model.eval()

    def rollout():
        return sample_rollout(policy, model, SampleBatch(prompts, indices, seed=0, epoch=0),
                              config=config, device=device)

    with PeakMemory(device) as mem:
        recorded = rollout()
    report["rollout_peak_mb"] = mem.peak_mb
    times = []
    for _ in range(args.rollout_repeats):
        accelerator.wait_for_everyone()  # ranks start together: the slowest one sets the pace
        times.append(common.time_once(rollout, device))
    report["rollout_s"] = statistics.median(times) if times else None

    model.train()
    advantages = torch.randn(args.batch_size, generator=torch.Generator().manual_seed(1)).to(device)
    step_times = []
    with PeakMemory(device) as mem:
        for step in range(args.train_steps):
            j = step % recorded.num_steps
            synchronize(device)
            start = time.perf_counter()
            ppo_step(policy, model, optimizer, accelerator, recorded, advantages, j, config=config)
            step_times.append(time.perf_counter() - start)
    report["train_peak_mb"] = mem.peak_mb
    report["tensors_after_train_mb"] = tensor_memory_mb(device)
    report["train_step_s"] = statistics.median(step_times[1:]) if len(step_times) > 1 else None
    report.update(batch=args.batch_size, steps=args.num_inference_steps, height=height, width=width, frames=frames,
                  family=args.family, scale=args.scale)

    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return report


def _zero_stage(accelerator) -> int:
    plugin = accelerator.state.deepspeed_plugin
    return int(plugin.zero_stage) if plugin is not None else 0


if __name__ == "__main__":
    main(parse_args())
