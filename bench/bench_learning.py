"""How fast and how steadily each objective learns: held-out toy_geneval against optimizer
steps and wall time, for several seeds, beside two ceilings.

Each (objective, seed) is one real ``train_genrl.py`` run (one process) on the no-argument
run's settings, with ``--objective`` (and what the no-argument run changes with it: its
sampler and learning rate, ``objective_values``) and ``--seed`` changed (the run seed: prompts, noise and
trained timesteps; evaluation always uses the same prompts and noise). Runs go ``--jobs`` at
a time, each with cores / jobs torch threads. The figures come from each run's
``logs/metrics.jsonl`` (``eval/toy_geneval_mean`` and ``time/elapsed_s``, wall time since the
launch, set-up and evaluations included). Each run's final weights are also evaluated from
``--final_noise_draws`` noises by ``eval_genrl.py --samples_per_prompt`` (``final_noise_mean``,
``final_noise_spread``, ``noise_sd``): at fixed weights one evaluation moves by about 0.02-0.03
with the noise alone, as much as the seeds differ, so the mean over draws is the figure to
compare runs by.

Every model as a user meets it: the base and each run's final weights are scored on the runs'
held-out prompts and noises (``--final_noise_draws`` of them) at the trained evaluation's
settings, at each guidance scale of ``--guidance_sweep`` (the evaluation's step count; the
best is reported with its scale) and at the pipeline's own defaults (``pipe(prompt)``'s steps and
guidance, ``genrl.evaluation.pipeline_defaults``: 28 steps at guidance 7 for SD3). A model trained unguided
need not stay good under guidance, and a base can be far better guided than unguided, so the
summary leads with the base at its best guidance against the trained model at its own settings,
the strict score (every check of a prompt passed) beside the mean.

Ceilings, on the same held-out prompts, evaluation settings and noise:
- best-of-K: the base model's mean over prompts of the best of K samples (K = group size,
  evaluation seeds 0..K-1): what picking the best sample of a group reaches without training;
- supervised: the toy model fine-tuned by flow matching on rendered ground-truth scenes of the
  train prompts (``scripts/pretrain_toy_model.py``'s loop, ``--supervised_steps``), scored every
  ``--supervised_eval_every`` steps at the runs' guidance (the curve shows whether the fine-tune
  reached its plateau); the ceiling is the best of the guidance sweep of its final weights:
  what the architecture reaches when it is shown the right answers. Its steps to 0.6 and 0.8
  (64 scenes a step, as an RL step's 64 samples) are the pace that labels for every sample set;
- supervised at the RL run's budget: the same fine-tune for as many scenes as the RL run
  sampled images (its epochs x samples per epoch, ``rl_samples``), swept the same way.

``--setting video`` checks that video learns too: the tiny Wan (5 frames of 32x32, random
transformer) with a VAE first trained on toy clips (``genrl.testing.toy_video``, so that what
the transformer samples decides what the clips look like), trained on ``temporal_smoothness``
over the toy train prompts and evaluated on the 16 first held-out ones (no ceilings; instead, how
smooth decodes of noise, still and mean latents are: the room the VAE leaves the policy).

    python bench/bench_learning.py                                # grpo, nft, awm x seeds 0 1 2 (~2 h on 2 cores)
    python bench/bench_learning.py --objectives nft --seeds 0 1 2 --max_train_steps 60
    python bench/bench_learning.py --setting video                # tiny Wan, temporal smoothness (~20 min)
    python bench/bench_learning.py --objectives grpo --extra=--grpo_guard   # an option of one objective
    python bench/bench_learning.py --objectives nft --base_model /tmp/toy6k --guidance_scale 1   # another base, CFG-free
    python bench/bench_learning.py --objectives nft --guidance_sweep 1 4.5      # a smaller guidance sweep
    python bench/bench_learning.py --quick                        # CI: tiny random model, 2 steps, one seed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import common
from common import ROOT, emit

OBJECTIVES = ("grpo", "nft", "awm")


def as_flags(values: dict) -> list[str]:
    """train_genrl.py flags for ``{flag name: value}``: True -> ``--name``, False -> ``--no-name``,
    a list -> its items after the flag."""
    flags = []
    for key, value in values.items():
        if isinstance(value, bool):
            flags.append(f"--{key}" if value else f"--no-{key}")
        else:
            flags += [f"--{key}", *(str(v) for v in (value if isinstance(value, list) else [value]))]
    return flags


def objective_values(objective: str) -> dict:
    """What the toy run's config file for ``objective`` (``recipes/toy_<objective>.yaml``) sets
    differently from another objective's: the sampler each objective needs, its learning rate."""
    from genrl.training import train_args
    runs = {name: train_args.toy_run(name) for name in OBJECTIVES}
    return {k: v for k, v in runs[objective].items() if any(run.get(k) != v for run in runs.values())}


def shared_values() -> dict:
    """What the toy run's config files of every objective set alike."""
    from genrl.training import train_args
    values = train_args.toy_run()
    return {k: v for k, v in values.items() if all(k not in objective_values(name) for name in OBJECTIVES)}


def objective_args(objective: str) -> list[str]:
    """``--objective`` and what the toy run changes with it (``objective_values``), as flags, so
    that the tiny-model settings sample each objective as the toy run does; a setting's own
    arguments come after and win."""
    return ["--objective", objective, *as_flags({k: v for k, v in objective_values(objective).items() if k != "objective"})]


