"""Pre-emption: a stop signal ends a run in a checkpoint at a safe point, and the resumed run ends
with the weights of an uninterrupted one, bit for bit.

The signal comes from the run's own reward (tests/_signalling_reward.py), at a known call, so the
test knows which phase it lands in: during the rollouts (async scoring: the next batch boundary
stops the epoch, whose samples are dropped) or during scoring at the end of the rollouts (sync
scoring: the epoch's update finishes first).
"""

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_python, run_script

from genrl.preemption import PreemptionWatch, preempted_exit_code

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
@pytest.mark.parametrize("mode, signal_name, stopped_epochs", [
    ("async", "SIGUSR1", 1),  # reward call 4 is epoch 1's first batch: the rollout stops, epoch 0 is saved
    ("sync", "SIGTERM", 2),  # call 4 scores epoch 1 after its rollouts: its update finishes, then it is saved
])
def test_a_signal_saves_a_checkpoint_and_the_resumed_run_ends_bit_identical(uninterrupted, tiny_sd3, prompt_file, marker,
                                                                              tmp_path, mode, signal_name, stopped_epochs):
    output_dir = str(tmp_path / "preempted")
    args = train_args(tiny_sd3, prompt_file, output_dir, marker, "--reward_mode", mode, "--resume_from_checkpoint", "latest",
                      signal_name=signal_name)
    proc = run_python("train_genrl.py", args)
    assert proc.returncode == preempted_exit_code(getattr(signal, signal_name)), proc.stderr[-3000:]
    reference = train_steps(uninterrupted)
    step = reference[stopped_epochs - 1][1]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"train_genrl.py: Pre-empted by {signal_name} at step {step}: saved checkpoint-{step}; "
        "continue with --resume_from_checkpoint latest."
    )
    assert f"Received {signal_name} again: already stopping" in proc.stderr
    assert sorted(n for n in os.listdir(output_dir) if n.startswith("checkpoint")) == [f"checkpoint-{step}"]
    assert not os.path.exists(os.path.join(output_dir, "transformer")), "a pre-empted run exported"
    assert train_steps(output_dir) == reference[:stopped_epochs]
    state = json.load(open(os.path.join(output_dir, f"checkpoint-{step}", "genrl_state.json")))
    assert (state["global_step"], state["epoch"]) == (step, stopped_epochs - 1)

    run_script("train_genrl.py", args)  # the marker exists now: no second signal
    assert train_steps(output_dir) == reference
    for folder in ("transformer", "transformer_ema"):
        resumed, expected = weights(output_dir, folder), weights(uninterrupted, folder)
        assert all(torch.equal(resumed[k], expected[k]) for k in expected), f"{folder} differs from the uninterrupted run"
    os.remove(marker)
