"""Wan2.1-T2V-1.3B on one H200: rollout throughput, PPO step time, peak memory and MFU.

The transformer is the real-size Wan2.1-T2V-1.3B architecture with random weights (no
download), built from the published config values: 30 layers, width 1536 (12 heads x 128),
FFN 8960, in/out channels 16, patch (1, 2, 2), text_dim 4096, freq_dim 256, qk_norm
rms_norm_across_heads, cross_attn_norm, eps 1e-6, rope_max_seq_len 1024 (~1.42 B parameters).
Sampling: 33 frames at 240x416 (latents (16, 9, 30, 52): 9 x 15 x 26 = 3510 tokens), 20 steps,
one prompt group of 4, CFG 4.5 (one transformer call on the [uncond; cond] batch of 8 per step),
flow-SDE noise 0.7 at every step. Training: one PPO micro batch of the group (the trainer's
update: step_log_prob + grpo_loss + backward + clip + AdamW), fp32 master weights under bf16
autocast (``--mixed_precision bf16`` of train_genrl.py without DeepSpeed); if it runs out of
memory it is retried with gradient checkpointing (``gradient_checkpointing`` says which ran).

Measured: the transformer's forwards and backwards at full size, genrl's rollout loop
(``sample_rollout``: SDE step, log-probs, per-sample generators, trajectory recording, decode to
the CPU), the PPO step (``step_log_prob`` + ``grpo_loss`` + backward + AdamW), peak memory
(``torch.cuda.max_memory_allocated`` per phase, model and optimizer included) and MFU.
Not measured: the UMT5 text encoder (random prompt embeddings of the real shape (B, 512, 4096)
stand in for it; encode_s is the time to draw them), the real Wan VAE (a tiny random
AutoencoderKLWan with the same 4x/8x compression and 16 latent channels decodes instead;
decode_s is reported apart and is far below the real VAE's cost), reward models, EMA,
checkpoints, multi-GPU communication and DeepSpeed.

FLOPs are counted analytically (``wan_forward_flops``; matmuls and attention, 2 FLOPs per
multiply-add; norms, activations, RoPE and the SDE step are left out). For one sequence of s
video tokens, s_t text tokens, width d, FFN width f, L layers, c channels, patch volume p:

    F = L [ s (12 d^2 + 4 d f + 4 s d + 4 s_t d) + 4 s_t d^2 ]       transformer blocks
        + 2 s d c p (in) + 2 s d c p (out)                            patch embedding, output projection
        + 2 s_t (d_text d + d^2) + 2 (f_freq d + d^2 + 6 d^2)         text and time embedders

(12 d^2: self-attention q, k, v, o (8 d^2) and cross-attention q, o (4 d^2) per video token;
4 s_t d^2: cross-attention k, v over the text; 4 s d and 4 s_t d: scores and weighted sums.)
Rollout FLOPs = steps x F x forward batch (2B with CFG); a PPO step = 3 F x forward batch
(backward = 2 forwards; the recomputation of gradient checkpointing is not counted, as usual
for MFU). MFU = FLOPs / seconds / peak, peak = 790 TFLOP/s (H200 dense bf16, --peak_tflops).

``--bf16_weights`` trains bf16 weights as ``accelerate launch --config_file
accelerate_configs/zero2.yaml --num_processes 1 --mixed_precision bf16`` does: DeepSpeed ZeRO-2's
bf16 mode in this one process, fp32 master weights and Adam states in its optimizer (whose step
DeepSpeed runs inside the backward, so there the bare forward+backward includes it).

``--profile`` adds torch.profiler tables of one rollout and one PPO step (the ops with the
most self time on the device, or on the CPU without one), printed and emitted as ``profile``
records. ``--fit_table`` adds, for micro batches 1, 2, 4, ... up to ``--train_batch_size`` with
and without gradient checkpointing, the PPO step's peak memory and whether it fits a card of
``--fit_gib`` GiB (80: an H100/A100-80GB); an out-of-memory combination is recorded as such. CFG
runs as one batch of [uncond; cond] (as the trainer does), so the forward batch is 2x the
micro batch.

    python bench/bench_h200_wan.py                   # on one H200 (well under 8 minutes)
    python bench/bench_h200_wan.py --profile --fit_table
    python bench/bench_h200_wan.py --quick           # CI on a CPU: a tiny Wan of the same layout, seconds
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import common
from bench_rollout import measure_rollout
from bench_train_step import build_single_process_accelerator, build_zero2_bf16_accelerator, measure_ppo_step, ppo_step
from common import PeakMemory, emit, synchronize

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json values.
WAN_1_3B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)
# The same layout, tiny: for --quick (CI on a CPU).
WAN_TINY = dict(WAN_1_3B, num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=32, ffn_dim=32,
                num_layers=2, rope_max_seq_len=32)
FULL = dict(height=240, width=416, num_frames=33, steps=20, group_size=4, text_len=512)
QUICK = dict(height=32, width=32, num_frames=5, steps=2, group_size=2, text_len=8)


def wan_forward_flops(config: dict, latent_shape: tuple[int, int, int, int], text_len: int, batch: int = 1) -> int:
    """FLOPs of one ``WanTransformer3DModel`` forward on ``batch`` sequences of latents
    ``(C, F, H, W)`` and ``text_len`` text tokens (formula in the module docstring)."""
    p_t, p_h, p_w = config["patch_size"]
    channels, frames, height, width = latent_shape
    d = config["num_attention_heads"] * config["attention_head_dim"]
    f, layers, st = config["ffn_dim"], config["num_layers"], text_len
    s = (frames // p_t) * (height // p_h) * (width // p_w)
    p = p_t * p_h * p_w
    blocks = layers * (s * (12 * d * d + 4 * d * f + 4 * s * d + 4 * st * d) + 4 * st * d * d)
    patches = 2 * s * d * channels * p + 2 * s * d * config["out_channels"] * p
    embedders = 2 * st * (config["text_dim"] * d + d * d) + 2 * (config["freq_dim"] * d + d * d + 6 * d * d)
    return batch * (blocks + patches + embedders)


def build_policy(config: dict, text_len: int, device: torch.device, weight_dtype: torch.dtype):
    """A ``WanPolicy`` over a WanPipeline with the given transformer (random init, float32, built
    on ``device``), a tiny random 16-channel Wan VAE and random prompt embeddings."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from genrl.policies import WanPolicy

    class RandomTextWanPolicy(WanPolicy):
        """Prompt embeddings are random ``(B, text_len, text_dim)`` tensors, the shape UMT5 gives."""

        def encode_prompts(self, prompts, device, guidance_scale, negative_prompt=""):
            generator = torch.Generator(device).manual_seed(0)
            shape = (len(prompts), text_len, self.transformer.config.text_dim)
            draw = lambda: torch.randn(shape, generator=generator, device=device, dtype=weight_dtype)  # noqa: E731
            embeds = {"prompt_embeds": draw()}
            if self.use_cfg(guidance_scale):
                embeds["negative_prompt_embeds"] = draw()
            return embeds

    torch.manual_seed(0)
    with torch.device(device):
        transformer = WanTransformer3DModel(**config)
    vae = AutoencoderKLWan(
        base_dim=4, z_dim=config["in_channels"], dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    pipeline = WanPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # Wan 2.1's flow shift at 480p
    )
    return RandomTextWanPolicy(pipeline).to(device, weight_dtype)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--num_frames", type=int, default=None)
    parser.add_argument("--num_inference_steps", type=int, default=None)
    parser.add_argument("--group_size", type=int, default=None, help="Samples in the rollout batch (one prompt group).")
    parser.add_argument("--train_batch_size", type=int, default=None, help="PPO micro batch (default: the group).")
    parser.add_argument("--guidance_scale", type=float, default=4.5)
    parser.add_argument("--noise_level", type=float, default=0.7)
    parser.add_argument("--text_len", type=int, default=None, help="Text tokens (512 as WanPipeline).")
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], default=None, help="Default bf16 on CUDA, no on a CPU.")
    parser.add_argument("--gradient_checkpointing", choices=["auto", "on", "off"], default="auto",
                        help="auto: without, retried with it on out-of-memory.")
    parser.add_argument("--train_repeats", type=int, default=None, help="Timed PPO steps (default 3; 1 with --quick).")
    parser.add_argument("--num_layers", type=int, default=None,
                        help="Override the number of transformer blocks (e.g. 2 for a smoke test of the real width on a CPU).")
    parser.add_argument("--peak_tflops", type=float, default=790.0, help="Peak dense bf16 TFLOP/s of the device (MFU).")
    parser.add_argument("--compile", action="store_true",
                        help="Regional torch.compile of the transformer's blocks (train_genrl.py --compile); the "
                             "timed repeats follow one untimed warm-up that compiles.")
    parser.add_argument("--bf16_weights", action="store_true",
                        help="Weights in bf16 with fp32 master weights and Adam states: DeepSpeed ZeRO-2's bf16 mode in "
                             "this one process, as `accelerate launch --config_file accelerate_configs/zero2.yaml "
                             "--num_processes 1 --mixed_precision bf16 train_genrl.py` trains.")
    parser.add_argument("--attention_backend", type=str, default=None,
                        help="diffusers attention backend (train_genrl.py --attention_backend), e.g. _native_cudnn, flash.")
    parser.add_argument("--profile", action="store_true",
                        help="Print torch.profiler tables of one rollout and one PPO step (top ops by self time).")
    parser.add_argument("--profile_rows", type=int, default=15, help="Ops per profiler table.")
    parser.add_argument("--fit_table", action="store_true",
                        help="Peak memory of the PPO step for each micro batch (1, 2, 4, ...) with and without "
                             "gradient checkpointing, against a card of --fit_gib GiB.")
    parser.add_argument("--fit_gib", type=float, default=80.0, help="The card the fit table checks against (GiB).")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    args.height = args.height or sizes["height"]
    args.width = args.width or sizes["width"]
    args.num_frames = args.num_frames or sizes["num_frames"]
    args.num_inference_steps = args.num_inference_steps or sizes["steps"]
    args.group_size = args.group_size or sizes["group_size"]
    args.train_batch_size = args.train_batch_size or args.group_size
    args.text_len = args.text_len or sizes["text_len"]
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.train_repeats = args.train_repeats or (1 if args.quick else 3)
    if args.train_batch_size > args.group_size:
        parser.error(f"--train_batch_size {args.train_batch_size} exceeds the rollout batch {args.group_size}.")
    return args


