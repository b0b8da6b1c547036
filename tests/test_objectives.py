"""Per-micro-batch losses of each objective on tiny models of every family: what the
likelihood-free objectives train on, and that they are on-policy at the start of an epoch."""

import dataclasses

import pytest
import torch

from genrl.errors import SetupError
from genrl.math.nft import awm_loss, forward_noise
from genrl.objectives import (
    awm_step_loss,
    check_sigma_range_holds,
    draw_forward_batch,
    fill_old_velocity,
    grpo_step_loss,
    nft_step_loss,
    reference_model,
    steps_in_sigma_range,
)
from genrl.testing.tiny_pipelines import FAMILIES, build_tiny_policy
from genrl.training.rollout import SampleBatch, SamplingConfig, concat_rollouts, index_rollout, sample_rollout

torch.set_num_threads(2)

PROMPTS = ["a red circle", "a red circle", "two blue squares below a tree", "a green triangle"]
GROUP_INDICES = [0, 1, 0, 0]


@pytest.fixture(scope="module")
def policies():
    return {family: build_tiny_policy(family).to("cpu") for family in FAMILIES}


def _rollout(policy, guidance_scale=3.0, noise_level=0.0, steps=4):
    config = SamplingConfig(num_inference_steps=steps, guidance_scale=guidance_scale, noise_level=noise_level, same_latent=False)
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=3, epoch=1),
                             config=config, device="cpu")
    return rollout, config


def test_rollout_keeps_the_clean_latents_it_decoded(policies):
    policy = policies["sd3"]
    rollout, _ = _rollout(policy)
    assert rollout.final_latents.shape == (4, *policy.latent_shape(32, 32, 1))
    torch.testing.assert_close(policy.decode(rollout.final_latents[:1]), rollout.samples[:1])


def test_forward_batch_draws_depend_on_the_sample_not_the_batch(policies):
    policy = policies["sd3"]
    rollout, config = _rollout(policy)
    schedule = policy.timesteps_and_sigmas(config.num_inference_steps, rollout.final_latents, "cpu")
    whole = draw_forward_batch(rollout, *schedule, 3, seed=0, epoch=1)
    parts = [draw_forward_batch(index_rollout(rollout, i), *schedule, 3, seed=0, epoch=1) for i in ([0, 1], [2, 3])]
    for name in ("noise", "noisy", "sigmas", "timesteps"):
        assert torch.equal(getattr(whole, name), torch.cat([getattr(p, name) for p in parts])), name
    # Distinct steps of the schedule (never the final sigma 0), noised by the forward process.
    timesteps, sigmas = schedule
    assert whole.sigmas.shape == (4, 3) and (whole.sigmas > 0).all()
    for row in range(4):
        assert len(set(whole.sigmas[row].tolist())) == 3
        assert set(whole.sigmas[row].tolist()) <= set(sigmas[:-1].tolist())
    torch.testing.assert_close(whole.timesteps, whole.sigmas * 1000)
    expected = forward_noise(rollout.final_latents[2], whole.noise[2, 1][None], whole.sigmas[2, 1][None])[0]
    torch.testing.assert_close(whole.noisy[2, 1], expected)
    # The same sample in another epoch draws other timesteps and noise.
    other = draw_forward_batch(rollout, *schedule, 3, seed=0, epoch=2)
    assert not torch.equal(other.noise, whole.noise)
    with pytest.raises(ValueError, match="num_timesteps"):
        draw_forward_batch(rollout, *schedule, 5, seed=0, epoch=1)


