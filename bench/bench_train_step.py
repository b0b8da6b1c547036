"""PPO step time: the trainer's update on one micro batch against a bare forward + backward.

One PPO step is what train_genrl.py does per micro batch and trained timestep:
``genrl.training.rollout.step_log_prob`` (transformer forward with CFG as sampled, SDE log-prob of the
recorded transition) + ``genrl.math.grpo.grpo_loss`` + ``accelerator.backward`` + gradient clipping
+ ``optimizer.step()`` (AdamW) + ``zero_grad``, on transitions recorded by a real
``sample_rollout`` of the same model. The baseline replays the transformer call of that step
on exactly its inputs (captured with a forward pre-hook), backpropagates the mean square of
the output, and stops there: no log-prob, no loss, no optimizer. Ratios:

    overhead_ratio         = ppo_step_s / bare_fwd_bwd_s      (everything the trainer adds)
    fwd_bwd_overhead_ratio = ppo_fwd_bwd_s / bare_fwd_bwd_s   (log-prob + loss only)

optimizer_s is the clip + AdamW step + zero_grad part of ppo_step_s. Peak memory is measured
on the first (untimed) PPO step, whose AdamW step allocates the optimizer states.

    python bench/bench_train_step.py                 # wan, sd3, flux; small transformers (~30 s on 2 cores)
    python bench/bench_train_step.py --quick         # CI: tiny models, seconds
    python bench/bench_train_step.py --families wan --scale mid --device cuda --mixed_precision bf16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import common
from bench_rollout import FULL_SIZES, QUICK_SIZES
from common import PeakMemory, capture_forward_inputs, emit, group_prompts, synchronize, time_interleaved


def ppo_step(policy, model, optimizer, accelerator, rollout, advantages: torch.Tensor, j: int, *, config,
             clip_range: float = 1e-3, max_grad_norm: float = 1.0) -> float:
    """One PPO step of the trainer on all samples of ``rollout`` at recorded step ``j``:
    ``step_log_prob`` + ``grpo_loss`` + backward, then clip + AdamW + zero_grad. Returns the
    seconds of the forward and backward (the rest is the optimizer's)."""
    from genrl.math.grpo import grpo_loss
    from genrl.training.rollout import step_log_prob

    device = advantages.device
    start = time.perf_counter()
    samples = torch.arange(len(rollout.prompts))
    out = step_log_prob(policy, model, rollout.transitions(samples, torch.full_like(samples, j)), config=config)
    loss, _ = grpo_loss(out.log_prob, rollout.log_probs[:, j].to(out.log_prob.device), advantages, clip_range)
    accelerator.backward(loss)
    synchronize(device)
    fwd_bwd = time.perf_counter() - start
    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad()
    synchronize(device)
    return fwd_bwd


def measure_ppo_step(
    policy,
    model: torch.nn.Module,
    optimizer,
    accelerator,
    rollout,
    advantages: torch.Tensor,
    *,
    config,
    device: torch.device,
    repeats: int,
    clip_range: float = 1e-3,
    max_grad_norm: float = 1.0,
) -> dict:
    """Time PPO steps on all samples of ``rollout`` (cycling through its recorded timesteps)
    and the bare forward + backward on the same inputs; ``advantages`` is ``(B,)``.

    Returns ppo_step_s, ppo_fwd_bwd_s, optimizer_s, bare_fwd_bwd_s, the two overhead ratios,
    samples_per_s (B / ppo_step_s), peak_mem_mb, bare_peak_mem_mb, start_mem_mb.
    """
    from genrl.policies.base import unwrap_module

    if rollout.num_steps == 0:
        raise ValueError("The rollout recorded no stochastic step; use noise_level > 0 and at least 2 steps.")
    calls = {"n": 0}
    splits: dict[str, list[float]] = {"fwd_bwd": [], "opt": []}
    advantages = advantages.to(device)

    def timed_ppo_step():
        j = calls["n"] % rollout.num_steps
        calls["n"] += 1
        start = time.perf_counter()
        fwd_bwd = ppo_step(policy, model, optimizer, accelerator, rollout, advantages, j, config=config,
                           clip_range=clip_range, max_grad_norm=max_grad_norm)
        splits["fwd_bwd"].append(fwd_bwd)
        splits["opt"].append(time.perf_counter() - start - fwd_bwd)

    model.train()
    with PeakMemory(device) as mem, capture_forward_inputs(unwrap_module(model)) as captured:
        timed_ppo_step()
    args, kwargs = captured[0]

    # DeepSpeed's engine runs no backward without its optimizer step (its ZeRO gradient hooks
    # expect one): under DeepSpeed the bare figure includes that step.
    deepspeed = accelerator.state.deepspeed_plugin is not None

    def bare_fwd_bwd():
        out = model(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out.sample
        loss = out.float().square().mean()
        accelerator.backward(loss) if deepspeed else loss.backward()
        optimizer.zero_grad()

    with PeakMemory(device) as bare_mem:
        bare_fwd_bwd()
    for values in splits.values():
        values.clear()
    times = time_interleaved({"ppo": timed_ppo_step, "bare": bare_fwd_bwd}, device, repeats)
    fwd_bwd, opt = statistics.median(splits["fwd_bwd"]), statistics.median(splits["opt"])
    batch = rollout.latents.shape[0]
    return {
        "ppo_step_s": times["ppo"],
        "ppo_fwd_bwd_s": fwd_bwd,
        "optimizer_s": opt,
        "bare_fwd_bwd_s": times["bare"],
        "overhead_ratio": times["ppo"] / times["bare"],
        "fwd_bwd_overhead_ratio": fwd_bwd / times["bare"],
        "samples_per_s": batch / times["ppo"],
        "peak_mem_mb": mem.peak_mb,
        "bare_peak_mem_mb": bare_mem.peak_mb,
        "start_mem_mb": mem.start_mb,
    }


def prepare_training(policy, accelerator, learning_rate: float = 1e-6):
    """The transformer (fully trainable) and AdamW, prepared by ``accelerator`` as the trainer does."""
    transformer = policy.transformer.requires_grad_(True)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=learning_rate)
    return accelerator.prepare(transformer, optimizer)


def record_rollout(policy, model, *, batch_size: int, group_size: int, config, device: torch.device, seed: int = 0):
    """A real ``sample_rollout`` of ``model``: the transitions the PPO step trains on."""
    from genrl.training.rollout import SampleBatch, sample_rollout

    prompts, indices = group_prompts(batch_size, group_size)
    model.eval()
    return sample_rollout(policy, model, SampleBatch(prompts, indices, seed=seed, epoch=0),
                          config=config, device=device)


def build_single_process_accelerator(device: torch.device, mixed_precision: str):
    """One process, as ``accelerate launch`` (or plain python) gives train_genrl.py on one device."""
    from accelerate import Accelerator

    return Accelerator(cpu=device.type == "cpu", mixed_precision=mixed_precision)


def build_zero2_bf16_accelerator(micro_batch_size: int, max_grad_norm: float = 1.0):
    """One process under DeepSpeed ZeRO-2 in its bf16 mode, as ``accelerate launch --config_file
    accelerate_configs/zero2.yaml --num_processes 1 --mixed_precision bf16`` gives train_genrl.py:
    bf16 weights in the forward and backward, fp32 master weights and Adam states in DeepSpeed's
    optimizer. The launcher's environment is set here (variables already set are kept)."""
    import os
    import tempfile

    from genrl.distributed.launch import build_accelerator, configure_deepspeed
    launcher_env = {
        "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false", "ACCELERATE_GRADIENT_CLIPPING": str(max_grad_norm),
        "ACCELERATE_MIXED_PRECISION": "bf16", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(common.free_port()),
    }
    for name, value in launcher_env.items():
        os.environ.setdefault(name, value)
    accelerator = build_accelerator(output_dir=tempfile.mkdtemp(prefix="genrl-bench-"), mixed_precision="bf16")
    configure_deepspeed(accelerator, micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm)
    return accelerator


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--families", type=str, default="wan,sd3,flux",
                        help="Comma-separated, of wan, sd3, flux, zimage, flux2-klein, qwenimage, flux2.")
    parser.add_argument("--scale", choices=common.SCALE_NAMES, default=None, help="Transformer size (default small; tiny with --quick).")
    parser.add_argument("--batch_size", type=int, default=None, help="Samples per micro batch (default 4; 2 with --quick).")
    parser.add_argument("--num_inference_steps", type=int, default=None, help="Rollout steps (default 6; 3 with --quick).")
    parser.add_argument("--guidance_scale", type=float, default=4.5)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--num_frames", type=int, default=None)
    parser.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], default="no")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    args = parser.parse_args(argv)
    args.scale = args.scale or ("tiny" if args.quick else "small")
    args.batch_size = args.batch_size or (2 if args.quick else 4)
    args.num_inference_steps = args.num_inference_steps or (3 if args.quick else 6)
    args.repeats = args.repeats or (2 if args.quick else 5)
    return args


