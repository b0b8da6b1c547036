"""The processes of a run: Accelerate / DeepSpeed set-up shared by the scripts, the checks on what
the launcher started, and how the processes end.

The same ``accelerate_configs/*.yaml`` serve GPUs (NCCL) and CPU-only machines (gloo):
DeepSpeed runs on CPU through gloo when CUDA is absent. There is no dataloader for
Accelerate to read DeepSpeed's micro batch from, so the scripts set it from their arguments.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, parse_flag_from_env

from genrl.errors import SetupError


def gpu_shortage(local_processes: int, gpus: int) -> str | None:
    """The sentence for more processes on this machine than visible GPUs, else None.

    NCCL needs one GPU per process: two ranks on one GPU fail deep inside NCCL ("invalid
    usage"). With no GPU at all the scripts use gloo on the CPU, so 0 GPUs is fine."""
    if gpus == 0 or local_processes <= gpus:
        return None
    return (
        f"{local_processes} processes were launched on this machine but only {gpus} GPU(s) are visible, and NCCL needs "
        f"one GPU per process: launch with --num_processes {gpus}, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run "
        f"every process on the CPU with gloo."
    )


def build_accelerator(
    *,
    output_dir: str,
    logging_dir: str = "logs",
    mixed_precision: str | None = None,
    gradient_accumulation_steps: int = 1,
    log_with: str | list[str] | None = None,
    collective_timeout_s: float | None = None,
) -> Accelerator:
    """An Accelerator that uses gloo when there is no CUDA (DeepSpeed included).

    ``collective_timeout_s`` bounds every collective of the process group (gloo and NCCL,
    DeepSpeed's included): a rank waiting longer for a hung or stopped peer fails instead of
    waiting forever (see :func:`describe_timeout`). Under DeepSpeed, ``prepare_deepspeed_start``
    runs first.
    """
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    launched = _launched()
    cpu_only = launched and not torch.cuda.is_available()
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    shortage = gpu_shortage(local_processes, torch.cuda.device_count()) if launched else None
    if shortage:
        raise SetupError(shortage)
    group = {"backend": "gloo"} if cpu_only else {}
    if collective_timeout_s:
        group["timeout"] = timedelta(seconds=collective_timeout_s)
        # DeepSpeed builds its data-parallel groups with new_group(ranks), which takes torch's
        # module default (30 min), not the default group's timeout: set that default too.
        import torch.distributed.distributed_c10d as c10d

        c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = group["timeout"]
    if deepspeed:
        prepare_deepspeed_start(cpu_only=cpu_only, local_processes=local_processes)
    # A single plain process has no process group: a backend there would make Accelerate ask for one.
    kwargs_handlers = [InitProcessGroupKwargs(**group)] if launched and group else []
    return Accelerator(
        # Without CUDA, a multi_gpu (DDP) config becomes DDP over gloo on CPU; DeepSpeed keeps its own type.
        cpu=cpu_only and not deepspeed,
        gradient_accumulation_steps=gradient_accumulation_steps,
        mixed_precision=mixed_precision,
        log_with=None if log_with in (None, "none", ["none"]) else log_with,
        project_config=ProjectConfiguration(project_dir=output_dir, logging_dir=f"{output_dir}/{logging_dir}"),
        kwargs_handlers=kwargs_handlers,
    )


def prepare_deepspeed_start(*, cpu_only: bool, local_processes: int) -> None:
    """Before DeepSpeed's communication backend starts: no op built at every process start,
    and a build lock in the way of an op this run needs stops it in one sentence
    (``genrl.distributed.deepspeed_ops``) instead of a launch that waits forever."""
    from accelerate.utils import DeepSpeedPlugin

    from genrl.distributed.deepspeed_ops import check_build_locks, skip_shm_comm_op

    skip_shm_comm_op()
    if cpu_only:
        # DeepSpeed's CPU accelerator counts its "devices" as NUMA nodes by running `numactl`
        # in a subprocess unless LOCAL_SIZE is set, and ZeRO-3 asks at every gradient
        # reduce-scatter (~1,200 forks in a 3-step test run). It is set as DeepSpeed's own
        # launcher sets it; its only other reader is the shared-memory op kept unbuilt above.
        os.environ.setdefault("LOCAL_SIZE", str(local_processes))
    # The config as Accelerate will read it (the launch's variables, or its DeepSpeed JSON).
    check_build_locks(DeepSpeedPlugin().deepspeed_config.get("zero_optimization", {}))


def _launched() -> bool:
    """Whether this process belongs to a process group: several processes, or DeepSpeed (which
    makes one of a single process too)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"


def runs_on_cpu() -> bool:
    """Whether ``build_accelerator`` will put this process on the CPU, known before it is built
    so that settings that need an accelerator are refused at parse time: the launcher asked for
    the CPU (``--cpu``), a process group without CUDA (gloo, as ``build_accelerator`` sets up),
    or no accelerator torch can use."""
    if parse_flag_from_env("ACCELERATE_USE_CPU"):
        return True
    if _launched():
        return not torch.cuda.is_available()
    devices = getattr(torch, "accelerator", None)  # torch >= 2.6: CUDA, MPS, XPU and others alike
    return not (devices.is_available() if devices is not None else torch.cuda.is_available())


def check_mixed_precision(precision: str | None) -> None:
    """fp16 on the CPU is refused (ValueError, one sentence): torch has no fast float16 kernels
    there (a matrix product about 20 times slower than in float32 on an AVX-512 CPU) and it
    changes the scores; bf16 is the CPU's reduced precision. ``precision``: the flag's value, else
    what ``accelerate launch --mixed_precision`` exported."""
    precision = precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision == "fp16" and runs_on_cpu():
        raise ValueError(
            "--mixed_precision fp16 is for GPUs: on the CPU it runs the models in float16, far slower than in float32 "
            "and with other scores; use --mixed_precision bf16 (the CPU's fast reduced precision) or no."
        )


def _launcher_environment() -> list[bytes] | None:
    """The environment this process's parent (the launcher) started with, as ``NAME=value``
    entries (Linux ``/proc``), or None where it cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def check_launched_processes() -> None:
    """``accelerate launch`` asked for several processes that started this one alone: a
    ValueError of one sentence. Without a multi-process config the launcher starts several
    processes only on 2 or more GPUs; else it runs the script once, with the MASTER_ADDR it set
    for the processes it did not start and no WORLD_SIZE. A MASTER_ADDR the launcher itself
    inherited (a cluster job's) says nothing: the launcher's own environment tells them apart,
    and where it cannot be read nothing is said."""
    env = os.environ
    if "ACCELERATE_DYNAMO_BACKEND" not in env or "WORLD_SIZE" in env or "MASTER_ADDR" not in env:
        return  # not accelerate launch's single-process launcher, or no sign of more processes
    inherited = _launcher_environment()
    if inherited is None or any(entry.startswith(b"MASTER_ADDR=") for entry in inherited):
        return
    gpus = torch.cuda.device_count()
    raise ValueError(
        f"accelerate launch was asked for more than one process but started this one alone (without a multi-process "
        f"config file it starts several only on 2 or more GPUs, and this machine shows {gpus}): add --config_file "
        f"accelerate_configs/multi_gpu.yaml to run them (on the CPU over gloo), or launch one process."
    )


def cpu_threads_per_process(requested: int, cores: int, local_processes: int) -> int:
    """Torch threads of each process training on the CPU: ``requested`` when > 0, else
    max(1, cores // local_processes), the machine's cores shared among its processes.

    ``accelerate launch`` without a config sets OMP_NUM_THREADS=1 for a CPU run, so a 2-core
    machine would otherwise leave one core idle."""
    if requested < 0:
        raise ValueError(f"cpu_threads must be >= 0 (0: the cores shared among the processes), got {requested}.")
    return requested if requested > 0 else max(1, cores // max(1, local_processes))


def describe_timeout(err: BaseException, timeout_s: float) -> str | None:
    """One sentence for a collective that timed out waiting for a peer (rank and operation
    named), or None when ``err`` is something else."""
    text = str(err)
    if not isinstance(err, RuntimeError) or ("Timed out" not in text and "timed out" not in text.lower()):
        return None
    operation, tb = "a collective", err.__traceback__
    while tb is not None:  # the innermost torch.distributed call is the operation that waited
        if tb.tb_frame.f_code.co_filename.endswith("distributed_c10d.py"):
            operation = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    rank = os.environ.get("RANK", "0")
    return (
        f"Rank {rank} waited more than --collective_timeout {timeout_s:g} s in {operation} for the other processes "
        f"({text.splitlines()[0].strip()}): one of them is hung, stopped or dead, so the run was ended."
    )


def configure_deepspeed(accelerator: Accelerator, *, micro_batch_size: int, max_grad_norm: float) -> None:
    """Fill DeepSpeed's batch sizes and clipping from the script's arguments (no-op without
    DeepSpeed). train_batch_size = micro batch * accumulation steps * processes."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    config = plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["gradient_accumulation_steps"] = accelerator.gradient_accumulation_steps
    config["train_batch_size"] = micro_batch_size * accelerator.gradient_accumulation_steps * accelerator.num_processes
    config["gradient_clipping"] = max_grad_norm


def end_processes(accelerator: Accelerator, exit_code: int = 0) -> None:
    """The scripts' last step: Accelerate's ``end_training`` (trackers closed, process group
    destroyed), then, where this process ran collectives, its exit with ``exit_code`` without
    Python's interpreter teardown (streams and logging flushed first); otherwise it returns.

    Gloo work objects that DeepSpeed still references can outlive ``destroy_process_group`` and
    hold tensors; freeing those while the interpreter is torn down aborts the process with
    "terminate called without an active exception" (pytorch/pytorch#179291). On the CPU here that
    killed one rank of a finished 2-process ZeRO-3 run now and then, after its export was written.
    """
    collectives = torch.distributed.is_available() and torch.distributed.is_initialized()
    accelerator.end_training()
    if not collectives:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(exit_code)
