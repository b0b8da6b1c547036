"""One training epoch's phases in a setting matched with Flow-GRPO's train_sd3.py.

The shipped toy model (genrl/assets/toy-shapes-t2i), one process, one torch thread: 16 train
prompts x 8 samples per epoch (rollout batch 32 x 4), micro batch 32 x gradient accumulation
2, 10 denoising steps, CFG 4.5, noise level 0.7 with every step stochastic, all 9 stochastic
steps trained, full fine-tuning, beta 0, GRPO with ``--filter_zero_advantage``, reward
``toy_geneval``, no evaluation. It runs ``train_genrl.py`` for ``--epochs`` epochs and reads the
phases each epoch logged (``logs/metrics.jsonl``):

- ``rollout_s``: the denoising loop (``time/rollout_s``), ``decode_s``: the VAE (``time/decode_s``),
- ``reward_s``: the wait for rewards still scoring after the last rollout (``time/reward_s``),
- ``train_s``: the update (``time/train_s``), and per trained sample,
- ``kept``: samples with a non-zero advantage; ``trained``: the samples the update ran on
  (``--filter_zero_advantage`` rounds the kept count up to a multiple of micro batch x accumulation),
- ``epoch_s``: phases 1-6 (``time/epoch_s``).

It prints one JSON record per epoch after the first (the first pays one-off costs) and their
medians. `bench_flow_grpo_epoch.py` runs Flow-GRPO's own script beside it.

    python bench/bench_epoch.py                               # 5 epochs, ~40 s each on one core
    python bench/bench_epoch.py --extra="--vae_decode_batch_size 32"
    python bench/bench_epoch.py --extra="--compile --vae_decode_batch_size 32"   # the CPU levers
    python bench/bench_epoch.py --quick                       # CI: 2 small epochs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import common
from common import emit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The matched setting, on top of the shipped model and its train prompts.
MATCHED = [
    "--group_size", "8", "--rollout_batch_size", "32", "--rollout_batches_per_epoch", "4",
    "--train_batch_size", "32", "--gradient_accumulation_steps", "2", "--num_inference_steps", "10",
    "--guidance_scale", "4.5", "--noise_level", "0.7", "--sde_window_size", "0", "--timestep_fraction", "1.0",
    "--objective", "grpo", "--beta", "0", "--filter_zero_advantage", "--reward_fn", "toy_geneval",
]
# CI: the same code path, 2 prompts x 4 samples per epoch, 4 steps.
QUICK = [
    "--group_size", "4", "--rollout_batch_size", "8", "--rollout_batches_per_epoch", "1",
    "--train_batch_size", "4", "--gradient_accumulation_steps", "1", "--num_inference_steps", "4",
    "--guidance_scale", "4.5", "--noise_level", "0.7", "--sde_window_size", "0", "--timestep_fraction", "1.0",
    "--objective", "grpo", "--beta", "0", "--filter_zero_advantage", "--reward_fn", "toy_geneval",
]
PHASES = {"rollout_s": "time/rollout_s", "decode_s": "time/decode_s", "reward_s": "time/reward_s",
          "train_s": "time/train_s", "epoch_s": "time/epoch_s"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI: 2 small epochs.")
    parser.add_argument("--epochs", type=int, default=None, help="Epochs to run (default 5; 2 with --quick).")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads of the training process.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra", type=str, default="", help="More train_genrl.py arguments, one string "
                        "(write --extra=--flag when it starts with a dash and has no space).")
    parser.add_argument("--output_dir", type=str, default=None, help="The run's folder (default: a temporary one).")
    args = parser.parse_args(argv)
    args.epochs = args.epochs or (2 if args.quick else 5)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is not reported.")
    return args


def epoch_phases(metrics_path: str, samples_per_epoch: int) -> list[dict]:
    """One record per logged epoch: the phases' seconds, the samples kept and trained, and the
    update's seconds per trained sample."""
    rows = []
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if "time/train_s" not in record:
                continue  # an evaluation-only line
            row = {name: record.get(key) for name, key in PHASES.items()}
            row["kept"] = round(record["train/informative_fraction"] * samples_per_epoch)
            row["trained"] = round(record["train/kept_fraction"] * samples_per_epoch)
            row["train_s_per_trained_sample"] = row["train_s"] / row["trained"] if row["trained"] else None
            row["step"] = record["step"]
            rows.append(row)
    return rows


def run_epochs(args, samples_per_epoch: int) -> list[dict]:
    """Run ``train_genrl.py`` in the setting for ``args.epochs`` epochs; the phases of the epochs
    after the first (the first pays one-off costs)."""
    from genrl.training.train_args import DEFAULT_MODEL, DEFAULT_TRAIN_PROMPTS

    setting = QUICK if args.quick else MATCHED
    out_dir = args.output_dir or tempfile.mkdtemp(prefix="bench-epoch-")
    command = [sys.executable, os.path.join(ROOT, "train_genrl.py"), "--pretrained_model_name_or_path", DEFAULT_MODEL,
               "--prompt_dataset", DEFAULT_TRAIN_PROMPTS, *setting, "--num_epochs", str(args.epochs),
               "--seed", str(args.seed), "--output_dir", out_dir, "--overwrite_output_dir", "--report_to", "none",
               *args.extra.split()]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    log_path = os.path.join(out_dir, "train.log")
    os.makedirs(out_dir, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"train_genrl.py exited {proc.returncode}; see {log_path}.")
    return epoch_phases(os.path.join(out_dir, "logs", "metrics.jsonl"), samples_per_epoch)[1:]


def samples_per_epoch(setting: list[str]) -> int:
    return int(setting[setting.index("--rollout_batch_size") + 1]) * int(
        setting[setting.index("--rollout_batches_per_epoch") + 1])


def main(args) -> list[dict]:
    common.print_machine("cpu", note=f"train_genrl.py, 1 process, {args.threads} torch thread(s)")
    per_epoch = samples_per_epoch(QUICK if args.quick else MATCHED)
    rows = run_epochs(args, per_epoch)
    settings = {"setting": "quick" if args.quick else "matched", "extra": args.extra, "samples_per_epoch": per_epoch}
    for epoch, row in enumerate(rows, start=2):
        emit({"bench": "epoch", **settings, "epoch": epoch, **row})
    keys = [*PHASES, "kept", "trained", "train_s_per_trained_sample"]
    median = {k: statistics.median(r[k] for r in rows if r[k] is not None) for k in keys
              if any(r[k] is not None for r in rows)}
    return [emit({"bench": "epoch", **settings, "epoch": "median", "epochs": len(rows), **median})]


if __name__ == "__main__":
    main(parse_args())
