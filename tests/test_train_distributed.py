"""train_genrl.py under `accelerate launch --num_processes 2` with the shipped configs (gloo on CPU).

The same seed and data must give the same weights whatever the sharding: DDP, ZeRO-2 and
ZeRO-3 differ only in where parameters and optimizer states live. A run killed after a
checkpoint and resumed with `latest` must end where an uninterrupted run ends.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, kill_launch, launch_command, run_script, script_env, script_errors

pytestmark = pytest.mark.slow

CONFIGS = ["multi_gpu", "zero2", "zero3"]


def train_args(model: str, prompts: str, output_dir: str, *extra: str) -> list[str]:
    return [
        "--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--reward_fn", "jpeg_compressibility",
        "--output_dir", output_dir, "--group_size", "4", "--rollout_batch_size", "4", "--rollout_batches_per_epoch", "1",
        "--train_batch_size", "2", "--gradient_accumulation_steps", "2", "--num_inference_steps", "4",
        "--num_epochs", "3", "--checkpointing_steps", "1", "--report_to", "none", "--seed", "7",
        # EMA under ZeRO-3 keeps each rank's own partition; its export must match DDP's too.
        "--use_ema", "--ema_decay", "0.5", "--ema_update_interval", "2",
        # Evaluation runs on every rank in lockstep (3 batches over 2 ranks: one rank pads).
        "--eval_prompt_dataset", prompts, "--eval_steps", "2", "--eval_batch_size", "2", "--eval_max_batches", "3",
        # A large Adam epsilon keeps updates proportional to the gradients: with the tiny
        # gradients of a random model, eps=1e-8 turns float reduction-order noise (which
        # differs between DDP and DeepSpeed) into visible weight differences.
        "--learning_rate", "1e-2", "--adam_epsilon", "1e-4",
        # Halved after optimizer step 2: Accelerate steps the scheduler once per process (under
        # DeepSpeed too); the rules count optimizer steps.
        "--lr_scheduler", "piecewise_constant", "--lr_step_rules", "1:2,0.5",
        *extra,
    ]


def exported_weights(output_dir: str, folder: str = "transformer") -> dict[str, torch.Tensor]:
    return load_file(os.path.join(output_dir, folder, "diffusion_pytorch_model.safetensors"))


# What DeepSpeed's CPU backend names its shared-memory all-reduce buffers in /dev/shm.
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"


def shm_buffers() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_BUFFER_PREFIX)} if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def shm_before_runs() -> set[str]:
    return shm_buffers()


# The lock file torch's JIT builder holds while it builds or loads DeepSpeed's CPU shared-memory
# all-reduce op, which DeepSpeed's CPU backend would otherwise load at every process start.
SHM_OP_LOCK = os.path.join("deepspeed_shm_comm", "lock")


@pytest.fixture(scope="module")
def stale_extensions(tmp_path_factory) -> dict[str, str]:
    """For each DeepSpeed config, a fresh TORCH_EXTENSIONS_DIR (a fresh machine's) holding the
    ``SHM_OP_LOCK`` that a build killed while holding it left behind."""
    out = {}
    for config in ("zero2", "zero3"):
        out[config] = str(tmp_path_factory.mktemp(f"{config}-torch-extensions"))
        os.makedirs(os.path.dirname(os.path.join(out[config], SHM_OP_LOCK)))
        open(os.path.join(out[config], SHM_OP_LOCK), "w").close()
    return out


@pytest.fixture(scope="module")
def runs(shm_before_runs, stale_extensions, tiny_sd3, prompt_file, tmp_path_factory):
    """One 2-process run per config, same seed and data. The DeepSpeed runs start on
    ``stale_extensions`` (a load of that op would wait on its lock forever: run_script's
    timeout bounds what that would cost here)."""
    out = {}
    for config in CONFIGS:
        output_dir = str(tmp_path_factory.mktemp(config))
        env = {"TORCH_EXTENSIONS_DIR": stale_extensions[config]} if config in stale_extensions else {}
        if config == "zero3":  # LOCAL_SIZE set before it starts, as DeepSpeed's own launcher sets it
            env["LOCAL_SIZE"] = "2"
        proc = run_script("train_genrl.py", train_args(tiny_sd3, prompt_file, output_dir), config=config, num_processes=2,
                          env=env)
        with open(os.path.join(output_dir, "launch.log"), "w") as f:
            f.write(proc.stdout + proc.stderr)
        out[config] = output_dir
    return out


def test_deepspeed_runs_leave_nothing_in_shared_memory(runs, shm_before_runs):
    """DeepSpeed's CPU backend, with its shared-memory all-reduce op loaded and LOCAL_SIZE set
    when it starts, opens buffers of 66 MB per rank and never unlinks them: each run would keep
    that in RAM (/dev/shm) until a reboot. The trainer keeps that op unloaded, whoever sets
    LOCAL_SIZE (the trainer in the ZeRO-2 run, the launch before the start in the ZeRO-3 one)."""
    assert shm_buffers() - shm_before_runs == set()


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_deepspeed_runs_build_no_op_and_pass_a_stale_build_lock(runs, stale_extensions, config):
    """The runs above finished on an extensions cache holding a stale lock of the op that
    DeepSpeed's CPU backend builds (and loads, under that lock) at every process start: they
    neither waited on it nor built anything, so no launch depends on a warm cache."""
    extensions = stale_extensions[config]
    files = sorted(os.path.relpath(os.path.join(folder, name), extensions)
                   for folder, _, names in os.walk(extensions) for name in names)
    assert files == [SHM_OP_LOCK]


@pytest.mark.parametrize("config", CONFIGS)
def test_two_process_run_writes_checkpoints_and_loadable_export(runs, tiny_sd3, config):
    from diffusers import SD3Transformer2DModel

    output_dir = runs[config]
    checkpoints = sorted(d for d in os.listdir(output_dir) if d.startswith("checkpoint-"))
    assert checkpoints == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert not any(d.endswith(".tmp") for d in os.listdir(output_dir))
    state = json.load(open(os.path.join(output_dir, "checkpoint-3", "genrl_state.json")))
    formats = {"multi_gpu": "torch", "zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3"}
    assert state == {"global_step": 3, "epoch": 2, "num_processes": 2, "format": formats[config], "per_rank_dirs": ["ema"],
                     "run": state["run"]}
    assert state["run"]["seed"] == 7 and state["run"]["group_size"] == 4, "the checkpoint records its run"

    trained = SD3Transformer2DModel.from_pretrained(os.path.join(output_dir, "transformer"))
    base = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer")
    changed = [n for (n, p), q in zip(trained.named_parameters(), base.parameters()) if not torch.equal(p, q)]
    assert changed, "training did not change any weight"

    lines = [json.loads(l) for l in open(os.path.join(output_dir, "logs", "metrics.jsonl"))]
    train_lines = [l for l in lines if "train/approx_kl" in l]
    assert [l["step"] for l in train_lines] == [1, 2, 3]
    assert all("reward/jpeg_compressibility_mean" in l for l in train_lines)
    eval_steps = [l["step"] for l in lines if "eval/jpeg_compressibility_mean" in l]
    assert eval_steps == [0, 2, 3], "evaluation before training, when step 2 is passed, and at the end"


@pytest.mark.parametrize("folder", ["transformer", "transformer_ema"])
def test_ddp_zero2_zero3_give_the_same_weights(runs, folder):
    reference = exported_weights(runs["multi_gpu"], folder)
    for config in ("zero2", "zero3"):
        weights = exported_weights(runs[config], folder)
        assert weights.keys() == reference.keys()
        diff = max((weights[k] - reference[k]).abs().max().item() for k in reference)
        assert diff <= 1e-5, f"{config} {folder} differs from DDP by {diff}"
    trained, ema = exported_weights(runs["zero3"]), exported_weights(runs["zero3"], "transformer_ema")
    assert any(not torch.equal(trained[k], ema[k]) for k in trained), "the EMA export equals the trained weights"


def test_every_config_follows_the_learning_rate_rules_in_optimizer_steps(runs):
    for config, output_dir in runs.items():
        with open(os.path.join(output_dir, "logs", "metrics.jsonl")) as f:
            epochs = [json.loads(line) for line in f if '"train/lr"' in line]
        assert [(e["step"], e["train/lr"]) for e in epochs] == [(1, 1e-2), (2, 5e-3), (3, 5e-3)], config


def test_zero3_builds_the_transformer_partitioned_and_counts_its_full_flops(runs):
    # The shipped zero3.yaml sets zero3_init_flag: true: no rank ever holds the whole transformer
    # (genrl.distributed.zero_init); the weights above equal DDP's, so the partitioned load was exact.
    log = open(os.path.join(runs["zero3"], "launch.log")).read()
    held = re.findall(r"\[RANK (\d)\] Transformer built under zero.Init: this rank holds ([\d,]+) of its ([\d,]+)", log)
    assert sorted(rank for rank, _, _ in held) == ["0", "1"], log[-3000:]
    for _, part, total in held:
        assert int(part.replace(",", "")) <= 0.55 * int(total.replace(",", ""))
    assert "Transformer built under zero.Init" not in open(os.path.join(runs["zero2"], "launch.log")).read()
    # DeepSpeed's gathers call torch APIs deprecated in torch 2.13: the warning is known noise.
    assert "all_gather_into_tensor` is deprecated" not in log and "reduce_scatter_tensor` is deprecated" not in log

    def flops(output_dir):  # counted on the full shapes, not the partitions
        lines = [json.loads(l) for l in open(os.path.join(output_dir, "logs", "metrics.jsonl"))]
        return [l["perf/transformer_flops"] for l in lines if "perf/transformer_flops" in l]

    assert flops(runs["zero3"]) == flops(runs["multi_gpu"]) and flops(runs["zero3"])


def test_killed_run_resumes_to_the_same_weights(runs, tiny_sd3, prompt_file, tmp_path):
    output_dir = str(tmp_path / "killed")
    args = train_args(tiny_sd3, prompt_file, output_dir, "--resume_from_checkpoint", "latest")
    proc = subprocess.Popen(
        launch_command("train_genrl.py", args, config="zero2", num_processes=2),
        env=script_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while not os.path.isdir(os.path.join(output_dir, "checkpoint-1")):
            assert proc.poll() is None, "the run ended before writing its first checkpoint"
            assert time.time() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
    finally:
        kill_launch(proc)  # the launcher and both ranks, mid-run
    assert not os.path.exists(os.path.join(output_dir, "transformer")), "the run finished before it was killed"

    run_script("train_genrl.py", args, config="zero2", num_processes=2)
    for folder in ("transformer", "transformer_ema"):  # optimizer, scheduler and EMA state all restored
        resumed, uninterrupted = exported_weights(output_dir, folder), exported_weights(runs["zero2"], folder)
        diff = max((resumed[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted)
        assert diff <= 1e-6, f"resumed run's {folder} differs from the uninterrupted one by {diff}"


def test_zero3_resumes_from_a_checkpoint_to_the_same_weights(runs, tiny_sd3, prompt_file, tmp_path):
    # The resumed run builds the transformer partitioned again (zero3.yaml's zero3_init_flag),
    # then DeepSpeed loads each rank's shard of weights and optimizer states over it.
    output_dir = str(tmp_path / "zero3")
    shutil.copytree(runs["zero3"], output_dir)
    for name in ("checkpoint-3", "transformer", "transformer_ema"):
        shutil.rmtree(os.path.join(output_dir, name))
    proc = run_script("train_genrl.py", train_args(tiny_sd3, prompt_file, output_dir, "--resume_from_checkpoint", "latest"),
                      config="zero3", num_processes=2)
    assert f"Resuming from {os.path.join(output_dir, 'checkpoint-2')}" in proc.stdout + proc.stderr
    steps = [json.loads(l)["step"] for l in open(os.path.join(output_dir, "logs", "metrics.jsonl"))
             if "train/approx_kl" in l]
    assert steps == [1, 2, 3], "the resumed run trained only the last epoch"
    for folder in ("transformer", "transformer_ema"):
        resumed, uninterrupted = exported_weights(output_dir, folder), exported_weights(runs["zero3"], folder)
        diff = max((resumed[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted)
        assert diff <= 1e-6, f"resumed run's {folder} differs from the uninterrupted one by {diff}"


@pytest.mark.parametrize("config", CONFIGS)
def test_real_checkpoints_pass_the_resume_check_and_each_poisoned_file_is_refused(runs, config, tmp_path):
    """The allow-list admits every file DDP, ZeRO-2 and ZeRO-3 write, and nothing with a payload."""
    from genrl.checkpoints.safe_load import UnsafeCheckpointError, pickle_files, verify_checkpoint

    from _poison import poison, ran

    checkpoint = os.path.join(runs[config], "checkpoint-1")
    assert verify_checkpoint(checkpoint, 0) == verify_checkpoint(checkpoint, 1) == []
    names = [os.path.relpath(p, checkpoint) for p in pickle_files(checkpoint)]
    expected = {"multi_gpu": "optimizer.bin", "zero2": "pytorch_model/mp_rank_00_model_states.pt",
                "zero3": "pytorch_model/zero_pp_rank_1_mp_rank_00_model_states.pt"}
    assert expected[config] in names and "random_states_1.pkl" in names and "ema/rank1.pt" in names
    for name in names:
        copy, marker = str(tmp_path / name.replace("/", "_")), str(tmp_path / (name.replace("/", "_") + ".marker"))
        shutil.copytree(checkpoint, copy)
        poison(os.path.join(copy, name), marker)
        with pytest.raises(UnsafeCheckpointError, match=f"^Refusing to resume from {copy}: {os.path.join(copy, name)} calls exec"):
            verify_checkpoint(copy, 0)
        assert not ran(marker)


def test_resuming_a_poisoned_zero2_checkpoint_fails_before_loading_and_runs_nothing(runs, tiny_sd3, prompt_file, tmp_path):
    """DeepSpeed itself reads mp_rank_00_model_states.pt with weights_only=False."""
    from _poison import poison, ran

    output_dir, marker = str(tmp_path / "poisoned"), str(tmp_path / "marker")
    shutil.copytree(runs["zero2"], output_dir)
    poison(os.path.join(output_dir, "checkpoint-3", "pytorch_model", "mp_rank_00_model_states.pt"), marker)
    args = train_args(tiny_sd3, prompt_file, output_dir, "--resume_from_checkpoint", "latest", "--num_epochs", "4")
    proc = subprocess.run(launch_command("train_genrl.py", args, config="zero2", num_processes=2), env=script_env(),
                          capture_output=True, text=True, timeout=300)
    assert not ran(marker), "the poisoned checkpoint ran its payload"
    assert proc.returncode != 0
    refusals = [e for e in script_errors(proc.stderr) if e.startswith("train_genrl.py: error: Refusing to resume")]
    assert refusals and "mp_rank_00_model_states.pt calls exec when unpickled" in refusals[0], proc.stderr[-3000:]
    assert "trained timesteps per sample" not in proc.stderr and not os.path.isdir(os.path.join(output_dir, "checkpoint-4"))


def test_zero_advantage_filtering_keeps_ranks_in_lockstep_under_zero3(tmp_path):
    """The toy colour check is discrete (0, 1/2 or 1 per sample), so whole groups often score alike
    (zero advantage): each rank drops a different number of samples, yet both must take the same
    optimizer steps or ZeRO-3's collectives would hang (the run has a timeout)."""
    output_dir = str(tmp_path / "filtered")
    args = [
        "--pretrained_model_name_or_path", os.path.join(ROOT, "genrl", "assets", "toy-shapes-t2i"),
        "--prompt_dataset", os.path.join(ROOT, "genrl", "assets", "prompts", "toy_train.txt"),
        "--reward_fn", "toy_geneval_color", "--output_dir", output_dir, "--group_size", "4",
        "--rollout_batch_size", "8", "--rollout_batches_per_epoch", "1", "--train_batch_size", "2",
        "--num_inference_steps", "4", "--guidance_scale", "2", "--sde_window_size", "1",
        "--num_epochs", "2", "--filter_zero_advantage", "--report_to", "none",
    ]
    run_script("train_genrl.py", args, config="zero3", num_processes=2, timeout=300)
    lines = [json.loads(l) for l in open(os.path.join(output_dir, "logs", "metrics.jsonl"))]
    kept = [l["train/kept_fraction"] for l in lines]
    assert len(kept) == 2 and all(0 < k <= 1 for k in kept)
    assert min(kept) < 1, "no group had equal scores: the filter was never exercised"
    # Trained samples are the informative ones rounded up to whole micro batches on every rank.
    informative = [l["train/informative_fraction"] for l in lines]
    assert all(0 < i <= k for i, k in zip(informative, kept)), (informative, kept)


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_a_signal_to_the_launcher_saves_on_every_rank_and_the_resumed_run_ends_bit_identical(runs, tiny_sd3, prompt_file,
                                                                                            tmp_path, signal_name):
    """Kubernetes sends SIGTERM to the container's first process, here `accelerate launch`, whose
    torchrun forwards it to the ranks and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT before SIGKILL; SLURM's
    --signal=USR1@N reaches it too, and torchrun forwards SIGUSR1 with the README's environment."""
    output_dir = str(tmp_path / "preempted")
    args = train_args(tiny_sd3, prompt_file, output_dir, "--resume_from_checkpoint", "latest", "--checkpointing_steps", "100")
    env = {**script_env(), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120",
           "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
    proc = subprocess.Popen(
        launch_command("train_genrl.py", args, config="zero2", num_processes=2), env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    metrics = os.path.join(output_dir, "logs", "metrics.jsonl")
    try:
        deadline = time.time() + 300
        while not (os.path.exists(metrics) and '"train/lr"' in open(metrics).read()):  # epoch 0 is done
            assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before its first epoch"
            time.sleep(0.1)
        proc.send_signal(getattr(signal, signal_name))  # the launcher alone
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            kill_launch(proc)
    assert proc.returncode == 128 + getattr(signal, signal_name), stderr[-3000:]
    stopped = [line for line in stderr.splitlines() if f"train_genrl.py: Pre-empted by {signal_name} at step" in line]
    assert len(stopped) == 1, stderr[-3000:]  # one sentence, from the main process
    step = int(re.search(r"at step (\d+): saved checkpoint-\1; continue with --resume_from_checkpoint latest\.$",
                         stopped[0]).group(1))
    assert sorted(n for n in os.listdir(output_dir) if n.startswith("checkpoint")) == [f"checkpoint-{step}"]
    assert not os.path.exists(os.path.join(output_dir, "transformer")), "a pre-empted run exported"

    run_script("train_genrl.py", args, config="zero2", num_processes=2)
    for folder in ("transformer", "transformer_ema"):
        resumed, uninterrupted = exported_weights(output_dir, folder), exported_weights(runs["zero2"], folder)
        assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted), f"{folder} differs"


def test_a_checkpoint_resumed_under_another_distributed_setup_is_one_sentence_before_any_model_loads(
        runs, tiny_sd3, prompt_file, tmp_path):
    """ZeRO-2 under DDP (the other directions: tests/test_node_storage.py)."""
    written, resumed, was, now = "zero2", "multi_gpu", "DeepSpeed ZeRO-2", "one process or DDP, without DeepSpeed"
    config = "accelerate_configs/zero2.yaml"
    output_dir = str(tmp_path / written)
    shutil.copytree(runs[written], output_dir)
    shutil.rmtree(os.path.join(output_dir, "checkpoint-3"))
    args = train_args(tiny_sd3, prompt_file, output_dir, "--resume_from_checkpoint", "latest")
    proc = subprocess.run(launch_command("train_genrl.py", args, config=resumed, num_processes=2), env=script_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    checkpoint = os.path.join(output_dir, "checkpoint-2")
    assert set(script_errors(proc.stderr)) == {
        f"train_genrl.py: error: Cannot resume from {checkpoint}: it was written under {was} and this run uses {now}, "
        f"whose optimizer states are laid out otherwise: resume it with the config it was written with (--config_file "
        f"{config}), or start afresh with --overwrite_output_dir or a new --output_dir."
    }, proc.stderr[-3000:]
    assert "trained timesteps per sample" not in proc.stderr, "refused only after the models loaded"
