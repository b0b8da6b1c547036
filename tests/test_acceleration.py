"""--attention_backend and --compile (genrl.training.acceleration) on tiny transformers, on the CPU."""

import copy

import pytest
import torch
from diffusers import SD3Transformer2DModel
from diffusers.models.attention_dispatch import _AttentionBackendRegistry

from genrl.errors import SetupError
from genrl.testing.tiny_pipelines import build_tiny_policy
from genrl.training.acceleration import compile_repeated_blocks, repeated_block_classes, set_attention_backend


def velocity_inputs(policy, batch: int = 2):
    """Latents ``(batch, *latent_shape)``, timesteps and CFG embeddings of ``policy`` (seeded)."""
    generator = torch.Generator().manual_seed(0)
    shape = policy.latent_shape(*policy.resolve_size(None, None, None))
    latents = torch.randn((batch, *shape), generator=generator)
    timesteps = torch.tensor([700.0, 300.0][:batch])
    embeds = policy.encode_prompts(["a red circle", "a blue square"][:batch], "cpu", 4.5)
    return latents, timesteps, embeds


def backends_of(transformer) -> set:
    return {m.processor._attention_backend for m in transformer.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")}


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_the_native_backend_is_set_on_every_attention_and_keeps_the_velocity(family):
    policy = build_tiny_policy(family)
    latents, timesteps, embeds = velocity_inputs(policy)
    with torch.no_grad():
        before = policy.predict_velocity(policy.transformer, latents, timesteps, embeds, 4.5)
    reference = copy.deepcopy(policy.transformer)  # as the frozen copy of full fine-tuning
    set_attention_backend([policy.transformer, reference], "NATIVE", device="cpu", dtype=torch.float32)
    assert backends_of(policy.transformer) == backends_of(reference) == {"native"}
    with torch.no_grad():
        after = policy.predict_velocity(policy.transformer, latents, timesteps, embeds, 4.5)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)


def test_a_backend_stays_with_the_models_named():
    """diffusers' set_attention_backend also makes the backend every other model's default; an
    fp32 model elsewhere in the process would then be sent to a bf16-only kernel (cuDNN, flash)."""
    policy = build_tiny_policy("wan")
    bystander = copy.deepcopy(policy.transformer)
    active = _AttentionBackendRegistry._active_backend
    set_attention_backend([policy.transformer], "_native_math", device="cpu", dtype=torch.float32)
    assert backends_of(policy.transformer) == {"_native_math"} and backends_of(bystander) == {None}
    assert _AttentionBackendRegistry._active_backend == active


@pytest.mark.parametrize("name, reason", [
    ("flash", "please install `flash-attn"),  # diffusers' own requirement check: the package is missing
    ("_native_cudnn", "cannot run on cpu in float32"),  # found by the probe: no such kernel on this device
])
def test_a_backend_missing_here_is_one_sentence_and_changes_nothing(name, reason):
    policy = build_tiny_policy("wan")
    active = _AttentionBackendRegistry._active_backend
    with pytest.raises(SetupError) as error:
        set_attention_backend([policy.transformer], name, device="cpu", dtype=torch.float32)
    message = str(error.value)
    assert message.startswith(f"--attention_backend {name} ") and reason in message, message
    assert "\n" not in message and message.endswith(".")
    assert backends_of(policy.transformer) == {None}  # the model was left as loaded
    assert _AttentionBackendRegistry._active_backend == active


def test_sd3_attention_does_not_go_through_the_dispatcher_so_a_backend_is_refused():
    policy = build_tiny_policy("sd3")
    with pytest.raises(SetupError, match="does not apply to SD3Transformer2DModel"):
        set_attention_backend([policy.transformer], "native", device="cpu", dtype=torch.float32)


@pytest.mark.slow  # inductor compiles three graphs (no-grad forward, forward and backward): ~40 s on a cold cache
def test_compiled_sd3_blocks_give_the_eager_velocity_and_gradients():
    """SD3 declares no _repeated_blocks in diffusers 0.42: its JointTransformerBlock (its
    _no_split_modules) is compiled instead. One block keeps the CPU compile short."""
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16,
    )
    eager = copy.deepcopy(transformer)
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8, generator=generator), timestep=torch.tensor([700.0, 300.0]),
                  encoder_hidden_states=torch.randn(2, 5, 32, generator=generator),
                  pooled_projections=torch.randn(2, 32, generator=generator), return_dict=False)

    assert compile_repeated_blocks(transformer) == repeated_block_classes(transformer) == ["JointTransformerBlock"]
    assert transformer.transformer_blocks[0]._compiled_call_impl is not None
    assert list(transformer.state_dict()) == list(eager.state_dict())  # the same names: checkpoints, exports, EMA
    with torch.no_grad():  # the rollout
        torch.testing.assert_close(transformer(**inputs)[0], eager(**inputs)[0], rtol=1e-4, atol=1e-5)
    outputs = []
    for model in (transformer, eager):  # the update: forward and backward with grad
        model.train()
        outputs.append(model(**inputs)[0])
        outputs[-1].square().mean().backward()
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(transformer.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6, msg=name)
