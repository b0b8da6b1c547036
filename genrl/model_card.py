"""The README.md model card written next to an export, through huggingface_hub's ModelCard.

The YAML metadata is built as a ``ModelCardData`` and rendered by huggingface_hub; the body is
a small Jinja template filled from the run (base model, reward, hyper-parameters, evaluation
scores, sample images, the launch command).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Iterable, Sequence

from huggingface_hub import ModelCard, ModelCardData

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

Fine-tuned from {{ base_model_link }} with reinforcement learning (GRPO / Flow-GRPO) by genrl,
against the reward `{{ reward_spec }}`.
{% if is_lora %}
This repository holds a LoRA adapter of the transformer (`pytorch_lora_weights.safetensors`).
{% else %}
This repository holds the fine-tuned transformer (`transformer/`, diffusers format).
{% endif %}
## How to use

```python
import torch
from diffusers import DiffusionPipeline
{% if is_lora %}
pipe = DiffusionPipeline.from_pretrained("{{ base_model }}", torch_dtype=torch.bfloat16)
pipe.load_lora_weights("{{ repo_hint }}", weight_name="pytorch_lora_weights.safetensors")
{% else %}
pipe = DiffusionPipeline.from_pretrained("{{ base_model }}", torch_dtype=torch.bfloat16)
pipe.transformer = type(pipe.transformer).from_pretrained("{{ repo_hint }}", subfolder="transformer", torch_dtype=torch.bfloat16)
{% endif %}pipe.to("cuda")
```
{% if eval_rows %}
## Evaluation

| reward | mean | std |
|---|---|---|
{% for name, mean, std in eval_rows %}| {{ name }} | {{ mean }} | {{ std }} |
{% endfor %}{% endif %}{% if images %}
## Samples

{% for image in images %}![sample {{ loop.index }}]({{ image }})
{% endfor %}{% endif %}
## Training

Launched with:

```bash
{{ launch_command }}
```

| hyper-parameter | value |
|---|---|
{% for key, value in hyperparameters %}| {{ key }} | `{{ value }}` |
{% endfor %}"""


_FLAT_KEY = re.compile(r"^(?:eval/)?(?P<name>.+)_(?P<stat>mean|std)$")


def _eval_rows(eval_metrics: dict | None) -> list[tuple[str, str, str]]:
    """Table rows (reward, mean, std) from ``{"name": {"mean": m, "std": s}}`` (an
    ``EvalResult.metrics``), ``{"eval/name_mean": m, "eval/name_std": s}`` (its ``log_dict()``)
    or ``{"name": m}``."""
    stats: dict[str, dict] = {}
    for key, value in (eval_metrics or {}).items():
        flat = _FLAT_KEY.match(key) if not isinstance(value, dict) else None
        if isinstance(value, dict):
            stats.setdefault(key, {}).update(value)
        elif flat:
            stats.setdefault(flat["name"], {})[flat["stat"]] = value
        else:
            stats.setdefault(key, {})["mean"] = value
    return [(name, _fmt(s.get("mean")), _fmt(s.get("std"))) for name, s in sorted(stats.items())]


def _fmt(x) -> str:
    return "" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)


def _card_images(export_dir: str, sample_images: Iterable[str]) -> list[str]:
    """Paths of the sample images relative to ``export_dir``; images outside it are copied
    into ``export_dir/samples/`` so that the card and the pushed folder carry them."""
    out = []
    for path in sample_images:
        path = os.path.abspath(path if os.path.isabs(path) else os.path.join(export_dir, path))
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"write_model_card got sample image {path!r}, which does not exist "
                f"(a relative image path is read relative to export_dir {export_dir!r})."
            )
        rel = os.path.relpath(path, export_dir)
        if rel.startswith(".."):
            os.makedirs(os.path.join(export_dir, "samples"), exist_ok=True)
            rel = os.path.join("samples", os.path.basename(path))
            shutil.copyfile(path, os.path.join(export_dir, rel))
        out.append(rel.replace(os.sep, "/"))
    return out


def write_model_card(
    export_dir: str,
    *,
    base_model: str,
    reward_spec: str,
    hyperparameters: dict,
    eval_metrics: dict | None = None,
    sample_images: Sequence[str] = (),
    launch_command: str = "",
    tags: list[str] | None = None,
    repo_id: str | None = None,
    pipeline_tag: str | None = None,
) -> str:
    """Write ``export_dir/README.md`` and return its path.

    Args:
        export_dir: the export folder; a LoRA export is recognised by its
            ``pytorch_lora_weights.safetensors``.
        base_model: the model fine-tuned (a Hub id goes into the card metadata; a local path
            is only named in the text, since the Hub's ``base_model`` field must be an id).
        reward_spec: the ``--reward_fn`` string, e.g. ``"hpsv3:1.0,videoalign_ta:0.5"``.
        hyperparameters: the training arguments, shown as a table.
        eval_metrics: ``{reward: {"mean": m, "std": s}}`` (``EvalResult.metrics``), its
            ``log_dict()`` (``{"eval/<reward>_mean": m, ...}``) or ``{reward: value}``; ``None``
            leaves the section out.
        sample_images: image paths (relative to ``export_dir`` or absolute; outside ones are
            copied to ``export_dir/samples/``).
        launch_command: the command line that trained it.
        tags: extra Hub tags.
        repo_id: the Hub repo, for the usage snippet (defaults to a placeholder).
        pipeline_tag: e.g. ``"text-to-video"``, ``"text-to-image"``.
    """
    if not os.path.isdir(export_dir):
        raise FileNotFoundError(f"write_model_card got export_dir={export_dir!r}, which is not a folder.")
    is_lora = os.path.isfile(os.path.join(export_dir, "pytorch_lora_weights.safetensors"))
    is_hub_id = bool(_HUB_ID.match(base_model)) and not os.path.exists(base_model)
    card_tags = ["genrl", "grpo", "flow-grpo", "reinforcement-learning", "diffusers"]
    card_tags += ["lora"] if is_lora else []
    card_tags += list(tags or [])
    card_data = ModelCardData(
        base_model=base_model if is_hub_id else None,
        library_name="diffusers",
        pipeline_tag=pipeline_tag,
        tags=card_tags,
    )
    card = ModelCard.from_template(
        card_data,
        template_str=_TEMPLATE,
        title=f"{repo_id or os.path.basename(os.path.abspath(export_dir))}",
        base_model=base_model,
        base_model_link=f"[{base_model}](https://huggingface.co/{base_model})" if is_hub_id else f"`{base_model}`",
        reward_spec=reward_spec,
        is_lora=is_lora,
        repo_hint=repo_id or "<this-repo-id>",
        eval_rows=_eval_rows(eval_metrics),
        images=_card_images(export_dir, sample_images),
        launch_command=launch_command or "(not recorded)",
        # a "|" would end a markdown table cell
        hyperparameters=sorted((str(k), str(v).replace("|", "\\|")) for k, v in hyperparameters.items()),
    )
    path = os.path.join(export_dir, "README.md")
    card.save(path)
    return path
