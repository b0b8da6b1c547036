"""Build the trained transformer already partitioned across ranks (ZeRO-3's ``zero.Init``).

With ``zero3_init_flag: true`` in a ZeRO-3 config, no rank ever holds the whole transformer:
it is constructed inside ``deepspeed.zero.Init`` (each parameter keeps only this rank's
shard), then its weights are copied in one module at a time, each module's parameters
gathered, written by rank 0 from the memory-mapped safetensors files, and partitioned again
(``GatheredParameters(modifier_rank=0)``, the recipe transformers uses for its own models).
diffusers' ``from_pretrained`` does not do this, so without it every rank first loads the
whole model and DeepSpeed shards it afterwards.

Only safetensors weights are read: a pickled ``.bin`` checkpoint could run code when loaded.
"""

from __future__ import annotations

import json
import os

import torch

from genrl.errors import SetupError, hub_failure_reason, hub_hint

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"


def zero3_init_requested(plugin) -> bool:
    """Whether ``plugin`` (``accelerator.state.deepspeed_plugin``, or None) is ZeRO-3 with
    ``zero3_init_flag: true``."""
    return plugin is not None and int(plugin.zero_stage) == 3 and bool(plugin.zero3_init_flag)


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of ``param`` as the model sees it: a ZeRO-3 partitioned parameter's own shape
    is ``(0,)`` outside a gather; DeepSpeed keeps the full one in ``ds_shape``."""
    return getattr(param, "ds_shape", param.shape)


def full_numel(param: torch.Tensor) -> int:
    """The number of elements of ``param`` on all ranks together (``ds_numel`` when partitioned)."""
    return int(getattr(param, "ds_numel", param.numel()))


def add_variant(name: str, variant: str | None) -> str:
    """diffusers' file name of a weights ``variant``: the variant goes before the last suffix,
    "diffusion_pytorch_model.safetensors" -> "diffusion_pytorch_model.fp16.safetensors"."""
    if not variant:
        return name
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}.{variant}.{suffix}"


def transformer_folder(pretrained_model_name_or_path: str, revision: str | None = None, subfolder: str = "transformer") -> str:
    """The ``subfolder`` (a transformer's) of a pipeline: a local folder's, or the Hub snapshot's
    with only its config and safetensors files downloaded."""
    path = os.fspath(pretrained_model_name_or_path)
    if os.path.isdir(path):
        return os.path.join(path, subfolder)
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(path, revision=revision,
                                     allow_patterns=[f"{subfolder}/*.json", f"{subfolder}/*.safetensors"])
    except Exception as error:  # not found, offline, invalid id: all mean "cannot get it"
        raise SetupError(f"The {subfolder} of Hub model {path!r} could not be fetched ({hub_failure_reason(error)}); "
                         f"{hub_hint()}.") from error
    return os.path.join(snapshot, subfolder)


def weight_files(folder: str, variant: str | None = None) -> dict[str, str]:
    """Tensor name -> safetensors file holding it, from a sharded checkpoint's index or the
    single weights file of ``folder``."""
    index = os.path.join(folder, add_variant(WEIGHTS_INDEX_NAME, variant))
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = os.path.join(folder, add_variant(WEIGHTS_NAME, variant))
    if not os.path.isfile(single):
        raise SetupError(
            f"{folder!r} has no {os.path.basename(single)} (nor a sharded index): building the transformer under "
            f"zero3_init_flag reads safetensors weights only; convert the checkpoint, or set zero3_init_flag: false."
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def file_shapes(files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from the safetensors headers of ``files`` (no data is read)."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def weights_mismatch(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> str | None:
    """What stops loading weights of shapes ``found`` into a model whose tensors have shapes
    ``expected`` (both name -> shape), as one sentence; None when every expected tensor is
    there with its shape. Extra tensors in the files are ignored, as diffusers does."""
    missing = [name for name in expected if name not in found]
    if missing:
        return (f"the files lack {len(missing)} of the model's {len(expected)} tensors (e.g. {missing[0]!r}): "
                f"they are not weights of this model")
    wrong = [name for name in expected if found[name] != expected[name]]
    if wrong:
        name = wrong[0]
        return (f"{len(wrong)} tensors have another shape than the model's (e.g. {name!r}: {found[name]} in the files, "
                f"{expected[name]} in the model)")
    return None


def load_partitioned_transformer(
    transformer_class: type,
    folder: str,
    ds_config: dict,
    *,
    variant: str | None = None,
) -> torch.nn.Module:
    """``transformer_class`` (a diffusers ``ModelMixin``) built from ``folder`` inside
    ``deepspeed.zero.Init(ds_config)``: every rank holds only its shard of each parameter,
    with the pretrained weights. Collective: every rank calls it (and every rank checks the
    files' headers, so a mismatch fails on all ranks alike, before any gather). The weights
    take the dtype ``zero.Init`` gives the parameters (bf16 under DeepSpeed's bf16 mode, else
    fp32)."""
    import deepspeed
    import torch.distributed as dist
    from safetensors import safe_open

    files = weight_files(folder, variant)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = transformer_class.from_config(transformer_class.load_config(folder))
    expected = {name: tuple(full_shape(t)) for name, t in model.state_dict(keep_vars=True).items()}
    problem = weights_mismatch(expected, file_shapes(files))
    if problem:
        raise SetupError(f"The transformer weights in {folder!r} do not fit {transformer_class.__name__}'s config: {problem}.")
    writer = not dist.is_initialized() or dist.get_rank() == 0
    handles: dict[str, object] = {}

    def read(name: str) -> torch.Tensor:
        path = files[name]
        if path not in handles:  # memory-mapped: only the tensors read are paged in
            handles[path] = safe_open(path, framework="pt")
        return handles[path].get_tensor(name)

    with torch.no_grad():
        for prefix, module in model.named_modules():
            prefix = f"{prefix}." if prefix else ""
            params = list(module.named_parameters(recurse=False))
            if params:  # gathered whole on every rank, written by rank 0, partitioned again on exit
                with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                    if writer:
                        for name, param in params:
                            param.copy_(read(prefix + name))
            for name, buffer in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:  # never partitioned: every rank reads its own
                    buffer.copy_(read(prefix + name))
    return model


def describe_partitioned_build(model: torch.nn.Module) -> str:
    """The log line of a partitioned build: how much of the model this rank holds."""
    held = sum(getattr(p, "ds_tensor", p).numel() for p in model.parameters())
    total = sum(full_numel(p) for p in model.parameters())
    return (f"Transformer built under zero.Init: this rank holds {held:,} of its {total:,} parameter elements "
            f"({100 * held / max(total, 1):.1f}%).")
