"""Where a user meets a model (``pipe(prompt)``): the evaluation at the pipeline's defaults samples
with the step count and guidance the family's pipeline uses when called with a prompt alone."""

import pytest

from genrl.evaluation.pipeline_defaults import at_pipeline_defaults, pipeline_call_defaults
from genrl.testing.tiny_pipelines import build_tiny_pipeline, build_tiny_policy
from genrl.training.rollout import SamplingConfig


@pytest.mark.parametrize("family, expected", [
    ("sd3", {"num_inference_steps": 28, "guidance_scale": 7.0}),
    ("flux", {"num_inference_steps": 28, "guidance_scale": 3.5}),  # the guidance embedding's default
    ("wan", {"num_inference_steps": 50, "guidance_scale": 5.0}),
    # true CFG only with a negative prompt, which pipe(prompt) does not pass: unguided
    ("qwenimage", {"num_inference_steps": 50, "guidance_scale": 1.0}),
])
def test_each_family_is_scored_as_pipe_prompt_samples(family, expected):
    policy = build_tiny_policy(family)
    assert pipeline_call_defaults(policy.pipeline, policy.guidance_keyword) == expected
    config = at_pipeline_defaults(SamplingConfig(num_inference_steps=10, guidance_scale=4.0, negative_prompt="blurry",
                                                 ode_solver="ab2"), policy.pipeline, policy.guidance_keyword)
    assert (config.num_inference_steps, config.guidance_scale) == tuple(expected.values())
    assert (config.ode_solver, config.negative_prompt) == ("euler", "")


def test_qwen_images_pipe_prompt_runs_no_unconditional_branch():
    """The ground truth behind g = 1 for a true-CFG pipeline: called with a prompt alone (and its
    default true_cfg_scale 4) it runs one transformer forward a step."""
    pipeline = build_tiny_pipeline("qwenimage")
    forwards = []
    pipeline.transformer.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
    pipeline("a red circle", num_inference_steps=2, height=32, width=32, output_type="latent")
    assert len(forwards) == 2
