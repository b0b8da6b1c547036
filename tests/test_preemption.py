"""Pre-emption: a stop signal ends a run in a checkpoint at a safe point, and the resumed run ends
with the weights of an uninterrupted one, bit for bit.

The signal comes from the run's own reward (tests/_signalling_reward.py), at a known call, so the
test knows which phase it lands in: during the rollouts (async scoring: the next batch boundary
stops the epoch, whose samples are dropped) or during scoring at the end of the rollouts (sync
scoring: the epoch's update stops after its current optimizer step, keeping the epoch's samples).
"""

import json
import os
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from genrl.distributed.preemption import PreemptionWatch, preempted_exit_code

from conftest import launch_command, run_python, run_script, script_env

REWARD = "tests._signalling_reward:brightness"


class OneProcess:
    device = torch.device("cpu")
    num_processes = 1

    def gather(self, tensor):
        return tensor


def test_the_first_signal_is_kept_a_second_is_ignored_and_the_status_is_128_plus_its_number():
    watch = PreemptionWatch().install()
    try:
        assert not watch.agreed(OneProcess())
        os.kill(os.getpid(), signal.SIGINT)  # not a KeyboardInterrupt while the watch is installed
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.agreed(OneProcess()) and watch.signum == signal.SIGINT
        assert watch.exit_code == 130
    finally:
        watch.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert [preempted_exit_code(s) for s in (signal.SIGTERM, signal.SIGUSR1)] == [143, 138]


def train_args(model, prompts, output_dir, marker, *extra, signal_name="SIGTERM"):
    options = {REWARD: {"marker": marker, "at_call": 4, "signal": signal_name, "times": 2}}
    return [
        "--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--reward_fn", REWARD,
        "--reward_options", json.dumps(options), "--output_dir", output_dir, "--group_size", "4",
        "--rollout_batch_size", "4", "--rollout_batches_per_epoch", "3", "--train_batch_size", "4",
        "--num_inference_steps", "4", "--num_epochs", "3", "--seed", "5", "--report_to", "none",
        "--use_ema", "--ema_decay", "0.5", "--learning_rate", "1e-2", "--adam_epsilon", "1e-4", *extra,
    ]


def weights(output_dir, folder):
    return load_file(os.path.join(output_dir, folder, "diffusion_pytorch_model.safetensors"))


def train_steps(output_dir):
    with open(os.path.join(output_dir, "logs", "metrics.jsonl")) as f:
        return [(r["epoch"], r["step"]) for r in map(json.loads, f) if "train/lr" in r]


@pytest.fixture(scope="module")
def marker(tmp_path_factory):
    return str(tmp_path_factory.mktemp("signal") / "sent")


@pytest.fixture(scope="module")
def uninterrupted(tiny_sd3, prompt_file, marker, tmp_path_factory):
    open(marker, "w").close()  # the reward sends no signal in this run
    output_dir = str(tmp_path_factory.mktemp("uninterrupted"))
    run_script("train_genrl.py", train_args(tiny_sd3, prompt_file, output_dir, marker))
    os.remove(marker)
    return output_dir


