"""NaN and Inf are caught where they appear (genrl.training.nan_guard and the update loop, genrl/training/update.py):
a non-finite step is skipped and said so, a few in a row stop the run with one sentence, and
no checkpoint or export is written from the diverged weights."""

import json
import logging
import math
import os
import re
import subprocess

import pytest
import torch

from genrl.training.nan_guard import NonFiniteError, NonFiniteGuard

from conftest import launch_command, script_env, script_errors

NAN = float("nan")


class OneProcess:
    """gather() of a single process: what Accelerate returns without a process group."""

    is_main_process = True
    device = torch.device("cpu")

    def gather(self, tensor):
        return tensor


def test_a_non_finite_step_is_skipped_and_said_so_and_a_finite_one_resets_the_count(caplog):
    guard, acc = NonFiniteGuard(learning_rate=1e-4), OneProcess()
    assert guard.check_step(acc, 1, True, torch.tensor(0.5))
    with caplog.at_level(logging.WARNING):
        assert not guard.check_step(acc, 2, False, torch.tensor(NAN))
        assert not guard.check_step(acc, 3, True, float("inf"))
    assert [r.getMessage() for r in caplog.records] == [
        "Step 2: non-finite loss; the optimizer step was skipped (1 in a row, the run stops at 3).",
        "Step 3: non-finite gradient norm; the optimizer step was skipped (2 in a row, the run stops at 3).",
    ]
    assert guard.check_step(acc, 4, True, None)  # DeepSpeed without a norm: the loss decides
    assert guard.consecutive == 0 and guard.skipped == 2


def test_three_in_a_row_stop_with_one_sentence_naming_the_step_and_the_learning_rate():
    guard, acc = NonFiniteGuard(learning_rate=1e10), OneProcess()
    guard.check_step(acc, 5, False, NAN)
    guard.check_step(acc, 6, False, NAN)
    with pytest.raises(NonFiniteError) as stop:
        guard.check_step(acc, 7, False, NAN)
    message = str(stop.value)
    assert message.startswith("Stopped at step 7: the last 3 optimizer steps had a non-finite loss")
    assert "--learning_rate 1e+10 is too high" in message and "\n" not in message and message.count(". ") == 0


def test_non_finite_samples_stop_before_any_reward_sees_them():
    guard = NonFiniteGuard(learning_rate=1e10)
    guard.check_samples(OneProcess(), torch.rand(2, 3, 1, 4, 4), epoch=0, step=0)
    samples = torch.rand(2, 3, 1, 4, 4)
    samples[1, 0, 0, 0, 0] = NAN
    with pytest.raises(NonFiniteError, match=r"^Stopped in epoch 1 after step 2: the policy's samples are NaN"):
        guard.check_samples(OneProcess(), samples, epoch=1, step=2)


BLIND_REWARD = '''
def by_index(samples, prompts, metadata):
    """Never looks at the images, so NaN weights would go on training (and exit 0) without the guard."""
    return [float(i % 3) for i in range(len(prompts))]
'''


