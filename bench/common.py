"""Shared parts of the benchmark scripts: the machine line, timing, peak memory, output, the
benchmark models and the launcher of multi-process workers.

Every script prints its figures as JSON lines (one object per measurement, ``"bench"`` names
the script) followed by a table for people, and one ``{"machine": {...}}`` line first. Figures
are printed, never asserted. Times are wall-clock seconds, medians over ``repeats``; memory is
MiB (2^20 bytes).

Peak memory (``PeakMemory``): on CUDA, ``torch.cuda.max_memory_allocated`` (reset at the start
of the measured block); on a CPU, the peak resident set size of the process (``VmHWM``), reset
at the start of the block through ``/proc/self/clear_refs`` (Linux), after ``malloc_trim`` has
returned memory freed by earlier work to the OS. RSS counts everything the
process holds (Python, libraries, the model), so the figure is an absolute peak, not a delta;
``start_mb`` gives the level it started from.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Iterator, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from genrl.training.console import silence_known_noise  # noqa: E402

# The benchmarks print what the trainer prints: none of its known start-up noise.
silence_known_noise()

import torch  # noqa: E402

# Prompts every tiny tokenizer knows (genrl.testing.tiny_pipelines.TINY_VOCAB), one per prompt group.
PROMPTS = (
    "a red circle", "two blue squares", "a green triangle left of a yellow circle", "three red triangles",
    "a blue circle above a red square", "two yellow circles", "a green square", "a red square below a blue triangle",
)

MEMORY_KIND = {"cuda": "cuda_max_allocated", "cpu": "rss_peak"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----- the machine ------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_description(device: str | torch.device = "cpu", note: str | None = None) -> dict[str, Any]:
    """Where the figures come from: platform, CPU model and count, memory, library versions,
    device, torch threads, and the 1-minute load average when the script started (other jobs on
    a shared machine slow every figure down)."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
        "deepspeed": _version("deepspeed"),
        "device": str(device),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    if hasattr(os, "getloadavg"):
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gb"] = round(props.total_memory / 2**30, 1)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    if note:
        info["note"] = note
    return info


def print_machine(device: str | torch.device = "cpu", note: str | None = None) -> dict[str, Any]:
    """Print the ``{"machine": ...}`` line and return the description."""
    info = machine_description(device, note)
    print(json.dumps({"machine": info}), flush=True)
    return info


# ----- output -------------------------------------------------------------------------------


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, (list, tuple)):  # curves: the floats inside too
        return [_round(v) for v in value]
    return value