def toy_run_args(model: str) -> list[str]:
    """The toy run's shared settings (``shared_values``) spelled out as flags, with ``model`` as
    the base: naming a model leaves the toy run's config file, so everything else it sets is
    passed explicitly and the run differs from the toy one only in its weights. The objective's
    own values are left out: ``objective_args`` comes first in a run and brings them."""
    return as_flags({**shared_values(), "pretrained_model_name_or_path": model})


THRESHOLDS = (0.6, 0.8)
SETTINGS = ("toy", "video", "quick")
# The held-out score each setting reports.
SCORES = {"toy": "toy_geneval", "video": "temporal_smoothness", "quick": "toy_geneval"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI: a tiny random model, 2 steps, one seed (--setting quick).")
    parser.add_argument("--setting", choices=SETTINGS, default="toy",
                        help="toy: the no-argument run; video: tiny Wan on temporal_smoothness; quick: CI.")
    parser.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="Run seeds (default 0 1 2; 0 with --quick).")
    parser.add_argument("--max_train_steps", type=int, default=None, help="Default: the no-argument run's (2 with --quick).")
    parser.add_argument("--eval_steps", type=int, default=None, help="Default: the no-argument run's (1 with --quick).")
    parser.add_argument("--jobs", type=int, default=2, help="Training runs at a time.")
    parser.add_argument("--output_dir", type=str, default=None,
                        help="Runs, their base model and prompts, logs and learning_curves.png (default "
                        "bench-output/learning-<setting>).")
    parser.add_argument("--no_ceilings", action="store_true", help="Skip the best-of-K and supervised ceilings.")
    parser.add_argument("--supervised_steps", type=int, default=None,
                        help="Supervised ceiling: fine-tuning flow steps (1600; 2 with --quick).")
    parser.add_argument("--supervised_eval_every", type=int, default=None,
                        help="Supervised ceiling: evaluate every this many steps too, the ceiling is the best (400; 1 with --quick).")
    parser.add_argument("--base_model", type=str, default=None,
                        help="toy setting: another toy pipeline folder as the base (e.g. one pretrained longer by "
                             "scripts/pretrain_toy_model.py), for the runs and the ceilings; default: the shipped model.")
    parser.add_argument("--guidance_scale", type=float, default=None,
                        help="toy setting: sampling and evaluation CFG scale of the runs and the ceilings (1: CFG-free); "
                             "default: the no-argument run's.")
    parser.add_argument("--video_vae_steps", type=int, default=800,
                        help="video setting: steps of the tiny Wan VAE's training on toy clips (genrl.testing.toy_video).")
    parser.add_argument("--final_noise_draws", type=int, default=None,
                        help="Evaluate each run's final weights from this many noises (eval_genrl.py --samples_per_prompt) "
                             "and report the mean (default 4; 2 with --quick; 0: skip).")
    parser.add_argument("--guidance_sweep", type=float, nargs="+", default=None,
                        help="Guidance scales every model is scored at besides its trained settings and the pipeline's "
                             "defaults (default 1 2 4.5 7.5; 1 4.5 with --quick).")
    parser.add_argument("--no_sweep", action="store_true",
                        help="Skip the guidance sweeps and the pipeline-defaults scores (and the summary they lead).")
    parser.add_argument("--extra", type=str, default="", help="More train_genrl.py arguments for every run, one string "
                        "(write --extra=--grpo_guard when it starts with a dash and has no space).")
    args = parser.parse_args(argv)
    args.quick = args.quick or args.setting == "quick"
    args.setting = "quick" if args.quick else args.setting
    if args.setting != "toy" and (args.base_model or args.guidance_scale is not None):
        parser.error(f"--base_model and --guidance_scale apply to the toy setting, not to --setting {args.setting}.")
    args.seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    if args.final_noise_draws is None:
        args.final_noise_draws = 2 if args.quick else 4
    args.supervised_steps = args.supervised_steps or (2 if args.quick else 1600)
    args.supervised_eval_every = args.supervised_eval_every or (1 if args.quick else 400)
    args.supervised_batch_size = 8 if args.quick else 64  # scenes per supervised step
    args.guidance_sweep = args.guidance_sweep or ([1.0, 4.5] if args.quick else [1.0, 2.0, 4.5, 7.5])
    args.output_dir = args.output_dir or os.path.join("bench-output", f"learning-{args.setting}")
    # The ceilings' evaluation: the no-argument run's (4 batches of 32), or one batch of 8.
    args.ceiling_batches = (1, 8) if args.quick else None
    return args


# ----- the training runs ---------------------------------------------------------------------


def _write_prompts(path: str, prompts) -> str:
    with open(path, "w") as f:
        f.write("\n".join(prompts) + "\n")
    return path


