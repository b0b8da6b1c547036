"""Memory, speed and the processes of a run: precision, threads, kernels, compilation and how
long a process waits for the others."""

from dataclasses import dataclass
from typing import Literal

from transformers.hf_argparser import HfArg

from genrl.distributed.launch import check_mixed_precision
from genrl.distributed.zero3 import under_zero3
from genrl.training.acceleration import check_attention_backend_name


@dataclass
class PerformanceArguments:
    _argument_group_name = "memory, speed and processes"

    mixed_precision: Literal["no", "fp16", "bf16"] | None = HfArg(
        default=None, help="Autocast precision (default: the accelerate config's); the SDE math stays fp32."
    )
    allow_tf32: bool = HfArg(default=False, help="Allow TF32 matmuls on Ampere+ GPUs.")
    cpu_threads: int | None = HfArg(
        default=None,
        help="Torch threads per process when training on the CPU; 0: the machine's cores shared among its processes. "
        "Default: as launched (`accelerate launch` sets 1 per CPU process unless given "
        "--num_cpu_threads_per_process or OMP_NUM_THREADS).",
    )
    gradient_checkpointing: bool = HfArg(
        default=False, help="Recompute the transformer's activations in the backward pass (less memory, slower)."
    )
    attention_backend: str | None = HfArg(
        default=None, metadata={"metavar": "NAME"},
        help="Attention kernel of the transformer (and its frozen reference) through diffusers' attention dispatcher, "
        "e.g. native, flash (flash-attn 2), _flash_3 (FlashAttention-3, Hopper), _native_cudnn, sage; default: "
        "the model's own. Wan and FLUX only (SD3's attention does not go through the dispatcher). A backend whose "
        "package or device is missing fails before training.",
    )
    compile: bool = HfArg(
        default=False,
        help="Regional torch.compile (fullgraph) of the transformer's repeated blocks, after the LoRA set-up: the "
        "first rollout and update of the run compile (minutes for a large model), later ones run the compiled "
        "blocks. Not with ZeRO-3.",
    )
    peak_tflops: float | None = HfArg(
        default=None,
        help="Peak dense TFLOP/s of one device in the training precision (its data sheet's dense figure, e.g. 989 for "
        "an H100 SXM in bf16): logs perf/mfu, the transformer's counted FLOPs per second over this peak.",
    )
    collective_timeout: float = HfArg(
        default=1800,
        help="Seconds a process waits for the others in a collective before the run fails (a hung or stopped rank).",
    )

    def check(self) -> None:
        check_mixed_precision(self.mixed_precision)
        if self.cpu_threads is not None and self.cpu_threads < 0:
            raise ValueError(f"--cpu_threads must be >= 0 (0: the machine's cores shared among its processes), got {self.cpu_threads}.")
        if self.compile and under_zero3():
            raise ValueError(
                "--compile does not work under ZeRO-3 (DeepSpeed gathers each block's partitioned weights in hooks that "
                "torch.compile cannot trace); use --compile with zero2, multi_gpu or one process, or leave it out under zero3."
            )
        if self.attention_backend is not None:
            check_attention_backend_name(self.attention_backend)  # the names diffusers knows, listed
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"--peak_tflops must be the device's peak TFLOP/s, a number > 0, got {self.peak_tflops}.")
        if not self.collective_timeout > 0:
            raise ValueError(f"--collective_timeout must be a number of seconds > 0, got {self.collective_timeout}.")