def huge_lr_run(model, prompts, output_dir, reward, tmp_path, batches_per_epoch, config=None, num_processes=1, *extra):
    (tmp_path / "blind_reward.py").write_text(BLIND_REWARD)
    env = script_env()
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    args = [
        "--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--reward_fn", reward,
        "--output_dir", output_dir, "--group_size", "4", "--rollout_batch_size", "4",
        "--rollout_batches_per_epoch", str(batches_per_epoch), "--train_batch_size", "2", "--num_inference_steps", "4",
        "--num_epochs", "3", "--checkpointing_steps", "1", "--report_to", "none", "--learning_rate", "1e10", *extra,
    ]
    proc = subprocess.run(launch_command("train_genrl.py", args, config, num_processes), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    return proc.stderr


def assert_nothing_resumable_saved(output_dir):
    """No export and no checkpoint that ``latest`` would resume: every checkpoint of diverged weights
    was set aside; no NaN in the logs."""
    assert not os.path.exists(os.path.join(output_dir, "transformer")), "the diverged weights were exported"
    assert [d for d in os.listdir(output_dir) if re.fullmatch(r"checkpoint-\d+", d)] == []
    metrics = os.path.join(output_dir, "logs", "metrics.jsonl")
    for line in open(metrics) if os.path.exists(metrics) else []:
        assert all(not (isinstance(v, float) and math.isnan(v)) for v in json.loads(line).values()), line


@pytest.mark.slow
def test_a_huge_learning_rate_with_a_builtin_reward_stops_before_the_reward_sees_nan(tiny_sd3, prompt_file, tmp_path):
    """Two steps per epoch: step 2 is skipped (so no checkpoint-2), then epoch 1's samples are NaN."""
    out = str(tmp_path / "out")
    stderr = huge_lr_run(tiny_sd3, prompt_file, out, "jpeg_compressibility", tmp_path, batches_per_epoch=1)
    assert "Not saving checkpoint-2: its last optimizer step was non-finite." in stderr
    errors = script_errors(stderr)
    assert len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith("train_genrl.py: error: Stopped in epoch 1 after step 2: the policy's samples are NaN")
    assert errors[0].endswith("; nothing from these weights was saved.")
    assert "Float images" not in stderr
    assert_nothing_resumable_saved(out)


@pytest.mark.slow
def test_a_checkpoint_of_weights_that_then_give_nan_samples_is_set_aside_and_named_on_resume(tiny_sd3, prompt_file,
                                                                                              tmp_path):
    """One step per epoch: step 1 makes the weights huge but finite and checkpoint-1 holds them, then
    epoch 1's samples are NaN: checkpoint-1 is set aside, so that ``latest`` never resumes it."""
    out = str(tmp_path / "out")
    stderr = huge_lr_run(tiny_sd3, prompt_file, out, "jpeg_compressibility", tmp_path, 1, None, 1, "--train_batch_size", "4")
    assert script_errors(stderr) == [
        "train_genrl.py: error: Stopped in epoch 1 after step 1: the policy's samples are NaN or infinite, so the weights "
        "diverged, most likely because --learning_rate 1e+10 is too high; checkpoint-1, written from these weights, was "
        "set aside as checkpoint-1.nonfinite so that --resume_from_checkpoint latest skips it."
    ], stderr[-3000:]
    assert_nothing_resumable_saved(out)
    aside = os.path.join(out, "checkpoint-1.nonfinite")
    assert os.path.isfile(os.path.join(aside, "genrl_state.json"))

    # Resumed on purpose with a sane rate, the checkpoint is named, not the new rate.
    stderr = huge_lr_run(tiny_sd3, prompt_file, out, "jpeg_compressibility", tmp_path, 1, None, 1, "--train_batch_size", "4",
                         "--learning_rate", "1e-4", "--resume_from_checkpoint", aside)
    assert script_errors(stderr) == [
        f"train_genrl.py: error: Stopped in epoch 1: the weights resumed from {aside} give NaN or infinite samples before "
        "any training step, so that checkpoint holds diverged weights: resume from an earlier checkpoint or start afresh."
    ], stderr[-3000:]


@pytest.mark.slow
def test_the_checkpoint_before_a_set_aside_one_survives_the_total_limit(tiny_sd3, prompt_file, tmp_path):
    """One step per epoch, at most one checkpoint kept: step 1 is sane, step 2 (the rate raised
    1e14-fold) makes the weights huge but finite, epoch 2's samples are NaN. checkpoint-2 is set
    aside, and checkpoint-1 was not pruned for it: older checkpoints go only once the newest one's
    weights have sampled finite rollouts."""
    out = str(tmp_path / "out")
    stderr = huge_lr_run(tiny_sd3, prompt_file, out, "jpeg_compressibility", tmp_path, 1, None, 1, "--train_batch_size", "4",
                         "--learning_rate", "1e-4", "--lr_scheduler", "piecewise_constant", "--lr_step_rules", "1:1,1e14",
                         "--checkpoints_total_limit", "1")
    errors = script_errors(stderr)
    assert len(errors) == 1 and errors[0].startswith("train_genrl.py: error: Stopped in epoch 2 after step 2"), stderr[-3000:]
    assert "checkpoint-2, written from these weights, was set aside as checkpoint-2.nonfinite" in errors[0]
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == ["checkpoint-1", "checkpoint-2.nonfinite"]


@pytest.mark.slow
def test_ranks_agree_and_stop_together_under_zero2(tiny_sd3, prompt_file, tmp_path):
    """A reward blind to NaN, two processes under ZeRO-2, four optimizer steps per epoch: step 1
    makes the weights huge, steps 2-4 give a NaN loss. Every rank skips the same steps and stops
    at the same one (a rank that went on alone would wait in a collective until the timeout)."""
    out = str(tmp_path / "out")
    stderr = huge_lr_run(tiny_sd3, prompt_file, out, "blind_reward:by_index", tmp_path, batches_per_epoch=2,
                         config="zero2", num_processes=2)
    # The launcher ends the other rank as soon as one exits, so one or both may have said it.
    stops = set(script_errors(stderr))
    assert stops == {(
        "train_genrl.py: error: Stopped at step 4: the last 3 optimizer steps had a non-finite loss, so the weights "
        "diverged, most likely because --learning_rate 1e+10 is too high for these rewards; nothing after the last "
        "finite step was saved."
    )}, stderr[-3000:]
    assert "Step 2: non-finite loss; the optimizer step was skipped (1 in a row" in stderr
    assert_nothing_resumable_saved(out)