def main(args) -> list[dict]:
    from genrl.training.rollout import SamplingConfig

    device = common.setup(args)
    accelerator = build_single_process_accelerator(device, args.mixed_precision)
    rows = []
    for family in [f.strip() for f in args.families.split(",") if f.strip()]:
        policy = common.build_bench_policy(family, args.scale).to(device)
        if args.gradient_checkpointing:
            policy.transformer.enable_gradient_checkpointing()
        model, optimizer = prepare_training(policy, accelerator)
        h, w, f = (QUICK_SIZES if args.quick else FULL_SIZES)[family]
        height, width, frames = policy.resolve_size(args.height or h, args.width or w, args.num_frames or f)
        config = SamplingConfig(
            num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale,
            height=height, width=width, num_frames=frames,
        )
        rollout = record_rollout(policy, model, batch_size=args.batch_size, group_size=args.batch_size, config=config, device=device)
        advantages = torch.randn(args.batch_size, generator=torch.Generator().manual_seed(0))
        figures = measure_ppo_step(
            policy, model, optimizer, accelerator, rollout, advantages, config=config, device=device, repeats=args.repeats,
        )
        rows.append(emit({
            "bench": "train_step", "family": family, "scale": args.scale,
            "params_m": common.count_parameters(model) / 1e6, "mixed_precision": args.mixed_precision,
            "gradient_checkpointing": args.gradient_checkpointing, "batch": args.batch_size,
            "height": height, "width": width, "frames": frames, "guidance_scale": args.guidance_scale,
            "forward_batch": 2 * args.batch_size if policy.use_cfg(args.guidance_scale) else args.batch_size,
            **figures, "mem_kind": common.memory_kind(device), "repeats": args.repeats,
        }))
        accelerator.free_memory()
        del policy, model, optimizer, rollout
    common.print_table(rows, [
        "family", "params_m", "batch", "height", "width", "frames", "ppo_step_s", "ppo_fwd_bwd_s", "optimizer_s",
        "bare_fwd_bwd_s", "overhead_ratio", "fwd_bwd_overhead_ratio", "samples_per_s", "peak_mem_mb",
    ], title="PPO step (median seconds per micro batch, one trained timestep)")
    return rows


if __name__ == "__main__":
    main(parse_args())
