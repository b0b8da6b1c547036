"""Speed levers of the transformer (``--attention_backend``, ``--compile``): the attention kernel,
chosen through diffusers' attention dispatcher, and regional ``torch.compile`` of the repeated
transformer blocks. Both leave the weights, their names and the numbers computed alone (up to
float rounding); the trainer applies them after the LoRA / trainable set-up, before
``accelerator.prepare``, to the trained transformer and to any frozen reference copy.

What diffusers 0.42 offers, per family (checked against its source):

- Wan and FLUX attention processors call ``dispatch_attention_fn``, so
  ``ModelMixin.set_attention_backend`` switches their kernel; SD3's ``JointAttnProcessor2_0``
  calls ``torch.nn.functional.scaled_dot_product_attention`` directly, so no backend can be set
  on it (torch picks its fused kernel on a GPU by itself), and asking is refused.
- Wan and FLUX declare ``_repeated_blocks`` (what ``ModelMixin.compile_repeated_blocks``
  compiles); SD3 does not, so its ``_no_split_modules`` (``JointTransformerBlock``, the class
  of its repeated blocks) stands in.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Sequence

import torch

from genrl.errors import SetupError


def attention_backend_names() -> list[str]:
    """Every backend name diffusers' attention dispatcher knows (``AttentionBackendName``),
    sorted, those starting with ``_`` last: diffusers marks them private, but they are valid
    (``_flash_3``: FlashAttention-3 on Hopper, ``_native_cudnn``: torch's cuDNN attention)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return sorted((member.value for member in AttentionBackendName), key=lambda name: (name.startswith("_"), name))


def check_attention_backend_name(name: str) -> None:
    """One sentence listing the valid names when ``name`` (case-insensitive, as diffusers takes
    it) is not a backend diffusers knows."""
    names = attention_backend_names()
    if name.lower() not in names:
        raise ValueError(f"--attention_backend {name!r} is not a diffusers attention backend; choose one of: {', '.join(names)}.")


def _dispatching_processors(transformer: torch.nn.Module) -> list:
    """The attention processors of ``transformer`` that go through diffusers' dispatcher (those
    ``set_attention_backend`` sets a backend on)."""
    processors = (getattr(module, "processor", None) for module in transformer.modules())
    return [p for p in processors if p is not None and hasattr(p, "_attention_backend")]


def _smoothed(message: str) -> str:
    """diffusers' error text as the clause of one sentence: its trailing period dropped, its
    "... . Please install x." joined with a semicolon."""
    return message.strip().rstrip(".").replace(". Please", "; please")


def probe_attention_backend(name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int = 64) -> None:
    """Check that diffusers' attention backend ``name`` works here, before any model uses it:
    under diffusers' ``attention_backend(name)`` context (its own requirement check: a missing
    package, a Hub kernel that cannot be fetched), one attention forward and backward of
    ``(batch 1, 16 tokens, 2 heads, head_dim)`` (diffusers' ``(B, S, H, D)`` layout) on
    ``device`` in ``dtype`` through the dispatcher, which finds what the requirement check cannot
    see (a kernel the device lacks, a dtype it does not take, no backward). Each failure is one
    sentence (``SetupError``); the dispatcher's active backend is as before afterwards."""
    from diffusers import attention_backend
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    with ExitStack() as stack:
        try:
            stack.enter_context(attention_backend(name))
        except Exception as error:  # RuntimeError for a missing package; anything from a Hub kernel fetch
            raise SetupError(f"--attention_backend {name} cannot be used here: {_smoothed(str(error))}.") from error
        generator = torch.Generator().manual_seed(0)
        query, key, value = (
            torch.randn(1, 16, 2, head_dim, generator=generator).to(device, dtype).requires_grad_(True) for _ in range(3)
        )
        try:
            out = dispatch_attention_fn(query, key, value)  # the active backend: ``name``
            out.float().sum().backward()
        except Exception as error:  # any kernel failure: training would hit the same one
            first_line = (str(error).splitlines() or [""])[0]
            raise SetupError(
                f"--attention_backend {name} cannot run on {torch.device(device).type} in {str(dtype).replace('torch.', '')} "
                f"(a tiny attention forward and backward failed: {type(error).__name__}: {_smoothed(first_line)}); "
                "pick another backend, e.g. native, or another --mixed_precision."
            ) from error


def set_attention_backend(
    transformers: Sequence[torch.nn.Module], name: str, *, device: torch.device | str, dtype: torch.dtype
) -> None:
    """Select diffusers' attention backend ``name`` for every module of ``transformers`` (the
    trained transformer and any frozen copy) with ``ModelMixin.set_attention_backend``, once
    ``probe_attention_backend`` found that it works on ``device`` in ``dtype``. One sentence
    (``SetupError``), with nothing changed, when a model's attention does not go through the
    dispatcher (SD3), when diffusers refuses the backend (its own message, wrapped), or when the
    kernel cannot run here. Other models keep the dispatcher's process-wide default."""
    name = name.lower()
    check_attention_backend_name(name)
    for transformer in transformers:
        if not _dispatching_processors(transformer):
            raise SetupError(
                f"--attention_backend does not apply to {type(transformer).__name__}: its attention does not go through "
                "diffusers' attention dispatcher (it calls torch's scaled_dot_product_attention, which picks a fused kernel "
                "on a GPU by itself); leave --attention_backend out."
            )
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    head_dim = getattr(transformers[0].config, "attention_head_dim", 64) if transformers else 64
    probe_attention_backend(name, device, dtype, head_dim=int(head_dim))
    # diffusers also makes the backend the process-wide default, which every other model's
    # dispatcher calls would then take (an fp32 model cannot run cuDNN's or flash's kernels):
    # keep the choice to the models named.
    active = _AttentionBackendRegistry._active_backend
    try:
        for transformer in transformers:
            try:
                transformer.set_attention_backend(name)
            except Exception as error:
                raise SetupError(f"--attention_backend {name} cannot be used here: {_smoothed(str(error))}.") from error
    finally:
        _AttentionBackendRegistry.set_active_backend(active)


def repeated_block_classes(transformer: torch.nn.Module) -> list[str]:
    """Class names of ``transformer``'s repeated blocks: its class's ``_repeated_blocks`` (what
    ``compile_repeated_blocks`` compiles), else its ``_no_split_modules`` (SD3 in diffusers 0.42
    declares only those, ``JointTransformerBlock``); empty when it declares neither."""
    return list(getattr(type(transformer), "_repeated_blocks", None) or getattr(transformer, "_no_split_modules", None) or [])


def compile_repeated_blocks(transformer: torch.nn.Module, *, fullgraph: bool = True) -> list[str]:
    """Regional ``torch.compile`` of ``transformer`` (in place) with diffusers'
    ``ModelMixin.compile_repeated_blocks(fullgraph=...)``: every block of a repeated class is
    compiled (lazily: at its first call, and again for each new grad mode, train/eval mode,
    LoRA adapter on/off or batch size it sees, a handful per run); the rest of the forward stays eager, and parameter names are unchanged
    (checkpoints, exports and the EMA see the same module). Returns the compiled class names; a
    model that declares no repeated blocks is refused with one sentence (``SetupError``)."""
    blocks = repeated_block_classes(transformer)
    if not blocks:
        raise SetupError(
            f"--compile compiles a transformer's repeated blocks, and {type(transformer).__name__} declares none "
            "(no _repeated_blocks nor _no_split_modules); leave --compile out."
        )
    if not getattr(type(transformer), "_repeated_blocks", None):
        transformer._repeated_blocks = blocks  # on this instance only: the blocks diffusers will compile
    transformer.compile_repeated_blocks(fullgraph=fullgraph)
    return blocks
