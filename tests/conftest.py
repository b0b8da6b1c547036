import os
import sys

# Tests never touch the network and never compete for the 2 CI cores with BLAS threads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import atexit
import contextlib
import json
import select
import signal
import socket
import subprocess
import tempfile
import time

import pytest
import torch

# DeepSpeed on the CPU where there is no GPU; where there is one it finds CUDA itself (forcing
# "cpu" there put DeepSpeed's tensors on the CPU under Accelerate's NCCL group: a GPU-machine bug).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Each test worker runs as on a fresh machine: an empty extensions cache of its own for torch's
# JIT builds (DeepSpeed's ops), neither reusing ~/.cache/torch_extensions nor waiting on a lock
# a killed build left there.
if "TORCH_EXTENSIONS_DIR" not in os.environ:
    import shutil

    os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="genrl-tests-torch-extensions-")
    atexit.register(shutil.rmtree, os.environ["TORCH_EXTENSIONS_DIR"], ignore_errors=True)

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

    hide_gpus = ["env", "CUDA_VISIBLE_DEVICES=", "DS_ACCELERATOR=cpu"] if torch.cuda.device_count() < num_processes else []
    return hide_gpus + [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", os.path.join(ROOT, "accelerate_configs", f"{config}.yaml"),
        "--num_processes", str(num_processes), "--main_process_port", str(free_port()),
        path, *args,
    ]


class ScriptServer:
    """The client of ``tests/_script_server.py``: one pre-imported interpreter per test worker,
    started on first use, that runs ``python train_genrl.py ...`` (or ``eval_genrl.py``) in a
    forked child, without the ~13 s of imports a fresh interpreter pays (README "Tests")."""

    SCRIPTS = ("train_genrl.py", "eval_genrl.py")

    def __init__(self):
        self.env = script_env()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "_script_server.py")], cwd=ROOT, env=self.env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        )
        self.pending = b""
        assert self.reply(timeout=300) == {"ready": True}, "the script server did not start"

    # Variables that may differ from the server's without changing what its imports did: pytest's
    # name of the current test, and what importing torch and OpenCV set themselves.
    NEUTRAL = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "LD_LIBRARY_PATH"}

    def serves(self, env: dict) -> bool:
        """Whether a run in ``env`` can fork from this server: libraries read some variables
        (the Hub's HF_HOME, HF_HUB_OFFLINE, tokens and endpoints) when they are imported, so any
        other difference from the server's environment needs a fresh interpreter."""
        return all(env.get(k) == self.env.get(k) for k in set(env) | set(self.env) if k not in self.NEUTRAL)

    def reply(self, timeout: float) -> "dict | None":
        """The server's next line as a dict, or None if none came within ``timeout`` seconds.
        Unbuffered reads, so that a line already received is never hidden from select."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the script server exited ({self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, script: str, args: list[str], cwd: str, env: dict, timeout: float, text: bool) -> subprocess.CompletedProcess:
        """What ``subprocess.run([python, script, *args], capture_output=True)`` returns."""
        with tempfile.TemporaryDirectory() as logs:
            out, err = os.path.join(logs, "stdout"), os.path.join(logs, "stderr")
            request = {"script": os.path.join(ROOT, script), "args": [str(a) for a in args], "cwd": str(cwd),
                       "env": env, "out": out, "err": err}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            pid = self.reply(timeout=60)["pid"]
            done = self.reply(timeout)
            timed_out = done is None
            if timed_out:
                os.kill(pid, signal.SIGKILL)  # the child this server forked for this call
                done = self.reply(timeout=60)
            returncode = done["returncode"]
            mode = "r" if text else "rb"
            with open(out, mode) as f_out, open(err, mode) as f_err:
                stdout, stderr = f_out.read(), f_err.read()
        argv = [sys.executable, script, *args]
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


_server: "ScriptServer | None" = None


def script_server() -> ScriptServer:
    """This worker's ScriptServer, started on first use and closed when the worker exits."""
    global _server
    if _server is None:
        _server = ScriptServer()
        atexit.register(_server.close)
    return _server


