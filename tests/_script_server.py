"""A pre-imported interpreter that runs the top-level scripts in forked children, for the tests.

A single-process launch of ``train_genrl.py`` or ``eval_genrl.py`` on the tests' tiny models
spends about 13 s importing torch, diffusers, transformers, datasets and matplotlib and a few
seconds running. This server imports the scripts' modules once per test worker; each request
forks a child that runs the script as ``python script.py args`` would: its own process, working
directory, argv, stdout and stderr, ``__name__ == "__main__"``, and the interpreter's exit
(non-daemon threads joined, atexit handlers run, output flushed, the exit status of
``sys.exit`` or of an uncaught exception with its traceback). Only the imports are shared, and
the child skips the interpreter's final teardown of the module graph (about 2.8 s of freeing
objects that a fresh process pays at every exit). Multi-process runs still go through
``accelerate launch`` (``conftest.launch_command``), and runs that need another environment
(``conftest.ScriptServer.serves``) start a fresh interpreter.

Protocol, one JSON object a line: a request ``{"script", "args", "cwd", "env", "out", "err"}`` on stdin
is answered ``{"pid": ...}`` once the child runs, then ``{"returncode": ...}`` (negative: killed
by that signal) once it has ended. The server exits when stdin closes.
"""

import atexit
import json
import os
import runpy
import sys
import threading


def serve() -> None:
    """Answer requests until stdin closes."""
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


def run_child(request: dict) -> None:
    """In the forked child: become ``python script args`` in ``cwd`` with stdout and stderr in
    the given files, run the script, exit; never returns."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the server's request pipe is not the script's stdin
    os.close(null)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)  # as `python script.py` puts the script's folder first
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit_request:
        status = exit_status(exit_request.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    exit_without_teardown(status)


def exit_status(code: object) -> int:
    """The status ``python script.py`` ends with after ``sys.exit(code)``: None is 0, an int
    itself, anything else is printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_without_teardown(status: int) -> None:
    """End the child as the interpreter ends a script, up to its final teardown: wait for the
    non-daemon threads, run the atexit handlers, flush the output, then exit at once."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    # The repository root in place of tests/, as `python train_genrl.py` would have it.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # What the scripts import; nothing runs (no thread pool, no model) before the forks.
    import eval_genrl  # noqa: F401
    import train_genrl  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    serve()