def setting_args(setting: str, workdir: str, base_model: str | None = None,
                 guidance_scale: float | None = None, video_vae_steps: int = 800) -> list[str]:
    """train_genrl.py arguments of a setting, on top of the no-argument run's (toy: on
    ``base_model`` when given, at ``guidance_scale`` when given; video: on the tiny Wan with a
    VAE trained ``video_vae_steps`` steps on toy clips, ``genrl.testing.toy_video``)."""
    from genrl.testing.tiny_pipelines import save_tiny_pipeline

    if setting == "toy":
        flags = toy_run_args(base_model) if base_model else []
        return flags + (["--guidance_scale", str(guidance_scale)] if guidance_scale is not None else [])
    if setting == "video":
        from genrl.testing.toy_video import save_toy_video_pipeline
        from genrl.training.train_args import DEFAULT_EVAL_PROMPTS, DEFAULT_TRAIN_PROMPTS

        model, figures = save_toy_video_pipeline(os.path.join(workdir, "toy-wan"), video_vae_steps)
        emit({"bench": "learning", "video_vae": "toy clips", "steps": video_vae_steps, **figures})
        # The toy world's prompt split: 16 held-out prompts, one clip each, at every evaluation.
        return [
            "--pretrained_model_name_or_path", model, "--prompt_dataset", DEFAULT_TRAIN_PROMPTS,
            "--eval_prompt_dataset", DEFAULT_EVAL_PROMPTS, "--reward_fn", "temporal_smoothness",
            "--eval_reward_fn", "temporal_smoothness", "--group_size", "4", "--train_samples_per_group", "4",
            "--rollout_batch_size", "16",
            "--rollout_batches_per_epoch", "1", "--train_batch_size", "8", "--gradient_accumulation_steps", "2",
            "--num_inference_steps", "8", "--guidance_scale", "1.0", "--learning_rate", "1e-3",
            "--max_train_steps", "60", "--eval_steps", "5", "--eval_batch_size", "8", "--eval_max_batches", "2",
            "--eval_diversity_prompts", "0",
        ]
    # quick: a tiny random SD3 model and four prompts, the same code path in seconds (CI).
    model = save_tiny_pipeline("sd3", os.path.join(workdir, "tiny-sd3"), seed=0)
    prompts = _write_prompts(os.path.join(workdir, "prompts.txt"), common.PROMPTS[:4])
    return [
        "--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--eval_prompt_dataset", prompts,
        "--reward_fn", "toy_geneval", "--group_size", "2", "--train_samples_per_group", "2",
        "--rollout_batch_size", "4", "--rollout_batches_per_epoch", "1",
        # One optimizer step per epoch (4 samples, one trained timestep each), so the curve has a
        # point after every step: evaluation runs at epoch ends.
        "--train_batch_size", "4", "--gradient_accumulation_steps", "1", "--num_inference_steps", "3",
        "--sde_window_size", "1", "--sde_window_range", "0", "2", "--eval_batch_size", "4", "--eval_max_batches", "1",
    ]


def run_training(objective: str, seed: int, out_dir: str, base: list[str], args, threads: int) -> dict:
    """One train_genrl.py run; returns its eval curve ``{"steps", "elapsed", "scores"}``."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", os.path.join(ROOT, "train_genrl.py"),
               *objective_args(objective), *base, "--seed", str(seed), "--output_dir", out_dir, "--overwrite_output_dir",
               "--report_to", "none", "--cpu_threads", str(threads)]  # the bench's share of the cores, not the no-argument run's all
    if args.max_train_steps:
        command += ["--max_train_steps", str(args.max_train_steps)]
    if args.eval_steps:
        command += ["--eval_steps", str(args.eval_steps)]
    command += args.extra.split()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "train.log"), "w") as log:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{objective} seed {seed} exited {proc.returncode}; see {os.path.join(out_dir, 'train.log')}.")
    curve = read_curve(os.path.join(out_dir, "logs", "metrics.jsonl"), f"eval/{SCORES[args.setting]}_mean")
    curve["wall_s"] = time.perf_counter() - start
    curve["noise_scores"] = final_over_noise(out_dir, args.final_noise_draws, threads, SCORES[args.setting])
    return curve


def final_over_noise(run_dir: str, draws: int, threads: int, score: str) -> list[float]:
    """The run's final weights evaluated from ``draws`` noises by one ``eval_genrl.py
    --samples_per_prompt draws`` with the run's own evaluation settings (draw k: the noise of
    the run's evaluation seed + 1000 k, so the run's own K evaluation draws are the first K here
    and, for K <= draws, the mean of those repeats the curve's last point); returns each draw's
    mean. At fixed weights one evaluation of the toy
    run's 122 held-out prompts, one sample each, moves by about 0.02 from one noise to the next,
    as much as the seeds' spread: the mean over draws measures the weights, not the draw."""
    if draws < 1:
        return []
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    run_dir = os.path.abspath(run_dir)  # eval_genrl.py runs in the repository root
    out = os.path.join(run_dir, "noise-draws")
    command = [sys.executable, os.path.join(ROOT, "eval_genrl.py"), "--model", run_dir, "--samples_per_prompt", str(draws),
               "--save_samples", "0", "--output_dir", out]
    with open(os.path.join(run_dir, "noise-draws.log"), "a") as log:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"evaluating {run_dir} over {draws} noises exited {proc.returncode}; see {log.name}.")
    with open(os.path.join(out, "metrics.json")) as f:
        stats = json.load(f)["metrics"][score]
    return stats.get("draw_means") or [stats["mean"]]


def read_curve(metrics_path: str, score: str) -> dict:
    """The evaluations of one run: steps, wall seconds since launch, held-out ``score``."""
    steps, elapsed, scores = [], [], []
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if score in record:
                steps.append(record["step"])
                elapsed.append(record.get("time/elapsed_s", float("nan")))
                scores.append(record[score])
    return {"steps": steps, "elapsed": elapsed, "scores": scores}


