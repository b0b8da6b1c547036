"""bench/: every script runs with --quick and prints the machine line and its figures as JSON
lines; the figures are checked for presence and consistency with the asked configuration,
never for speed. Also the pieces the figures rest on: the analytic Wan FLOP count against
torch's FLOP counter, the CPU peak-memory reset, shared storages counted once.

The quick runs start together when the module starts (each one thread), so that the
file's wall time is about the total CPU time over the cores, not its sum.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, script_env

BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

# run name -> (the "bench" its figures carry, script and arguments)
RUNS = {
    "rollout": ("rollout", ["bench_rollout.py", "--quick"]),
    "train_step": ("train_step", ["bench_train_step.py", "--quick", "--families", "wan,sd3,flux"]),
    "rewards": ("rewards", ["bench_rewards.py", "--quick"]),
    "scaling": ("scaling", ["bench_scaling.py", "--quick"]),
    # The two configs as two runs side by side, each one launch of 2 processes.
    "zero2": ("zero_memory", ["bench_zero_memory.py", "--quick", "--configs", "zero2"]),
    "zero3": ("zero_memory", ["bench_zero_memory.py", "--quick", "--configs", "zero3"]),
    "h200_wan": ("h200_wan", ["bench_h200_wan.py", "--quick", "--profile", "--profile_rows", "5", "--fit_table"]),
    "h200_wan_bf16": ("h200_wan", ["bench_h200_wan.py", "--quick", "--bf16_weights"]),
    "learning": ("learning", ["bench_learning.py", "--quick", "--jobs", "2", "--output_dir", "{tmp}"]),
    "epoch": ("epoch", ["bench_epoch.py", "--quick", "--epochs", "3"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every quick run started at once; output goes to files (a full pipe would stall a run)."""
    env = script_env()
    env["CUDA_VISIBLE_DEVICES"] = ""  # --quick is the CPU check, also on a machine with a GPU
    logs = tmp_path_factory.mktemp("bench_logs")
    procs = {}
    for name, (_, (script, *args)) in RUNS.items():
        args = [arg.format(tmp=tmp_path_factory.mktemp(name)) if arg == "{tmp}" else arg for arg in args]
        with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
            procs[name] = subprocess.Popen([sys.executable, os.path.join(BENCH, script), *args], cwd=ROOT, env=env,
                                           stdout=out, stderr=err, text=True)
    yield procs, logs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def records(runs, name: str) -> tuple[dict, list[dict]]:
    """(machine description, figure records) printed by the quick run ``name``."""
    procs, logs = runs
    returncode = procs[name].wait(timeout=600)
    stdout, stderr = (logs / f"{name}.out").read_text(), (logs / f"{name}.err").read_text()
    script = RUNS[name][1][0]
    assert returncode == 0, f"{script} exited {returncode}:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    machines = [line["machine"] for line in lines if "machine" in line]
    assert len(machines) == 1, "every script prints exactly one machine line"
    figures = [line for line in lines if "machine" not in line]
    assert figures, f"{script} printed no figures"
    assert all(f["bench"] == RUNS[name][0] for f in figures)
    return machines[0], figures