def train_figures(policy, model, optimizer, accelerator, recorded, config, device, args) -> dict:
    """PPO-step figures on the first ``--train_batch_size`` samples of ``recorded``; with
    ``--gradient_checkpointing auto`` an out-of-memory error is followed by a retry with it."""
    from genrl.training.rollout import index_rollout

    batch = index_rollout(recorded, list(range(args.train_batch_size)))
    advantages = torch.randn(args.train_batch_size, generator=torch.Generator().manual_seed(0))

    def run(checkpointing: bool) -> dict:
        if checkpointing:
            policy.transformer.enable_gradient_checkpointing()
        figures = measure_ppo_step(
            policy, model, optimizer, accelerator, batch, advantages, config=config, device=device,
            repeats=args.train_repeats,
        )
        return {**figures, "gradient_checkpointing": checkpointing}

    try:
        return run(args.gradient_checkpointing == "on")
    except torch.cuda.OutOfMemoryError:
        if args.gradient_checkpointing != "auto":
            raise
    # Out of the except block, the traceback no longer pins the activations: free them, retry.
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    emit({"bench": "h200_wan", "phase": "note", "note": "out of memory without gradient checkpointing; retried with it"})
    return run(True)


def profile_ops(fn, device: torch.device, rows: int) -> tuple[str, list[dict]]:
    """torch.profiler over one call of ``fn``: the printed table and the top ``rows`` ops by self
    time (on the device where there is one, else the CPU), each with its share of the total."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1.0
    top = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:rows]
    ops = [{"op": e.key, "self_ms": getattr(e, attr) / 1e3, "share": getattr(e, attr) / total, "calls": e.count}
           for e in top]
    table = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows)
    return table, ops


def micro_batches(largest: int) -> list[int]:
    """1, 2, 4, ... below ``largest``, then ``largest``."""
    sizes, size = [], 1
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


def fit_table(policy, model, optimizer, accelerator, recorded, config, device, args) -> list[dict]:
    """The PPO step's peak memory for each micro batch, with and without gradient checkpointing."""
    from genrl.training.rollout import index_rollout

    transformer = policy.transformer
    rows = []
    for checkpointing in (False, True):
        if checkpointing:
            transformer.enable_gradient_checkpointing()
        else:
            transformer.disable_gradient_checkpointing()
        for batch in micro_batches(args.train_batch_size):
            micro = index_rollout(recorded, list(range(batch)))
            advantages = torch.randn(batch, generator=torch.Generator().manual_seed(0)).to(device)
            peak_mb, outcome = float("nan"), "ran"
            try:
                with PeakMemory(device) as mem:
                    ppo_step(policy, model, optimizer, accelerator, micro, advantages, 0, config=config)
                peak_mb = mem.peak_mb
            except torch.cuda.OutOfMemoryError:
                outcome = "out of memory"
            if outcome != "ran":  # out of the except block the traceback no longer pins the activations
                optimizer.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
            fits = outcome == "ran" and peak_mb / 1024 <= args.fit_gib
            rows.append(emit({
                "bench": "h200_wan", "phase": "fit", "micro_batch": batch, "forward_batch": batch * (2 if policy.use_cfg(
                    args.guidance_scale) else 1), "cfg": "one batch", "gradient_checkpointing": checkpointing,
                "outcome": outcome, "peak_mem_mb": peak_mb, "fit_gib": args.fit_gib, "fits": fits,
            }))
    transformer.disable_gradient_checkpointing()
    return rows


