"""Servers a test module starts on localhost (the reward service, `transformers serve`) and
stops by their process id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import IO, Any

import psutil
import pytest


def start_server(command: list[str], health_url: str, log: IO[str], *, cwd: str | None = None, env: dict | None = None,
                 timeout: float = 180) -> subprocess.Popen:
    """``command`` in a session of its own, its output in ``log``; returns once ``health_url``
    answers, or fails the test with the log's end."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(health_url, timeout=5).read()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_server(proc)
                log.seek(0)
                pytest.fail(f"{command[1:3]} did not start:\n{log.read()[-4000:]}")
            time.sleep(0.5)


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the server, then SIGKILL whatever of it is left: the processes it started, found
    before it was asked to stop."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        child.kill()
    psutil.wait_procs(alive, timeout=10)


class RewardService(str):
    """``serve_rewards.py`` serving ``spec`` (with ``options``) on a free localhost port, one CPU
    replica on a Ray instance of 2 cores, its output in ``log``: its URL. ``start`` (again: on the
    same port), ``stop``, ``requests``."""

    def __new__(cls, spec: str, options: dict[str, Any], log: IO[str], env: dict | None = None):
        from conftest import ROOT, free_port

        port = free_port()
        url = super().__new__(cls, f"http://127.0.0.1:{port}")
        url.log, url.env, url.root = log, env, ROOT
        url.command = [sys.executable, os.path.join(ROOT, "serve_rewards.py"), "--reward_fn", spec,
                       "--reward_options", json.dumps(options), "--port", str(port), "--num_cpus_per_replica", "1",
                       "--num_cpus", "2", "--batch_wait_s", "0.05"]
        url.proc = None
        return url

    def start(self) -> "RewardService":
        """Returns once it answers (or fails the test with its log's end)."""
        self.proc = start_server(self.command, f"{self}/health", self.log, cwd=self.root, env=self.env)
        return self

    def stop(self) -> None:
        stop_server(self.proc)

    def requests(self) -> int:
        """The scoring requests its replica answered."""
        return json.loads(urllib.request.urlopen(f"{self}/health", timeout=10).read())["requests"]
