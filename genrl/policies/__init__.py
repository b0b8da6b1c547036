"""Model-family adapters and ``load_policy``, which picks one from a pipeline's model_index.json."""

from __future__ import annotations

import json
import os

import diffusers
import torch

from genrl.distributed.zero_init import load_partitioned_transformer, transformer_folder
from genrl.errors import SetupError, hub_failure_reason, hub_hint
from genrl.evaluation.pipeline_defaults import GUIDANCE_OPTION_FLAGS
from genrl.policies.base import FlowPolicy
from genrl.policies.flux import FluxPolicy
from genrl.policies.flux2 import Flux2KleinPolicy, Flux2Policy
from genrl.policies.hunyuan15 import HunyuanVideo15Policy
from genrl.policies.hunyuan15_i2v import HunyuanVideo15ImageToVideoPolicy
from genrl.policies.qwenimage import QwenImagePolicy
from genrl.policies.qwenimage_edit import QwenImageEditPlusPolicy, QwenImageEditPolicy
from genrl.policies.sd3 import SD3Policy
from genrl.policies.wan import EXPERTS, WanPolicy, two_expert_message
from genrl.policies.wan_i2v import WanImageToVideoPolicy
from genrl.policies.zimage import ZImagePolicy

# Pipeline class name (model_index.json "_class_name") -> adapter.
POLICIES: dict[str, type[FlowPolicy]] = {
    "WanPipeline": WanPolicy,
    "WanImageToVideoPipeline": WanImageToVideoPolicy,
    "StableDiffusion3Pipeline": SD3Policy,
    "FluxPipeline": FluxPolicy,
    "ZImagePipeline": ZImagePolicy,
    "Flux2KleinPipeline": Flux2KleinPolicy,
    "QwenImagePipeline": QwenImagePolicy,
    "Flux2Pipeline": Flux2Policy,
    "HunyuanVideo15Pipeline": HunyuanVideo15Policy,
    "HunyuanVideo15ImageToVideoPipeline": HunyuanVideo15ImageToVideoPolicy,
    "QwenImageEditPipeline": QwenImageEditPolicy,
    "QwenImageEditPlusPipeline": QwenImageEditPlusPolicy,
}

# Optional file next to model_index.json: {"height": .., "width": .., "num_frames": ..} and, for an
# image-editing model, "condition_image_area" (the pixels its conditioning image is resized to).
SAMPLING_DEFAULTS_FILE = "sampling_defaults.json"

__all__ = ["FlowPolicy", "WanPolicy", "WanImageToVideoPolicy", "SD3Policy", "FluxPolicy", "ZImagePolicy", "Flux2KleinPolicy",
           "Flux2Policy", "QwenImagePolicy", "QwenImageEditPolicy", "QwenImageEditPlusPolicy", "HunyuanVideo15Policy",
           "HunyuanVideo15ImageToVideoPolicy", "POLICIES", "load_policy", "policy_for_pipeline"]


def _read_json(path_or_id: str, filename: str, revision: str | None, required: bool) -> dict | None:
    """``filename`` from a local folder, or from the Hub when ``path_or_id`` is not a folder."""
    if os.path.isdir(path_or_id):
        path = os.path.join(path_or_id, filename)
        if not os.path.isfile(path):
            if required:
                raise SetupError(f"{path_or_id!r} has no {filename}; expected a diffusers pipeline folder.")
            return None
    else:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(path_or_id, filename, revision=revision)
        except Exception as error:  # not found, offline, invalid id: all mean "cannot get it"
            if required:
                raise SetupError(
                    f"{path_or_id!r} is neither a local pipeline folder nor a Hub model id whose {filename} could be "
                    f"fetched ({hub_failure_reason(error)}); {hub_hint()}."
                ) from error
            return None
    with open(path) as f:
        return json.load(f)