def test_forward_batch_sigma_range_draws_only_the_steps_inside_it(policies):
    """--train_sigma_range keeps the draws among the steps whose sigma lies in [lo, hi]: with a
    range holding the two noisiest of 4 steps every sample trains at both, never at the others;
    a range holding all steps draws what no range draws."""
    policy = policies["sd3"]
    rollout, config = _rollout(policy)
    schedule = policy.timesteps_and_sigmas(config.num_inference_steps, rollout.final_latents, "cpu")
    sigmas = schedule[1]  # (5,): 4 steps from 1 down, then 0
    noisy_half = (float(sigmas[1]) - 1e-4, 1.0)
    assert steps_in_sigma_range(sigmas, noisy_half).tolist() == [0, 1]
    noisiest = draw_forward_batch(rollout, *schedule, 2, seed=0, epoch=1, sigma_range=noisy_half)
    for row in noisiest.sigmas.tolist():
        assert sorted(row, reverse=True) == sigmas[:2].tolist()
    quiet = draw_forward_batch(rollout, *schedule, 1, seed=0, epoch=1, sigma_range=(0.0, float(sigmas[2]) + 1e-4))
    assert set(quiet.sigmas.flatten().tolist()) <= set(sigmas[2:4].tolist())
    whole = draw_forward_batch(rollout, *schedule, 3, seed=0, epoch=1)
    assert torch.equal(draw_forward_batch(rollout, *schedule, 3, seed=0, epoch=1, sigma_range=(0.0, 1.0)).sigmas, whole.sigmas)
    with pytest.raises(ValueError, match="sigma_range"):
        draw_forward_batch(rollout, *schedule, 1, seed=0, epoch=1, sigma_range=(0.5, 0.5))
    with pytest.raises(ValueError, match="num_timesteps"):
        draw_forward_batch(rollout, *schedule, 3, seed=0, epoch=1, sigma_range=noisy_half)


def test_a_sigma_range_too_narrow_for_the_schedule_is_one_sentence_at_start_up(policies):
    policy = policies["sd3"]
    config = SamplingConfig(num_inference_steps=4, guidance_scale=1.0, noise_level=0.0)
    check_sigma_range_holds(policy, config, 2, (0.5, 1.0))  # sigmas 1, 0.75, 0.5, 0.25 (tiny SD3, no shift)
    with pytest.raises(SetupError) as failure:
        check_sigma_range_holds(policy, config, 2, (0.9, 1.0))
    assert str(failure.value).startswith("--train_sigma_range 0.9 1.0 holds 1 of the 4 sampling steps (sigmas 1.000, ")
    assert str(failure.value).endswith("fewer than the 2 trained timesteps per sample; widen the range or lower --timestep_fraction.")