def first_reaching(curve: dict, threshold: float, key: str) -> float | None:
    """The step (or second) of the first evaluation at or above ``threshold``, None if never."""
    for value, score in zip(curve[key], curve["scores"]):
        if score >= threshold:
            return value
    return None


def summarize(objective: str, curves: list[dict]) -> dict:
    """Mean and spread (max - min) over seeds of the final score, the best score, the final
    minus the best earlier one (steadiness), and steps / seconds to each threshold: their mean
    when every seed reached it (None otherwise, as a mean over the seeds that did would flatter
    the objective), with how many seeds did (``seeds_to_<t>``)."""
    finals = [c["scores"][-1] for c in curves]
    drops = [c["scores"][-1] - max(c["scores"][:-1] or c["scores"]) for c in curves]
    row = {
        "bench": "learning", "objective": objective, "seeds": len(curves), "steps": curves[0]["steps"][-1],
        "start": curves[0]["scores"][0], "final_mean": statistics.fmean(finals), "final_spread": max(finals) - min(finals),
        "best_mean": statistics.fmean(max(c["scores"]) for c in curves), "final_minus_best_earlier": min(drops),
        "wall_s_mean": statistics.fmean(c["elapsed"][-1] for c in curves),
    }
    if all(c.get("noise_scores") for c in curves):
        # The final weights over several evaluation noises (final_over_noise): mean and spread
        # over seeds of each seed's mean, and how far one evaluation moves with the noise alone.
        per_seed = [statistics.fmean(c["noise_scores"]) for c in curves]
        row.update(final_noise_mean=statistics.fmean(per_seed), final_noise_spread=max(per_seed) - min(per_seed))
        if all(len(c["noise_scores"]) > 1 for c in curves):
            row["noise_sd"] = statistics.fmean(statistics.stdev(c["noise_scores"]) for c in curves)
    for threshold in THRESHOLDS:
        row[f"seeds_to_{threshold}"] = sum(first_reaching(c, threshold, "steps") is not None for c in curves)
        for key, unit in (("steps", "steps"), ("elapsed", "s")):
            reached = [first_reaching(c, threshold, key) for c in curves]
            row[f"{unit}_to_{threshold}"] = statistics.fmean(reached) if all(r is not None for r in reached) else None
    return row


# ----- every model as a user meets it -----------------------------------------------------------

# The sweeps score the partial-credit score and, beside it, the strict one (all checks passed).
STRICT = "toy_geneval_strict"
SWEEP_REWARD = f"toy_geneval,{STRICT}:0"


def run_plan(run_dir: str, draws: int):
    """(base model, ``EvalPlan``) of a finished run: its trained evaluation's prompts, batches,
    noise seed and sampling (``train_args.sampling_configs`` of its recorded arguments), scored by
    ``SWEEP_REWARD`` from ``draws`` noises."""
    from genrl.checkpoints.checkpointing import CONFIG_FILE
    from genrl.data.prompts import load_prompts
    from genrl.evaluation.evaluate import EvalSettings
    from genrl.rewards import build_reward_fn
    from genrl.training.train_args import sampling_configs
    from genrl.training.train_logging import EvalPlan

    with open(os.path.join(run_dir, CONFIG_FILE)) as f:
        config = json.load(f)
    run = argparse.Namespace(**config["args"])
    _, sampling = sampling_configs(run)
    prompts = load_prompts(run.eval_prompt_dataset, split=run.eval_split, prompt_column=run.prompt_column)
    settings = EvalSettings(sampling, seed=run.eval_seed, batch_size=run.eval_batch_size, max_batches=run.eval_max_batches,
                            keep_samples=0, samples_per_prompt=draws)
    plan = EvalPlan(prompts, build_reward_fn(SWEEP_REWARD), settings, video_fps=run.eval_video_fps)
    return config["base_model"], plan


def guided_sweep(policy, plan, guidance_scales) -> dict:
    """``policy`` scored on ``plan``'s prompts and noises at its sampling settings (``trained``),
    at each of ``guidance_scales`` with its step count (``sweep``: ``[guidance, mean, strict]``
    rows, the plan's own guidance among them; ``best``: the row of the highest mean) and at the
    pipeline's default steps and guidance (``defaults``)."""
    from genrl.evaluation.pipeline_defaults import at_pipeline_defaults
    from genrl.training.train_logging import evaluate_plan

    def score(config) -> list[float]:
        metrics = evaluate_plan(plan, policy, policy.transformer, device="cpu", config=config).metrics
        return [config.guidance_scale, metrics["toy_geneval"]["mean"], metrics[STRICT]["mean"]]

    sweep = [score(dataclasses.replace(plan.settings.config, guidance_scale=g))
             for g in sorted({*map(float, guidance_scales), plan.settings.config.guidance_scale})]
    defaults = at_pipeline_defaults(plan.settings.config, policy.pipeline, policy.guidance_keyword)
    with policy.pipeline_call_guidance():
        _, mean, strict = score(defaults)
    trained = next(row for row in sweep if row[0] == plan.settings.config.guidance_scale)
    return {"sample_steps": plan.settings.config.num_inference_steps, **sweep_summary(sweep, trained),
            "defaults_steps": defaults.num_inference_steps, "defaults_cfg": defaults.guidance_scale,
            "defaults": mean, "defaults_strict": strict}


def best_guidance(sweep: list[list[float]]) -> list[float]:
    """The ``[guidance, mean, strict]`` row of the highest mean (the lowest guidance among equals)."""
    return max(sorted(sweep), key=lambda row: row[1])


