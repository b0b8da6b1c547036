"""Family adapters on tiny real diffusers pipelines: loading, encoding, latents, velocity, decoding,
and sampling parity with the pipelines' own ``__call__``."""

import json

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import (
    ClassifierFreeGuidance,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    UniPCMultistepScheduler,
)

from genrl.data.prompt_images import image_digest
from genrl.data.seeding import latent_generator
from genrl.errors import SetupError
from genrl.policies import (
    POLICIES,
    Flux2KleinPolicy,
    Flux2Policy,
    FluxPolicy,
    HunyuanVideo15Policy,
    QwenImageEditPolicy,
    QwenImagePolicy,
    SD3Policy,
    WanImageToVideoPolicy,
    WanPolicy,
    ZImagePolicy,
    load_policy,
    policy_for_pipeline,
)
from genrl.testing.tiny_pipelines import (
    FAMILIES,
    TINY_CHAT_MAX_LENGTH,
    TINY_MISTRAL_MAX_LENGTH,
    TINY_SAMPLING_DEFAULTS,
    VARIANTS,
    build_tiny_pipeline,
    save_tiny_pipeline,
)
from genrl.training.rollout import SampleBatch, SamplingConfig, sample_rollout

torch.set_num_threads(2)

ADAPTERS = {"wan": WanPolicy, "sd3": SD3Policy, "flux": FluxPolicy, "zimage": ZImagePolicy, "flux2-klein": Flux2KleinPolicy,
            "qwenimage": QwenImagePolicy, "flux2": Flux2Policy, "hunyuanvideo15": HunyuanVideo15Policy}
# Prompts through a chat template: the tiny Qwen and Mistral tokenizers' token limits.
CHAT_LIMITS = {"zimage": TINY_CHAT_MAX_LENGTH, "flux2-klein": TINY_CHAT_MAX_LENGTH, "qwenimage": TINY_CHAT_MAX_LENGTH,
               "flux2": TINY_MISTRAL_MAX_LENGTH, "hunyuanvideo15": TINY_CHAT_MAX_LENGTH}


def _image(seed: int, height: int = 40, width: int = 48) -> PIL.Image.Image:
    """A random RGB image of another size than the samples (the pipelines resize it)."""
    return PIL.Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {family: save_tiny_pipeline(family, root / family, seed=0) for family in FAMILIES + VARIANTS}


@pytest.fixture(scope="module")
def policies(tiny_dirs):
    return {family: load_policy(path, wan_expert="high" if "a14b" in family else None).to("cpu")
            for family, path in tiny_dirs.items()}


def assert_each_sample_as_if_alone(policy, latents, t, embeds, guidance_scale):
    """A batch's velocities are each sample's own, as predicted for it alone."""
    with torch.no_grad():
        both = policy.predict_velocity(policy.transformer, latents, t, embeds, guidance_scale)
        for i in range(len(latents)):
            alone = policy.predict_velocity(policy.transformer, latents[i:i + 1], t[i:i + 1],
                                            {k: v[i:i + 1] for k, v in embeds.items()}, guidance_scale)
            torch.testing.assert_close(both[i:i + 1], alone, rtol=0, atol=1e-5)


