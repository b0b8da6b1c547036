"""How a diffusers pipeline samples when called with a prompt alone (``pipe(prompt)``): its
own default step count and guidance scale, read from its ``__call__`` signature, so that a
model can be scored where a user who loads it meets it (28 steps at guidance 7 for
``StableDiffusion3Pipeline``, 28 at 3.5 for ``FluxPipeline``, 50 at 5 for ``WanPipeline``).

The trainer scores its base and its final weights there with ``--eval_pipeline_defaults``
(logged as ``eval_pipeline_defaults/*``; the model card states both), and
``bench/bench_learning.py`` scores every model it reports there.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch here: the model card writer imports this module
    from genrl.training.rollout import SamplingConfig

# Where the evaluation at the pipeline's defaults goes in the logs: ``<prefix>/<reward>_mean``,
# ``_std``, and the settings it sampled with, ``<prefix>/num_inference_steps`` and
# ``<prefix>/guidance_scale``.
LOG_PREFIX = "eval_pipeline_defaults"
SETTING_KEYS = ("num_inference_steps", "guidance_scale")

# Guidance options besides the scale that some pipelines' calls take (Z-Image's), set by the flags
# of the same names; ``FlowPolicy.guidance_options`` says which family takes which.
GUIDANCE_OPTION_FLAGS = ("cfg_normalization", "cfg_truncation")


def pipeline_call_defaults(pipeline, guidance_keyword: str = "guidance_scale") -> dict[str, float]:
    """``{"num_inference_steps": n, "guidance_scale": g}``: the defaults of ``pipeline``'s
    ``__call__`` (a pipeline instance or class), those of the two it has, the scale read under the
    call's ``guidance_keyword`` (the policy's). A true-CFG pipeline (Qwen-Image) guides only when
    given a negative prompt, which ``pipe(prompt)`` is not: g = 1 there. A pipeline whose call
    takes no scale but has a ``guider`` component (HunyuanVideo 1.5): the guider's."""
    parameters = inspect.signature(pipeline.__call__).parameters
    named = {"num_inference_steps": "num_inference_steps", "guidance_scale": guidance_keyword}
    defaults = {key: parameters[name].default for key, name in named.items()
                if name in parameters and isinstance(parameters[name].default, (int, float))}
    negative = parameters.get("negative_prompt")
    if guidance_keyword == "true_cfg_scale" and negative is not None and negative.default is None:
        defaults["guidance_scale"] = 1.0
    guider = getattr(pipeline, "guider", None)  # HunyuanVideo 1.5
    if guider is not None and "guidance_scale" not in defaults:
        defaults["guidance_scale"] = float(guider.guidance_scale)
    return defaults


def at_pipeline_defaults(config: SamplingConfig, pipeline, guidance_keyword: str = "guidance_scale") -> SamplingConfig:
    """``config`` (an evaluation's) with the pipeline's default steps and guidance
    (``pipeline_call_defaults``), integrated with Euler as the pipeline's scheduler does and
    without a negative prompt; the size, prompts and noise stay the evaluation's, so that only how
    the model is sampled changes."""
    return dataclasses.replace(config, **pipeline_call_defaults(pipeline, guidance_keyword), ode_solver="euler",
                               negative_prompt="")


def settings_text(settings: dict) -> str:
    """``28 steps, guidance 7`` for ``{"num_inference_steps": 28, "guidance_scale": 7.0}``."""
    return f"{int(settings['num_inference_steps'])} steps, guidance {settings['guidance_scale']:g}"
