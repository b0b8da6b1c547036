"""One run's --output_dir never silently absorbs another: a checkpoint records the
arguments that decide its trajectory; resuming another run's checkpoint, or starting over on
top of checkpoints, is refused in one sentence; --overwrite_output_dir starts afresh; and
metrics.jsonl after a resume continues without logging any step twice."""

import json
import os
from argparse import Namespace

import pytest

from genrl.checkpoints.checkpointing import (
    STATE_FILE,
    check_output_dir,
    check_resumable,
    identity_differences,
    run_identity,
    trim_metrics,
)

from conftest import run_script, trainer_exit_in_process


def fake_checkpoint(output_dir, step, run=None):
    path = os.path.join(output_dir, f"checkpoint-{step}")
    os.makedirs(path)
    state = {"global_step": step, "epoch": step - 1, "num_processes": 1}
    with open(os.path.join(path, STATE_FILE), "w") as f:
        json.dump({**state, "run": run} if run is not None else state, f)
    return path


def identity(**changes):
    args = Namespace(pretrained_model_name_or_path="org/model", seed=1, group_size=4, sde_window_range=(0, 3),
                     reward_fn="jpeg_compressibility", objective="grpo")
    for k, v in changes.items():
        setattr(args, k, v)
    return run_identity(args)


def test_the_identity_is_json_and_names_each_difference():
    ours = identity()
    assert json.loads(json.dumps(ours)) == ours and ours["sde_window_range"] == [0, 3]
    assert identity_differences(ours, identity()) == []
    assert identity_differences(ours, identity(seed=2, group_size=8)) == ["--seed 1 there, 2 here", "--group_size 4 there, 8 here"]
    assert identity_differences({"seed": 1}, identity(group_size=8)) == [], "what a checkpoint did not record is not compared"


def test_another_runs_checkpoints_are_refused_and_this_runs_need_resume(tmp_path):
    out = str(tmp_path)
    check_output_dir(out, identity(), resuming=False)  # empty: a fresh start
    fake_checkpoint(out, 1, identity())
    check_output_dir(out, identity(), resuming=True)
    with pytest.raises(ValueError, match=r"already holds this run's checkpoints up to checkpoint-1: continue it with "
                                         r"--resume_from_checkpoint latest, or start afresh with --overwrite_output_dir"):
        check_output_dir(out, identity(), resuming=False)
    fake_checkpoint(out, 2, identity(reward_fn="toy_geneval"))
    with pytest.raises(ValueError) as refusal:
        check_output_dir(out, identity(), resuming=True)
    assert str(refusal.value) == (
        f"--output_dir {out} holds checkpoint-2 of another run (--reward_fn 'toy_geneval' there, 'jpeg_compressibility' "
        "here): start afresh with --overwrite_output_dir or a new --output_dir."
    )
    with pytest.raises(ValueError, match=r"^Cannot resume from .*checkpoint-2: it belongs to another run \(--reward_fn"):
        check_resumable(os.path.join(out, "checkpoint-2"), identity())


def test_a_checkpoint_written_before_runs_were_recorded_still_resumes(tmp_path):
    path = fake_checkpoint(str(tmp_path), 3)
    check_resumable(path, identity())
    check_output_dir(str(tmp_path), identity(), resuming=True)


def test_metrics_keep_the_epochs_up_to_the_checkpoint_and_drop_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "epoch": 0, "eval/x": 1}, {"step": 2, "epoch": 0}, {"step": 4, "epoch": 1}, {"step": 6, "epoch": 2}]
    path.write_text("".join(json.dumps(l) + "\n" for l in lines) + '{"step": 8, "ep')
    trim_metrics(str(path), 1)
    assert [json.loads(l) for l in path.read_text().splitlines()] == lines[:3]
    trim_metrics(str(path), -1)
    assert path.read_text() == ""


def train_args(model, prompts, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--reward_fn", "jpeg_compressibility",
            "--output_dir", out, "--group_size", "4", "--rollout_batch_size", "4", "--rollout_batches_per_epoch", "1",
            "--train_batch_size", "4", "--num_inference_steps", "3", "--num_epochs", "2", "--checkpointing_steps", "1",
            "--report_to", "none", "--seed", "1", *extra]


def train(model, prompts, out, *extra):
    return run_script("train_genrl.py", train_args(model, prompts, out, *extra))


def metric_steps(out):
    return [json.loads(l)["step"] for l in open(os.path.join(out, "logs", "metrics.jsonl"))]


@pytest.mark.slow
def test_a_run_refuses_another_runs_folder_resumes_its_own_and_overwrites_on_request(tiny_sd3, prompt_file, tmp_path,
                                                                                    monkeypatch):
    out = str(tmp_path / "out")
    train(tiny_sd3, prompt_file, out)
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) == ["checkpoint-1", "checkpoint-2"]
    assert metric_steps(out) == [1, 2]
    before = {d: os.path.getmtime(os.path.join(out, d, STATE_FILE)) for d in ("checkpoint-1", "checkpoint-2")}

    # Another seed is another run (the other refusals are unit-tested above), refused before any
    # model loads (in this process: trainer_exit_in_process fails the test if one does).
    message = trainer_exit_in_process(train_args(tiny_sd3, prompt_file, out, "--seed", "2", "--resume_from_checkpoint",
                                                 "latest"), monkeypatch)
    assert isinstance(message, str) and "--seed 1 there, 2 here" in message, message
    assert "--overwrite_output_dir or a new --output_dir" in message
    assert before == {d: os.path.getmtime(os.path.join(out, d, STATE_FILE)) for d in before}, "a refused run wrote"

    # Killed after epoch 1 was logged but before checkpoint-2 was complete: the resume redoes
    # epoch 1 and logs its step once.
    os.rename(os.path.join(out, "checkpoint-2"), os.path.join(out, "checkpoint-2.tmp"))
    train(tiny_sd3, prompt_file, out, "--resume_from_checkpoint", "latest", "--num_epochs", "3")
    assert metric_steps(out) == [1, 2, 3]

    train(tiny_sd3, prompt_file, out, "--seed", "2", "--num_epochs", "1", "--overwrite_output_dir")
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) == ["checkpoint-1"]
    assert json.load(open(os.path.join(out, "checkpoint-1", STATE_FILE)))["run"]["seed"] == 2
    assert metric_steps(out) == [1]