def _generators(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_load_round_trip(family, tiny_dirs, policies):
    path = tiny_dirs[family]
    pipeline = DiffusionPipeline.from_pretrained(path)  # plain diffusers loading works offline
    assert type(pipeline).__name__ == {v: k for k, v in POLICIES.items()}[ADAPTERS[family]]

    policy = policies[family]
    assert type(policy) is ADAPTERS[family] and policy.family == family
    assert policy.is_video == (family in ("wan", "hunyuanvideo15"))
    defaults = TINY_SAMPLING_DEFAULTS[family]
    assert (policy.default_height, policy.default_width) == (defaults["height"], defaults["width"])
    assert policy.default_num_frames == defaults["num_frames"]
    assert policy.transformer is policy.pipeline.transformer

    built = build_tiny_pipeline(family, seed=0).transformer.state_dict()
    loaded = policy.transformer.state_dict()
    assert built.keys() == loaded.keys()
    assert all(torch.equal(built[k], loaded[k]) for k in built)


def test_tiny_pipelines_are_deterministic_per_seed():
    a, b, c = (build_tiny_pipeline("sd3", seed=s).transformer.state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())
    state = torch.random.get_rng_state()
    build_tiny_pipeline("flux", seed=3)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is left alone
    with pytest.raises(ValueError, match="'sdxl'"):
        build_tiny_pipeline("sdxl")


def test_load_policy_dtypes(tiny_dirs):
    policy = load_policy(tiny_dirs["sd3"], dtype=torch.bfloat16)
    assert policy.transformer.dtype == torch.float32  # the trainer casts/prepares it
    for name, module in policy.frozen_modules().items():
        assert next(module.parameters()).dtype == torch.bfloat16, name
    assert set(policy.frozen_modules()) == {"vae", "text_encoder", "text_encoder_2", "text_encoder_3"}


def test_load_policy_errors(tmp_path, monkeypatch):
    """Each is a SetupError (the scripts print its one sentence), raised before any weights load."""
    with pytest.raises(SetupError, match="neither a local pipeline folder nor a Hub model id"):
        load_policy(str(tmp_path / "missing"))
    with pytest.raises(SetupError, match="neither a local pipeline folder nor a Hub model id"):
        load_policy("genrl-test/not-a-model")  # tests run with HF_HUB_OFFLINE=1
    with pytest.raises(SetupError, match="has no model_index.json"):
        load_policy(str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(SetupError, match="StableDiffusionXLPipeline.*FluxPipeline.*WanPipeline"):
        load_policy(str(tmp_path))
    # A family the installed diffusers does not have yet (an older diffusers without Z-Image).
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    import diffusers

    with monkeypatch.context() as patch:
        patch.setattr(diffusers, "ZImagePipeline", None)
        with pytest.raises(SetupError, match=r"is a ZImagePipeline, which the installed diffusers .* does not have; upgrade"):
            load_policy(str(tmp_path))
    # FLUX.2 [dev]'s tokenizer is a PixtralProcessor, whose image half needs torchvision: where a
    # package is missing, transformers stands in a placeholder that names it.
    import transformers

    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "Flux2Pipeline", "tokenizer": ["transformers", "PixtralProcessor"],
        "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"]}))
    with monkeypatch.context() as patch:
        patch.setattr(transformers, "PixtralProcessor", type("Placeholder", (), {"_backends": ["torchvision"]}))
        with pytest.raises(SetupError, match=r"cannot be loaded here: its tokenizer \(PixtralProcessor\) needs torchvision, "
                                             r"which is not installed \(pip install torchvision\)\.$"):
            load_policy(str(tmp_path))
    # Wan2.2-T2V-A14B's index (no weights here at all: the sentence must come from the index alone).
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "boundary_ratio": 0.875, "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"]}))
    with pytest.raises(SetupError, match="two-expert Wan 2.2 pipeline .*0.875.*--wan_expert high or --wan_expert low"):
        load_policy(str(tmp_path))
    # Prompts with images for a text-only pipeline, or without for an image-to-video one: from the index alone too.
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "expand_timesteps": False}))
    with pytest.raises(SetupError, match=r"is a text-to-video pipeline \(WanPipeline\) and takes no conditioning image, but"):
        load_policy(str(tmp_path), image_conditioned=True)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(SetupError, match=r"is a text-to-image pipeline \(FluxPipeline\)"):
        load_policy(str(tmp_path), image_conditioned=True)
    # A guidance option of another family's pipeline (Z-Image's), from the index alone.
    with pytest.raises(SetupError,
                       match=r"^--cfg_truncation applies only to ZImagePipeline; '.*' is a FluxPipeline\.$"):
        load_policy(str(tmp_path), guidance_options={"cfg_truncation": 0.5})
    for image_to_video in ("WanImageToVideoPipeline", "HunyuanVideo15ImageToVideoPipeline"):
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": image_to_video}))
        with pytest.raises(SetupError, match=rf"is an image-to-video pipeline \({image_to_video}\): every prompt needs a "
                                             r"conditioning image, and the prompts have no image column"):
            load_policy(str(tmp_path), image_conditioned=False)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideo15Pipeline"}))
    with pytest.raises(SetupError, match=r"is a text-to-video pipeline \(HunyuanVideo15Pipeline\) and takes no conditioning "
                                         r"image, but"):
        load_policy(str(tmp_path), image_conditioned=True)


def test_two_experts_each_train_their_own_steps_and_the_other_is_a_frozen_part(tiny_dirs):
    high = load_policy(tiny_dirs["wan2.2-a14b"], wan_expert="high")
    low = load_policy(tiny_dirs["wan2.2-a14b"], wan_expert="low", dtype=torch.bfloat16)
    assert high.transformer is high.pipeline.transformer and high.frozen_expert is high.pipeline.transformer_2
    assert low.transformer is low.pipeline.transformer_2 and low.frozen_expert is low.pipeline.transformer
    assert low.transformer.dtype == torch.float32 and low.frozen_expert.dtype == torch.bfloat16  # trained in fp32
    low.to("cpu", torch.bfloat16)
    assert "transformer" in low.frozen_modules() and not any(p.requires_grad for p in low.frozen_expert.parameters())
    t = torch.tensor([999.0, 875.0, 874.9, 100.0])
    assert high.expert_of(t).tolist() == [True, True, False, False] and low.expert_of(t).tolist() == [False, False, True, True]
    assert high.trained_sigma_range() == (0.875, 1.0) and low.trained_sigma_range()[1] < 0.875
    with pytest.raises(SetupError, match="--wan_expert must be one of"):
        WanPolicy(high.pipeline, expert="middle")
    with pytest.raises(SetupError, match="apply only to a two-expert"):
        WanPolicy(build_tiny_pipeline("wan"), expert="high")


def test_the_low_noise_scale_is_the_pipelines_default_where_pipe_prompt_is_scored(policies):
    """``pipe(prompt)`` guides Wan 2.2 A14B's low-noise steps at ``guidance_scale`` (its
    ``guidance_scale_2`` defaults to None): a run's own second scale is set aside there."""
    sizes = {f"default_{k}": v for k, v in TINY_SAMPLING_DEFAULTS["wan2.2-a14b"].items()}
    policy = WanPolicy(policies["wan2.2-a14b"].pipeline, expert="high", guidance_scale_2=2.0, **sizes)
    plain = WanPolicy(policies["wan2.2-a14b"].pipeline, expert="high", **sizes)
    embeds = policy.encode_prompts(["a red circle"], "cpu", guidance_scale=4.0, negative_prompt="")
    latents, t = policy.prepare_latents(_generators(1), 32, 32, 5, "cpu"), torch.tensor([100.0])  # a low-noise step
    with torch.no_grad():
        own = policy.predict_velocity(policy.transformer, latents, t, embeds, 4.0)
        with policy.pipeline_call_guidance():
            assert policy.guidance_scale_2 is None
            at_defaults = policy.predict_velocity(policy.transformer, latents, t, embeds, 4.0)
        assert policy.guidance_scale_2 == 2.0
        assert torch.equal(at_defaults, plain.predict_velocity(plain.transformer, latents, t, embeds, 4.0))
    assert not torch.allclose(own, at_defaults)


