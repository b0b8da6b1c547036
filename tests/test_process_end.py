"""How the scripts end (``genrl.distributed.launch.end_processes``): a process that ran collectives
exits with the run's status without the interpreter's teardown, its output flushed; one that
did not returns as usual."""

import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, script_env

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import atexit, socket, sys
    import torch.distributed as dist
    from accelerate import Accelerator
    from genrl.distributed.launch import end_processes
    if sys.argv[1] == "collectives":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    accelerator = Accelerator(cpu=True)
    atexit.register(lambda: print("interpreter teardown", flush=True))
    print("work done", end="")  # unflushed: end_processes must flush it
    end_processes(accelerator, exit_code=3)
    print(" and returned")
""")


@pytest.mark.parametrize("mode", ["collectives", "single"])
def test_end_processes_skips_the_teardown_only_after_collectives(mode):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env=script_env(), capture_output=True,
                          text=True, timeout=120)
    if mode == "collectives":
        assert proc.returncode == 3, proc.stderr[-2000:]
        assert proc.stdout == "work done", proc.stdout  # flushed, and no atexit handler ran
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout == "work done and returned\ninterpreter teardown\n"