def sweep_summary(sweep: list[list[float]], trained: list[float]) -> dict:
    """A sweep's rows with its ``trained`` row and its best, as flat figures."""
    best = best_guidance(sweep)
    return {"sweep": sweep, "trained_cfg": trained[0], "trained": trained[1], "trained_strict": trained[2],
            "best_cfg": best[0], "best": best[1], "best_strict": best[2]}


def mean_sweep(sweeps: list[dict]) -> dict:
    """Several seeds' ``guided_sweep`` results of one objective as one: each figure the mean
    over the seeds, the best guidance that of the mean sweep (not a mean of each seed's best)."""
    rows = [[row[0], *(statistics.fmean(s["sweep"][i][k] for s in sweeps) for k in (1, 2))]
            for i, row in enumerate(sweeps[0]["sweep"])]
    trained = next(row for row in rows if row[0] == sweeps[0]["trained_cfg"])
    return {"sample_steps": sweeps[0]["sample_steps"], **sweep_summary(rows, trained),
            **{k: sweeps[0][k] for k in ("defaults_steps", "defaults_cfg")},
            **{k: statistics.fmean(s[k] for s in sweeps) for k in ("defaults", "defaults_strict")}}


def samples_seen(records: list[dict], samples_per_epoch: int) -> int:
    """Images an RL run sampled: its epochs (the distinct epochs of its logged epoch records,
    those with ``time/train_s``) times ``samples_per_epoch`` (all processes)."""
    return len({r["epoch"] for r in records if "time/train_s" in r}) * samples_per_epoch


