"""The reward-hacking watch: diversity within a prompt's samples, the "trained rose
while held-out fell" rule, the alarms raised once each and again after a resume, the flags, the
card section, the plot panel, and a run built to hack that raises the alarm and stops."""

import json
import os

import pytest
import torch

from genrl.evaluation.plots import training_curves_figure
from genrl.evaluation.reward_watch import RewardWatch, diverging, group_diversity, watched_rewards
from genrl.hub.model_card import CardEvaluation, write_model_card
from genrl.training import train_args

from conftest import run_python, script_errors


def test_diversity_is_zero_for_copies_and_one_between_black_and_white():
    black, white = torch.zeros(3, 1, 8, 8), torch.ones(3, 1, 8, 8)
    assert group_diversity(torch.stack([torch.stack([black, black, black])])) == 0.0
    assert group_diversity(torch.stack([torch.stack([black, white])])) == pytest.approx(1.0)
    # Two prompts: mean over prompts of the mean over pairs. Pairs of (0, 0.5, 1): 0.5, 1, 0.5.
    grey = torch.full((3, 1, 8, 8), 0.5)
    value = group_diversity(torch.stack([torch.stack([black, grey, white]), torch.stack([black, black, black])]))
    assert value == pytest.approx((2 / 3 + 0) / 2)


def test_diversity_ignores_pixel_noise_finer_than_its_grid():
    # A 64x64 one-pixel checkerboard and its inverse differ at every pixel but look the same
    # (grey) at 32x32; a half-black half-white image and its mirror really differ.
    checker = (torch.arange(64)[:, None] + torch.arange(64)[None, :]) % 2
    a, b = checker.float()[None, None].expand(3, 1, 64, 64), (1 - checker).float()[None, None].expand(3, 1, 64, 64)
    assert group_diversity(torch.stack([a, b])[None]) == pytest.approx(0.0, abs=1e-6)
    half = torch.zeros(3, 1, 64, 64)
    half[..., :32] = 1
    assert group_diversity(torch.stack([half, half.flip(-1)])[None]) == pytest.approx(1.0)


def test_diversity_needs_groups_of_at_least_two():
    with pytest.raises(ValueError, match="K >= 2"):
        group_diversity(torch.zeros(2, 1, 3, 1, 4, 4))


def test_diverging_needs_every_step_of_the_window():
    assert diverging([0, 1, 2, 3], [5, 4, 3, 2], patience=3)
    assert not diverging([0, 1, 2, 3], [5, 4, 3, 3.5], patience=3)  # held-out rose at the end
    assert not diverging([0, 1, 1, 3], [5, 4, 3, 2], patience=3)  # trained flat once
    assert not diverging([1, 2, 3], [3, 2, 1], patience=3)  # too few evaluations
    assert diverging([9, 0, 1], [0, 5, 4], patience=1) and not diverging([9, 0, 1], [0, 5, 4], patience=2)


def _eval(trained, held_out, diversity):
    return {"eval/r_mean": trained, "eval/h_mean": held_out, "eval/diversity": diversity}


def test_each_alarm_is_raised_once_and_a_resumed_watch_raises_the_same(tmp_path):
    watch = RewardWatch(trained=["r"], held_out=["h"], patience=2, diversity_fraction=0.5)
    history = [_eval(0.1, 0.9, 0.40), _eval(0.2, 0.8, 0.30), _eval(0.3, 0.7, 0.25), _eval(0.4, 0.6, 0.19), _eval(0.5, 0.5, 0.1)]
    raised = [watch.observe(step, values) for step, values in enumerate(history)]
    assert raised[0] == raised[1] == [] and raised[4] == []
    assert len(raised[2]) == 1 and raised[2][0].startswith("the trained reward r rose at each of the last 2 evaluations")
    assert "held-out h fell at each (0.9 -> 0.7)" in raised[2][0]
    assert len(raised[3]) == 1 and "diversity within a prompt's samples fell to 0.19, below 0.5 x its first value 0.4" in raised[3][0]
    assert [step for step, _ in watch.alarms] == [2, 3]

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "epoch": s, "reward/r_mean": 0.0, **v}) + "\n" for s, v in enumerate(history))
                       + json.dumps({"step": 5, "epoch": 5, "reward/r_mean": 1.0}) + "\n")
    resumed = RewardWatch.from_metrics(str(metrics), trained=["r"], held_out=["h"], patience=2, diversity_fraction=0.5)
    assert resumed.alarms == watch.alarms and len(resumed.history) == 5
    assert resumed.observe(6, _eval(0.6, 0.4, 0.05)) == []  # nothing new: each alarm is raised once


def test_held_out_rewards_are_the_weight_0_ones_not_trained_on():
    assert watched_rewards("toy_geneval", "toy_geneval,toy_geneval_color:0,toy_geneval_position:0") == (
        ["toy_geneval"], ["toy_geneval_color", "toy_geneval_position"])
    assert watched_rewards("a_mod:fn_a:1,jpeg_compressibility:0.5", "jpeg_compressibility:0,toy_geneval:0") == (
        ["a_mod:fn_a", "jpeg_compressibility"], ["toy_geneval"])