def main(args) -> list[dict]:
    from genrl.training.rollout import SamplingConfig

    device = common.setup(args)
    if device.type != "cuda" and not args.quick and not args.num_layers:
        raise SystemExit(
            "bench_h200_wan.py: the full Wan2.1-1.3B run needs a GPU (hours on a CPU); use --quick, or"
            " --num_layers 1 for a smoke test of the real width and shapes."
        )
    mixed_precision = args.mixed_precision or ("bf16" if device.type == "cuda" or args.bf16_weights else "no")
    if args.bf16_weights and mixed_precision != "bf16":
        raise SystemExit("bench_h200_wan.py: --bf16_weights is DeepSpeed's bf16 mode; it takes --mixed_precision bf16.")
    weight_dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    config = dict(WAN_TINY if args.quick else WAN_1_3B)
    if args.num_layers:
        config["num_layers"] = args.num_layers

    start = time.perf_counter()
    policy = build_policy(config, args.text_len, device, weight_dtype)
    if args.bf16_weights:
        accelerator = build_zero2_bf16_accelerator(args.train_batch_size)
    else:
        accelerator = build_single_process_accelerator(device, mixed_precision)
    transformer = policy.transformer.requires_grad_(True)
    if args.attention_backend:  # the same helpers as train_genrl.py's flags
        from genrl.training.acceleration import probe_attention_backend, set_attention_backend

        probe_attention_backend(args.attention_backend, device, weight_dtype)
        set_attention_backend([transformer], args.attention_backend, device=device, dtype=weight_dtype)
    if args.compile:
        from genrl.training.acceleration import compile_repeated_blocks

        compile_repeated_blocks(transformer, fullgraph=True)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-6, fused=True if device.type == "cuda" else None)  # as the trainer
    model, optimizer = accelerator.prepare(transformer, optimizer)
    build_s = time.perf_counter() - start

    sampling = SamplingConfig(
        num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale, noise_level=args.noise_level,
        height=args.height, width=args.width, num_frames=args.num_frames,
    )
    latent_shape = policy.latent_shape(args.height, args.width, args.num_frames)
    cfg = 2 if policy.use_cfg(args.guidance_scale) else 1
    flops_per_sequence = wan_forward_flops(config, latent_shape, args.text_len)
    peak = args.peak_tflops * 1e12
    common_fields = {
        "bench": "h200_wan", "num_layers": config["num_layers"], "params_m": common.count_parameters(model) / 1e6, "mixed_precision": mixed_precision,
        "height": args.height, "width": args.width, "frames": args.num_frames, "latent_shape": list(latent_shape),
        "text_len": args.text_len, "steps": args.num_inference_steps, "guidance_scale": args.guidance_scale,
        "forward_flops_per_sequence": flops_per_sequence, "peak_tflops": args.peak_tflops,
        "mem_kind": common.memory_kind(device), "compile": args.compile,
        "attention_backend": args.attention_backend or "default", "weights": str(next(model.parameters()).dtype).removeprefix("torch."),
    }

    model.eval()
    rollout = measure_rollout(
        policy, model, batch_size=args.group_size, group_size=args.group_size, config=sampling, device=device,
        repeats=args.repeats,
    )
    rollout_flops = args.num_inference_steps * flops_per_sequence * cfg * args.group_size
    rows = [emit({
        **common_fields, "phase": "rollout", "build_s": build_s, "batch": args.group_size,
        "forward_batch": cfg * args.group_size, **rollout, "rollout_tflops": rollout_flops / 1e12,
        "mfu": rollout_flops / rollout["rollout_s"] / peak,
        "bare_forwards_mfu": rollout_flops / rollout["bare_forwards_s"] / peak, "repeats": args.repeats,
    })]

    from bench_train_step import record_rollout

    recorded = record_rollout(policy, model, batch_size=args.group_size, group_size=args.group_size, config=sampling, device=device)
    train = train_figures(policy, model, optimizer, accelerator, recorded, sampling, device, args)
    step_flops = 3 * flops_per_sequence * cfg * args.train_batch_size
    rows.append(emit({
        **common_fields, "phase": "train", "batch": args.train_batch_size, "forward_batch": cfg * args.train_batch_size,
        **train, "step_tflops": step_flops / 1e12, "mfu": step_flops / train["ppo_step_s"] / peak,
        "bare_fwd_bwd_mfu": step_flops / train["bare_fwd_bwd_s"] / peak, "repeats": args.train_repeats,
    }))
    common.print_table(rows, ["phase", "weights", "compile", "attention_backend", "params_m", "batch", "forward_batch", "rollout_s", "samples_per_s", "frames_per_s",
                              "overhead_ratio", "ppo_step_s", "bare_fwd_bwd_s", "gradient_checkpointing", "mfu",
                              "peak_mem_mb"], title="Wan2.1-T2V-1.3B architecture, random weights")
    if args.profile:
        from genrl.training.rollout import SampleBatch, index_rollout, sample_rollout

        prompts, indices = common.group_prompts(args.group_size, args.group_size)
        batch = index_rollout(recorded, list(range(args.train_batch_size)))
        advantages = torch.randn(args.train_batch_size, generator=torch.Generator().manual_seed(0)).to(device)

        def rollout_once():
            model.eval()
            sample_rollout(policy, model, SampleBatch(prompts, indices, seed=0, epoch=0),
                           config=sampling, device=device)

        def train_once():
            model.train()
            ppo_step(policy, model, optimizer, accelerator, batch, advantages, 0, config=sampling)

        for phase, fn in (("rollout", rollout_once), ("train", train_once)):
            table, ops = profile_ops(fn, device, args.profile_rows)
            print(f"\ntorch.profiler, one {'rollout' if phase == 'rollout' else 'PPO step'} "
                  f"(top {args.profile_rows} ops by self {'device' if device.type == 'cuda' else 'CPU'} time):\n{table}")
            rows.append(emit({**common_fields, "phase": "profile", "profiled": phase, "ops": ops}))
    if args.fit_table:
        fits = fit_table(policy, model, optimizer, accelerator, recorded, sampling, device, args)
        common.print_table(fits, ["micro_batch", "forward_batch", "gradient_checkpointing", "outcome", "peak_mem_mb", "fits"],
                           title=f"PPO step: fits a {args.fit_gib:g} GiB card?")
        rows += fits
    return rows


if __name__ == "__main__":
    main(parse_args())