def pipeline_class_for(path: str, index: dict, image_conditioned: bool | None) -> str:
    """The pipeline class to load ``path`` (its ``model_index.json`` is ``index``) as, for prompts
    with (``image_conditioned``) or without conditioning images (None: its own class). A Wan 2.2
    TI2V folder (a ``WanPipeline`` with ``expand_timesteps``) samples from images as a
    ``WanImageToVideoPipeline``; any other mismatch is one sentence."""
    class_name = index.get("_class_name")
    takes_images = POLICIES.get(class_name, FlowPolicy).image_conditioned
    if image_conditioned is None or image_conditioned == takes_images:
        return class_name
    if image_conditioned and class_name == "WanPipeline" and index.get("expand_timesteps"):
        return "WanImageToVideoPipeline"
    if image_conditioned:
        kind = "text-to-video" if POLICIES[class_name].is_video else "text-to-image"
        raise SetupError(f"{path!r} is a {kind} pipeline ({class_name}) and takes no conditioning image, but the prompts "
                         f"have an image column; leave it out (--image_column names it) or train an image-to-video model.")
    kind = "image-to-video" if POLICIES[class_name].is_video else "image-editing"
    raise SetupError(f"{path!r} is an {kind} pipeline ({class_name}): every prompt needs a conditioning image, "
                     f"and the prompts have no image column (--image_column names it).")
def _component_without_its_packages(index: dict) -> str | None:
    """Why a transformers component of ``model_index.json`` cannot be built here, or None:
    transformers stands in a placeholder, naming the packages it needs (``_backends``), for a
    class whose packages are missing (FLUX.2 [dev]'s PixtralProcessor needs torchvision)."""
    import transformers

    for name, value in index.items():
        if isinstance(value, list) and len(value) == 2 and value[0] == "transformers":
            needs = getattr(getattr(transformers, str(value[1]), None), "_backends", None)
            if needs:
                packages = " ".join(needs)
                return f"its {name} ({value[1]}) needs {packages}, which is not installed (pip install {packages})"
    return None


def guidance_options_of(args: dict) -> dict[str, float]:
    """The guidance options a run set (``GUIDANCE_OPTION_FLAGS``), from its arguments as a dict."""
    return {name: args[name] for name in GUIDANCE_OPTION_FLAGS if args.get(name) is not None}


def policy_for_pipeline(pipeline, **defaults) -> FlowPolicy:
    """The adapter for an already loaded pipeline; ``defaults`` are ``default_height`` etc."""
    name = type(pipeline).__name__
    if name not in POLICIES:
        raise ValueError(f"Unsupported pipeline class {name!r}; supported: {sorted(POLICIES)}.")
    return POLICIES[name](pipeline, **defaults)