@pytest.mark.parametrize("family", FAMILIES)
def test_nft_is_on_policy_right_after_the_old_velocities_are_recorded(family, policies):
    """fill_old_velocity and nft_step_loss must ask for the same (conditional) velocity:
    the old policy is the current one, so the deviation is 0 and the gradient is AWM's."""
    policy = policies[family]
    rollout, config = _rollout(policy, guidance_scale=3.0)
    schedule = policy.timesteps_and_sigmas(config.num_inference_steps, rollout.final_latents, "cpu")
    batch = draw_forward_batch(rollout, *schedule, 2, seed=0, epoch=1)
    order = [torch.tensor([2, 0]), torch.tensor([1, 3])]
    fill_old_velocity(policy, policy.transformer, batch, rollout.embeds, order, config.guidance_scale)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    idx = torch.tensor([0, 3])
    loss, stats = nft_step_loss(
        policy, policy.transformer, batch, rollout.embeds, idx, 1, advantages,
        guidance_scale=config.guidance_scale, adv_clip_max=5.0,
    )
    assert torch.isfinite(loss) and stats["old_deviation"].item() < 1e-10
    policy.transformer.zero_grad()
    loss.backward()
    recorded_grads = [p.grad.clone() for p in policy.transformer.parameters() if p.grad is not None]
    assert any(g.abs().sum() > 0 for g in recorded_grads)
    policy.transformer.zero_grad()

    # Before the weights move, the old velocity may come from the trained forward itself (what the
    # update does for the first optimizer step of an on-policy epoch): the same loss and gradient.
    batch.old_velocity = None
    current, _ = nft_step_loss(
        policy, policy.transformer, batch, rollout.embeds, idx, 1, advantages,
        guidance_scale=config.guidance_scale, adv_clip_max=5.0, old_is_current=True,
    )
    torch.testing.assert_close(current, loss, rtol=1e-6, atol=1e-7)
    current.backward()
    for got, expected in zip([p.grad for p in policy.transformer.parameters() if p.grad is not None], recorded_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    policy.transformer.zero_grad()


def test_old_velocities_are_recorded_only_for_the_micro_batches_asked(policies):
    """The others stay NaN: a loss that read an unrecorded one could not pass for a real one."""
    policy = policies["sd3"]
    rollout, config = _rollout(policy)
    schedule = policy.timesteps_and_sigmas(config.num_inference_steps, rollout.final_latents, "cpu")
    batch = draw_forward_batch(rollout, *schedule, 2, seed=0, epoch=1)
    fill_old_velocity(policy, policy.transformer, batch, rollout.embeds, [torch.tensor([3, 1])], config.guidance_scale)
    assert torch.isfinite(batch.old_velocity[[1, 3]]).all()
    assert torch.isnan(batch.old_velocity[[0, 2]]).all()


@pytest.mark.parametrize("family", ["sd3", "zimage", "flux2-klein", "qwenimage", "flux2", "hunyuanvideo15"])
def test_awm_step_is_the_advantage_weighted_flow_matching_loss(family, policies):
    policy = policies[family]
    rollout, config = _rollout(policy, guidance_scale=3.0)
    schedule = policy.timesteps_and_sigmas(config.num_inference_steps, rollout.final_latents, "cpu")
    batch = draw_forward_batch(rollout, *schedule, 2, seed=0, epoch=1)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    idx = torch.tensor([1, 2])
    with torch.no_grad():
        loss, _ = awm_step_loss(
            policy, policy.transformer, batch, rollout.embeds, idx, 0, advantages, guidance_scale=config.guidance_scale,
        )
        embeds = {k: v[idx] for k, v in rollout.embeds.items()}
        velocity = policy.predict_velocity(policy.transformer, batch.noisy[idx, 0], batch.timesteps[idx, 0], embeds,
                                           policy.conditional_guidance(config.guidance_scale))
        expected, _ = awm_loss(velocity, batch.noisy[idx, 0], batch.clean[idx], batch.noise[idx, 0], advantages[idx])
    torch.testing.assert_close(loss, expected)


def test_nft_without_old_velocities_fails_with_a_sentence(policies):
    policy = policies["sd3"]
    rollout, config = _rollout(policy)
    schedule = policy.timesteps_and_sigmas(config.num_inference_steps, rollout.final_latents, "cpu")
    batch = draw_forward_batch(rollout, *schedule, 1, seed=0, epoch=1)
    with pytest.raises(ValueError, match="fill_old_velocity"):
        nft_step_loss(policy, policy.transformer, batch, rollout.embeds, torch.tensor([0]), 0, torch.zeros(4),
                      guidance_scale=3.0, adv_clip_max=5.0)


def test_reference_model_switches_the_adapter_back_on_even_after_an_error():
    from peft import LoraConfig

    policy = build_tiny_policy("sd3")
    transformer = policy.transformer
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian", target_modules=["to_q"]))
    lora_layer = next(m for name, m in transformer.named_modules() if name.endswith("to_q"))
    assert not lora_layer.disable_adapters
    with pytest.raises(RuntimeError):
        with reference_model(transformer, None) as ref:
            assert ref is transformer and lora_layer.disable_adapters
            raise RuntimeError("boom")
    assert not lora_layer.disable_adapters
    frozen = object()
    with reference_model(transformer, frozen) as ref:
        assert ref is frozen and not lora_layer.disable_adapters


def test_grpo_step_loss_ratio_is_one_on_the_recorded_transitions(policies):
    policy = policies["wan"]
    rollout, config = _rollout(policy, guidance_scale=2.0, noise_level=0.8)
    joined = concat_rollouts([index_rollout(rollout, [0, 1]), index_rollout(rollout, [2, 3])])
    loss, stats = grpo_step_loss(
        policy, policy.transformer, joined, torch.tensor([3, 1]), torch.tensor([0, 2]), torch.tensor([1.0, 2.0, 3.0, 4.0]),
        config=config, clip_range=1e-3,
    )
    assert stats["ratio_max"].item() == pytest.approx(1.0, abs=1e-4)
    assert stats["ratio_min"].item() == pytest.approx(1.0, abs=1e-4)
    assert loss.item() == pytest.approx(-3.0, rel=1e-3)  # -mean(A * ratio) over samples 3 and 1


def test_zero_advantage_samples_leave_grpos_forward_and_the_gradient_stays(policies):
    """Without a KL term GRPO trains only the informative rows, scaled by b'/b: the same
    gradient as the whole micro batch, for half the transformer's rows here."""
    from genrl.objectives.grpo import informative_rows

    policy = policies["sd3"]
    rollout, config = _rollout(policy, guidance_scale=2.0, noise_level=0.8)
    idx, steps, adv = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 1, 0]), torch.tensor([1.5, 0.0, -2.0, 0.0])
    rows_seen = []
    hook = policy.transformer.register_forward_pre_hook(
        lambda m, args, kwargs: rows_seen.append(len(kwargs["hidden_states"])), with_kwargs=True)

    def gradient(rows, row_steps, scale):
        policy.transformer.zero_grad()
        loss, _ = grpo_step_loss(policy, policy.transformer, rollout, rows, row_steps, adv, config=config, clip_range=0.2)
        (loss * scale).backward()
        return [p.grad.clone() for p in policy.transformer.parameters() if p.grad is not None]

    try:
        whole = gradient(idx, steps, 1.0)
        rows, row_steps, scale = informative_rows(idx, steps, adv)
        assert rows.tolist() == [0, 2] and row_steps.tolist() == [0, 1] and scale == 0.5
        informative = gradient(rows, row_steps, scale)
    finally:
        hook.remove()
        policy.transformer.zero_grad(set_to_none=True)
    assert rows_seen == [8, 4]  # CFG: conditional and unconditional rows in one batch
    assert len(whole) == len(informative) and any(g.abs().max() > 0 for g in whole)
    for a, b in zip(whole, informative):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    # Nothing informative: one row at factor 0, so every rank still runs a backward pass.
    rows, row_steps, scale = informative_rows(idx, steps, torch.zeros(4))
    assert rows.tolist() == [0] and row_steps.tolist() == [0] and scale == 0.0


