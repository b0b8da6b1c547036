"""Servers a test module starts on localhost (the reward service, `transformers serve`) and
stops by their process id."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from typing import IO

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