@pytest.mark.parametrize("extra, expected", [
    (["--eval_diversity_samples", "1"],
     "--eval_diversity_prompts must be >= 0 and --eval_diversity_samples >= 2 (diversity compares samples), got 8 and 1."),
    (["--watch_patience", "0"], "--watch_patience must be >= 1 and --watch_diversity_fraction in [0, 1), got 0 and 0.75."),
    (["--eval_samples_per_prompt", "0"], "--eval_samples_per_prompt must be at least 1, got 0."),
    (["--watch_diversity_fraction", "1.5"],
     "--watch_patience must be >= 1 and --watch_diversity_fraction in [0, 1), got 3 and 1.5."),
])
def test_bad_evaluation_and_watch_settings_are_one_sentence(tmp_path, capsys, extra, expected):
    with pytest.raises(SystemExit):
        train_args.parse_args(["--output_dir", str(tmp_path / "out"), *extra])
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"train_genrl.py: error: {expected}"


def test_the_card_lists_the_alarms_or_says_there_were_none(tmp_path):
    def card(alarms):
        run = {"base_model": "org/base", "reward_fn": "jpeg_compressibility", "args": {"learning_rate": 1e-4}}
        write_model_card(str(tmp_path), run, evaluation=CardEvaluation(watch_alarms=alarms))
        return (tmp_path / "README.md").read_text()

    listed = card([(3, "the diversity within a prompt's samples fell to 0.1")])
    assert "## Reward-hacking watch" in listed and "- step 3: the diversity within a prompt's samples fell to 0.1" in listed
    assert "No alarm was raised" in card([])
    assert "Reward-hacking watch" not in card(None)  # no evaluation ran: nothing to say


def test_the_plot_has_a_watch_panel_with_both_signals():
    series = {"eval/diversity": [(0, 0.3), (10, 0.2)], "eval/velocity_kl": [(0, 0.0), (10, 0.4)],
              "eval/r_mean": [(0, 0.1), (10, 0.2)]}
    fig = training_curves_figure(series)
    watch = next(ax for ax in fig.axes if ax.get_title() == "reward watch")
    labels = watch.get_legend_handles_labels()[1] + [t.get_text() for t in watch.get_legend().get_texts()]
    assert "eval diversity" in labels and "eval velocity_kl" in labels
    empty = next(ax for ax in training_curves_figure({}).axes if ax.get_title() == "reward watch")
    assert [t.get_text() for t in empty.texts] == ["not logged"]


@pytest.mark.slow
def test_a_run_that_hacks_its_reward_raises_the_alarm_and_stops_before_saving(tmp_path):
    # The toy run trained on JPEG compressibility (it pays for blank images) with toy_geneval held
    # out: the trained reward rises while toy_geneval falls, from the first steps, and the samples
    # of a prompt turn alike (diversity 0.267, 0.240, 0.199 at steps 0-2, i.e. 0.90 and 0.75 of the
    # first: both alarms at step 2 with the fraction 0.8). Those figures are one trajectory: the
    # run's settings are spelled out (4 trained timesteps, 8 samples per prompt, all trained) so that
    # a change of the default keeps it.
    out = tmp_path / "out"
    args = ["--reward_fn", "jpeg_compressibility", "--eval_reward_fn", "jpeg_compressibility,toy_geneval:0",
            "--learning_rate", "3e-4", "--timestep_fraction", "0.4",
            "--max_train_steps", "6", "--eval_steps", "1", "--eval_max_batches", "1",
            "--group_size", "8", "--train_samples_per_group", "8",  # every sample, as the default trained before PODS
            "--rollout_batch_size", "16", "--rollout_batches_per_epoch", "1", "--train_batch_size", "16",
            "--gradient_accumulation_steps", "1", "--watch_patience", "2", "--watch_diversity_fraction", "0.8",
            "--checkpointing_steps", "1", "--eval_samples_per_prompt", "1",  # one noise: the alarm, not the score
            "--stop_on_reward_hacking", "--output_dir", str(out), "--report_to", "none"]
    proc = run_python("train_genrl.py", args)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = script_errors(proc.stderr)
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("train_genrl.py: error: the reward-hacking watch raised an alarm at step 2 (the trained "
                                "reward jpeg_compressibility rose at each of the last 2 evaluations")
    assert errors[0].endswith(f"(the last checkpoint before it is {out / 'checkpoint-1'}).")
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line and "Reward-hacking watch" in line]
    assert len(warnings) == 2 and all("Reward-hacking watch, step 2: " in w for w in warnings), warnings
    assert "held-out toy_geneval fell" in warnings[0] and "diversity within a prompt's samples fell" in warnings[1]
    # Nothing holds the weights that raised it: no checkpoint-2, no export.
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint-1"]
    assert not (out / "transformer").exists()
    evals = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if "eval/diversity" in e]
    assert [e["step"] for e in evals] == [0, 1, 2]
    # The drift from the frozen initial copy: none before training, then growing.
    drift = [e["eval/velocity_kl"] for e in evals]
    assert drift[0] == 0.0 and 0 < drift[1] < drift[2]