@pytest.mark.parametrize("family", FAMILIES)
def test_max_sequence_length_sets_the_t5_tokens_and_the_model_runs_on_them(family, tiny_dirs):
    """SD3's prompt embeddings are its CLIP tokens (16 here) followed by the T5 ones; FLUX's and
    Wan's are the T5/UMT5 tokens, Z-Image's and FLUX.2's the Qwen3 tokens of the chat-templated prompt.
    Default: the pipeline's (256 / 512), capped by the tiny tokenizers' 16 (the chat tokenizer's
    32); a value above the tokenizer's is capped too."""
    clip_tokens = 16 if family == "sd3" else 0
    cap = CHAT_LIMITS.get(family, 16)
    for asked, tokens in ((None, cap), (5, 5), (100, cap)):
        policy = load_policy(tiny_dirs[family], max_sequence_length=asked).to("cpu")
        assert policy.max_sequence_length == tokens
        embeds = policy.encode_prompts(["a red circle", "a cat"], "cpu", guidance_scale=3.0)
        assert embeds["prompt_embeds"].shape[1] == clip_tokens + tokens
        latents = policy.prepare_latents(_generators(2), *TINY_SAMPLING_DEFAULTS[family].values(), "cpu")
        with torch.no_grad():
            v = policy.predict_velocity(policy.transformer, latents, torch.tensor([500.0, 500.0]), embeds, 3.0)
        assert v.shape == latents.shape and torch.isfinite(v).all()
    with pytest.raises(ValueError, match="at least 1"):
        load_policy(tiny_dirs[family], max_sequence_length=0)


