"""The README.md model card written next to an export, through huggingface_hub's ModelCard.

The YAML metadata is built as a ``ModelCardData`` and rendered by huggingface_hub; the body is
a small Jinja template filled from the run (base model, reward, hyper-parameters, evaluation
scores, sample images, the launch command).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Iterable, Sequence

from huggingface_hub import ModelCard, ModelCardData

from genrl.evaluation.pipeline_defaults import GUIDANCE_OPTION_FLAGS, SETTING_KEYS
from genrl.evaluation.pipeline_defaults import LOG_PREFIX as PIPELINE_DEFAULTS
from genrl.evaluation.pipeline_defaults import settings_text as defaults_text
from genrl.evaluation.scores import drop_repeated_total, format_score, reward_means

# How the card names each --objective, and its Hub tags.
METHOD_NAMES = {"grpo": "GRPO / Flow-GRPO", "nft": "DiffusionNFT", "awm": "advantage-weighted matching"}
METHOD_TAGS = {"grpo": ["grpo", "flow-grpo"], "nft": ["diffusion-nft"], "awm": ["awm"]}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

Fine-tuned from {{ base_model_link }} with reinforcement learning ({{ method }}) by genrl,
against the reward `{{ reward_spec }}`.
{% if is_lora %}
This repository holds a LoRA adapter of the transformer (`pytorch_lora_weights.safetensors`).
{% else %}
This repository holds the fine-tuned transformer (`{{ component }}/`, diffusers format).
{% endif %}{% if settings %}
**Sample it as it was evaluated: {{ settings_text }}** (`{{ settings_file }}`). The scores below were
measured there. {% if defaults_text %}{{ defaults_text }} At other settings it was not evaluated:
check one with `eval_genrl.py` before relying on it.{% else %}At other settings, the pipeline's own defaults included, it was not evaluated and
can score below its base model (a model trained unguided need not stay good under guidance):
check a setting with `eval_genrl.py` before relying on it.{% endif %}{% if ode_note %} {{ ode_note }}{% endif %}
{% endif %}
## How to use

```python
import torch
from diffusers import {{ pipeline_class }}
{% if takes_image %}from diffusers.utils import load_image
{% endif %}
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
pipe = {{ pipeline_class }}.from_pretrained("{{ base_ref }}", torch_dtype=dtype)
{% if is_lora %}{{ lora_loader }}("{{ weights_ref }}", weight_name="pytorch_lora_weights.safetensors"{{ lora_extra }})
{% else %}pipe.{{ component }} = type(pipe.{{ component }}).from_pretrained("{{ weights_ref }}", subfolder="{{ component }}", torch_dtype=dtype)
{% endif %}pipe.to(device)
{% if guider_scale is not none %}pipe.guider = pipe.guider.new(guidance_scale={{ guider_scale }})  # this pipeline's guidance scale
{% endif %}{% if settings %}{% if takes_image %}input_image = load_image("{{ example_image }}")  # the conditioning image: a path or a URL
{% endif %}settings = {{ call_literal }}  # what the scores below were measured with
{{ output_name }} = pipe({% if takes_image %}image=input_image, {% endif %}prompt="{{ example_prompt }}", **settings).{{ output_attr }}[0]
{% endif %}```
{% if before_after_rows %}
## Evaluation

Held-out prompts, deterministic sampling, before and after training:

| reward | {{ before_label }} | {{ after_label }} | change |
|---|---|---|---|
{% for name, before, after, change in before_after_rows %}| {{ name }} | {{ before }} | {{ after }} | {{ change }} |
{% endfor %}{% elif eval_rows %}
## Evaluation

| reward | mean | std |
|---|---|---|
{% for name, mean, std in eval_rows %}| {{ name }} | {{ mean }} | {{ std }} |
{% endfor %}{% endif %}{% if watch_alarms is not none %}
## Reward-hacking watch

{% if watch_alarms %}Alarms raised during training (held-out rewards, sample diversity; see `training_curves.png`):

{% for step, sentence in watch_alarms %}- step {{ step }}: {{ sentence }}
{% endfor %}{% else %}No alarm was raised: no held-out reward fell while the trained one rose{% if diversity_text %}, and
the diversity stayed above the alarm's threshold{% endif %}.
{% endif %}{% if diversity_text %}
{{ diversity_text }}
{% endif %}{% endif %}{% if images %}
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


def _eval_stats(eval_metrics: dict | None) -> dict[str, dict]:
    """``{name: {"mean": m, "std": s}}`` from ``{"name": {"mean": m, "std": s}}`` (an
    ``EvalResult.metrics``), ``{"eval/name_mean": m, "eval/name_std": s}`` (its ``log_dict()``)
    or ``{"name": m}``; "total" is left out when it repeats the one reward it sums."""
    stats: dict[str, dict] = {}
    for key, value in (eval_metrics or {}).items():
        flat = _FLAT_KEY.match(key) if not isinstance(value, dict) else None
        if isinstance(value, dict):
            stats.setdefault(key, {}).update(value)
        elif flat:
            stats.setdefault(flat["name"], {})[flat["stat"]] = value
        else:
            stats.setdefault(key, {})["mean"] = value
    means = drop_repeated_total({name: s.get("mean") for name, s in stats.items()})
    return {name: s for name, s in stats.items() if name in means}


def _eval_rows(eval_metrics: dict | None) -> list[tuple[str, str, str]]:
    """Table rows (reward, mean, std); ``eval_metrics`` in any form ``_eval_stats`` reads."""
    stats = sorted(_eval_stats(eval_metrics).items())
    return [(name, format_score(s.get("mean"), ".4f", ""), format_score(s.get("std"), ".4f", "")) for name, s in stats]


def _before_after_rows(before: dict | None, after: dict | None) -> list[tuple[str, str, str, str]]:
    """Table rows (reward, mean before, mean after, change) of the rewards both evaluations report."""
    if not before or not after:
        return []
    first, last = _eval_stats(before), _eval_stats(after)
    rows = []
    for name in sorted(set(first) & set(last)):
        a, b = first[name].get("mean"), last[name].get("mean")
        change = f"{b - a:+.4f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) else ""
        rows.append((name, format_score(a, ".4f", ""), format_score(b, ".4f", ""), change))
    return rows


def first_and_last_eval(metrics_jsonl_path: str, prefix: str = "eval/") -> list[tuple[int, dict]]:
    """``[(step, {"eval/<name>_mean": m, ...})]`` of the first and the last evaluation logged
    in the trainer's ``metrics.jsonl`` (one entry when there was one; none without); ``prefix``:
    the values kept (``eval_pipeline_defaults/``: the evaluations at the pipeline's defaults)."""
    evals = []
    if os.path.isfile(metrics_jsonl_path):
        with open(metrics_jsonl_path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a run killed mid-write leaves a truncated line
                values = {k: v for k, v in record.items() if k.startswith(prefix)}
                if values:
                    evals.append((int(record.get("step", 0)), values))
    return evals[:1] + evals[1:][-1:]


# Settings that only matter when their feature is on: (switch, keys); listed only when used.
_FEATURE_SETTINGS = (
    ("use_lora", ("rank", "lora_alpha", "lora_target_modules")),
    ("use_ema", ("ema_decay", "ema_update_interval", "ema_warmup", "ema_device")),
)


def _used_hyperparameters(hyperparameters: dict) -> dict:
    """``hyperparameters`` without the LoRA / EMA settings of a run that did not use them."""
    unused = {key for switch, keys in _FEATURE_SETTINGS if switch in hyperparameters and not hyperparameters[switch] for key in keys}
    return {k: v for k, v in hyperparameters.items() if k not in unused}


SAMPLING_FILE = "sampling_config.json"


@dataclass(frozen=True)
class PipelineUsage:
    """How the card's snippet samples the export with diffusers alone.

    pipeline_class: the diffusers pipeline the base is loaded as (an image-conditioned model's is
        the image pipeline it samples with: Wan 2.2 TI2V's own folder is a ``WanPipeline``).
    component: the trained transformer, ``transformer`` or Wan 2.2 A14B's low-noise ``transformer_2``.
    guidance_keyword: the pipeline call's name for the guidance scale (``true_cfg_scale`` for
        Qwen-Image); a pipeline whose call takes none but has a ``guider`` (HunyuanVideo 1.5) gets
        its guider replaced with one at the run's scale.
    image_conditioned: the snippet loads a conditioning image and passes it as ``image=``.
    """

    pipeline_class: str = "DiffusionPipeline"
    component: str = "transformer"
    guidance_keyword: str = "guidance_scale"
    image_conditioned: bool = False

    @classmethod
    def of(cls, policy) -> "PipelineUsage":
        """The usage of a ``FlowPolicy``'s pipeline."""
        return cls(type(policy.pipeline).__name__, policy.trained_component, policy.guidance_keyword,
                   policy.image_conditioned)

    def pipeline_type(self):
        """The diffusers class, or None for ``DiffusionPipeline`` or a class this diffusers lacks."""
        import diffusers

        return None if self.pipeline_class == "DiffusionPipeline" else getattr(diffusers, self.pipeline_class, None)

    def snippet_fields(self, settings: dict | None) -> dict:
        """The template's fields of the snippet: the class, how the weights load, the guider line and
        the call's keyword arguments (``settings`` less what the pipeline's call does not take)."""
        cls = self.pipeline_type()
        call = inspect.signature(cls.__call__).parameters if cls is not None else None
        takes_guider = cls is not None and "guider" in inspect.signature(cls.__init__).parameters
        settings = dict(settings or {})
        guider_scale = None
        if call is not None and self.guidance_keyword not in call and takes_guider:
            guider_scale = settings.get(self.guidance_keyword)
        if call is not None and not any(p.kind is p.VAR_KEYWORD for p in call.values()):
            settings = {k: v for k, v in settings.items() if k in call}
        second = self.component == "transformer_2"
        if cls is None or hasattr(cls, "load_lora_weights"):
            loader, extra = "pipe.load_lora_weights", ", load_into_transformer_2=True" if second else ""
        else:  # no LoRA loader on the pipeline: the transformer's own
            loader, extra = f"pipe.{self.component}.load_lora_adapter", ""
        return dict(pipeline_class=self.pipeline_class, component=self.component, lora_loader=loader, lora_extra=extra,
                    guider_scale=guider_scale, call_literal=json.dumps(settings), takes_image=self.image_conditioned)


def pipeline_tag_for(is_video: bool, image_conditioned: bool) -> str:
    """The Hub's pipeline tag of a model: what it takes (text, or an image and text) and makes."""
    return f"{'image' if image_conditioned else 'text'}-to-{'video' if is_video else 'image'}"


def sampling_settings(args: dict, is_video: bool, guidance_keyword: str = "guidance_scale") -> dict:
    """The keyword arguments of a diffusers pipeline call that samples as the run's evaluation
    did (``args``: the training arguments, as ``genrl_config.json`` records them): its steps,
    guidance (under the pipeline's ``guidance_keyword``), size, frames and text length where the
    run set them, the negative prompt where guidance uses it, and Wan 2.2 A14B's low-noise scale
    ``guidance_scale_2`` and Z-Image's ``cfg_truncation`` and ``cfg_normalization`` where the run
    set them. A ``true_cfg_scale`` pipeline (Qwen-Image) guides only when given a negative prompt:
    there it is passed even empty."""
    guidance = args.get("eval_guidance_scale")
    guidance = args.get("guidance_scale") if guidance is None else guidance
    guided = guidance is not None and guidance > 1
    settings = {
        "num_inference_steps": args.get("eval_num_inference_steps") or args.get("num_inference_steps"),
        guidance_keyword: guidance,
        "height": args.get("height"),
        "width": args.get("width"),
        "num_frames": args.get("num_frames") if is_video else None,
        "max_sequence_length": args.get("max_sequence_length"),
        "guidance_scale_2": args.get("guidance_scale_2"),
        **{name: args.get(name) for name in GUIDANCE_OPTION_FLAGS},
    }
    settings = {k: v for k, v in settings.items() if v not in (None, "")}
    negative = args.get("negative_prompt") or ""
    if guided and (negative or guidance_keyword == "true_cfg_scale"):
        settings["negative_prompt"] = negative
    return settings


def _settings_text(settings: dict) -> str:
    guidance = settings.get("guidance_scale", settings.get("true_cfg_scale"))
    text = f"{settings['num_inference_steps']} steps at guidance {guidance:g}"
    if "height" in settings and "width" in settings:
        text += f", {settings['height']}x{settings['width']}"
    if "num_frames" in settings:
        text += f", {settings['num_frames']} frames"
    return text


def headline_score(values: dict | None, prefix: str = "eval") -> tuple[str, float] | None:
    """``(reward, mean)`` an evaluation's ``values`` lead with: the total of the weighted
    rewards, or the reward it repeats (``drop_repeated_total``), else the first logged."""
    means = reward_means(values or {}, prefix)
    if not means:
        return None
    name = "total" if "total" in means else next(iter(means))
    return name, means[name]


def pipeline_defaults_sentence(base: dict | None, trained: dict | None) -> str:
    """What the model scores sampled as ``pipe(prompt)`` samples (the pipeline's own default
    steps and guidance), beside its base there: ``base`` and ``trained`` are the
    ``eval_pipeline_defaults/*`` values of the evaluations before training and at the end
    (``--eval_pipeline_defaults``); empty without the trained one."""
    score = headline_score(trained, PIPELINE_DEFAULTS)
    if score is None:
        return ""
    name, value = score
    settings = {k: trained[f"{PIPELINE_DEFAULTS}/{k}"] for k in SETTING_KEYS}
    text = f"At the pipeline's defaults (`pipe(prompt)`: {defaults_text(settings)}) it scores {value:.4f} on `{name}`"
    before = headline_score(base, PIPELINE_DEFAULTS)
    if before is None or before[0] != name:
        return text + "."
    text += f", its base model {before[1]:.4f}"
    if value < before[1]:
        text += ": there it is worse than the model it came from, so sample it with the settings above"
    return text + "."


def diversity_sentence(before: dict | None, after: dict | None, alarm_fraction: float | None) -> str:
    """How the diversity of a prompt's samples (``eval/diversity``) went from the first evaluation
    to the last, as a fraction of the first, and the watch's alarm threshold; empty without both."""
    first, last = (before or {}).get("eval/diversity"), (after or {}).get("eval/diversity")
    if not isinstance(first, (int, float)) or not isinstance(last, (int, float)) or first <= 0:
        return ""
    text = f"The diversity of a prompt's samples (`eval/diversity`) went from {first:.4f} to {last:.4f}, {last / first:.0%} of its start"
    if alarm_fraction is not None:
        text += f"; the watch alarms below {alarm_fraction:.0%} (`--watch_diversity_fraction`)"
    return text + "."


def _base_model_name(base_model: str, is_hub_id: bool) -> str:
    """A Hub id as it is; a local folder by its name (an absolute path names this machine only)."""
    return base_model if is_hub_id else os.path.basename(os.path.normpath(base_model))


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


@dataclass(frozen=True)
class CardEvaluation:
    """What a card reports of a run's evaluations.

    metrics: the last evaluation: ``{reward: {"mean": m, "std": s}}`` (``EvalResult.metrics``),
        its ``log_dict()`` (``{"eval/<reward>_mean": m, ...}``) or ``{reward: value}``; None
        leaves the section out. With ``baseline`` (the same, before training) the section shows
        both and the change.
    baseline: the evaluation before training, in any form ``metrics`` takes.
    steps: the optimizer steps of the two evaluations, for the column titles.
    settings: the pipeline call's keyword arguments the scores were measured with
        (:func:`sampling_settings`): the card states them first, its snippet samples with them,
        and they are written to ``sampling_config.json``.
    watch_alarms: the reward watch's ``(step, sentence)`` alarms (``RewardWatch.alarms``); None
        (no evaluation ran) leaves the section out, empty says none was raised.
    diversity_text: :func:`diversity_sentence`, shown in the watch's section.
    defaults_text: :func:`pipeline_defaults_sentence`, stated with ``settings`` (without it the
        card says the pipeline's defaults were not evaluated).
    """

    metrics: dict | None = None
    baseline: dict | None = None
    steps: tuple[int, int] | None = None
    settings: dict | None = None
    watch_alarms: Sequence[tuple[int, str]] | None = None
    diversity_text: str = ""
    defaults_text: str = ""


def write_model_card(
    export_dir: str,
    record: dict,
    *,
    evaluation: CardEvaluation | None = None,
    sample_images: Sequence[str] = (),
    repo_id: str | None = None,
    pipeline_tag: str | None = None,
    usage: PipelineUsage = PipelineUsage(),
) -> str:
    """Write ``export_dir/README.md`` and return its path; with ``evaluation.settings`` also
    ``export_dir/sampling_config.json``.

    Args:
        export_dir: the export folder; a LoRA export is recognised by its
            ``pytorch_lora_weights.safetensors``.
        record: the run, as ``genrl_config.json`` records it (``genrl.checkpoints.checkpointing.run_record``):
            ``base_model`` (a Hub id goes into the card metadata; a local folder is named by its
            folder name, since the Hub's ``base_model`` field must be an id), ``reward_fn``
            (the reward spec, e.g. ``"hpsv3:1.0,videoalign_ta:0.5"``), ``args`` (the training
            arguments, shown as a table, LoRA / EMA settings only when ``use_lora`` /
            ``use_ema`` is on; its ``objective``, default ``grpo``, is the method named in the
            text and the tags), and optionally ``launch_command`` and ``family`` (a Hub tag).
        evaluation: what the run's evaluations measured (:class:`CardEvaluation`; None: none ran).
        sample_images: image paths (relative to ``export_dir`` or absolute; outside ones are
            copied to ``export_dir/samples/``).
        repo_id: the Hub repo the card is pushed to; the usage snippet loads from it (else from
            ``export_dir``, and a local base model from its path).
        pipeline_tag: e.g. ``"text-to-video"``, ``"text-to-image"``, ``"image-to-video"``.
        usage: how the snippet loads and calls the pipeline (:class:`PipelineUsage`).
    """
    if not os.path.isdir(export_dir):
        raise FileNotFoundError(f"write_model_card got export_dir={export_dir!r}, which is not a folder.")
    evaluation = evaluation or CardEvaluation()
    is_video = pipeline_tag in ("text-to-video", "image-to-video")
    is_lora = os.path.isfile(os.path.join(export_dir, "pytorch_lora_weights.safetensors"))
    base_model, objective = record["base_model"], record["args"].get("objective", "grpo")
    is_hub_id = bool(_HUB_ID.match(base_model)) and not os.path.exists(base_model)
    card_tags = ["genrl", *METHOD_TAGS.get(objective, [objective]), "reinforcement-learning", "diffusers"]
    card_tags += ["lora"] if is_lora else []
    card_tags += [record["family"]] if record.get("family") else []
    card_data = ModelCardData(
        base_model=base_model if is_hub_id else None,
        library_name="diffusers",
        pipeline_tag=pipeline_tag,
        tags=card_tags,
    )
    if evaluation.settings:
        with open(os.path.join(export_dir, SAMPLING_FILE), "w") as f:
            json.dump(evaluation.settings, f, indent=2)
    card = ModelCard.from_template(
        card_data,
        template_str=_TEMPLATE,
        title=f"{repo_id or os.path.basename(os.path.abspath(export_dir))}",
        is_lora=is_lora,
        images=_card_images(export_dir, sample_images),
        **_model_fields(export_dir, record, is_hub_id, repo_id),
        **_evaluation_fields(evaluation, record["args"].get("ode_solver", "euler")),
        output_name="video" if is_video else "image",
        output_attr="frames" if is_video else "images",
        example_prompt="a cat walking in the snow" if is_video else "a photo of a cat",
        **usage.snippet_fields(evaluation.settings),
        example_image="first_frame.png" if is_video else "input.png",
    )
    path = os.path.join(export_dir, "README.md")
    card.save(path)
    return path


def _model_fields(export_dir: str, record: dict, is_hub_id: bool, repo_id: str | None) -> dict:
    """The template's fields of the base model, the method, the weights and the run's settings."""
    base_model, objective = record["base_model"], record["args"].get("objective", "grpo")
    base_name = _base_model_name(base_model, is_hub_id)
    return dict(
        base_model_link=f"[{base_model}](https://huggingface.co/{base_model})" if is_hub_id else f"`{base_name}` (a local folder)",
        # Pushed: the base's local path means nothing elsewhere, so the snippet says where it goes.
        base_ref=base_model if is_hub_id else f"path/to/{base_name}" if repo_id else os.path.abspath(base_model),
        weights_ref=repo_id or os.path.abspath(export_dir),
        reward_spec=record["reward_fn"],
        method=METHOD_NAMES.get(objective, objective),
        launch_command=record.get("launch_command") or "(not recorded)",
        # a "|" would end a markdown table cell
        hyperparameters=sorted((str(k), str(v).replace("|", "\\|")) for k, v in _used_hyperparameters(record["args"]).items()),
    )


def _evaluation_fields(evaluation: CardEvaluation, ode_solver: str) -> dict:
    """The template's fields of the evaluation: the sampling settings, the scores, the watch."""
    settings = evaluation.settings
    return dict(
        eval_rows=_eval_rows(evaluation.metrics),
        watch_alarms=None if evaluation.watch_alarms is None else list(evaluation.watch_alarms),
        before_after_rows=_before_after_rows(evaluation.baseline, evaluation.metrics),
        before_label=f"before (step {evaluation.steps[0]})" if evaluation.steps else "before",
        after_label=f"after (step {evaluation.steps[1]})" if evaluation.steps else "after",
        settings=settings or None,
        settings_text=_settings_text(settings) if settings else "",
        settings_file=SAMPLING_FILE,
        ode_note="" if ode_solver == "euler" else (
            f"Its evaluation integrated with genrl's `{ode_solver}` solver (`eval_genrl.py`); the diffusers pipeline "
            "integrates with Euler, which samples somewhat differently."),
        diversity_text=evaluation.diversity_text,
        defaults_text=evaluation.defaults_text,
    )


def write_run_card(
    export_dir: str,
    metrics_path: str,
    record: dict,
    *,
    is_video: bool,
    usage: PipelineUsage = PipelineUsage(),
    last_eval: dict | None,
    sample_images: Sequence[str],
    repo_id: str | None = None,
    watch_alarms: Sequence[tuple[int, str]] | None = None,
) -> str:
    """The card of a training run's final export: base model, rewards, family, objective, settings
    and launch command from ``record`` (what ``genrl_config.json`` records), and the held-out
    score before training and at the end from the trainer's ``metrics_path`` (``last_eval``, the
    ``eval/*`` values of the last evaluation, when the log holds none), with the base's and the
    final score at the pipeline's defaults where it logged them (``--eval_pipeline_defaults``),
    and the reward watch's ``watch_alarms``. ``usage``: how the snippet samples the export
    (:class:`PipelineUsage`, ``PipelineUsage.of(policy)``). Returns its path."""
    evals = first_and_last_eval(metrics_path)
    defaults = first_and_last_eval(metrics_path, PIPELINE_DEFAULTS + "/")
    args = record["args"]
    evaluation = CardEvaluation(
        metrics=evals[-1][1] if evals else last_eval or None,
        baseline=evals[0][1] if len(evals) > 1 else None,  # before training vs the end
        steps=(evals[0][0], evals[-1][0]) if len(evals) > 1 else None,
        settings=sampling_settings(args, is_video, usage.guidance_keyword),
        watch_alarms=watch_alarms,
        diversity_text=diversity_sentence(evals[0][1], evals[-1][1], args.get("watch_diversity_fraction"))
        if len(evals) > 1 else "",
        # Before training (step 0) and at the end: the base's and the export's figures.
        defaults_text=pipeline_defaults_sentence(next((v for step, v in defaults[:1] if step == 0), None),
                                                 next((v for step, v in defaults[-1:] if step > 0), None)),
    )
    return write_model_card(export_dir, record, evaluation=evaluation, sample_images=sample_images, repo_id=repo_id,
                            pipeline_tag=pipeline_tag_for(is_video, usage.image_conditioned), usage=usage)
