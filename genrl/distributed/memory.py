"""Memory of a run: its peak, and the dtypes of the trained and master weights."""

from __future__ import annotations

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA max allocated on GPU, max RSS on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def weight_dtypes(model: torch.nn.Module, optimizer) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(dtype of the trainable weights the forward pass uses, dtype of the weights the
    optimizer steps, None if it cannot tell): fp32 / fp32 without DeepSpeed (bf16 is
    autocast); under DeepSpeed's bf16 mode bf16 / fp32, its fp32 master partitions (ZeRO-1/2's
    ``single_partition_of_fp32_groups``, ZeRO-3's ``fp32_partitioned_groups_flat``: ZeRO-3's
    torch optimizer sees them only inside its step)."""
    weights = next((p.dtype for p in model.parameters() if p.requires_grad), None)
    chain = [optimizer]  # accelerate's wrapper -> (DeepSpeed's ZeRO optimizer ->) torch's
    while getattr(chain[-1], "optimizer", None) is not None:
        chain.append(chain[-1].optimizer)
    for level in chain:
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            flats = [t for t in getattr(level, name, None) or [] if isinstance(t, torch.Tensor)]
            if flats:
                return weights, flats[0].dtype
    for level in reversed(chain):
        for group in getattr(level, "param_groups", []):
            if group["params"]:
                return weights, group["params"][0].dtype
    return weights, None


def describe_weight_dtypes(weights: torch.dtype | None, masters: torch.dtype | None) -> str:
    """The log line of ``weight_dtypes``: "Trained weights in bfloat16, the optimizer's master weights in float32."."""

    def name(dtype):
        return str(dtype).removeprefix("torch.") if dtype is not None else "an unknown dtype"

    return f"Trained weights in {name(weights)}, the optimizer's master weights in {name(masters)}."