def test_to_moves_and_freezes_only_the_frozen_parts(tiny_dirs):
    policy = load_policy(tiny_dirs["flux"])
    policy.to("cpu", torch.bfloat16)
    for module in policy.frozen_modules().values():
        assert not module.training
        assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in module.parameters())
    assert policy.transformer.dtype == torch.float32
    assert all(p.requires_grad for p in policy.transformer.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_prompts_is_batch_first_with_negatives_for_true_cfg(family, policies):
    policy = policies[family]
    prompts = ["a red circle", "two blue squares left of a tree"]
    with_cfg = policy.encode_prompts(prompts, "cpu", guidance_scale=4.0, negative_prompt="dark")
    without = policy.encode_prompts(prompts, "cpu", guidance_scale=policy.conditional_guidance(4.0))
    has_negatives = any(k.startswith("negative_") for k in with_cfg)
    assert has_negatives == policy.uses_true_cfg and policy.uses_true_cfg == (family not in ("flux", "flux2"))
    assert not any(k.startswith("negative_") for k in without)
    assert all(v.shape[0] == 2 for v in with_cfg.values())
    assert not torch.equal(with_cfg["prompt_embeds"][0], with_cfg["prompt_embeds"][1])
    alone = policy.encode_prompts(prompts[1:], "cpu", guidance_scale=policy.conditional_guidance(4.0))
    torch.testing.assert_close(alone["prompt_embeds"][0], without["prompt_embeds"][1])


@pytest.mark.parametrize("family", ["zimage", "qwenimage", "hunyuanvideo15"])
def test_prompts_of_different_lengths_keep_their_own_tokens(family, policies):
    """Families whose transformer sees each prompt's tokens alone keep them right-padded with a
    mask: each row holds its own prompt's tokens, the caller's prompt list is left as it was
    (Z-Image's pipeline writes the chat template into it), and a sample's velocity does not
    depend on the lengths of the prompts beside it."""
    policy = policies[family]
    prompts = ["a cat", "two red dogs on a big table"]
    embeds = policy.encode_prompts(prompts, "cpu", guidance_scale=3.0, negative_prompt="dark blue")
    assert prompts == ["a cat", "two red dogs on a big table"]
    for key in ("prompt_embeds", "negative_prompt_embeds"):
        values, mask = embeds[key], embeds[f"{key}_mask"]
        assert mask.dtype == torch.bool and mask.shape == values.shape[:2]
        lengths = mask.sum(dim=1)
        assert (mask == (torch.arange(mask.shape[1]) < lengths[:, None])).all(), "right-padded"
        assert (values[~mask] == 0).all() and (values[mask].abs().sum(dim=-1) > 0).all()
    assert embeds["prompt_embeds_mask"].sum(dim=1).tolist()[0] < embeds["prompt_embeds_mask"].sum(dim=1).tolist()[1]
    latents = policy.prepare_latents(_generators(2), 32, 32, 1, "cpu")
    t = torch.tensor([800.0, 300.0])
    assert_each_sample_as_if_alone(policy, latents, t, embeds, 3.0)


@pytest.mark.parametrize(
    "family, shape", [("wan", (4, 2, 4, 4)), ("sd3", (4, 8, 8)), ("flux", (4, 8, 8)), ("zimage", (4, 8, 8)),
                      ("flux2-klein", (16, 4, 4)), ("qwenimage", (4, 4, 4)), ("flux2", (16, 4, 4)),
                      ("hunyuanvideo15", (4, 2, 2, 2))]
)
def test_prepare_latents_draws_each_sample_from_its_generator(family, shape, policies):
    policy = policies[family]
    latents = policy.prepare_latents(_generators(3), 32, 32, 5, "cpu")
    assert latents.shape == (3, *shape) and latents.dtype == torch.float32
    alone = policy.prepare_latents(_generators(1, seed=2), 32, 32, 5, "cpu")
    assert torch.equal(latents[2:], alone)


def test_unsupported_sizes_fail_early(policies):
    with pytest.raises(ValueError, match="height=20"):
        policies["sd3"].latent_shape(20, 32, 1)  # SD3 tiny needs multiples of 4 (VAE) * 2 (patch)
    with pytest.raises(ValueError, match="num_frames=4"):
        policies["wan"].latent_shape(32, 32, 4)
    with pytest.raises(ValueError, match="width=36"):
        policies["flux"].latent_shape(32, 36, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_schedule_starts_at_one_and_ends_at_zero(family, policies):
    policy = policies[family]
    latents = policy.prepare_latents(_generators(1), 32, 32, 5, "cpu")
    timesteps, sigmas = policy.timesteps_and_sigmas(6, latents, "cpu")
    assert timesteps.shape == (6,) and sigmas.shape == (7,)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and (sigmas[1:] < sigmas[:-1]).all()
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000)


@pytest.mark.parametrize("family", ["wan", "sd3", "zimage", "flux2-klein", "qwenimage", "hunyuanvideo15"])
def test_true_cfg_combines_cond_and_uncond_in_one_forward(family, policies):
    """v = v_u + g (v_c - v_u); Z-Image's pipeline writes it v = v_c + g (v_c - v_u), guidance 0
    being the conditional velocity alone; Qwen-Image's rescales v to |v_c| token by token (a token:
    a 2x2 patch of every channel)."""
    policy = policies[family]
    embeds = policy.encode_prompts(["a red circle", "a cat"], "cpu", guidance_scale=3.0, negative_prompt="blue")
    latents = policy.prepare_latents(_generators(2), 32, 32, 5, "cpu")
    t = torch.tensor([900.0, 400.0])
    cond = {k: v for k, v in embeds.items() if not k.startswith("negative_")}
    uncond = {k[len("negative_"):]: v for k, v in embeds.items() if k.startswith("negative_")}
    alone = policy.conditional_guidance(3.0)
    with torch.no_grad():
        v_c = policy.predict_velocity(policy.transformer, latents, t, cond, guidance_scale=alone)
        v_u = policy.predict_velocity(policy.transformer, latents, t, uncond, guidance_scale=alone)
        v = policy.predict_velocity(policy.transformer, latents, t, embeds, guidance_scale=3.0)
    assert v.shape == latents.shape and v.dtype == torch.float32
    assert not torch.allclose(v_c, v_u)
    base = v_c if family == "zimage" else v_u
    expected = base + 3.0 * (v_c - v_u)
    if family == "qwenimage":
        pack = lambda v: type(policy.pipeline)._pack_latents(v, *v.shape)  # noqa: E731
        expected = expected * (pack(v_c).norm(dim=-1) / pack(expected).norm(dim=-1)).view(2, 2, 2).repeat_interleave(
            2, dim=1).repeat_interleave(2, dim=2)[:, None]
    torch.testing.assert_close(v, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="negative"):
        policy.predict_velocity(policy.transformer, latents, t, cond, guidance_scale=3.0)


@pytest.mark.parametrize("options", [{"cfg_truncation": 0.3}, {"cfg_normalization": 1.0},
                                     {"cfg_truncation": 0.3, "cfg_normalization": 1.0}])
def test_zimage_guidance_options_sample_as_its_pipeline_does(options, policies):
    """Z-Image's ``cfg_truncation`` (no guidance once 1 - t/1000 passes it) and ``cfg_normalization``
    (the guided velocity's norm capped at that many times the conditional one's) give our
    deterministic loop the pipeline's own samples; each changes them; ``pipeline_call_guidance``
    samples as ``pipe(prompt)`` does, at the defaults, and keeps the run's options after it."""
    sizes = TINY_SAMPLING_DEFAULTS["zimage"]
    policy = ZImagePolicy(policies["zimage"].pipeline, **options, **{f"default_{k}": v for k, v in sizes.items()})
    prompts = ["a red circle above a blue square", "three green triangles"]
    config = SamplingConfig(num_inference_steps=4, guidance_scale=3.0, noise_level=0.0, negative_prompt="dark")

    def final_latents(policy):
        batch = SampleBatch(prompts, [0, 0], seed=7, epoch=0)
        return sample_rollout(policy, policy.transformer, batch, config=config, device="cpu")

    rollout, plain = final_latents(policy), final_latents(policies["zimage"])  # steps at progress 0, 0.1, 0.25, 0.5
    assert (rollout.final_latents - plain.final_latents).abs().max() > 1e-3, "the options must change the samples"
    latents = policy.prepare_latents([latent_generator(p, 7, 0, 0, True) for p in prompts], sizes["height"],
                                     sizes["width"], 1, "cpu")
    call = dict(height=sizes["height"], width=sizes["width"], num_inference_steps=4, guidance_scale=3.0,
                max_sequence_length=policy.max_sequence_length, latents=latents, **options)
    final = policy.pipeline(prompt=list(prompts), negative_prompt=["dark"] * 2, **call, output_type="latent").images
    torch.testing.assert_close(rollout.final_latents, final, rtol=0, atol=1e-5)
    # Fresh lists again: the pipeline writes its chat template into the prompt lists it is given.
    expected = policy.pipeline(prompt=list(prompts), negative_prompt=["dark"] * 2, **call, output_type="pt").images
    torch.testing.assert_close(rollout.samples, expected.unsqueeze(2), rtol=0, atol=1e-4)
    with policy.pipeline_call_guidance():
        assert torch.equal(final_latents(policy).final_latents, plain.final_latents)
    assert all(getattr(policy, name) == value for name, value in options.items())

    # Training batches mix timesteps: each sample is guided (or not) by its own, as if alone.
    embeds = policy.encode_prompts(prompts, "cpu", guidance_scale=3.0, negative_prompt="dark")
    t = torch.tensor([900.0, 500.0])  # progress 0.1 (guided) and 0.5 (past a truncation of 0.3)
    assert_each_sample_as_if_alone(policy, latents, t, embeds, 3.0)


def test_a_step_distilled_klein_ignores_guidance_as_its_pipeline_does():
    """FLUX.2 [klein]'s distilled checkpoints (``is_distilled`` in model_index.json) sample
    without CFG whatever the scale: no negative embeddings, one forward."""
    pipeline = build_tiny_pipeline("flux2-klein")
    pipeline.register_to_config(is_distilled=True)
    policy = policy_for_pipeline(pipeline).to("cpu")
    assert not policy.use_cfg(4.0) and policy_for_pipeline(build_tiny_pipeline("flux2-klein")).use_cfg(4.0)
    embeds = policy.encode_prompts(["a cat"], "cpu", guidance_scale=4.0)
    assert set(embeds) == {"prompt_embeds"}
    latents = policy.prepare_latents(_generators(1), 32, 32, 1, "cpu")
    with torch.no_grad():
        guided = policy.predict_velocity(policy.transformer, latents, torch.tensor([600.0]), embeds, 4.0)
        plain = policy.predict_velocity(policy.transformer, latents, torch.tensor([600.0]), embeds, 1.0)
    assert torch.equal(guided, plain)


@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_flux_guidance_is_a_transformer_input(family, policies):
    policy = policies[family]
    embeds = policy.encode_prompts(["a red circle"], "cpu", guidance_scale=3.5)
    latents = policy.prepare_latents(_generators(1), 32, 32, 1, "cpu")
    t = torch.tensor([700.0])
    with torch.no_grad():
        low = policy.predict_velocity(policy.transformer, latents, t, embeds, guidance_scale=1.0)
        high = policy.predict_velocity(policy.transformer, latents, t, embeds, guidance_scale=5.0)
    assert low.shape == latents.shape and not torch.allclose(low, high)


def test_inputs_are_cast_to_a_bf16_transformer(tiny_dirs):
    policy = load_policy(tiny_dirs["wan"]).to("cpu")
    transformer = policy.transformer.to(torch.bfloat16)
    embeds = policy.encode_prompts(["a cat"], "cpu", guidance_scale=2.0)
    latents = policy.prepare_latents(_generators(1), 32, 32, 5, "cpu")
    with torch.no_grad():
        v = policy.predict_velocity(transformer, latents, torch.tensor([500.0]), embeds, guidance_scale=2.0)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


@pytest.mark.parametrize("family, guidance_scale", [("wan", 3.0), ("wan2.2", 3.0), ("wan2.2", 1.0), ("sd3", 3.0),
                                                    ("sd3", 1.0), ("sd3.5", 3.0), ("flux", 3.0), ("wan2.2-a14b", 3.0),
                                                    ("wan2.2-a14b", 1.0), ("wan2.2-a14b/low", 3.0),
                                                    ("wan2.1-i2v", 3.0), ("wan2.1-i2v", 1.0), ("wan2.2-i2v", 3.0),
                                                    ("wan2.2-i2v", 1.0), ("wan2.2-i2v-a14b/low", 3.0), ("zimage", 3.0),
                                                    ("zimage", 0.0), ("flux2-klein", 3.0), ("flux2-klein", 1.0),
                                                    ("qwenimage", 4.0), ("qwenimage", 1.0), ("flux2", 4.0),
                                                    ("flux2", 1.5), ("hunyuanvideo15", 4.0), ("hunyuanvideo15", 1.0),
                                                    ("hunyuanvideo15-i2v", 4.0), ("hunyuanvideo15-i2v", 1.0)])
def test_deterministic_rollout_matches_the_pipeline(family, guidance_scale, policies):
    """Noise level 0 makes our loop the pipeline's own Euler sampler: same initial noise, same
    prompt encoding, schedule, guidance and decoding must give the same frames. Wan 2.2 A14B's
    experts each sample their own steps, the low-noise one at its own guidance scale, whichever
    of them is the trained one. Image-to-video samples from the same image as the pipeline (Wan
    2.1 I2V: its CLIP embeddings too; TI2V: as the first latent frame; HunyuanVideo 1.5 I2V: its
    SigLIP embeddings too, at the size the pipeline picks for the image's aspect ratio)."""
    family, _, expert = family.partition("/")
    policy = policies[family]
    extra = {}
    if "a14b" in family:
        policy = type(policy)(policy.pipeline, expert=expert or "high", guidance_scale_2=2.0,
                              **{f"default_{k}": v for k, v in TINY_SAMPLING_DEFAULTS[family].items()})
        extra = {"guidance_scale_2": 2.0}
    height, width, num_frames = TINY_SAMPLING_DEFAULTS[family].values()
    prompts = ["a red circle above a blue square", "three green triangles"]
    if policy.family == "hunyuanvideo15":  # its second encoder (ByT5) reads the prompt's quoted text
        prompts[1] = 'a sign that says "open" near a tree'
    config = SamplingConfig(num_inference_steps=4, guidance_scale=guidance_scale, noise_level=0.0, negative_prompt="dark")
    # HunyuanVideo 1.5 I2V samples at the size its pipeline picks for the image: images of 5:8 give the tiny 32 x 48.
    image_size = (40, 64) if family == "hunyuanvideo15-i2v" else (40, 48)
    images = [_image(0, *image_size)] * 2 if policy.image_conditioned else None
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(prompts, [0, 0], seed=7, epoch=0, images=images),
                             config=config, device="cpu")
    assert rollout.num_steps == 0
    if images is not None:
        extra["image"] = images[0]
        other = sample_rollout(policy, policy.transformer,
                               SampleBatch(prompts, [0, 0], seed=7, epoch=0, images=[_image(1, *image_size)] * 2),
                               config=config, device="cpu")
        assert (other.samples - rollout.samples).abs().max() > 0.01, "the image must condition the samples"

    image_id = image_digest(images[0]) if images is not None else None  # a record's seeds include its image
    generators = [latent_generator(p, 7, 0, 0, True, image_id) for p in prompts]
    latents = policy.prepare_latents(generators, height, width, num_frames, "cpu")
    kwargs = dict(
        prompt=prompts, height=height, width=width, num_inference_steps=4, guidance_scale=guidance_scale,
        output_type="pt", max_sequence_length=policy.max_sequence_length,
    )
    if policy.family == "wan":
        out = policy.pipeline(latents=latents, num_frames=num_frames, negative_prompt="dark", **kwargs, **extra).frames
        expected = out.permute(0, 2, 1, 3, 4)  # (B, F, C, H, W) -> (B, C, F, H, W)
    elif policy.family == "sd3":
        out = policy.pipeline(latents=latents, negative_prompt="dark", **kwargs).images
        expected = out.unsqueeze(2)
    elif policy.family == "zimage":  # its pipeline writes the chat template into the prompt list it is given
        kwargs.update(prompt=list(prompts))
        expected = policy.pipeline(latents=latents, negative_prompt=["dark"] * 2, **kwargs).images.unsqueeze(2)
    elif policy.family == "flux2-klein":  # its pipeline takes the negative prompt as embeddings only
        negative, _ = policy.pipeline.encode_prompt(["dark"] * 2, max_sequence_length=policy.max_sequence_length)
        expected = policy.pipeline(latents=latents, negative_prompt_embeds=negative, **kwargs).images.unsqueeze(2)
    elif policy.family == "qwenimage":  # true_cfg_scale, and CFG only with a negative prompt
        kwargs.update(latents=type(policy.pipeline)._pack_latents(latents, *latents.shape), guidance_scale=None,
                      true_cfg_scale=guidance_scale, negative_prompt="dark" if guidance_scale > 1 else None)
        expected = policy.pipeline(**kwargs).images.unsqueeze(2)
        # Its tiny VAE decodes almost any latents to nearly the same image: the loop is compared before it too.
        final = policy.pipeline(**{**kwargs, "output_type": "latent"}).images
        ours = rollout.final_latents
        torch.testing.assert_close(type(policy.pipeline)._pack_latents(ours, *ours.shape), final, rtol=0, atol=1e-5)
    elif policy.family == "flux2":  # guidance goes in as an input of the transformer
        expected = policy.pipeline(latents=latents, **kwargs).images.unsqueeze(2)
    elif policy.family == "hunyuanvideo15":  # guided by its guider component; its VAE decodes one clip at a time
        pipeline, guider = policy.pipeline, policy.pipeline.guider
        call = dict(prompt=prompts, negative_prompt=["dark"] * 2, num_frames=num_frames, num_inference_steps=4,
                    latents=latents, **extra)
        if not policy.image_conditioned:  # image-to-video: the size is the one it picks for the image
            call.update(height=height, width=width)
        pipeline.guider, pipeline.vae.use_slicing = ClassifierFreeGuidance(guidance_scale=guidance_scale), True
        try:
            expected = pipeline(**call, output_type="pt").frames.permute(0, 2, 1, 3, 4)
            final = pipeline(**call, output_type="latent").frames
        finally:
            pipeline.guider, pipeline.vae.use_slicing = guider, False
        torch.testing.assert_close(rollout.final_latents, final, rtol=0, atol=1e-5)
    else:
        packed = FluxPipeline._pack_latents(latents, *latents.shape)
        expected = policy.pipeline(latents=packed, **kwargs).images.unsqueeze(2)
    assert rollout.samples.shape == expected.shape
    torch.testing.assert_close(rollout.samples, expected, rtol=0, atol=1e-4)


