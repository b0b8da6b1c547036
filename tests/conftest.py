import os
import sys

# Tests never touch the network and never compete for the 2 CI cores with BLAS threads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import socket
import subprocess

import pytest

PROMPTS = ["a red circle", "a blue square", "a green triangle", "a yellow circle"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def launch_command(script: str, args: list[str], config: str | None = None, num_processes: int = 1) -> list[str]:
    """`accelerate launch` with a shipped config (or plain python when config is None)."""
    path = os.path.join(ROOT, script)
    if config is None:
        return [sys.executable, path, *args]
    # Fewer GPUs than processes (e.g. a 1-GPU machine): run them all on the CPU with gloo,
    # as the scripts would otherwise refuse (NCCL needs one GPU per process).
    import torch

    hide_gpus = ["env", "CUDA_VISIBLE_DEVICES="] if torch.cuda.device_count() < num_processes else []
    return hide_gpus + [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", os.path.join(ROOT, "accelerate_configs", f"{config}.yaml"),
        "--num_processes", str(num_processes), "--main_process_port", str(free_port()),
        path, *args,
    ]


def run_script(script: str, args: list[str], config: str | None = None, num_processes: int = 1, timeout: int = 600):
    """Run a top-level script to completion; fail the test with its output if it fails."""
    proc = subprocess.run(
        launch_command(script, args, config, num_processes), cwd=ROOT, env=script_env(),
        capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        pytest.fail(f"{script} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


# Tests that launch the real scripts or benchmarks as new processes (seconds to minutes each)
# are marked slow, so that `pytest -m "not slow"` is the fast lane; the default run keeps them.
# Whole modules of such tests, and fixtures that launch them for the tests that use them:
SLOW_MODULES = {"test_train_distributed", "test_train_objectives", "test_train_script", "test_train_hub", "test_relative_paths"}
SLOW_FIXTURES = {"runs"}  # test_bench: every benchmark's --quick run


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in SLOW_MODULES or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def trainer_exit_in_process(argv: list[str], monkeypatch) -> "str | int":
    """``train_genrl.run(argv)`` in this process, for input refused before any model loads (a
    launch costs ~10 s of imports): the SystemExit's code, i.e. the sentence the script prints
    on its last stderr line with exit status 1 (an int: that exit status). Loading a model fails
    the test; so does any other exception (the script would print a traceback)."""
    import train_genrl

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was refused")

    monkeypatch.setattr(train_genrl, "load_policy", no_model)
    with pytest.raises(SystemExit) as exit_info:
        train_genrl.run(argv)
    return exit_info.value.code


def script_errors(stderr: str, script: str = "train_genrl.py") -> list[str]:
    """The ``<script>: error: <sentence>`` reports in a script's stderr, in order (a progress bar
    left open may share their line, and so may another rank's report: two processes writing at
    once can put both sentences before either newline)."""
    prefix = f"{script}: error: "
    return [prefix + piece for line in stderr.splitlines() for piece in line.split(prefix)[1:]]


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory) -> str:
    """A tiny random SD3 pipeline saved to disk, loaded by the scripts through from_pretrained."""
    from genrl.testing.tiny_pipelines import save_tiny_pipeline

    return save_tiny_pipeline("sd3", str(tmp_path_factory.mktemp("models") / "tiny-sd3"), seed=0)


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return str(path)


@pytest.fixture
def isolated_rewards():
    """Rewards a test registers and models it caches are gone after it."""
    from genrl.rewards import lifecycle, registry

    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)
    lifecycle.clear_reward_models(cleanup=lambda: None)
