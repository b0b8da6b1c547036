"""DeepSpeed's C++ ops built at run time: the one the trainer keeps DeepSpeed from building, and
the build locks of the ones a run needs, checked before the process group exists.

DeepSpeed builds an op it was not installed with (``DS_BUILD_<OP>=1 pip install deepspeed``)
through torch's JIT extension builder, which holds a lock file, ``<op>/lock`` under
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions/py<version>_<cpu|cuXYZ>``),
around every load, of a cached build too. A process killed while holding it leaves the file
behind, and from then on every load of that op waits for it to go, silently and forever.

Its CPU communication backend builds one at every process start: the shared-memory all-reduce
(``deepspeed_shm_comm``), used only by its inference all-reduce, never by training (its
``all_reduce`` is torch.distributed's). ``skip_shm_comm_op`` keeps it unbuilt. The ops a run
does need (``cpu_adam`` for an offloaded optimizer, ``async_io`` for NVMe offload) are loaded
once the model is prepared; ``check_build_locks`` finds a lock left in their way first.
"""

from __future__ import annotations

import logging
import os
import time

from genrl.errors import SetupError

logger = logging.getLogger(__name__)

# Longer than any one op's build takes on a busy machine (cpu_adam: 3 minutes on 2 busy cores).
BUILD_LOCK_WAIT_S = 600.0


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed's CPU communication backend from building and loading its shared-memory
    all-reduce op, which only its inference all-reduce uses. Call before the backend starts.

    The backend builds the op only when ``deepspeed.ops.__compatible_ops__`` marks it
    compatible, and that dict is built once and kept, so marking it incompatible lasts. A
    no-op on accelerators without the op (CUDA: NCCL)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().get_op_builder("ShareMemCommBuilder")
    if builder is None:
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[builder.NAME] = False


def needed_jit_ops(zero_config: dict) -> list[str]:
    """The names of the ops DeepSpeed will build at run time for this ``zero_optimization``
    config (and the trainer's AdamW); those it was installed with are left out."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    def device(key):
        return str((zero_config.get(key) or {}).get("device", "none")).lower()

    classes = []
    if device("offload_optimizer") in ("cpu", "nvme"):  # Accelerate swaps AdamW for DeepSpeedCPUAdam
        classes.append("CPUAdamBuilder")
    if "nvme" in (device("offload_optimizer"), device("offload_param")):
        classes.append("AsyncIOBuilder")
    accelerator = get_accelerator()
    names = [builder.NAME for builder in map(accelerator.get_op_builder, classes) if builder is not None]
    prebuilt = accelerator_name == accelerator._name  # DeepSpeed's own test before it loads an installed op
    return [name for name in names if not (prebuilt and installed_ops.get(name, False))]


def build_lock_path(op: str) -> str:
    """The lock file torch's JIT builder holds while it builds or loads ``op``."""
    from torch.utils.cpp_extension import _get_build_directory

    return os.path.join(_get_build_directory(op, verbose=False), "lock")


def lock_holders(path: str) -> list[int] | None:
    """The PIDs of this machine's processes that have ``path`` open (torch's builder keeps its
    lock file open while it holds it), or None where ``/proc`` cannot tell. Other users'
    processes are not seen."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target = os.path.realpath(path)
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            # readlink, not stat: it never waits on the file's (perhaps network) filesystem
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd")):
                holders.append(int(pid))
        except OSError:  # gone meanwhile, or another user's
            continue
    return holders


def wait_for_build_lock(path: str, op: str, timeout_s: float = BUILD_LOCK_WAIT_S, poll_s: float = 1.0) -> str | None:
    """None once ``path`` (``op``'s build lock) is gone; the sentence that stops the run if it
    is stale, or still there after ``timeout_s``.

    A lock that no process on this machine holds is stale at once: a build holds it open from
    the moment it creates it to just before it removes it. While one does, this waits for that
    build. Where ``/proc`` cannot tell, it waits ``timeout_s`` for the lock to go."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while os.path.exists(path):
        holders = lock_holders(path)
        if holders == []:
            time.sleep(0.1)  # a finishing build closes the file just before it removes it
            if os.path.exists(path):
                return (f"DeepSpeed's build lock {path} is stale (no process on this machine holds it: a build of its "
                        f"{op} op was killed while holding it) and every DeepSpeed launch here would wait on it "
                        f"forever: delete it, unless a machine that shares this folder is building {op} right now.")
            return None
        if time.monotonic() >= deadline:
            if holders:
                return (f"PID {', '.join(map(str, holders))} on this machine has held DeepSpeed's build lock {path} "
                        f"for more than {timeout_s:g} s building its {op} op: let it finish or stop it, then launch "
                        f"again.")
            return (f"DeepSpeed's build lock {path} did not go within {timeout_s:g} s: delete it if no process "
                    f"(here or on a machine that shares this folder) is building its {op} op, as a killed build "
                    f"leaves it behind and every DeepSpeed launch would wait on it forever.")
        if not announced:
            who = f"PID {', '.join(map(str, holders))}" if holders else "another process"
            logger.warning(f"Waiting (at most {timeout_s:g} s) for {who} to finish building DeepSpeed's {op} op "
                           f"({path}).")
            announced = True
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
    return None


def check_build_locks(zero_config: dict, timeout_s: float = BUILD_LOCK_WAIT_S) -> None:
    """Before the process group exists (every rank of a launch gets past this before any of
    them builds), raise ``SetupError`` with one sentence for a build lock that would make this
    run wait forever on an op it needs (``needed_jit_ops``)."""
    for op in needed_jit_ops(zero_config):
        problem = wait_for_build_lock(build_lock_path(op), op, timeout_s)
        if problem is not None:
            raise SetupError(problem)
