"""The tests' script server (tests/_script_server.py) runs a script in a forked child as a fresh
interpreter would: the same output, exit status, working directory, argv, environment,
``__main__``, atexit handlers and joined threads. Each case runs both ways and compares."""

import os
import subprocess
import sys

import pytest

from conftest import ScriptServer, script_env, script_server

PROBE = '''
import atexit, os, sys, threading, time

mode = sys.argv[1]
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "probe", os.environ.get("GENRL_PROBE"),
      "script folder first", sys.path[0] == os.path.dirname(os.path.abspath(__file__)), "name", __name__)
atexit.register(lambda: print("atexit ran", flush=True))


def late():
    time.sleep(0.2)
    print("the thread finished", flush=True)


threading.Thread(target=late).start()
with open("written.txt", "w") as f:
    f.write(mode)
if mode == "status":
    sys.exit(3)
if mode == "sentence":
    sys.exit("train_genrl.py: error: one sentence")
if mode == "raise":
    raise ValueError("a traceback")
'''


@pytest.mark.parametrize("mode", ["ok", "status", "sentence", "raise"])
def test_a_forked_run_is_a_fresh_run(mode, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**script_env(), "GENRL_PROBE": "seen"}
    runs = {}
    for how in ("fresh", "forked"):
        cwd = tmp_path / how / "cwd"
        cwd.mkdir(parents=True)
        if how == "fresh":
            runs[how] = subprocess.run([sys.executable, str(script), mode], cwd=cwd, env=env, capture_output=True,
                                       text=True, timeout=60)
        else:
            runs[how] = script_server().run(str(script), [mode], str(cwd), env, timeout=60, text=True)
        assert (cwd / "written.txt").read_text() == mode
    fresh, forked = runs["fresh"], runs["forked"]
    assert forked.returncode == fresh.returncode == {"ok": 0, "status": 3, "sentence": 1, "raise": 1}[mode]
    assert forked.stdout == fresh.stdout
    assert "probe seen" in fresh.stdout and "script folder first True name __main__" in fresh.stdout
    assert fresh.stdout.endswith("the thread finished\natexit ran\n")
    if mode == "raise":  # the traceback's frames differ (runpy's), not its last line
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "ValueError: a traceback"
    else:
        assert forked.stderr == fresh.stderr


def test_a_run_past_its_timeout_is_killed_and_reported_as_subprocess_run_would(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as timeout:
        script_server().run(str(script), [], str(tmp_path), script_env(), timeout=1, text=True)
    assert timeout.value.output == "started\n"
    # The server answers the next request: the killed child was reaped.
    quick = tmp_path / "quick.py"
    quick.write_text("print('done')\n")
    assert script_server().run(str(quick), [], str(tmp_path), script_env(), timeout=30, text=True).stdout == "done\n"


def test_only_the_servers_environment_forks():
    server = script_server()
    assert server.serves({**server.env, "PYTEST_CURRENT_TEST": "another test"})
    assert not server.serves({**server.env, "HF_HOME": "/elsewhere"})  # read when huggingface_hub is imported
    assert not server.serves({k: v for k, v in server.env.items() if k != "HF_HUB_OFFLINE"})
    assert set(ScriptServer.SCRIPTS) == {"train_genrl.py", "eval_genrl.py"}