def load_policy(
    pretrained_model_name_or_path: str,
    *,
    revision: str | None = None,
    variant: str | None = None,
    dtype: torch.dtype = torch.float32,
    zero3_init_config: dict | None = None,
    max_sequence_length: int | None = None,
    wan_expert: str | None = None,
    guidance_scale_2: float | None = None,
    sampling_only: bool = False,
    image_conditioned: bool | None = None,
    guidance_options: dict[str, float] | None = None,
) -> FlowPolicy:
    """Load a diffusers pipeline (local folder or Hub id) and wrap it in its family's adapter.

    Text encoders and VAE are loaded in ``dtype``; the transformer always in float32 (the
    trainer casts and prepares it). Components saved as null in model_index.json (e.g. SD3
    without T5) stay None. A ``sampling_defaults.json`` next to model_index.json, when
    present, sets the default sampling size. ``max_sequence_length``: T5/UMT5 tokens per prompt
    (None: the pipeline's default).

    ``zero3_init_config`` (a ZeRO-3 DeepSpeed config, with ``zero3_init_flag: true``): the
    transformer is built partitioned across the ranks (``genrl.distributed.zero_init``) and no rank holds
    all of it; collective, every rank calls it.

    A two-expert Wan 2.2 pipeline (A14B) trains the ``wan_expert`` ("high": ``transformer``,
    "low": ``transformer_2``), loaded like a single transformer (float32, partitioned under
    ZeRO-3); the other expert is a frozen part, in ``dtype`` and whole on every rank.
    ``guidance_scale_2`` guides its low-noise steps (``WanPolicy``). Without ``wan_expert`` such a
    pipeline loads only with ``sampling_only`` (evaluation).

    ``image_conditioned``: whether the prompts come with conditioning images (None: load the
    folder's own class); an image-to-video pipeline without them, or a text-only one with them,
    is a ``SetupError`` before any weights load, and Wan 2.2 TI2V with them loads as
    ``WanImageToVideoPipeline`` (``pipeline_class_for``).

    ``guidance_options``: guidance settings besides the scale by the pipeline call's names (Z-Image's
    ``cfg_normalization`` and ``cfg_truncation``, ``FlowPolicy.guidance_options``); one the
    family's pipeline does not take is a ``SetupError`` before any weights load.
    """
    path = os.fspath(pretrained_model_name_or_path)
    index = _read_json(path, "model_index.json", revision, required=True)
    class_name = index.get("_class_name")
    if class_name not in POLICIES:
        raise SetupError(f"Unsupported pipeline class {class_name!r} in {path!r}; supported: {sorted(POLICIES)}.")
    if getattr(diffusers, class_name, None) is None:
        raise SetupError(f"{path!r} is a {class_name}, which the installed diffusers {diffusers.__version__} does not "
                         "have; upgrade it (pip install -U diffusers).")
    unusable = _component_without_its_packages(index)
    if unusable:
        raise SetupError(f"{path!r} cannot be loaded here: {unusable}.")
    class_name = pipeline_class_for(path, index, image_conditioned)
    guidance_options = guidance_options or {}
    for name in guidance_options:
        if name not in POLICIES[class_name].guidance_options:
            owners = sorted(k for k, policy in POLICIES.items() if name in policy.guidance_options)
            raise SetupError(f"--{name} applies only to {' and '.join(owners)}; {path!r} is a {class_name}.")
    two_experts = (index.get("transformer_2") or [None])[0] is not None
    if two_experts and wan_expert not in EXPERTS and not (sampling_only and wan_expert is None):  # before any weights load
        raise SetupError(two_expert_message(path, index.get("boundary_ratio")))
    trained = "transformer_2" if two_experts and wan_expert == "low" else "transformer"
    components = {  # saved as null: stay None
        name: None
        for name, value in index.items()
        if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[0] is None
    }
    components.update(POLICIES[class_name].replaced_components(path, revision))
    if zero3_init_config is not None:
        transformer_class = getattr(diffusers, index[trained][1])
        components[trained] = load_partitioned_transformer(
            transformer_class, transformer_folder(path, revision, trained), zero3_init_config, variant=variant
        )
    try:
        pipeline = getattr(diffusers, class_name).from_pretrained(
            path,
            revision=revision,
            variant=variant,
            dtype={"default": dtype, trained: torch.float32},
            **components,
        )
    except OSError as error:  # a Hub model whose weights could not be downloaded
        if os.path.isdir(path):
            raise
        raise SetupError(f"The weights of Hub model {path!r} could not be fetched ({hub_failure_reason(error)}); {hub_hint()}.") from error
    pipeline.set_progress_bar_config(disable=True)
    sizes = _read_json(path, SAMPLING_DEFAULTS_FILE, revision, required=False) or {}
    unknown = set(sizes) - {"height", "width", "num_frames", "condition_image_area"}
    if unknown:
        raise ValueError(
            f"{SAMPLING_DEFAULTS_FILE} in {path!r} has unknown keys {sorted(unknown)}; expected height, width, num_frames, "
            "condition_image_area."
        )
    experts = dict(expert=wan_expert, guidance_scale_2=guidance_scale_2) if two_experts else {}
    return POLICIES[class_name](pipeline, max_sequence_length=max_sequence_length, **experts, **guidance_options,
                                **{f"default_{k}": int(v) for k, v in sizes.items()})