def rl_samples(run_dir: str) -> int:
    """``samples_seen`` of a finished one-process run, from its ``logs/metrics.jsonl`` and its
    recorded arguments (``RunSchedule``)."""
    from genrl.checkpoints.checkpointing import CONFIG_FILE
    from genrl.training.schedule import RunSchedule

    with open(os.path.join(run_dir, CONFIG_FILE)) as f:
        run = argparse.Namespace(**json.load(f)["args"])
    with open(os.path.join(run_dir, "logs", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    schedule = RunSchedule.from_args(run, num_processes=1, num_prompts=1)
    return samples_seen(records, schedule.samples_per_epoch_all_processes)


def budget_steps(samples: int, batch_size: int) -> int:
    """Supervised steps of ``batch_size`` scenes that see at least ``samples`` images: ceil(samples / batch_size)."""
    return max(1, math.ceil(samples / batch_size))


def headline(objective: str, base: dict, trained: dict, supervised: dict | None = None,
             at_budget: dict | None = None) -> dict:
    """The summary's first row: the base at its best guidance -> the trained model (``trained``:
    ``mean_sweep`` over its seeds) at its own settings, strict beside each mean; both at their best
    guidance and at the pipeline's defaults; the supervised ceiling (the best of its sweep) and the
    supervised run at the RL run's budget beside them."""
    row = {"bench": "learning", "headline": objective,
           "base_best_cfg": base["best_cfg"], "base_best": base["best"], "base_best_strict": base["best_strict"],
           "trained_cfg": trained["trained_cfg"], "trained": trained["trained"], "trained_strict": trained["trained_strict"],
           "gain": trained["trained"] - base["best"],
           "trained_best_cfg": trained["best_cfg"], "trained_best": trained["best"],
           "defaults": f"{trained['defaults_steps']} steps, CFG {trained['defaults_cfg']:g}",
           "base_defaults": base["defaults"], "trained_defaults": trained["defaults"]}
    for name, ceiling in (("supervised", supervised), ("supervised_budget", at_budget)):
        if ceiling is not None:
            row.update({name: ceiling["score"], f"{name}_cfg": ceiling["cfg"], f"{name}_strict": ceiling["strict"],
                        f"{name}_steps": ceiling["steps"]})
    return row


def headline_line(row: dict) -> str:
    """The summary's lead sentence of one headline row."""
    text = (f"{row['headline']}: base at its best (CFG {row['base_best_cfg']:g}) {row['base_best']:.3f} "
            f"(strict {row['base_best_strict']:.3f}) -> trained {row['trained']:.3f} (strict {row['trained_strict']:.3f}) "
            f"at CFG {row['trained_cfg']:g}; at the pipeline's defaults ({row['defaults']}) base {row['base_defaults']:.3f}, "
            f"trained {row['trained_defaults']:.3f}")
    if "supervised" in row:
        text += f"; supervised ceiling {row['supervised']:.3f} (CFG {row['supervised_cfg']:g})"
    if "supervised_budget" in row:
        text += (f", supervised at the RL run's images ({row['supervised_budget_steps']} steps) "
                 f"{row['supervised_budget']:.3f} (CFG {row['supervised_budget_cfg']:g})")
    return text


def sweep_models(args, curves: dict[str, list[dict]]) -> tuple[dict, dict[str, list[dict]]]:
    """``guided_sweep`` of each run's base (once per base and evaluation) and of each run's final
    weights: (``{run dir: its base's sweep}``, ``{objective: [sweep of each seed]}``)."""
    from genrl.checkpoints.checkpointing import load_trained_policy

    draws = max(1, args.final_noise_draws)
    swept, base_of_run, runs = {}, {}, {}
    for objective, seeds in curves.items():
        for curve in seeds:
            run_dir = curve["run_dir"]
            base_model, plan = run_plan(run_dir, draws)
            settings = plan.settings
            key = json.dumps([base_model, dataclasses.asdict(settings.config), settings.seed, settings.batch_size,
                              settings.max_batches])
            if key not in swept:
                swept[key] = emit({"bench": "learning", "model": "base", "path": base_model,
                                   **guided_sweep(load_trained_policy(base_model), plan, args.guidance_sweep)})
            base_of_run[run_dir] = swept[key]
            record = guided_sweep(load_trained_policy(run_dir), plan, args.guidance_sweep)
            runs.setdefault(objective, []).append(emit({"bench": "learning", "model": os.path.basename(run_dir),
                                                         "objective": objective, **record}))
    return base_of_run, runs


# ----- the ceilings ---------------------------------------------------------------------------


def eval_setting(batches: tuple[int, int] | None = None, guidance_scale: float | None = None):
    """The held-out prompts and evaluation settings of the no-argument run; ``batches`` =
    (max_batches, batch_size) overrides its evaluation size, ``guidance_scale`` its CFG scale."""
    from genrl.data.prompts import load_prompts
    from genrl.rewards import build_reward_fn
    from genrl.training import train_args
    from genrl.training.rollout import SamplingConfig

    run = train_args.toy_run()
    if batches is not None:
        run["eval_max_batches"], run["eval_batch_size"] = batches
    prompts = load_prompts(run["eval_prompt_dataset"])
    guidance = run["guidance_scale"] if guidance_scale is None else guidance_scale
    config = SamplingConfig(num_inference_steps=10, guidance_scale=guidance, noise_level=0.0,
                            decode_batch_size=run["vae_decode_batch_size"])
    return prompts, build_reward_fn("toy_geneval"), config, run


def held_out_scores(policy, seed: int, batches: tuple[int, int] | None = None,
                    guidance_scale: float | None = None, samples_per_prompt: int = 1) -> list[float]:
    """toy_geneval of each held-out prompt, sampled as the trainer's evaluation samples it
    (the mean over ``samples_per_prompt`` noises, ``genrl.evaluation.evaluate.draw_seed``)."""
    from genrl.evaluation.evaluate import EvalSettings, evaluate

    prompts, reward_fn, config, run = eval_setting(batches, guidance_scale)
    settings = EvalSettings(config, seed=seed, batch_size=run["eval_batch_size"], max_batches=run["eval_max_batches"],
                            keep_samples=0, samples_per_prompt=samples_per_prompt)
    result = evaluate(policy, policy.transformer, prompts, reward_fn, settings, device="cpu")
    return [r["scores"]["toy_geneval"] for r in result.per_prompt]


def best_of_k_ceiling(k: int, batches: tuple[int, int] | None = None, model: str | None = None,
                      guidance_scale: float | None = None) -> dict:
    """Mean over held-out prompts of the best of ``k`` base-model samples (seeds 0..k-1); the
    base is ``model`` (default: the shipped toy model)."""
    from genrl.policies import load_policy
    from genrl.training import train_args
    policy = load_policy(model or train_args.DEFAULT_MODEL).to("cpu")
    per_seed = [held_out_scores(policy, seed, batches, guidance_scale) for seed in range(k)]
    best = [max(scores) for scores in zip(*per_seed)]
    return {"bench": "learning", "ceiling": f"best_of_{k}", "score": statistics.fmean(best),
            "single_sample": statistics.fmean(per_seed[0])}


def ceiling_plan(batches: tuple[int, int] | None, guidance_scale: float | None, draws: int):
    """The ``EvalPlan`` of the ceilings' sweeps: ``eval_setting``'s prompts and sampling, scored
    by ``SWEEP_REWARD`` from ``draws`` noises (evaluation seed 0, as the runs')."""
    from genrl.evaluation.evaluate import EvalSettings
    from genrl.rewards import build_reward_fn
    from genrl.training.train_logging import EvalPlan

    prompts, _, config, run = eval_setting(batches, guidance_scale)
    settings = EvalSettings(config, seed=0, batch_size=run["eval_batch_size"], max_batches=run["eval_max_batches"],
                            keep_samples=0, samples_per_prompt=draws)
    return EvalPlan(prompts, build_reward_fn(SWEEP_REWARD), settings, video_fps=0)


def supervised_ceiling(steps: int, eval_every: int | None = None, batches: tuple[int, int] | None = None,
                       model: str | None = None, guidance_scale: float | None = None, noise_draws: int = 0,
                       guidance_sweep=(1.0,), batch_size: int = 64, name: str = "supervised") -> dict:
    """The toy model (``model``, default the shipped one) fine-tuned on ground-truth scenes of
    the train prompts for ``steps`` flow steps of ``batch_size`` scenes, evaluated every
    ``eval_every`` steps and at the end as the no-argument run evaluates (its
    ``eval_samples_per_prompt`` noises per prompt, at the runs' guidance): ``curve`` holds these as
    ``[step, score]``, and shows whether the fine-tune reached its plateau. Its final weights are
    then scored from ``noise_draws`` noises (seeds 0, 1000, ..., as the runs' ``final_over_noise``)
    at each guidance of ``guidance_sweep`` and at the pipeline's defaults (``guided_sweep``): the
    ceiling ``score`` is the best of that sweep, with its guidance ``cfg``; ``final_noise_mean``
    is its row at the runs' guidance."""
    import numpy as np
    import torch
    from diffusers import StableDiffusion3Pipeline

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import pretrain_toy_model as pretrain

    from genrl.data.toy_scenes import all_specs, is_test_combination
    from genrl.policies import policy_for_pipeline
    from genrl.training import train_args

    pipe = StableDiffusion3Pipeline.from_pretrained(model or train_args.DEFAULT_MODEL)
    pipe.set_progress_bar_config(disable=True)
    options = pretrain.parse_args(["--steps", str(steps), "--learning_rate", "3e-4", "--warmup_steps", "0",
                                   "--log_every", str(max(1, steps // 4)), "--eval_every", str(eval_every or 0),
                                   "--batch_size", str(batch_size)])
    specs = [s for s in all_specs() if not is_test_combination(s)]
    # No .to(): it would freeze the text encoders, which the fine-tune trains.
    policy = policy_for_pipeline(pipe)
    curve, eval_s = [], [0.0]

    def score(step: int) -> None:
        begin = time.perf_counter()
        draws = train_args.toy_run().get("eval_samples_per_prompt", 1)
        curve.append([step, statistics.fmean(held_out_scores(policy, 0, batches, guidance_scale, draws))])
        eval_s[0] += time.perf_counter() - begin
        print(f"  {name} step {step}: held-out toy_geneval {curve[-1][1]:.4f}", flush=True)

    torch.manual_seed(0)
    start = time.perf_counter()
    pretrain.train_transformer(pipe, specs, options, np.random.default_rng(0), progress=score)
    seconds = time.perf_counter() - start - eval_s[0]
    score(steps)
    # How many steps labelled scenes need to each threshold: the pace RL's steps compare with.
    reach = {"steps": [step for step, _ in curve], "scores": [value for _, value in curve]}
    sweep = guided_sweep(policy, ceiling_plan(batches, guidance_scale, max(1, noise_draws)), guidance_sweep)
    return {"bench": "learning", "ceiling": name, "score": sweep["best"], "cfg": sweep["best_cfg"],
            "strict": sweep["best_strict"], "steps": steps, "images": steps * batch_size, "curve": curve,
            "curve_best": max(value for _, value in curve), "train_s": seconds, "final_noise_mean": sweep["trained"],
            **sweep, **{f"steps_to_{t}": first_reaching(reach, t, "steps") for t in THRESHOLDS}}


def video_reward_reach(model: str, num_samples: int = 32) -> dict:
    """How far any policy could move the video setting's reward: temporal_smoothness of the
    tiny Wan's decodes of ``num_samples`` standard-normal latents (what sampling from noise
    gives, roughly), of the same latents with every latent frame equal to the first (no motion
    in latent space), and of all-zero latents. If the three agree within the samples' spread,
    the VAE, not the transformer, decides the reward."""
    import torch

    from genrl.policies import load_policy
    from genrl.rewards import build_reward_fn

    policy = load_policy(model).to("cpu")
    reward = build_reward_fn("temporal_smoothness")
    height, width, frames = policy.resolve_size(None, None, None)
    latents = torch.randn((num_samples, *policy.latent_shape(height, width, frames)), generator=torch.Generator().manual_seed(0))
    still = latents.clone()
    still[:, :, 1:] = latents[:, :, :1]  # (B, C, F, H, W): every latent frame a copy of the first

    def score(z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return reward(policy.decode(z), [""] * len(z), None)["temporal_smoothness"]

    noise = score(latents)
    return {"bench": "learning", "reach": "temporal_smoothness", "noise_latents_mean": float(noise.mean()),
            "noise_latents_std": float(noise.std()), "still_latents_mean": float(score(still).mean()),
            "zero_latents": float(score(torch.zeros_like(latents[:1]))[0])}


# ----- output -----------------------------------------------------------------------------------


def plot(curves: dict[str, list[dict]], ceilings: list[dict], path: str, score: str) -> str:
    """Held-out score against steps and against wall time: mean over seeds, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for objective, runs in curves.items():
        n = min(len(c["scores"]) for c in runs)
        scores = np.array([c["scores"][:n] for c in runs])
        for ax, key in zip(axes, ("steps", "elapsed")):
            x = np.mean([c[key][:n] for c in runs], axis=0)
            (line,) = ax.plot(x, scores.mean(0), marker="o", ms=3, label=f"{objective} ({len(runs)} seeds)")
            ax.fill_between(x, scores.min(0), scores.max(0), color=line.get_color(), alpha=0.2)
    for ceiling in ceilings:
        for ax in axes:
            ax.axhline(ceiling["score"], ls="--", lw=1, color="gray")
        label = ceiling["ceiling"] + (f" (CFG {ceiling['cfg']:g})" if "cfg" in ceiling else "")
        axes[1].annotate(label, (1.0, ceiling["score"]), xycoords=("axes fraction", "data"),
                         ha="right", va="bottom", fontsize=8, color="gray")
    axes[0].set_xlabel("optimizer steps")
    axes[1].set_xlabel("wall seconds (one run)")
    axes[0].set_ylabel(f"held-out {score}")
    axes[0].legend(loc="lower right", fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(args) -> list[dict]:
    common.print_machine("cpu", note=f"{args.jobs} runs at a time")
    os.makedirs(args.output_dir, exist_ok=True)
    workdir = os.path.join(args.output_dir, "inputs")  # beside the runs: their exports name the base model in it
    os.makedirs(workdir, exist_ok=True)
    base = setting_args(args.setting, workdir, args.base_model, args.guidance_scale, args.video_vae_steps)
    if args.quick:
        args.max_train_steps = args.max_train_steps or 2
        args.eval_steps = args.eval_steps or 1
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    jobs = [(o, s) for o in args.objectives for s in args.seeds]
    run_dirs = {job: os.path.join(args.output_dir, f"{job[0]}-seed{job[1]}") for job in jobs}
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {job: pool.submit(run_training, *job, run_dirs[job], base, args, threads) for job in jobs}
        results = {job: {**future.result(), "run_dir": run_dirs[job]} for job, future in futures.items()}
    curves = {o: [results[(o, s)] for s in args.seeds] for o in args.objectives}
    rows = []
    for objective, runs in curves.items():
        for seed, curve in zip(args.seeds, runs):
            emit({"bench": "learning", "objective": objective, "seed": seed, **curve})
        rows.append(emit(summarize(objective, runs)))
    # Every model where a user samples it: the base and each run's final weights over the guidance
    # sweep and at the pipeline's defaults (a toy_geneval setting: the video one has no guidance to speak of).
    sweeps, bases = {}, {}
    if not args.no_sweep and SCORES[args.setting] == "toy_geneval":
        bases, sweeps = sweep_models(args, curves)
    ceilings, supervised, at_budget = [], None, {}
    if not args.no_ceilings and args.setting != "video":
        # K = the no-argument run's samples per prompt (its objective's preset: 16 for NFT with PODS).
        from genrl.training import train_args
        group_size = 2 if args.quick else train_args.toy_run().get("group_size", 8)
        options = dict(batches=args.ceiling_batches, model=args.base_model, guidance_scale=args.guidance_scale,
                       noise_draws=args.final_noise_draws, guidance_sweep=args.guidance_sweep,
                       batch_size=args.supervised_batch_size)
        ceilings = [emit(best_of_k_ceiling(group_size, args.ceiling_batches, args.base_model, args.guidance_scale))]
        supervised = emit(supervised_ceiling(args.supervised_steps, args.supervised_eval_every, **options))
        ceilings.append(supervised)
        # The same fine-tune seeing as many scenes as each objective's run sampled images.
        by_steps = {}
        for objective, runs in curves.items():
            samples = rl_samples(runs[0]["run_dir"])
            steps = budget_steps(samples, args.supervised_batch_size)
            if steps not in by_steps:
                by_steps[steps] = emit({**supervised_ceiling(steps, name="supervised_at_budget", **options),
                                        "rl_samples": samples})
                ceilings.append(by_steps[steps])
            at_budget[objective] = by_steps[steps]
    headlines = [emit(headline(objective, bases[runs[0]["run_dir"]], mean_sweep(sweeps[objective]), supervised,
                               at_budget.get(objective)))
                 for objective, runs in curves.items() if objective in sweeps]
    # The summary: the headline first, then the sweeps, the curves and the ceilings.
    if headlines:
        print("\nBase at its best guidance -> trained at its own settings (strict score beside the mean; mean over seeds):")
        for row in headlines:
            print("  " + headline_line(row))
        common.print_table(headlines, ["headline", "base_best_cfg", "base_best", "base_best_strict", "trained_cfg", "trained",
                                       "trained_strict", "gain", "trained_best_cfg", "trained_best", "defaults",
                                       "base_defaults", "trained_defaults", "supervised_cfg", "supervised",
                                       "supervised_budget_steps", "supervised_budget_cfg", "supervised_budget"])
        swept = [*{id(b): b for b in bases.values()}.values(), *(r for records in sweeps.values() for r in records)]
        swept += [{"model": c["ceiling"], **c} for c in ceilings if "sweep" in c]
        common.print_table(swept, ["model", "sample_steps", "trained_cfg", "trained", "trained_strict", "best_cfg", "best",
                                   "best_strict", "defaults_steps", "defaults_cfg", "defaults", "defaults_strict"],
                           title=f"Each model over guidance ({', '.join(f'{g:g}' for g in args.guidance_sweep)}) and at the "
                                 "pipeline's defaults")
    common.print_table(rows, ["objective", "seeds", "steps", "start", "final_mean", "final_spread", "best_mean",
                              "final_minus_best_earlier", "final_noise_mean", "final_noise_spread", "noise_sd",
                              "steps_to_0.6", "seeds_to_0.6", "steps_to_0.8", "seeds_to_0.8", "s_to_0.6", "s_to_0.8",
                              "wall_s_mean"], title=f"Held-out {SCORES[args.setting]} (mean over seeds; spread = max - min)")
    common.print_table(ceilings, ["ceiling", "score", "cfg", "strict", "final_noise_mean", "single_sample", "steps", "images",
                                  "curve_best", "steps_to_0.6", "steps_to_0.8", "train_s"],
                       title="Ceilings (supervised: the best of the guidance sweep of its final weights)")
    if args.setting == "video":
        reach = emit(video_reward_reach(base[base.index("--pretrained_model_name_or_path") + 1]))
        common.print_table([reach], ["noise_latents_mean", "noise_latents_std", "still_latents_mean", "zero_latents"],
                           title="What the tiny Wan's VAE leaves to the policy (temporal_smoothness of decoded latents)")
    path = plot(curves, ceilings, os.path.join(args.output_dir, "learning_curves.png"), SCORES[args.setting])
    emit({"bench": "learning", "plot": path})
    return headlines + rows + ceilings


if __name__ == "__main__":
    main(parse_args())
