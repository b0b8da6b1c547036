"""The shared denoising loop: what it records, and that recomputing the recorded transitions
under the same weights gives back the recorded log-probs (PPO ratio exactly 1)."""

import dataclasses

import numpy as np
import PIL.Image
import pytest
import torch

from genrl.testing.tiny_pipelines import FAMILIES, TINY_SAMPLING_DEFAULTS, build_tiny_policy
from genrl.training.rollout import (
    SampleBatch,
    SamplingConfig,
    concat_rollouts,
    decode_in_chunks,
    index_rollout,
    sample_rollout,
    step_log_prob,
)

torch.set_num_threads(2)

PROMPTS = ["a red circle", "a red circle", "two blue squares below a tree"]
GROUP_INDICES = [0, 1, 0]


@pytest.fixture(scope="module")
def policies():
    return {family: build_tiny_policy(family).to("cpu") for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
@pytest.mark.parametrize("window", [0, 2])
def test_recomputed_log_probs_equal_recorded_ones(family, guidance_scale, window, policies):
    policy = policies[family]
    config = SamplingConfig(
        num_inference_steps=4, guidance_scale=guidance_scale, noise_level=0.9, sde_window_size=window
    )
    prompts, indices = [PROMPTS[0], PROMPTS[2]], [1, 0]
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(prompts, indices, seed=1, epoch=2),
                             config=config, device="cpu")
    expected_steps = window if window else config.num_inference_steps - 1  # the step to sigma' = 0 is not recorded
    assert rollout.log_probs.shape == (2, expected_steps)
    assert rollout.latents.shape[:2] == rollout.next_latents.shape[:2] == (2, expected_steps)
    assert torch.isfinite(rollout.log_probs).all()

    # Re-score every transition in one mixed batch: samples sit at different steps.
    out = step_log_prob(policy, policy.transformer, rollout.all_transitions(), config=config)
    torch.testing.assert_close(out.log_prob, rollout.log_probs.flatten(), rtol=0, atol=1e-5)
    assert (out.std > 0).all()

    # Decoded samples: on the CPU, (B, C, F, H, W), in [0, 1].
    size = TINY_SAMPLING_DEFAULTS[family]
    assert rollout.samples.device.type == "cpu" and rollout.samples.dtype == torch.float32
    assert rollout.samples.shape == (2, 3, size["num_frames"], size["height"], size["width"])
    assert rollout.samples.min() >= 0 and rollout.samples.max() <= 1 and rollout.samples.std() > 0
    assert rollout.prompts == prompts and rollout.group_indices == indices


def test_progressive_window_slides_one_step_every_n_epochs_then_stays():
    from genrl.training.rollout import progressive_window_start, stochastic_steps

    # lo 1, last start 4 (range (1, 7), window 3), a step every 2 epochs: 1 1 2 2 3 3 4 4 4 ...
    assert [progressive_window_start(e, 1, 4, 2) for e in range(10)] == [1, 1, 2, 2, 3, 3, 4, 4, 4, 4]
    config = SamplingConfig(num_inference_steps=8, sde_window_size=3, sde_window_range=(1, 7), sde_window_shift_every=2)
    sigmas = torch.linspace(1, 0, 9)
    for epoch, start in ((0, 1), (5, 3), (40, 4)):
        mask = stochastic_steps(["a", "b", "c"], sigmas, seed=0, epoch=epoch, config=config)
        expected = torch.zeros(8, dtype=torch.bool)
        expected[start : start + 3] = True
        assert (mask == expected).all(), (epoch, mask)  # one window for every prompt, whatever the seed
    random = stochastic_steps([f"p{i}" for i in range(12)], sigmas, seed=0, epoch=0,
                              config=dataclasses.replace(config, sde_window_shift_every=0))
    assert len({int(row.nonzero()[0]) for row in random}) > 1, "the default draws a window per prompt"
    with pytest.raises(ValueError, match="sde_window_shift_every must be >= 0"):
        SamplingConfig(sde_window_shift_every=-1)