def test_wan22_ti2v_loads_as_wan_with_its_16x_patchified_latents(policies):
    """Wan 2.2 TI2V-5B's folder layout (``expand_timesteps`` in model_index.json, a VAE with
    ``patch_size`` 2 and ``scale_factor_spatial`` 16) is a WanPolicy: latents are 1/16 of the
    frame, sizes must be multiples of 16 x the transformer's patch 2, and the transformer takes
    one timestep per latent token."""
    policy = policies["wan2.2"]
    assert type(policy) is WanPolicy and policy.pipeline.config.expand_timesteps
    assert policy.latent_shape(64, 64, 5) == (8, 2, 4, 4)
    assert policy.image_seq_len(torch.zeros(1, 8, 2, 4, 4)) == 2 * 2 * 2
    with pytest.raises(ValueError, match="height=48"):
        policy.latent_shape(48, 64, 5)
    embeds = policy.encode_prompts(["a cat", "a dog"], "cpu", guidance_scale=1.0)
    latents = policy.prepare_latents(_generators(2), 64, 64, 5, "cpu")
    timesteps = []
    hook = policy.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: timesteps.append(kwargs["timestep"]), with_kwargs=True)
    try:
        with torch.no_grad():  # per-sample timesteps, as the likelihood-free objectives train
            v = policy.predict_velocity(policy.transformer, latents, torch.tensor([900.0, 100.0]), embeds, 1.0)
            v0 = policy.predict_velocity(policy.transformer, latents[:1], torch.tensor([900.0]), {
                "prompt_embeds": embeds["prompt_embeds"][:1]}, 1.0)
    finally:
        hook.remove()
    # As WanPipeline passes them: (B, frames x h/2 x w/2 tokens), each row its sample's timestep.
    torch.testing.assert_close(timesteps[0], torch.tensor([[900.0] * 8, [100.0] * 8]))
    assert v.shape == latents.shape
    torch.testing.assert_close(v[:1], v0, rtol=0, atol=1e-5)