def positive(record: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(record[key], (int, float)) and record[key] > 0, f"{key}={record.get(key)!r} in {record}"


def test_machine_line_names_the_machine(runs):
    machine, _ = records(runs, "rewards")
    for key in ("platform", "cpu", "cpu_count", "torch", "diffusers", "device", "torch_threads"):
        assert machine[key], key
    assert machine["device"] == "cpu" and machine["torch_threads"] == 1  # OMP_NUM_THREADS=1 of the test env


def test_rollout_figures(runs):
    _, figures = records(runs, "rollout")
    assert [f["family"] for f in figures] == ["wan", "sd3", "flux"]
    for f in figures:
        positive(f, "rollout_s", "bare_forwards_s", "encode_s", "decode_s", "samples_per_s", "overhead_ratio", "peak_mem_mb")
        assert f["samples_per_s"] == pytest.approx(f["batch"] / f["rollout_s"], rel=1e-2)
        assert f["overhead_ratio"] == pytest.approx(f["rollout_s"] / f["bare_forwards_s"], rel=1e-2)
    wan, sd3, flux = figures
    assert wan["frames"] == 5 and wan["frames_per_s"] == pytest.approx(5 * wan["samples_per_s"], rel=1e-2)
    assert sd3["frames_per_s"] is None and sd3["frames"] == 1
    # True CFG runs the transformer on [uncond; cond]; FLUX takes guidance as an input.
    assert (wan["forward_batch"], sd3["forward_batch"], flux["forward_batch"]) == (4, 4, 2)


def test_train_step_figures(runs):
    _, figures = records(runs, "train_step")
    assert [f["family"] for f in figures] == ["wan", "sd3", "flux"]
    for f in figures:
        positive(f, "ppo_step_s", "ppo_fwd_bwd_s", "optimizer_s", "bare_fwd_bwd_s", "overhead_ratio", "peak_mem_mb")
        assert f["ppo_fwd_bwd_s"] < f["ppo_step_s"]  # the step is the forward/backward plus the optimizer


def test_reward_figures(runs):
    _, figures = records(runs, "rewards")
    seen = {(f["reward"], f["layout"]) for f in figures}
    for layout in ("image", "video"):
        for name in ("prepare_images", "jpeg_compressibility", "temporal_smoothness", "toy_geneval", "all"):
            assert (name, layout) in seen
    for f in figures:
        positive(f, "score_s", "samples_per_s", "frames_per_s", "peak_mem_mb")
        assert f["frames"] == (1 if f["layout"] == "image" else 5)


def test_scaling_moves_one_axis_at_a_time(runs):
    _, figures = records(runs, "scaling")
    by_axis = {}
    for f in figures:
        by_axis.setdefault(f["axis"], []).append(f)
        positive(f, "rollout_s", "samples_per_s", "train_step_s", "rollout_peak_mem_mb", "train_peak_mem_mb")
    assert set(by_axis) == {"group_size", "steps", "frames", "resolution"}
    field = {"group_size": "group_size", "steps": "steps", "frames": "frames", "resolution": "height"}
    for axis, rows in by_axis.items():
        assert [r["value"] for r in rows] == [r[field[axis]] for r in rows]
        assert len({r["value"] for r in rows}) == len(rows) > 1


def test_epoch_phases_fit_in_the_epoch_and_training_rounds_to_whole_micro_batches(runs):
    _, figures = records(runs, "epoch")
    epochs, median = figures[:-1], figures[-1]
    assert [f["epoch"] for f in epochs] == [2, 3] and median["epoch"] == "median" and median["epochs"] == 2
    for f in epochs:
        positive(f, "rollout_s", "decode_s", "train_s", "epoch_s", "train_s_per_trained_sample")
        assert f["rollout_s"] + f["decode_s"] + f["train_s"] <= f["epoch_s"]
        # --quick: 8 samples per epoch, micro batch 4 x accumulation 1
        assert 0 <= f["kept"] <= f["trained"] <= 8 and f["trained"] % 4 == 0, f
        assert f["train_s_per_trained_sample"] == pytest.approx(f["train_s"] / f["trained"], rel=1e-3)


def test_zero_memory_reports_every_rank_of_both_configs(runs):
    figures = records(runs, "zero2")[1] + records(runs, "zero3")[1]
    assert sorted((f["config"], f["rank"], f["zero_stage"]) for f in figures) == [
        ("zero2", 0, 2), ("zero2", 1, 2), ("zero3", 0, 3), ("zero3", 1, 3)
    ]
    for f in figures:
        assert f["world_size"] == 2
        positive(f, "after_prepare_mb", "rollout_peak_mb", "train_peak_mb", "tensors_after_train_mb", "train_step_s")
        # The shipped zero3.yaml builds the transformer partitioned; its size counts all shards.
        assert f["zero3_init"] == (f["zero_stage"] == 3)
    assert len({round(f["params_m"], 6) for f in figures}) == 1
    # ZeRO-3's engine runs with the trainer's width-based buckets, not DeepSpeed's 5e8 / 5e7 elements.
    from genrl.testing.tiny_pipelines import build_tiny_pipeline

    config = build_tiny_pipeline("sd3").transformer.config
    width = config.num_attention_heads * config.attention_head_dim
    for f in figures:
        if f["zero_stage"] == 3:
            assert (f["ds_reduce_bucket_size"], f["ds_prefetch_bucket_size"]) == (width**2, int(0.9 * width**2))
        else:
            assert f["ds_reduce_bucket_size"] == 5e8  # ZeRO-2 keeps DeepSpeed's own


def test_h200_script_quick_run_counts_its_flops(runs):
    from bench_h200_wan import WAN_TINY, wan_forward_flops

    _, figures = records(runs, "h200_wan")
    assert [f["phase"] for f in figures] == ["rollout", "train", "profile", "profile"] + ["fit"] * 4
    rollout, train, *profiles = figures[:4]
    # --profile: the top 5 ops of one rollout and one PPO step, each with its share of the self time.
    assert [p["profiled"] for p in profiles] == ["rollout", "train"]
    for profile in profiles:
        shares = [op["share"] for op in profile["ops"]]
        assert len(shares) == 5 and shares == sorted(shares, reverse=True)
        assert all(0 < s <= 1 for s in shares) and sum(shares) <= 1 + 1e-6
    # --fit_table: micro batches 1 and 2 (the group) without and with checkpointing; CFG doubles the rows.
    fits = figures[4:]
    assert [(f["micro_batch"], f["gradient_checkpointing"]) for f in fits] == [(1, False), (2, False), (1, True), (2, True)]
    for f in fits:
        assert f["outcome"] == "ran" and f["forward_batch"] == 2 * f["micro_batch"] and f["fits"] is True
        positive(f, "peak_mem_mb")
    assert rollout["forward_flops_per_sequence"] == wan_forward_flops(WAN_TINY, tuple(rollout["latent_shape"]), rollout["text_len"])
    assert rollout["latent_shape"] == [16, 2, 4, 4]  # 5 frames at 32x32 through the 4x/8x VAE
    for f in (rollout, train):
        positive(f, "mfu", "peak_mem_mb")
    positive(rollout, "rollout_s", "samples_per_s", "frames_per_s", "bare_forwards_s")
    positive(train, "ppo_step_s", "bare_fwd_bwd_s")


def test_h200_script_bf16_weights_lever_trains_bf16_weights_under_deepspeed(runs):
    _, plain = records(runs, "h200_wan")
    _, figures = records(runs, "h200_wan_bf16")
    assert {f["weights"] for f in plain[:2]} == {"float32"}  # bf16 autocast over fp32 weights
    assert [f["phase"] for f in figures] == ["rollout", "train"]
    for f in figures:
        assert f["weights"] == "bfloat16" and f["mixed_precision"] == "bf16"
    positive(figures[1], "ppo_step_s", "bare_fwd_bwd_s", "mfu", "peak_mem_mb")


def test_learning_bench_runs_every_objective_and_both_ceilings(runs):
    _, figures = records(runs, "learning")
    curves = [f for f in figures if "seed" in f]
    assert sorted(f["objective"] for f in curves) == ["awm", "grpo", "nft"]
    for curve in curves:
        assert curve["steps"] == [0, 1, 2], "evaluation before training and after each of the 2 steps"
        assert len(curve["scores"]) == len(curve["elapsed"]) == 3
        assert all(0 <= s <= 1 for s in curve["scores"])
        assert curve["elapsed"] == sorted(curve["elapsed"]) and curve["elapsed"][0] > 0
    summaries = {f["objective"]: f for f in figures if "final_mean" in f}
    assert set(summaries) == {"grpo", "nft", "awm"}
    for objective, row in summaries.items():
        curve = next(c for c in curves if c["objective"] == objective)
        assert row["final_mean"] == pytest.approx(curve["scores"][-1], abs=1e-3) and row["final_spread"] == 0
        # The final weights re-evaluated from two noises: the first is the trainer's own evaluation
        # noise, so it repeats the curve's last point (eval_genrl.py reads the run's own settings).
        assert len(curve["noise_scores"]) == 2
        assert curve["noise_scores"][0] == pytest.approx(curve["scores"][-1], abs=1e-6)
        assert row["final_noise_mean"] == pytest.approx(sum(curve["noise_scores"]) / 2, abs=1e-4)  # printed to 4 decimals
        assert row["noise_sd"] >= 0 and row["final_noise_spread"] == 0
    ceilings = {f["ceiling"]: f for f in figures if "ceiling" in f}
    assert set(ceilings) == {"best_of_2", "supervised", "supervised_at_budget"}
    assert ceilings["best_of_2"]["score"] >= ceilings["best_of_2"]["single_sample"]
    # The supervised fine-tune is scored during training (step 1) and at its end (step 2) at the
    # runs' guidance; the ceiling is the best of the guidance sweep of its final weights.
    supervised = ceilings["supervised"]
    assert [step for step, _ in supervised["curve"]] == [1, 2] and supervised["steps"] == 2
    assert supervised["curve_best"] == max(score for _, score in supervised["curve"])
    for threshold in (0.6, 0.8):
        assert supervised[f"steps_to_{threshold}"] == next((s for s, v in supervised["curve"] if v >= threshold), None)
    # The quick runs: 2 epochs of 4 samples; the supervised run at that budget sees 8 scenes, one step of 8.
    at_budget = ceilings["supervised_at_budget"]
    assert at_budget["rl_samples"] == 8 and (at_budget["steps"], at_budget["images"]) == (1, 8)
    assert [step for step, _ in at_budget["curve"]] == [1]
    for ceiling in (supervised, at_budget):
        assert_sweep(ceiling, trained_cfg=1.0)  # the no-argument run's evaluation, CFG-free
        assert (ceiling["score"], ceiling["cfg"], ceiling["strict"]) == (ceiling["best"], ceiling["best_cfg"],
                                                                         ceiling["best_strict"])
        assert ceiling["final_noise_mean"] == ceiling["trained"]
    # Every model where a user samples it: the base once, each run's final weights.
    swept = {f["model"]: f for f in figures if "sweep" in f and "model" in f}
    assert set(swept) == {"base", "grpo-seed0", "nft-seed0", "awm-seed0"}
    for record in swept.values():
        assert_sweep(record, trained_cfg=4.5)  # the quick runs train and evaluate at the default guidance
        assert record["sample_steps"] == 3
    for objective in ("grpo", "nft", "awm"):
        # In-process at the trained settings over two noises = eval_genrl.py's two draws of the same export.
        assert swept[f"{objective}-seed0"]["trained"] == pytest.approx(summaries[objective]["final_noise_mean"], abs=1e-3)
    # The summary leads with the base at its best guidance -> the trained model, strict beside the mean.
    headlines = {f["headline"]: f for f in figures if "headline" in f}
    assert set(headlines) == {"grpo", "nft", "awm"}
    base = swept["base"]
    for objective, row in headlines.items():
        run = swept[f"{objective}-seed0"]
        assert (row["base_best_cfg"], row["base_best"], row["base_best_strict"]) == (base["best_cfg"], base["best"],
                                                                                   base["best_strict"])
        assert (row["trained_cfg"], row["trained"], row["trained_strict"]) == (4.5, run["trained"], run["trained_strict"])
        assert (row["base_defaults"], row["trained_defaults"]) == (base["defaults"], run["defaults"])
        assert row["defaults"] == "28 steps, CFG 7"
        assert (row["supervised"], row["supervised_cfg"]) == (supervised["score"], supervised["cfg"])
        assert (row["supervised_budget"], row["supervised_budget_steps"]) == (at_budget["score"], 1)
    text = [line for line in (runs[1] / "learning.out").read_text().splitlines() if not line.startswith("{")]
    lead = next(i for i, line in enumerate(text) if line.startswith("Base at its best guidance -> trained"))
    assert text[lead + 1].startswith("  grpo: base at its best (CFG ")
    tables = [i for i, line in enumerate(text) if line.startswith(("Held-out", "Ceilings", "Each model"))]
    assert len(tables) == 3 and min(tables) > lead
    plot = next(f["plot"] for f in figures if "plot" in f)
    assert os.path.getsize(plot) > 0


def assert_sweep(record: dict, trained_cfg: float) -> None:
    """A model's guided sweep: the quick sweep's guidance scales, its trained row among them, its
    best the row of the highest mean, and the SD3 pipeline's own defaults (28 steps at CFG 7)."""
    rows = record["sweep"]
    assert [g for g, _, _ in rows] == [1.0, 4.5], rows
    assert all(0 <= mean <= 1 and 0 <= strict <= mean for _, mean, strict in rows)
    assert record["best"] == max(mean for _, mean, _ in rows)
    assert [record["best_cfg"], record["best"], record["best_strict"]] in rows
    assert record["trained_cfg"] == trained_cfg and [trained_cfg, record["trained"], record["trained_strict"]] in rows
    assert (record["defaults_steps"], record["defaults_cfg"]) == (28, 7.0)
    assert 0 <= record["defaults_strict"] <= record["defaults"] <= 1


@pytest.mark.parametrize("batch, latent_shape, text_len", [(1, (16, 2, 4, 6), 5), (3, (16, 3, 6, 4), 11)])
def test_wan_flop_formula_matches_torch_flop_counter(batch, latent_shape, text_len):
    """The analytic count equals the matmul + attention FLOPs torch counts on a real forward
    (math attention, so that the attention products are counted)."""
    from bench_h200_wan import WAN_TINY, wan_forward_flops
    from diffusers import WanTransformer3DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    config = dict(WAN_TINY, num_layers=3, ffn_dim=40, out_channels=8)
    torch.manual_seed(0)
    model = WanTransformer3DModel(**config).eval()
    x = torch.randn(batch, *latent_shape)
    context = torch.randn(batch, text_len, config["text_dim"])
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(hidden_states=x, timestep=torch.full((batch,), 500.0), encoder_hidden_states=context, return_dict=False)
    assert wan_forward_flops(config, latent_shape, text_len, batch) == counter.get_total_flops()


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_cpu_peak_memory_is_reset_per_block():
    from common import PeakMemory

    with PeakMemory("cpu") as first:
        block = np.ones(200 * 2**20 // 8)  # 200 MiB, touched
        del block
    with PeakMemory("cpu") as second:
        pass
    assert first.reset and second.reset
    assert first.peak_mb - first.start_mb > 150
    assert second.peak_mb - second.start_mb < 50  # the first block's peak does not leak into the second


def test_tensor_memory_counts_shared_storage_once():
    from common import tensor_memory_mb

    before = tensor_memory_mb("cpu")
    flat = torch.zeros(10 * 2**20 // 4)  # 10 MiB
    views = [flat[i * 1000 : (i + 1) * 1000] for i in range(20)]
    parts = [torch.empty(0).set_(flat.untyped_storage(), 0, (1000,)) for _ in range(5)]  # same storage, new tensors
    grown = tensor_memory_mb("cpu") - before
    assert 9.5 < grown < 11, grown
    del flat, views, parts


def test_learning_summary_counts_seeds_to_a_threshold_and_averages_steps_only_when_all_reach_it():
    # GRPO's seed 1 on the toy run never reached 0.6 within 200 steps: a mean over the seeds that
    # did would read as the objective's pace, so the summary gives none and says how many reached it.
    import bench_learning

    def curve(scores):
        return {"steps": [0, 20, 40, 60], "elapsed": [1.0, 11.0, 21.0, 31.0], "scores": scores}

    fast, slow, never = curve([0.3, 0.61, 0.7, 0.81]), curve([0.3, 0.5, 0.6, 0.7]), curve([0.3, 0.4, 0.5, 0.59])
    both = bench_learning.summarize("nft", [fast, slow])
    assert both["steps_to_0.6"] == 30 and both["s_to_0.6"] == 16 and both["seeds_to_0.6"] == 2
    assert both["steps_to_0.8"] is None and both["seeds_to_0.8"] == 1
    assert both["final_mean"] == pytest.approx(0.755) and both["final_spread"] == pytest.approx(0.11)
    assert both["final_minus_best_earlier"] == pytest.approx(0.1)  # the worst seed's last minus its best before
    partial = bench_learning.summarize("grpo", [fast, never])
    assert partial["steps_to_0.6"] is None and partial["seeds_to_0.6"] == 1
    assert partial["final_minus_best_earlier"] == pytest.approx(0.09)


def test_learning_headline_compares_the_trained_model_with_the_base_at_its_best_guidance():
    # The shipped base scores 0.33 unguided and 0.67 at CFG 7.5; a trained model at 0.79 unguided
    # that falls under guidance. The headline must set the trained score against the base's best
    # (not its unguided score), and the trained model's best guidance must be that of the seeds'
    # mean sweep, not a mean of each seed's own best.
    import bench_learning

    def sweep(rows, defaults):
        trained = next(r for r in rows if r[0] == 1.0)
        return {"sample_steps": 10, **bench_learning.sweep_summary(rows, trained), "defaults_steps": 28,
                "defaults_cfg": 7.0, "defaults": defaults, "defaults_strict": defaults / 4}

    base = sweep([[1.0, 0.334, 0.05], [2.0, 0.439, 0.1], [4.5, 0.614, 0.2], [7.5, 0.669, 0.3]], 0.681)
    assert [base["best_cfg"], base["best"], base["best_strict"]] == [7.5, 0.669, 0.3]
    assert [base["trained_cfg"], base["trained"]] == [1.0, 0.334]
    seed0 = sweep([[1.0, 0.80, 0.6], [2.0, 0.81, 0.55], [4.5, 0.65, 0.3], [7.5, 0.55, 0.2]], 0.60)
    seed1 = sweep([[1.0, 0.78, 0.5], [2.0, 0.70, 0.4], [4.5, 0.65, 0.3], [7.5, 0.58, 0.2]], 0.62)
    assert seed0["best_cfg"] == 2.0 and seed1["best_cfg"] == 1.0
    trained = bench_learning.mean_sweep([seed0, seed1])
    assert trained["best_cfg"] == 1.0 and trained["best"] == pytest.approx(0.79)  # 0.79 at CFG 1 beats 0.755 at 2
    assert trained["trained"] == pytest.approx(0.79) and trained["trained_strict"] == pytest.approx(0.55)
    assert trained["defaults"] == pytest.approx(0.61)
    supervised = {"score": 0.851, "cfg": 4.5, "strict": 0.6, "steps": 1600}
    at_budget = {"score": 0.823, "cfg": 2.0, "strict": 0.5, "steps": 400}
    row = bench_learning.headline("nft", base, trained, supervised, at_budget)
    assert (row["base_best_cfg"], row["base_best"], row["base_best_strict"]) == (7.5, 0.669, 0.3)
    assert row["gain"] == pytest.approx(0.79 - 0.669)
    assert (row["base_defaults"], row["trained_defaults"]) == (0.681, pytest.approx(0.61))
    assert row["defaults"] == "28 steps, CFG 7"
    assert (row["supervised"], row["supervised_cfg"], row["supervised_budget"], row["supervised_budget_steps"]) == (
        0.851, 4.5, 0.823, 400)
    line = bench_learning.headline_line(row)
    assert line.startswith("nft: base at its best (CFG 7.5) 0.669 (strict 0.300) -> trained 0.790 (strict 0.550) at CFG 1")
    # Equal means: the lower guidance (the cheaper sampling) is the best.
    assert bench_learning.best_guidance([[4.5, 0.7, 0.1], [1.0, 0.7, 0.2]]) == [1.0, 0.7, 0.2]


def test_learning_supervised_run_at_the_rl_budget_sees_as_many_images_as_the_rl_run_sampled(tmp_path):
    # The default run: 100 epochs of 16 prompts x 16 samples = 25600 images, two optimizer steps an
    # epoch; at 64 scenes a step, supervision sees as many in 400 steps (not 200: one per RL step).
    import argparse

    import bench_learning

    from genrl.training import train_args
    from genrl.training.schedule import RunSchedule

    records = []
    for epoch in range(100):
        records += [{"step": 2 * epoch + 1, "epoch": epoch, "time/train_s": 1.0},
                    {"step": 2 * epoch + 2, "epoch": epoch, "eval/toy_geneval_mean": 0.5}]
    run = argparse.Namespace(**vars(train_args.parse_args(["--output_dir", str(tmp_path)])))
    per_epoch = RunSchedule.from_args(run, num_processes=1, num_prompts=1).samples_per_epoch_all_processes
    assert per_epoch == 256
    samples = bench_learning.samples_seen(records, per_epoch)
    assert samples == 25600
    assert bench_learning.budget_steps(samples, 64) == 400
    assert bench_learning.budget_steps(8, 64) == 1 and bench_learning.budget_steps(65, 64) == 2  # never fewer images
    # A run stopped after 3 epochs logged 3 epochs of samples, whatever it planned.
    assert bench_learning.samples_seen(records[:6], per_epoch) == 768


def test_learning_bench_on_another_base_runs_the_no_argument_settings_on_it(tmp_path):
    # Naming a model leaves the toy run's config file, so --base_model spells every value of it
    # out: the parsed run must equal the no-argument one in everything but the weights.
    import bench_learning

    from genrl.training import train_args
    other = str(tmp_path / "longer-pretrained")
    os.makedirs(other)
    out = ["--output_dir", str(tmp_path / "out")]
    changed = ("pretrained_model_name_or_path", "guidance_scale")
    for objective in bench_learning.OBJECTIVES:  # as run_training orders them: the objective, then the setting
        flags = bench_learning.objective_args(objective) + bench_learning.setting_args(
            "toy", str(tmp_path), base_model=other, guidance_scale=1.0)
        got = vars(train_args.parse_args(flags + out))
        want = vars(train_args.parse_args(["--objective", objective] + out))
        assert got["pretrained_model_name_or_path"] == other and got["guidance_scale"] == 1.0
        assert {k: v for k, v in got.items() if k not in changed} == {k: v for k, v in want.items() if k not in changed}
    assert bench_learning.setting_args("toy", str(tmp_path)) == []  # the shipped model: the no-argument run itself
    with pytest.raises(SystemExit):
        bench_learning.parse_args(["--setting", "video", "--base_model", other])


def test_video_setting_trains_every_objective_on_the_toy_wan_and_the_toy_split(tmp_path):
    """The video setting's model is the tiny Wan with a trained toy-clip VAE (its latent statistics
    set), and every objective's flags parse with it into a temporal_smoothness run on the toy
    world's train prompts, evaluated on its held-out ones."""
    import bench_learning
    from diffusers import AutoencoderKLWan

    from genrl.training import train_args
    flags = bench_learning.setting_args("video", str(tmp_path), video_vae_steps=2)
    model = flags[flags.index("--pretrained_model_name_or_path") + 1]
    vae = AutoencoderKLWan.from_pretrained(model, subfolder="vae")
    assert vae.config.base_dim == 8 and len(vae.config.latents_std) == vae.config.z_dim
    for objective in bench_learning.OBJECTIVES:
        args = train_args.parse_args(bench_learning.objective_args(objective) + flags + ["--output_dir", str(tmp_path / "out")])
        assert (args.objective, args.reward_fn, args.eval_reward_fn) == (objective, "temporal_smoothness", "temporal_smoothness")
        assert (args.prompt_dataset, args.eval_prompt_dataset) == (train_args.DEFAULT_TRAIN_PROMPTS, train_args.DEFAULT_EVAL_PROMPTS)
        assert args.learning_rate == 1e-3 and args.max_train_steps == 60


def test_video_reach_scores_real_decodes_of_the_tiny_wan(tmp_path):
    """The video setting's diagnostic decodes latents through the tiny Wan's VAE and scores them
    with the reward the setting trains: finite smoothness values in [-1, 0] that vary between
    noise latents (so they are real decodes, not a constant)."""
    import bench_learning

    from genrl.testing.tiny_pipelines import save_tiny_pipeline

    reach = bench_learning.video_reward_reach(save_tiny_pipeline("wan", tmp_path / "tiny-wan"), num_samples=4)
    values = [reach[k] for k in ("noise_latents_mean", "still_latents_mean", "zero_latents")]
    assert all(-1 <= v <= 0 for v in values)
    assert reach["noise_latents_std"] > 0


def test_gpu_check_counts_failed_parts_and_prints_side_by_side_parts_whole(tmp_path):
    """bench/gpu_check.sh with parts joined by "+": an unknown name counts as a failed part
    (the exit status) and says so; the known part beside it still runs and its output comes back
    whole, framed by its own header and status line."""
    env = {**script_env(), "GPU_CHECK_PARTS": "bogus+versions", "GPU_CHECK_OUT": str(tmp_path)}
    result = subprocess.run(["bash", os.path.join(BENCH, "gpu_check.sh")], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "gpu_check: no part named bogus" in result.stdout
    header = "=== versions (side by side with: bogus versions)"
    body = result.stdout.partition(header + "\n")[2]
    assert "torch " in body.partition(f"{header}: ok in")[0]
    assert "gpu_check: 1 part(s) failed" in result.stdout


def test_flow_grpo_side_by_side_clamps_only_the_text_encoder_lengths():
    # Flow-GRPO's script pads CLIP to 77 and T5 to 128 tokens; the toy encoders take 12 and 1. The
    # side-by-side must condition both trainers on the same 13 text tokens, and leave the
    # 256-token prompt ids (decoded back to prompts for its per-prompt statistics) whole.
    import bench_flow_grpo_epoch
    from transformers import AutoTokenizer

    from genrl.training.train_args import DEFAULT_MODEL

    def ids(tokenizer, max_length):
        return tokenizer(["a red circle above a blue square"], padding="max_length", max_length=max_length,
                         truncation=True, return_tensors="pt").input_ids

    clip, t5 = (AutoTokenizer.from_pretrained(DEFAULT_MODEL, subfolder=s) for s in ("tokenizer", "tokenizer_3"))
    before = ids(clip, 12)
    for tokenizer in (clip, t5):
        bench_flow_grpo_epoch.clamp_tokenizer(tokenizer)
    assert torch.equal(ids(clip, 77), before)
    assert ids(t5, 128).shape == (1, 1)
    assert ids(clip, 256).shape == (1, 256)
    assert clip.decode(ids(clip, 256)[0], skip_special_tokens=True) == "a red circle above a blue square"


def test_flow_grpo_side_by_side_names_a_folder_without_the_script(tmp_path, capsys):
    import bench_flow_grpo_epoch

    with pytest.raises(SystemExit):
        bench_flow_grpo_epoch.parse_args(["--flow_grpo_dir", str(tmp_path)])
    assert "holds no scripts/train_sd3.py" in capsys.readouterr().err


BENCH_FAMILIES = ["wan", "sd3", "flux", "zimage", "flux2-klein", "qwenimage", "flux2"]


def _scaled_transformers(family: str):
    """The tiny ``family`` policy and its transformer at every scale, built on the meta device
    (shapes, no weights)."""
    from genrl.testing.tiny_pipelines import FAMILIES, build_tiny_policy

    import common

    assert family in FAMILIES
    policy = build_tiny_policy(family)
    tiny = policy.transformer
    scaled = {}
    for scale in common.SCALE_NAMES:
        with torch.device("meta"):
            scaled[scale] = type(tiny).from_config(common.bench_transformer_config(family, scale, tiny.config))
    return policy, scaled


@pytest.mark.parametrize("family", BENCH_FAMILIES)
def test_every_family_has_every_scale(family):
    """``--scale`` for every family: its transformer's config at each scale builds, each larger
    than the one before."""
    _, scaled = _scaled_transformers(family)
    sizes = [sum(p.numel() for p in transformer.parameters()) for transformer in scaled.values()]
    assert sizes == sorted(set(sizes)), sizes


@pytest.mark.slow
@pytest.mark.parametrize("family", BENCH_FAMILIES)
def test_every_scale_fits_its_policy(family):
    """A forward and backward through the family's policy at the tiny sampling size, on the meta
    device, at each scale: its sizes fit together (heads, RoPE axes, widths) and each scale
    costs more than the one before."""
    from genrl.training.rollout import SamplingConfig
    from genrl.training.throughput import count_transformer_flops

    policy, scaled = _scaled_transformers(family)
    config = SamplingConfig(num_inference_steps=1, guidance_scale=1.0)
    costs = [count_transformer_flops(policy, transformer, config, "a red circle", "cpu").train
             for transformer in scaled.values()]
    assert costs == sorted(set(costs)), costs