def test_records_only_the_stochastic_steps_of_the_window(policies):
    policy = policies["sd3"]
    config = SamplingConfig(
        num_inference_steps=8, guidance_scale=1.0, sde_window_size=3, sde_window_range=(2, 7)
    )
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=4, epoch=0),
                             config=config, device="cpu")
    steps = rollout.step_indices
    assert steps.shape == (3, 3) and steps.dtype == torch.long
    assert (steps[:, 1:] - steps[:, :-1] == 1).all()  # consecutive
    assert (steps[:, 0] >= 2).all() and (steps[:, -1] <= 6).all()  # inside [2, 7) and before the last step
    _, sigmas = policy.timesteps_and_sigmas(8, rollout.latents[:, 0], "cpu")
    torch.testing.assert_close(rollout.sigmas, sigmas[steps])
    torch.testing.assert_close(rollout.sigmas_next, sigmas[steps + 1])
    torch.testing.assert_close(rollout.timesteps, sigmas[steps] * 1000)
    assert rollout.sigma_max == pytest.approx(float(sigmas[1]))
    # Each record chains: the state after step s is the state before step s + 1.
    torch.testing.assert_close(rollout.next_latents[:, :-1], rollout.latents[:, 1:], rtol=0, atol=0)


def test_deterministic_sampling_records_nothing(policies):
    policy = policies["flux"]
    config = SamplingConfig(num_inference_steps=3, noise_level=0.0)
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=0, epoch=0),
                             config=config, device="cpu")
    assert rollout.log_probs.shape == (3, 0) and rollout.latents.shape == (3, 0, 4, 8, 8)
    assert rollout.samples.shape == (3, 3, 1, 32, 32)


def test_on_step_sees_each_state_and_the_velocity_taken_and_changes_nothing(policies):
    # The reward watch measures the drift from the reference at these states: they must be the
    # states the loop visits, with the velocity it takes there, and watching must not change them.
    policy = policies["sd3"]
    config = SamplingConfig(num_inference_steps=3, noise_level=0.7, guidance_scale=3.0)
    seen = []
    watched = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=0, epoch=0),
                             config=config, device="cpu", on_step=lambda x, t, embeds, v: seen.append((x.clone(), t.clone(), v.clone())))
    plain = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=0, epoch=0),
                           config=config, device="cpu")
    assert torch.equal(watched.samples, plain.samples) and torch.equal(watched.log_probs, plain.log_probs)
    assert len(seen) == 3 and all(x.shape == (3, 4, 8, 8) and t.shape == (3,) for x, t, _ in seen)
    # The recorded stochastic steps start at the states on_step saw.
    for b in range(3):
        for s, step in enumerate(plain.step_indices[b].tolist()):
            assert torch.equal(seen[step][0][b], plain.latents[b, s])
    x, t, v = seen[1]
    assert torch.allclose(v, policy.predict_velocity(policy.transformer, x, t, plain.embeds, 3.0), atol=1e-6)


def test_step_log_prob_carries_gradients_to_the_transformer(policies):
    policy = policies["wan"]
    config = SamplingConfig(num_inference_steps=4, guidance_scale=2.0, sde_window_size=1)
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS[:2], GROUP_INDICES[:2], seed=0, epoch=0),
                             config=config, device="cpu")
    policy.transformer.zero_grad()
    out = step_log_prob(policy, policy.transformer, rollout.all_transitions(), config=config)
    out.log_prob.sum().backward()
    grads = [p.grad for p in policy.transformer.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    policy.transformer.zero_grad()


def test_index_and_concat_round_trip(policies):
    policy = policies["sd3"]
    config = SamplingConfig(num_inference_steps=3, guidance_scale=2.0)
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=0, epoch=0),
                             config=config, device="cpu")
    parts = [index_rollout(rollout, [2]), index_rollout(rollout, torch.tensor([0, 1]))]
    assert parts[0].prompts == [PROMPTS[2]] and parts[0].embeds["negative_prompt_embeds"].shape[0] == 1
    joined = concat_rollouts(parts)
    order = [2, 0, 1]
    assert joined.prompts == [PROMPTS[i] for i in order]
    assert joined.group_indices == [GROUP_INDICES[i] for i in order]
    for name in ("latents", "next_latents", "log_probs", "timesteps", "step_indices", "samples"):
        assert torch.equal(getattr(joined, name), getattr(rollout, name)[order]), name
    for key, value in rollout.embeds.items():
        assert torch.equal(joined.embeds[key], value[order]), key
    assert joined.sigma_max == rollout.sigma_max


