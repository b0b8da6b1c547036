"""One run per output folder: an OS-level lock that the run holds on it for its whole life.

Two runs writing into one folder interleave ``metrics.jsonl``, remove each other's unfinished
checkpoints and leave checkpoints of both. The run that takes the folder holds ``fcntl.flock``
on ``<output_dir>/.genrl.lock``: the kernel releases it when the process ends, however it
ends, so a killed run never blocks the next one (a marker file would). The holder writes its
host and PID into the file, for the sentence that refuses a second run. The file itself stays
after the run: removing a lock file races with a process that has just opened it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time

from genrl.errors import SetupError

LOCK_FILE = ".genrl.lock"

logger = logging.getLogger(__name__)

# Holders whose descriptor a forked child closes: a child that outlived its parent (a worker
# left behind by a kill) would otherwise keep the folder locked after the run is gone.
_holders: "set[OutputDirLock]" = set()


def _close_in_child() -> None:
    # Closing the child's copy leaves the parent's lock alone (flock belongs to the open file,
    # which the parent's descriptor still refers to); LOCK_UN here would release it.
    for holder in list(_holders):
        holder.release()


os.register_at_fork(after_in_child=_close_in_child)


class OutputDirLock:
    """The lock of one output folder: ``acquire`` takes it or raises ``SetupError`` naming the
    run that holds it; ``release`` (or leaving the ``with`` block) gives it back, and so does
    the end of the process. A holder that never acquired (another rank's) releases nothing."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.fd: int | None = None

    def acquire(self) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SetupError(busy_sentence(self.output_dir, self.path, read_holder(self.path))) from None
            if error.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            # Some network filesystems refuse locks (Lustre without its flock mount option):
            # running unlocked there beats refusing every run.
            logger.warning(f"{self.output_dir} cannot be locked ({error.strerror}): nothing stops a second run from "
                           f"writing into it while this one runs.")
            return
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({"host": socket.gethostname(), "pid": os.getpid()}) + "\n").encode())
        self.fd = fd
        _holders.add(self)

    def release(self) -> None:
        # Closing the last descriptor of the lock's open file releases the lock.
        if self.fd is not None:
            fd, self.fd = self.fd, None
            _holders.discard(self)
            os.close(fd)

    def __enter__(self) -> "OutputDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def read_holder(path: str, patience_s: float = 1.0) -> dict | None:
    """The ``{"host", "pid"}`` a holder wrote into the lock file, or None if it has not (yet):
    a holder writes it right after taking the lock, so an empty file is read again for up to
    ``patience_s`` seconds."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            with open(path) as f:
                holder = json.loads(f.read())
            if isinstance(holder, dict) and "pid" in holder:
                return holder
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def busy_sentence(output_dir: str, path: str, holder: dict | None) -> str:
    """The refusal of a second run into ``output_dir``."""
    who = f"PID {holder['pid']} on {holder.get('host', 'an unknown host')}" if holder else "another process"
    return (f"{output_dir} is in use by another run ({who} holds its lock {path}): wait for that run to end or stop "
            f"it, or pick another --output_dir.")


def lock_output_dir(accelerator, output_dir: str, *, take: bool | None = None) -> OutputDirLock:
    """Take ``output_dir``'s lock before anything in it is read, cleared or written, or stop
    every rank with the same ``SetupError`` naming the run that holds it.

    ``take``: whether this process takes the lock; by default the global main process does,
    once for the whole run (nodes sharing the folder included). Every rank learns every
    taker's outcome through one gather, so a run whose nodes write to disks of their own can
    pass each node's local main process. Returns this process's holder (one that holds
    nothing on the other ranks)."""
    from accelerate.utils import gather_object

    holder = OutputDirLock(output_dir)
    refusal = None
    if accelerator.is_main_process if take is None else take:
        try:
            holder.acquire()
        except SetupError as error:
            refusal = str(error)
    refusals = gather_object([refusal]) if accelerator.num_processes > 1 else [refusal]
    refused = next((r for r in refusals if r), None)
    if refused is not None:
        holder.release()
        raise SetupError(refused)
    return holder