@pytest.mark.slow
@pytest.mark.parametrize("mode, signal_name, steps_into_epoch", [
    ("async", "SIGUSR1", 0),  # reward call 4 is epoch 1's first batch: the rollout stops, epoch 0 is saved
    ("sync", "SIGTERM", 1),  # call 4 scores epoch 1 after its rollouts: its update stops after its first optimizer step
])
def test_a_signal_saves_a_checkpoint_and_the_resumed_run_ends_bit_identical(uninterrupted, tiny_sd3, prompt_file, marker,
                                                                              tmp_path, mode, signal_name, steps_into_epoch):
    output_dir = str(tmp_path / "preempted")
    args = train_args(tiny_sd3, prompt_file, output_dir, marker, "--reward_mode", mode, "--resume_from_checkpoint", "latest",
                      signal_name=signal_name)
    proc = run_python("train_genrl.py", args)
    assert proc.returncode == preempted_exit_code(getattr(signal, signal_name)), proc.stderr[-3000:]
    reference = train_steps(uninterrupted)
    assert reference[1][1] - reference[0][1] == 3, "epoch 1 must have optimizer steps left after its first"
    step = reference[0][1] + steps_into_epoch
    assert proc.stderr.strip().splitlines()[-1] == (
        f"train_genrl.py: Pre-empted by {signal_name} at step {step}: saved checkpoint-{step}; "
        "continue with --resume_from_checkpoint latest."
    )
    assert f"Received {signal_name} again: already stopping" in proc.stderr
    assert sorted(n for n in os.listdir(output_dir) if n.startswith("checkpoint")) == [f"checkpoint-{step}"]
    assert not os.path.exists(os.path.join(output_dir, "transformer")), "a pre-empted run exported"
    assert train_steps(output_dir) == reference[:1]
    state = json.load(open(os.path.join(output_dir, f"checkpoint-{step}", "genrl_state.json")))
    assert (state["global_step"], state["epoch"]) == (step, 0)
    experience = os.path.join(output_dir, f"checkpoint-{step}", "experience", "rank0.safetensors")
    if steps_into_epoch:  # epoch 1's samples are kept to finish its update, 3 passes (one optimizer step) done
        assert state["update_in_progress"] == {"epoch": 1, "micro_steps": 3} and os.path.isfile(experience)
    else:
        assert "update_in_progress" not in state and not os.path.exists(experience)

    run_script("train_genrl.py", args)  # the marker exists now: no second signal
    assert train_steps(output_dir) == reference
    for folder in ("transformer", "transformer_ema"):
        resumed, expected = weights(output_dir, folder), weights(uninterrupted, folder)
        assert all(torch.equal(resumed[k], expected[k]) for k in expected), f"{folder} differs from the uninterrupted run"
    os.remove(marker)


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_both_inside_the_update_and_zero2_resumes_bit_identical(tiny_sd3, prompt_file, tmp_path):
    """Two processes under ZeRO-2 training NFT, the signal in rank 1 alone, during its scoring after
    the rollouts: both ranks agree after the next optimizer step and each keeps its own samples of
    the epoch with the old velocities NFT recorded before the weights moved (the resumed run cannot
    recompute them); the resumed run logs and ends as the uninterrupted one."""
    marker = str(tmp_path / "sent")
    extra = ["--objective", "nft", "--noise_level", "0", "--no-same_latent", "--timestep_fraction", "0.5",
             "--rollout_batches_per_epoch", "2", "--reward_mode", "sync", "--num_epochs", "2",
             "--resume_from_checkpoint", "latest"]
    launch = dict(config="zero2", num_processes=2)
    open(marker, "w").close()
    uninterrupted = str(tmp_path / "uninterrupted")
    run_script("train_genrl.py", train_args(tiny_sd3, prompt_file, uninterrupted, marker, *extra), **launch)
    os.remove(marker)
    output_dir = str(tmp_path / "preempted")
    args = train_args(tiny_sd3, prompt_file, output_dir, marker, *extra)
    options = json.loads(args[args.index("--reward_options") + 1])
    options[REWARD].update(rank=1, times=1)
    args[args.index("--reward_options") + 1] = json.dumps(options)
    proc = subprocess.run(launch_command("train_genrl.py", args, **launch), env=script_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0, proc.stderr[-3000:]
    reference = train_steps(uninterrupted)
    assert reference[1][1] - reference[0][1] == 2, "epoch 1 must have an optimizer step left after its first"
    step = reference[0][1] + 1
    assert f"train_genrl.py: Pre-empted by SIGTERM at step {step}: saved checkpoint-{step}" in proc.stderr, proc.stderr[-3000:]
    checkpoint = os.path.join(output_dir, f"checkpoint-{step}")
    # One optimizer step of 2 passes (2 trained timesteps) done.
    assert json.load(open(os.path.join(checkpoint, "genrl_state.json")))["update_in_progress"] == {"epoch": 1, "micro_steps": 2}
    assert sorted(os.listdir(os.path.join(checkpoint, "experience"))) == ["rank0.safetensors", "rank1.safetensors"]
    for rank in (0, 1):
        old_velocity = load_file(os.path.join(checkpoint, "experience", f"rank{rank}.safetensors"))["prepared.old_velocity"]
        # NaN where the first optimizer step took its own, before the weights moved.
        assert old_velocity.isfinite().any() and old_velocity[old_velocity.isfinite()].abs().sum() > 0

    run_script("train_genrl.py", args, **launch)
    assert train_steps(output_dir) == train_steps(uninterrupted)
    lines = [json.loads(l) for l in open(os.path.join(output_dir, "logs", "metrics.jsonl"))]
    expected = [json.loads(l) for l in open(os.path.join(uninterrupted, "logs", "metrics.jsonl"))]
    keys = [k for k in expected[-1] if k.startswith(("train/", "reward/")) and k != "train/lr"]
    assert {"train/policy_loss", "train/old_deviation", "train/skipped_steps", f"reward/{REWARD}_mean"} <= set(keys)
    for key in keys:  # the resumed epoch logs the statistics of all its steps, those before the stop too
        assert [l.get(key) for l in lines] == [e.get(key) for e in expected], key
    for folder in ("transformer", "transformer_ema"):
        resumed, expected = weights(output_dir, folder), weights(uninterrupted, folder)
        assert all(torch.equal(resumed[k], expected[k]) for k in expected), f"{folder} differs"