def test_bad_configs_fail_early(policies):
    with pytest.raises(ValueError, match="sde_type"):
        SamplingConfig(sde_type="ddim")
    with pytest.raises(ValueError, match="noise_level"):
        SamplingConfig(noise_level=-0.1)
    policy = policies["sd3"]
    config = SamplingConfig(num_inference_steps=4, sde_window_size=3, sde_window_range=(2, None))
    with pytest.raises(ValueError, match="sde_window_range"):
        sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=0, epoch=0),
                       config=config, device="cpu")
    with pytest.raises(ValueError, match="group index"):
        sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, [0], seed=0, epoch=0),
                       config=SamplingConfig(), device="cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_in_chunks_gives_the_one_at_a_time_samples(family, policies, monkeypatch):
    """--vae_decode_batch_size only changes how many samples a VAE call decodes: the same
    samples to float rounding, every one of them (two calls of 2 rows, the second padded)."""
    policy = policies[family]
    one = SamplingConfig(num_inference_steps=3, noise_level=0.0, decode_batch_size=1)
    chunked = SamplingConfig(num_inference_steps=3, noise_level=0.0, decode_batch_size=2)
    calls = []
    decode = policy.decode
    monkeypatch.setattr(policy, "decode", lambda latents: calls.append(len(latents)) or decode(latents))
    a = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=0, epoch=0),
                       config=one, device="cpu")
    b = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=0, epoch=0),
                       config=chunked, device="cpu")
    assert calls == [1, 1, 1, 2, 2]
    assert torch.equal(a.final_latents, b.final_latents)
    assert a.samples.shape == b.samples.shape and a.samples.shape[0] == len(PROMPTS) == 3
    torch.testing.assert_close(b.samples, a.samples, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="decode_batch_size"):
        SamplingConfig(decode_batch_size=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_chunked_decode_does_not_depend_on_the_rows_beside_a_sample(family, policies):
    """What keeps samples independent of the batch layout at any --vae_decode_batch_size: every
    call has the chunk's shape, so a sample decodes to the same bits wherever it sits and whatever
    shares its call (5 rows in chunks of 2 and 3, shuffled, and split as two processes would)."""
    policy = policies[family]
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(5, *policy.latent_shape(*policy.resolve_size(None, None, None)), generator=generator)
    with torch.no_grad():
        for chunk in (2, 3):
            whole = decode_in_chunks(policy.decode, latents, chunk)
            order = torch.tensor([3, 0, 4, 2, 1])
            shuffled = decode_in_chunks(policy.decode, latents[order], chunk)
            assert torch.equal(shuffled, whole[order])
            split = torch.cat([decode_in_chunks(policy.decode, latents[:2], chunk),
                               decode_in_chunks(policy.decode, latents[2:], chunk)])
            assert torch.equal(split, whole)
    assert whole.shape[0] == 5 and whole.device.type == "cpu"


def test_ab2_starts_with_euler_moves_on_in_second_order_and_leaves_sde_steps_alone(policies):
    policy = policies["sd3"]

    def run(solver: str, noise_level: float, **extra):
        states = []
        config = SamplingConfig(num_inference_steps=4, noise_level=noise_level, guidance_scale=3.0, ode_solver=solver, **extra)
        rollout = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=0, epoch=0),
                                 config=config, device="cpu", on_step=lambda x, t, embeds, v: states.append((x.clone(), v.clone())))
        return rollout, states

    euler, euler_states = run("euler", 0.0)
    ab2, ab2_states = run("ab2", 0.0)
    assert torch.equal(ab2_states[1][0], euler_states[1][0]), "the first step has no history: Euler"
    # The second step: x2 = x1 + dt1 (v1 + r/2 (v1 - v0)), r = dt1 / dt0, from the loop's own sigmas.
    _, sigmas = policy.timesteps_and_sigmas(4, euler.final_latents, "cpu")
    (x1, v1), v0 = ab2_states[1], ab2_states[0][1]
    dt0, dt1 = float(sigmas[1] - sigmas[0]), float(sigmas[2] - sigmas[1])
    expected = x1 + dt1 * (v1 + 0.5 * (dt1 / dt0) * (v1 - v0))
    assert torch.allclose(ab2_states[2][0], expected, atol=1e-6)
    assert not torch.equal(ab2.final_latents, euler.final_latents)
    # Every step stochastic (the last one, to sigma 0, is deterministic but follows an SDE step):
    # the solver changes nothing, and the recorded log-probs are the SDE's.
    sde_euler, _ = run("euler", 0.7)
    sde_ab2, _ = run("ab2", 0.7)
    assert torch.equal(sde_ab2.final_latents, sde_euler.final_latents)
    assert torch.equal(sde_ab2.log_probs, sde_euler.log_probs)
    with pytest.raises(ValueError, match="ode_solver"):
        SamplingConfig(ode_solver="rk4")