def test_guarded_grpo_step_is_on_policy_and_moves_with_the_recorded_means(policies):
    """GRPO-Guard's ratio is exactly 1 on the rollout's own transitions (recorded means kept
    through index/concat), and drops off 1 when the recorded means are not the policy's."""
    policy = policies["sd3"]
    rollout, config = _rollout(policy, guidance_scale=2.0, noise_level=0.8)
    assert rollout.means is None, "means are recorded only when asked"
    config = dataclasses.replace(config, record_means=True)
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(PROMPTS, GROUP_INDICES, seed=3, epoch=1),
                             config=config, device="cpu")
    joined = concat_rollouts([index_rollout(rollout, [2, 3]), index_rollout(rollout, [0, 1])])
    assert joined.means.shape == joined.latents.shape
    idx, steps, adv = torch.tensor([0, 3]), torch.tensor([1, 0]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    _, stats = grpo_step_loss(policy, policy.transformer, joined, idx, steps, adv, config=config, clip_range=1e-3,
                              guard=True)
    assert stats["ratio_min"].item() == pytest.approx(1.0, abs=1e-5)
    assert stats["ratio_max"].item() == pytest.approx(1.0, abs=1e-5)
    # The per-timestep reweighting: on policy (r = 1) the loss is -mean(A / (T dt)) of the picked steps.
    loss, _ = grpo_step_loss(policy, policy.transformer, joined, idx, steps, adv, config=config, clip_range=1e-3,
                             guard=True, reweight=True)
    dt = joined.sigmas[idx, steps] - joined.sigmas_next[idx, steps]
    assert not torch.allclose(dt[0], dt[1]), "the picked steps should differ in length"
    expected = -(adv[idx] / (config.num_inference_steps * dt)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)
    joined.means = joined.means + 0.1 * torch.randn_like(joined.means)
    _, moved = grpo_step_loss(policy, policy.transformer, joined, idx, steps, adv, config=config, clip_range=1e-3,
                              guard=True)
    assert abs(moved["ratio_mean"].item() - 1.0) > 1e-3
    joined.means = None
    with pytest.raises(ValueError, match="GRPO-Guard's ratio needs the rollout's recorded SDE means"):
        grpo_step_loss(policy, policy.transformer, joined, idx, steps, adv, config=config, clip_range=1e-3, guard=True)