@pytest.mark.slow  # the pipelines VAE-encode the image at 1024 x 1024 pixels: seconds for the tiny VAE on a CPU
@pytest.mark.parametrize("family, guidance_scale", [("qwenimage-edit", 4.0), ("qwenimage-edit", 1.0),
                                                    ("qwenimage-edit-plus", 4.0)])
def test_qwenimage_edit_samples_as_its_pipeline(family, guidance_scale, policies):
    """At its pipeline's conditioning size, from an image of the sampled aspect ratio, noise level 0
    samples as the pipeline does (true CFG with a negative prompt above 1): the image read by
    Qwen2.5-VL with each prompt (Edit Plus: a smaller one, after "Picture 1: "), its VAE latents
    after the noise's in the image stream (Edit-2511: at timestep 0). One prompt a call: Edit Plus
    takes no more."""
    loaded = policies[family]
    policy = type(loaded)(loaded.pipeline, default_height=32, default_width=32)  # the pipeline's conditioning size
    assert policy.condition_sizes(32, 32)[1] == (1024, 1024)
    prompts, image = ["a red circle above a blue square", "three green triangles"], _image(0, 40, 40)
    config = SamplingConfig(num_inference_steps=4, guidance_scale=guidance_scale, noise_level=0.0, negative_prompt="dark")
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(prompts, [0, 0], seed=7, epoch=0, images=[image] * 2),
                             config=config, device="cpu")
    latents = policy.prepare_latents([latent_generator(p, 7, 0, 0, True, image_digest(image)) for p in prompts], 32, 32, 1,
                                     "cpu")
    pack = type(policy.pipeline)._pack_latents
    finals, outputs = [], []
    for i, prompt in enumerate(prompts):
        outputs.append(policy.pipeline(
            image=image, prompt=prompt, height=32, width=32, num_inference_steps=4, true_cfg_scale=guidance_scale,
            negative_prompt="dark" if guidance_scale > 1 else None, latents=pack(latents[i:i + 1], 1, 4, 4, 4),
            output_type="pt", callback_on_step_end_tensor_inputs=["latents"],
            callback_on_step_end=lambda pipe, step, t, values: finals.append(values["latents"]) or {},
        ).images)
    ours = rollout.final_latents
    # The tiny VAE decodes almost any latents alike: the loop is compared before it too.
    torch.testing.assert_close(pack(ours, *ours.shape), torch.cat(finals[3::4]), rtol=0, atol=1e-5)
    torch.testing.assert_close(rollout.samples, torch.cat(outputs).unsqueeze(2), rtol=0, atol=1e-4)