def run_python(script: str, args: list[str], cwd: str = ROOT, env: dict | None = None, timeout: float = 600,
               text: bool = True) -> subprocess.CompletedProcess:
    """``python <script> <args>`` run to completion with its output captured. The top-level
    scripts run through the worker's ScriptServer where the environment allows; anything else
    (another script, Hub variables of its own) in a fresh interpreter."""
    env = script_env() if env is None else env
    if script in ScriptServer.SCRIPTS and script_server().serves(env):
        return script_server().run(script, args, cwd, env, timeout, text)
    return subprocess.run(launch_command(script, args), cwd=cwd, env=env, capture_output=True, text=text,
                          timeout=timeout)


def run_script(script: str, args: list[str], config: str | None = None, num_processes: int = 1, timeout: int = 600,
               env: dict | None = None):
    """Run a top-level script to completion; fail the test with its output if it fails. Without
    a config it runs as ``python <script>`` (run_python), with one through ``accelerate launch``.
    ``env``: variables added to the scripts' environment."""
    if config is None:
        proc = run_python(script, args, timeout=timeout, env={**script_env(), **env} if env else None)
    else:
        with subprocess.Popen(
            launch_command(script, args, config, num_processes), cwd=ROOT, env={**script_env(), **(env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        ) as launch:
            try:
                stdout, stderr = launch.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_launch(launch)
                raise
        proc = subprocess.CompletedProcess(launch.args, launch.returncode, stdout, stderr)
    if proc.returncode != 0:
        pytest.fail(f"{script} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL a launch started with ``start_new_session=True``: its ranks first, then the launcher
    and its process group. The ranks of ``accelerate launch`` run in sessions of their own, so
    killing the launcher's group alone leaves them running on (and holding the output folder)."""
    import psutil

    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    for rank in ranks:
        with contextlib.suppress(psutil.Error):
            rank.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(ranks, timeout=30)


# Tests that launch the real scripts or benchmarks as new processes (seconds to minutes each)
# are marked slow, so that `pytest -m "not slow"` is the fast lane; the default run keeps them.
# Whole modules of such tests, and fixtures that launch them for the tests that use them:
SLOW_MODULES = {"test_train_distributed", "test_train_objectives", "test_train_script", "test_train_hub", "test_relative_paths",
                "test_script_server"}
SLOW_FIXTURES = {"runs"}  # test_bench: every benchmark's --quick run


# The extended lane (`pytest -m extended`; CI runs it after the default lane): the slow tests of
# these modules and these slow tests. Each repeats, on another model family, server or launcher, a
# path the default lane already runs end to end: the benchmarks' quick runs, the README's runnable
# commands, the reward service and the VLM judge's server, two "nodes", the two-expert Wan, a run
# that hacks its reward, Qwen-Image-Edit's sampling at its pipeline's 1024 x 1024 conditioning.
EXTENDED_MODULES = {"test_bench", "test_readme", "test_reward_service", "test_vlm_judge", "test_multi_node",
                    "test_wan_experts", "test_wan_i2v", "test_image_families", "test_hunyuanvideo15"}
EXTENDED_TESTS = {"test_a_run_that_hacks_its_reward_raises_the_alarm_and_stops_before_saving",
                  "test_qwenimage_edit_samples_as_its_pipeline"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in SLOW_MODULES or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow") and (module in EXTENDED_MODULES or item.originalname in EXTENDED_TESTS):
            item.add_marker(pytest.mark.extended)


def trainer_exit_in_process(argv: list[str], monkeypatch) -> "str | int":
    """``train_genrl.run(argv)`` in this process, for input refused before any model loads (a
    launch costs ~10 s of imports): the SystemExit's code, i.e. the sentence the script prints
    on its last stderr line with exit status 1 (an int: that exit status). Loading a model fails
    the test; so does any other exception (the script would print a traceback)."""
    import genrl.training.run
    import train_genrl

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was refused")

    monkeypatch.setattr(genrl.training.run, "load_policy", no_model)
    with pytest.raises(SystemExit) as exit_info:
        train_genrl.run(argv)
    return exit_info.value.code


def assert_help_documents_each_section(parser, sections, help_text: str) -> None:
    """Every flag of ``parser`` has help, and ``help_text`` (its ``--help``) shows each of
    ``sections`` as one group holding each of its fields."""
    from dataclasses import fields

    missing = [a.dest for a in parser._actions if not (a.help or "").strip()]
    assert not missing, f"flags without help: {missing}"
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    for section in sections:
        assert f"\n{section._argument_group_name}:\n" in help_text, section
        assert {f.name for f in fields(section)} <= groups[section._argument_group_name], section


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
