"""Flow-GRPO's ``train_sd3.py`` and ``train_genrl.py`` side by side, one epoch of the
matched work at a time, on the CPU.

Both run the shipped toy model (genrl/assets/toy-shapes-t2i), one process, one torch thread,
fp32: 16 prompts x 8 samples per epoch (rollout batch 32 x 4), 10 steps, CFG 4.5, noise level
0.7 at every step, 9 trained timesteps, full fine-tuning, beta 0, zero-advantage samples left
out, reward ``toy_geneval``. Rounds alternate the runs (Flow-GRPO, then each genrl setting) so
that a machine's slow minutes fall on both sides, and the epochs after the first are reported,
with their medians and each genrl setting's ratio to Flow-GRPO.

Flow-GRPO is not vendored: point ``--flow_grpo_dir`` at a checkout of
https://github.com/yifan123/flow_grpo (the comparison used commit ac4c86e) and install what its
script imports (``pip install ml_collections absl-py wandb``; wandb runs disabled). Its files
are not edited; at run time this script only
- clamps the tokenizers' ``max_length`` to what the toy text encoders take (CLIP 12 tokens, T5
  1 token, where the script asks for 77 and 128; the 256-token prompt ids it decodes back to
  text stay as they are), so both sides condition on the same 13 text tokens;
- gives its ``multi_score`` genrl's ``toy_geneval`` scorer;
- times each epoch from one sampling start to the next and stops after ``--epochs``.
Its epoch therefore includes everything its loop does (text encoding, sampling, decoding,
rewards, statistics, training), as genrl's ``time/epoch_s`` does.

    python bench/bench_flow_grpo_epoch.py --flow_grpo_dir ../flow_grpo            # 2 rounds x 6 epochs
    python bench/bench_flow_grpo_epoch.py --flow_grpo_dir ../flow_grpo --genrl_settings "" "--compile"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import common
from common import emit, print_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_ENCODER_CALLS = (77, 128)  # the max_length Flow-GRPO's script passes to its CLIP and T5 tokenizers
ROLLOUT_BATCHES = 4  # per epoch, of 32 samples (4 prompts x 8) each


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flow_grpo_dir", required=True, help="A checkout of yifan123/flow_grpo.")
    parser.add_argument("--epochs", type=int, default=6, help="Epochs per run; the first is not reported.")
    parser.add_argument("--rounds", type=int, default=2, help="How many times each run goes, alternating.")
    parser.add_argument("--genrl_settings", nargs="*",
                        default=["", "--vae_decode_batch_size 32", "--compile --vae_decode_batch_size 32"],
                        help="genrl's runs: extra train_genrl.py flags, one string each ('' = the defaults).")
    parser.add_argument("--flow_grpo_worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is not reported.")
    if not os.path.isfile(os.path.join(args.flow_grpo_dir, "scripts", "train_sd3.py")):
        parser.error(f"{args.flow_grpo_dir} holds no scripts/train_sd3.py; point --flow_grpo_dir at a flow_grpo checkout.")
    return args


# ----- Flow-GRPO's side, in its own process ------------------------------------------------


def clamp_tokenizer(tokenizer) -> None:
    """Make ``tokenizer``'s calls with Flow-GRPO's text-encoder lengths pad to what the toy
    encoder takes (its ``model_max_length``); other lengths pass through."""
    base = type(tokenizer)

    class Clamped(base):
        def __call__(self, *args, **kwargs):
            if kwargs.get("max_length") in TEXT_ENCODER_CALLS:
                kwargs["max_length"] = min(kwargs["max_length"], self.model_max_length)
            return super().__call__(*args, **kwargs)

    tokenizer.__class__ = Clamped


def flow_grpo_config(flow_grpo_dir: str, data_dir: str, log_dir: str):
    """Flow-GRPO's base config set to the matched work."""
    spec = importlib.util.spec_from_file_location("flow_grpo_base_config", os.path.join(flow_grpo_dir, "config", "base.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from genrl.training.train_args import DEFAULT_MODEL

    c = module.get_config()
    c.pretrained.model, c.resolution = DEFAULT_MODEL, 32
    c.dataset, c.prompt_fn = data_dir, "geneval"
    c.mixed_precision, c.use_lora = "no", False
    c.eval_freq = c.save_freq = 10**9  # one evaluation at epoch 0 (one test prompt), no checkpoint
    c.sample.num_steps = c.sample.eval_num_steps = 10
    c.sample.guidance_scale, c.sample.noise_level = 4.5, 0.7
    c.sample.train_batch_size, c.sample.num_image_per_prompt, c.sample.num_batches_per_epoch = 32, 8, ROLLOUT_BATCHES
    c.sample.test_batch_size, c.sample.global_std = 1, False
    c.train.batch_size, c.train.gradient_accumulation_steps = 32, 2
    c.train.timestep_fraction = 0.9  # int(10 * 0.9) = 9 trained timesteps
    c.train.beta, c.train.ema, c.train.learning_rate = 0.0, False, 1e-5
    c.reward_fn = {"toy_geneval": 1.0}
    c.logdir = c.save_dir = log_dir
    return c


def run_flow_grpo_worker(args) -> None:
    sys.path[:0] = [args.flow_grpo_dir, os.path.join(args.flow_grpo_dir, "scripts")]
    import torch

    torch.set_num_threads(1)
    import flow_grpo.rewards

    from genrl.rewards.toy_geneval import toy_geneval_scores
    from genrl.training.train_args import DEFAULT_EVAL_PROMPTS, DEFAULT_TRAIN_PROMPTS

    def multi_score(device, score_dict):
        def score(images, prompts, metadata, only_strict=True):
            return {"avg": toy_geneval_scores(images, prompts)["overall"].numpy()}, {}
        return score

    flow_grpo.rewards.multi_score = multi_score
    import train_sd3

    load_pipeline = train_sd3.StableDiffusion3Pipeline.from_pretrained

    class Pipeline:  # what its main() loads the pipeline with: the real one, tokenizers clamped
        @staticmethod
        def from_pretrained(*a, **k):
            pipeline = load_pipeline(*a, **k)
            for tokenizer in (pipeline.tokenizer, pipeline.tokenizer_2, pipeline.tokenizer_3):
                clamp_tokenizer(tokenizer)
            return pipeline

    train_sd3.StableDiffusion3Pipeline = Pipeline

    starts, sample, batches = [], train_sd3.pipeline_with_logprob, ROLLOUT_BATCHES

    def timed_sample(*a, **k):
        if k.get("noise_level", 0) > 0:  # a training rollout (evaluation samples with noise 0)
            starts.append(time.perf_counter())
            if len(starts) > 1 and (len(starts) - 1) % batches == 0:
                epoch = (len(starts) - 1) // batches
                print(json.dumps({"flow_grpo_epoch": epoch, "epoch_s": starts[-1] - starts[-1 - batches]}), flush=True)
                if epoch >= args.epochs:
                    raise SystemExit(0)
        return sample(*a, **k)

    train_sd3.pipeline_with_logprob = timed_sample
    with tempfile.TemporaryDirectory(prefix="flow-grpo-") as tmp:
        data_dir = os.path.join(tmp, "data")
        os.makedirs(data_dir)
        for split, path, limit in (("train", DEFAULT_TRAIN_PROMPTS, None), ("test", DEFAULT_EVAL_PROMPTS, 1)):
            with open(path) as f:
                prompts = [line.strip() for line in f if line.strip()][:limit]
            with open(os.path.join(data_dir, f"{split}_metadata.jsonl"), "w") as f:
                f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
        train_sd3.FLAGS = argparse.Namespace(config=flow_grpo_config(args.flow_grpo_dir, data_dir, os.path.join(tmp, "logs")))
        train_sd3.main(None)


def flow_grpo_epochs(args) -> list[float]:
    """Seconds of each of Flow-GRPO's epochs after the first."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, os.path.abspath(__file__), "--flow_grpo_worker", "--flow_grpo_dir", args.flow_grpo_dir,
               "--epochs", str(args.epochs)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    epochs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"flow_grpo_epoch"')]
    if proc.returncode != 0 or len(epochs) < args.epochs:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise SystemExit(f"Flow-GRPO's train_sd3.py stopped after {len(epochs)} epochs (exit {proc.returncode}):\n{tail}")
    return [e["epoch_s"] for e in epochs[1:]]


def genrl_epochs(args, extra: str) -> list[float]:
    """Seconds of each of genrl's epochs after the first (``bench_epoch.py``'s matched run)."""
    import bench_epoch

    with tempfile.TemporaryDirectory(prefix="bench-genrl-") as out:
        bench_args = bench_epoch.parse_args(["--epochs", str(args.epochs), f"--extra={extra}", "--output_dir", out])
        rows = bench_epoch.run_epochs(bench_args, bench_epoch.samples_per_epoch(bench_epoch.MATCHED))
    return [row["epoch_s"] for row in rows]


def main(args) -> list[dict]:
    missing = [m for m in ("ml_collections", "absl", "wandb") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"Flow-GRPO's train_sd3.py imports {', '.join(missing)}: pip install ml_collections absl-py wandb.")
    commit = subprocess.run(["git", "-C", args.flow_grpo_dir, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    common.print_machine("cpu", note=f"1 process, 1 torch thread each; flow_grpo commit {commit}")
    runs = {"flow_grpo": None, **{f"genrl {extra}".strip(): extra for extra in args.genrl_settings}}
    seconds = {name: [] for name in runs}
    for round_ in range(1, args.rounds + 1):
        for name, extra in runs.items():
            epochs = flow_grpo_epochs(args) if extra is None else genrl_epochs(args, extra)
            seconds[name] += epochs
            emit({"bench": "flow_grpo_epoch", "run": name, "round": round_, "epoch_s": epochs})
    reference = statistics.median(seconds["flow_grpo"])
    rows = [emit({"bench": "flow_grpo_epoch", "run": name, "epochs": len(s), "median_epoch_s": statistics.median(s),
                  "min_epoch_s": min(s), "max_epoch_s": max(s), "vs_flow_grpo": statistics.median(s) / reference})
            for name, s in seconds.items()]
    print_table(rows, ["run", "epochs", "median_epoch_s", "min_epoch_s", "max_epoch_s", "vs_flow_grpo"],
                title="one matched epoch, medians of the epochs after the first")
    return rows


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.flow_grpo_worker:
        run_flow_grpo_worker(parsed)
    else:
        main(parsed)