def emit(record: dict[str, Any]) -> dict[str, Any]:
    """Print one figure as a JSON line (floats to 4 significant digits) and return it."""
    record = {k: _round(v) for k, v in record.items()}
    print(json.dumps(record), flush=True)
    return record


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str | None = None) -> None:
    """Print ``rows`` as an aligned text table of ``columns`` (missing values as ``-``)."""
    if not rows:
        return
    cells = [[("-" if row.get(c) is None else str(_round(row.get(c)))) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    if title:
        print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
    sys.stdout.flush()


# ----- timing -------------------------------------------------------------------------------


def synchronize(device: str | torch.device) -> None:
    """Wait for queued device work, so that wall-clock time covers it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], Any], device: str | torch.device) -> float:
    """Seconds ``fn()`` takes, device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def time_interleaved(
    fns: dict[str, Callable[[], Any]], device: str | torch.device, repeats: int
) -> dict[str, float]:
    """Median seconds of each function over ``repeats`` rounds, the functions taking turns
    within a round, so that a change of machine load hits all of them alike (their ratios
    stay meaningful on a shared machine)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_once(fn, device))
    return {name: statistics.median(values) for name, values in times.items()}


def set_threads(threads: int | None) -> None:
    """Torch intra-op threads (None: leave torch's default, one per usable core)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}.")
        torch.set_num_threads(threads)


# ----- memory -------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _memory_mb(device: str | torch.device, cuda_bytes, status_field: str) -> float:
    """CUDA figure via ``cuda_bytes(device)``, or a /proc/self/status field on a CPU (MiB);
    without /proc, the process's max RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        return cuda_bytes(device) / 2**20
    kib = _status_kib(status_field)
    if kib is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    return kib / 2**10


def current_memory_mb(device: str | torch.device) -> float:
    """Memory held now: CUDA allocated, or the process RSS on a CPU (MiB)."""
    return _memory_mb(device, torch.cuda.memory_allocated, "VmRSS")


def _release_free_heap() -> None:
    """Hand memory that is freed but kept by glibc's allocator back to the OS, so that the
    RSS a block starts from is what is live, not what earlier, larger work left behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_memory(device: str | torch.device) -> bool:
    """Restart peak tracking; False where the CPU peak cannot be reset (it then covers the
    process lifetime)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    _release_free_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


def peak_memory_mb(device: str | torch.device) -> float:
    """Peak since the last reset: CUDA max allocated, or the peak RSS (MiB)."""
    return _memory_mb(device, torch.cuda.max_memory_allocated, "VmHWM")


def tensor_memory_mb(device: str | torch.device) -> float:
    """Memory held by tensors now (MiB): CUDA allocated; on a CPU the storages of every tensor
    the garbage collector reaches, each counted once. Unlike RSS it leaves out the
    interpreter, libraries and freed memory the allocator keeps, so it shows what a
    sharding scheme keeps per process."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    gc.collect()
    spans: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == device.type:
                storage = obj.untyped_storage()
                start = storage.data_ptr()
                spans[start] = max(spans.get(start, 0), storage.nbytes())
        except Exception:  # noqa: BLE001 - odd objects (lazy proxies, freed storages) are skipped
            continue
    # Union of the address ranges: storages that share memory (flat buffers) count once.
    total, reach = 0, 0
    for start, size in sorted(spans.items()):
        end = start + size
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 2**20


class PeakMemory:
    """``with PeakMemory(device) as mem: ...`` then ``mem.peak_mb`` (peak inside the block),
    ``mem.start_mb`` (held when it started) and ``mem.reset`` (whether the peak could be reset)."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.start_mb = self.peak_mb = float("nan")
        self.reset = False

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        self.reset = reset_peak_memory(self.device)
        self.start_mb = current_memory_mb(self.device)
        return self

    def __exit__(self, *exc) -> None:
        self.peak_mb = peak_memory_mb(self.device)


def memory_kind(device: str | torch.device) -> str:
    return MEMORY_KIND.get(torch.device(device).type, "rss_peak")


# ----- the models ---------------------------------------------------------------------------

def _flux2_scale(double_blocks: int, single_blocks: int, heads: int) -> dict[str, Any]:
    """A FLUX.2 transformer's sizes: its checkpoints' 128-wide heads, RoPE axes and timestep channels."""
    return dict(num_layers=double_blocks, num_single_layers=single_blocks, attention_head_dim=128,
                num_attention_heads=heads, timestep_guidance_channels=256, axes_dims_rope=(32, 32, 32, 32))


# Transformer sizes on top of the tiny pipelines (genrl.testing.tiny_pipelines): the same components,
# text encoders and VAEs, with a larger transformer of the same family. "tiny" keeps the
# pipeline's own transformer (0.02-0.08 M parameters).
SCALES: dict[str, dict[str, dict[str, Any]]] = {
    "wan": {
        "small": dict(num_attention_heads=4, attention_head_dim=32, ffn_dim=512, num_layers=4, freq_dim=64),
        "mid": dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, num_layers=8, freq_dim=128),
        "large": dict(num_attention_heads=12, attention_head_dim=64, ffn_dim=3072, num_layers=16, freq_dim=128),
    },
    "sd3": {
        "small": dict(num_layers=4, attention_head_dim=32, num_attention_heads=4, caption_projection_dim=128,
                      pos_embed_max_size=64),
        "mid": dict(num_layers=8, attention_head_dim=64, num_attention_heads=8, caption_projection_dim=512,
                    pos_embed_max_size=64),
        "large": dict(num_layers=16, attention_head_dim=64, num_attention_heads=12, caption_projection_dim=768,
                      pos_embed_max_size=64),
    },
    "flux": {
        "small": dict(num_layers=2, num_single_layers=4, attention_head_dim=32, num_attention_heads=4,
                      axes_dims_rope=(8, 12, 12)),
        "mid": dict(num_layers=4, num_single_layers=8, attention_head_dim=64, num_attention_heads=8,
                    axes_dims_rope=(16, 24, 24)),
        "large": dict(num_layers=6, num_single_layers=12, attention_head_dim=64, num_attention_heads=12,
                      axes_dims_rope=(16, 24, 24)),
    },
    # The newer families keep their checkpoints' head width (128) and block layout, with 2, 4 and
    # 6 heads (width 256, 512, 768); "large" has the real checkpoint's depth.
    "zimage": {  # Z-Image: 30 layers behind 2 noise and 2 caption refiner layers, RoPE axes 32 / 48 / 48
        "small": dict(dim=256, n_heads=2, n_kv_heads=2, n_layers=4, n_refiner_layers=1, axes_dims=[32, 48, 48]),
        "mid": dict(dim=512, n_heads=4, n_kv_heads=4, n_layers=8, n_refiner_layers=2, axes_dims=[32, 48, 48]),
        "large": dict(dim=768, n_heads=6, n_kv_heads=6, n_layers=30, n_refiner_layers=2, axes_dims=[32, 48, 48]),
    },
    # FLUX.2 [klein] 9B: 8 double- and 24 single-stream blocks; FLUX.2 [dev]: 8 and 48.
    "flux2-klein": {"small": _flux2_scale(1, 3, 2), "mid": _flux2_scale(2, 6, 4), "large": _flux2_scale(8, 24, 6)},
    "flux2": {"small": _flux2_scale(1, 6, 2), "mid": _flux2_scale(2, 12, 4), "large": _flux2_scale(8, 48, 6)},
    "qwenimage": {  # Qwen-Image: 60 dual-stream blocks, RoPE axes 16 / 56 / 56
        "small": dict(num_layers=4, attention_head_dim=128, num_attention_heads=2, axes_dims_rope=(16, 56, 56)),
        "mid": dict(num_layers=15, attention_head_dim=128, num_attention_heads=4, axes_dims_rope=(16, 56, 56)),
        "large": dict(num_layers=60, attention_head_dim=128, num_attention_heads=6, axes_dims_rope=(16, 56, 56)),
    },
}
# large: 156 M (wan), 335 M (sd3), 237 M (flux), 267 M (zimage), 318 M (flux2-klein), 502 M (flux2),
# 1.28 B (qwenimage) parameters
SCALE_NAMES = ("tiny", "small", "mid", "large")


def bench_transformer_config(family: str, scale: str, tiny: dict) -> dict[str, Any]:
    """``tiny`` (the config of the tiny ``family`` pipeline's transformer) with its sizes replaced
    by ``SCALES[family][scale]`` (``tiny``: unchanged)."""
    config = {k: v for k, v in tiny.items() if not k.startswith("_")}
    return config if scale == "tiny" else {**config, **SCALES[family][scale]}


def build_bench_policy(family: str, scale: str = "tiny", seed: int = 0):
    """A ``FlowPolicy`` over the tiny ``family`` pipeline whose transformer is of size ``scale``
    ("tiny", "small", "mid", "large"), random init from ``seed``, float32 on the CPU."""
    from genrl.policies import policy_for_pipeline
    from genrl.testing.tiny_pipelines import FAMILIES, TINY_SAMPLING_DEFAULTS, build_tiny_pipeline

    if family not in FAMILIES:
        raise ValueError(f"Unknown family {family!r}; expected one of {FAMILIES}.")
    if scale not in SCALE_NAMES:
        raise ValueError(f"Unknown model scale {scale!r}; expected one of {SCALE_NAMES}.")
    pipeline = build_tiny_pipeline(family, seed=seed)
    if scale != "tiny":
        tiny = pipeline.transformer
        config = bench_transformer_config(family, scale, tiny.config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            transformer = type(tiny).from_config(config)
        pipeline.register_modules(transformer=transformer)
    defaults = {f"default_{k}": v for k, v in TINY_SAMPLING_DEFAULTS[family].items()}
    return policy_for_pipeline(pipeline, **defaults)


def save_bench_pipeline(family: str, scale: str, path: str, seed: int = 0) -> str:
    """``build_bench_policy``'s pipeline saved in diffusers format under ``path`` (with its
    ``sampling_defaults.json``), for workers that load it as the trainer does; returns ``path``."""
    from genrl.policies import SAMPLING_DEFAULTS_FILE
    from genrl.testing.tiny_pipelines import TINY_SAMPLING_DEFAULTS

    build_bench_policy(family, scale, seed).pipeline.save_pretrained(path)
    with open(os.path.join(path, SAMPLING_DEFAULTS_FILE), "w") as f:
        json.dump(TINY_SAMPLING_DEFAULTS[family], f)
    return path


def count_parameters(module: torch.nn.Module) -> int:
    """All of the module's parameter elements (on all ranks together where ZeRO-3 partitions them)."""
    from genrl.distributed.zero_init import full_numel
    from genrl.policies.base import unwrap_module

    return sum(full_numel(p) for p in unwrap_module(module).parameters())


def group_prompts(batch_size: int, group_size: int) -> tuple[list[str], list[int]]:
    """``batch_size`` samples made of whole groups: prompts and index-in-group lists."""
    if group_size < 1 or batch_size < 1 or batch_size % group_size != 0:
        raise ValueError(
            f"batch size {batch_size} must be a positive multiple of the group size {group_size}."
        )
    prompts, indices = [], []
    for g in range(batch_size // group_size):
        prompts += [PROMPTS[g % len(PROMPTS)]] * group_size
        indices += list(range(group_size))
    return prompts, indices


@contextlib.contextmanager
def capture_forward_inputs(module: torch.nn.Module) -> Iterator[list[tuple[tuple, dict]]]:
    """Record the ``(args, kwargs)`` of ``module``'s first forward call inside the block, so
    that a baseline can replay the transformer on exactly the inputs the loop gave it."""
    calls: list[tuple[tuple, dict]] = []

    def hook(_module, args, kwargs):
        if not calls:
            calls.append((args, dict(kwargs)))

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


# ----- multi-process workers ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_worker(
    config: str,
    num_processes: int,
    worker_args: Sequence[str],
    output_dir: str,
    *,
    threads_per_process: int | None = None,
    timeout: int = 900,
    launch_args: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Run ``bench/distributed_worker.py`` under ``accelerate launch --config_file
    accelerate_configs/<config>.yaml --num_processes N`` (plus ``launch_args``, e.g.
    ``--zero3_init_flag false``) and return the ranks' reports (read from
    ``output_dir/rank<r>.json``), rank 0 first. Fails with the worker's output tail."""
    path = os.path.join(ROOT, "accelerate_configs", f"{config}.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"No accelerate config {path}; expected a name such as multi_gpu, zero2 or zero3.")
    os.makedirs(output_dir, exist_ok=True)
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", path,
        "--num_processes", str(num_processes), "--main_process_port", str(free_port()), *launch_args,
        os.path.join(ROOT, "bench", "distributed_worker.py"), "--output_dir", output_dir, *worker_args,
    ]
    env = dict(os.environ)
    threads = threads_per_process or max(1, (os.cpu_count() or 1) // num_processes)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{config} worker with {num_processes} processes exited {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    reports = []
    for rank in range(num_processes):
        with open(os.path.join(output_dir, f"rank{rank}.json")) as f:
            reports.append(json.load(f))
    return reports


def setup(args) -> torch.device:
    """Start-up shared by the scripts: threads, quiet libraries, the device, the machine line."""
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # .to(dtype) on each benchmark model warns otherwise
    set_threads(args.threads)
    device = resolve_device(args.device)
    print_machine(device, args.note)
    return device


def add_common_args(parser) -> None:
    """--quick, --device, --threads, --repeats, --note: the same meaning in every script."""
    parser.add_argument("--quick", action="store_true", help="CI mode: tiny models, seconds.")
    parser.add_argument("--device", type=str, default=None, help="cpu or cuda (default: cuda when available).")
    parser.add_argument("--threads", type=int, default=None, help="Torch intra-op threads (default: torch's).")
    parser.add_argument("--repeats", type=int, default=None, help="Timed repeats per figure (median reported).")
    parser.add_argument("--note", type=str, default=None,
                        help='Free text on the machine line, e.g. "shared with other jobs".')


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} asked for CUDA, but torch sees no GPU; use --device cpu.")
    return device