def test_qwenimage_edit_reads_each_prompt_with_its_image(tiny_dirs, policies, monkeypatch):
    """Qwen-Image-Edit's folder loads here, without torchvision (its processor's video half needs
    it), with the processor of its image and text halves. A batch's conditioning is batch-first:
    one text encoding per distinct (prompt, image) pair and one per distinct image for the negative
    prompt, one VAE encoding per distinct image; each row is its own pair's, a sample's velocity
    does not depend on the others, and the image moves it."""
    assert json.load(open(f"{tiny_dirs['qwenimage-edit']}/model_index.json"))["processor"] == ["transformers",
                                                                                                "Qwen2VLProcessor"]
    policy = policies["qwenimage-edit"]
    assert type(policy) is QwenImageEditPolicy and type(policy.pipeline.processor).__name__ == "ImageTextQwen2VLProcessor"
    assert policy.condition_sizes(32, 64) == ((32, 96), (32, 96))  # 64 x 64 pixels at the samples' aspect ratio
    texts, vae_calls = [], []
    encode_prompt, encode_vae = policy.pipeline.encode_prompt, policy.pipeline._encode_vae_image
    monkeypatch.setattr(policy.pipeline, "encode_prompt", lambda **kw: texts.append(kw["prompt"]) or encode_prompt(**kw))
    monkeypatch.setattr(policy.pipeline, "_encode_vae_image", lambda x, **kw: vae_calls.append(x.shape) or encode_vae(x, **kw))
    a, b = _image(0, 40, 40), _image(1, 40, 40)
    prompts = ["a cat", "a cat", "two red dogs"]
    embeds = policy.encode_conditioning(prompts, [a, b, a], 32, 32, 1, "cpu", 3.0, "dark")
    assert texts == [["a cat"], ["a cat"], ["two red dogs"], ["dark"], ["dark"]]
    assert vae_calls == [(1, 3, 1, 64, 64)] * 2
    vision_tokens = 4  # the 64 x 64 image read at 56 x 56 pixels: 4 x 4 patches of 14, merged 2 x 2
    assert embeds["prompt_embeds"].shape == (3, policy.max_sequence_length + vision_tokens, 32)
    assert embeds["image_latents"].shape == (3, 16, 16)  # 8 x 8 latents packed 2 x 2
    for key in ("prompt_embeds", "negative_prompt_embeds", "image_latents"):
        assert not torch.equal(embeds[key][0], embeds[key][1])  # another image: another reading
    assert not torch.equal(embeds["prompt_embeds"][0], embeds["prompt_embeds"][2])
    assert torch.equal(embeds["negative_prompt_embeds"][0], embeds["negative_prompt_embeds"][2])
    latents = policy.prepare_latents(_generators(3), 32, 32, 1, "cpu")
    latents[1] = latents[0]
    t = torch.tensor([900.0, 900.0, 500.0])
    with torch.no_grad():
        v = policy.predict_velocity(policy.transformer, latents, t, embeds, 3.0)
        v2 = policy.predict_velocity(policy.transformer, latents[2:], t[2:], {k: e[2:] for k, e in embeds.items()}, 3.0)
    torch.testing.assert_close(v[2:], v2, rtol=0, atol=1e-5)
    assert (v[0] - v[1]).abs().max() > 1e-3, "the image must move the velocity"
    with pytest.raises(ValueError, match="edits an image: give one image per prompt"):
        policy.encode_conditioning(prompts, None, 32, 32, 1, "cpu", 3.0)