@pytest.mark.parametrize("expert", ["high", "low"])
def test_two_experts_recompute_the_log_probs_of_a_batch_mixing_their_steps(expert):
    """Wan 2.2 A14B: recorded transitions at steps of both experts, re-scored in one batch, each
    row by its own expert (the trained one passed in, the frozen one held by the policy) at its
    own guidance scale."""
    from genrl.policies import WanPolicy
    from genrl.testing.tiny_pipelines import build_tiny_pipeline

    sizes = {f"default_{k}": v for k, v in TINY_SAMPLING_DEFAULTS["wan2.2-a14b"].items()}
    policy = WanPolicy(build_tiny_pipeline("wan2.2-a14b"), expert=expert, guidance_scale_2=2.0, **sizes).to("cpu")
    config = SamplingConfig(num_inference_steps=4, guidance_scale=3.0, noise_level=0.9)
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS[:2], [0, 1], seed=1, epoch=0),
                             config=config, device="cpu")
    batch = rollout.all_transitions()
    assert policy.expert_of(batch.timesteps).any() and not policy.expert_of(batch.timesteps).all(), "the batch must mix the experts"
    out = step_log_prob(policy, policy.transformer, batch, config=config)
    torch.testing.assert_close(out.log_prob, rollout.log_probs.flatten(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family, guidance_scale", [("wan2.1-i2v", 3.0), ("wan2.2-i2v", 1.0), ("wan2.2-i2v-a14b", 3.0),
                                                    ("hunyuanvideo15-i2v", 4.0), ("qwenimage-edit", 4.0),
                                                    ("qwenimage-edit-plus", 1.0)])
def test_image_conditioned_families_recompute_their_log_probs(family, guidance_scale):
    """The image conditioning travels with the prompt embeddings: the recorded transitions of two
    prompt groups, each with its own image, re-scored in one batch give the recorded log-probs
    (Qwen-Image-Edit: the prompts read with their images, the images' latents beside the noise's).
    Wan 2.2 TI2V: the first latent frame ends as the image's latents, and the velocity there is 0
    (no weight changes that frame's share of a log-prob)."""
    policy = build_tiny_policy(family).to("cpu")
    images = [PIL.Image.fromarray((np.random.RandomState(s).rand(24, 40, 3) * 255).astype(np.uint8)) for s in (0, 1)]
    config = SamplingConfig(num_inference_steps=4, guidance_scale=guidance_scale, noise_level=0.9)
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=1, epoch=0, images=[images[0], images[0], images[1]]),
                             config=config, device="cpu")
    assert all(v.shape[0] == 3 for v in rollout.embeds.values())
    out = step_log_prob(policy, policy.transformer, rollout.all_transitions(), config=config)
    torch.testing.assert_close(out.log_prob, rollout.log_probs.flatten(), rtol=0, atol=1e-5)
    if getattr(policy, "first_frame_conditioned", False):
        assert torch.equal(rollout.final_latents[:, :, :1], rollout.embeds["condition"])
        with torch.no_grad():
            v = policy.predict_velocity(policy.transformer, rollout.latents[:, 0], rollout.timesteps[:, 0], rollout.embeds,
                                        guidance_scale)
        assert (v[:, :, 0] == 0).all() and (v[:, :, 1:] != 0).all()


def test_transitions_pick_each_sample_at_its_own_step(policies):
    """``Rollout.transitions(idx, steps)`` is sample idx[i] at recorded column steps[i], its embeds
    with it; ``all_transitions`` is every record, sample-major, as the flattened ``(B, S)`` records."""
    policy = policies["sd3"]
    config = SamplingConfig(**{**TINY_SAMPLING_DEFAULTS["sd3"], "sde_window_size": 3})
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=0, epoch=0),
                             config=config, device="cpu")
    idx, steps = torch.tensor([2, 0]), torch.tensor([1, 2])
    batch = rollout.transitions(idx, steps)
    for i, (sample, step) in enumerate(zip(idx.tolist(), steps.tolist())):
        assert torch.equal(batch.latents[i], rollout.latents[sample, step])
        assert torch.equal(batch.next_latents[i], rollout.next_latents[sample, step])
        assert batch.sigmas_next[i] == rollout.sigmas_next[sample, step] and batch.timesteps[i] == rollout.timesteps[sample, step]
        for key, value in rollout.embeds.items():
            assert torch.equal(batch.embeds[key][i], value[sample])
    every = rollout.all_transitions()
    assert torch.equal(every.latents, rollout.latents.flatten(0, 1))
    assert torch.equal(every.sigmas, rollout.sigmas.flatten())
    for key, value in rollout.embeds.items():
        assert torch.equal(every.embeds[key], value.repeat_interleave(rollout.num_steps, dim=0))