def test_image_to_video_encodes_each_distinct_image_once_into_its_own_rows(tiny_dirs, policies, monkeypatch):
    """Wan 2.2 TI2V's own folder (a WanPipeline) samples from images as a WanImageToVideoPipeline.
    A batch's image conditioning is batch-first, one VAE encoding per distinct image (a prompt
    group shares one), and each row is its own image's: a sample does not depend on the others."""
    ti2v = load_policy(tiny_dirs["wan2.2"], image_conditioned=True)
    assert type(ti2v) is WanImageToVideoPolicy and type(ti2v.pipeline).__name__ == "WanImageToVideoPipeline"
    assert ti2v.first_frame_conditioned and not ti2v.uses_image_encoder
    policy = policies["wan2.1-i2v"]
    assert "image_encoder" in policy.frozen_modules() and policy.uses_image_encoder
    assert policy.latent_shape(32, 32, 5) == (4, 2, 4, 4)  # the VAE's channels; the transformer takes 2 x 4 + 4
    encodes = []
    original = policy.pipeline.vae.encode
    monkeypatch.setattr(policy.pipeline.vae, "encode", lambda x, **kw: encodes.append(x.shape) or original(x, **kw))
    a, b = _image(0), _image(1, 32, 32)
    embeds = policy.encode_images([a, b, a], 32, 32, 5, "cpu")
    assert len(encodes) == 2 and encodes[0] == (1, 3, 5, 32, 32)  # the image and 4 black frames
    assert embeds["condition"].shape == (3, 4 + 4, 2, 4, 4) and embeds["image_embeds"].shape == (3, 17, 16)
    assert all(torch.equal(v[0], v[2]) and not torch.equal(v[0], v[1]) for v in embeds.values())
    alone = policy.encode_images([b], 32, 32, 5, "cpu")
    assert all(torch.equal(alone[k][0], embeds[k][1]) for k in alone)
    embeds.update(policy.encode_prompts(["a cat", "a dog", "a cat"], "cpu", guidance_scale=3.0))
    latents = policy.prepare_latents(_generators(3), 32, 32, 5, "cpu")
    t = torch.tensor([900.0, 500.0, 900.0])
    with torch.no_grad():
        v = policy.predict_velocity(policy.transformer, latents, t, embeds, 3.0)
        v1 = policy.predict_velocity(policy.transformer, latents[1:2], t[1:2], {k: e[1:2] for k, e in embeds.items()}, 3.0)
    torch.testing.assert_close(v[1:2], v1, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="give one image per prompt"):
        policy.encode_images(None, 32, 32, 5, "cpu")
    with pytest.raises(ValueError, match="takes no conditioning images"):
        policies["wan"].encode_images([a], 32, 32, 5, "cpu")


def test_wan_unipc_scheduler_is_replaced_by_flow_match_euler_with_its_shift():
    """Published Wan checkpoints ship UniPC with flow_shift; the SDE needs the Euler flow schedule."""
    pipeline = build_tiny_pipeline("wan")
    pipeline.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0
    )
    policy = policy_for_pipeline(pipeline)
    assert isinstance(policy.scheduler, FlowMatchEulerDiscreteScheduler)
    assert policy.scheduler.config.shift == 5.0
    assert (policy.default_height, policy.default_width, policy.default_num_frames) == (480, 832, 81)
    latents = torch.zeros(1, 4, 2, 4, 4)
    _, sigmas = policy.timesteps_and_sigmas(4, latents, "cpu")
    expected = FlowMatchEulerDiscreteScheduler(shift=5.0)
    expected.set_timesteps(4)
    torch.testing.assert_close(sigmas, expected.sigmas)
