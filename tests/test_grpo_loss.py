import math

import pytest
import torch

from genrl.math.grpo import grpo_loss, select_train_timesteps

CLIP = 0.2


def test_gradient_at_ratio_one_is_minus_advantage_over_batch():
    old = torch.tensor([-1.3, 0.4, 2.0, -0.7])
    log_prob = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0])
    loss, _ = grpo_loss(log_prob, old, adv, clip_range=CLIP)
    loss.backward()
    assert log_prob.grad.tolist() == pytest.approx((-adv / 4).tolist(), abs=1e-7)


def _clip_case():
    # ratios 1.5, 0.5, 0.5, 1.5, 1.0 with advantages 1, -1, 1, -1, 2.
    old = torch.zeros(5)
    delta = torch.log(torch.tensor([1.5, 0.5, 0.5, 1.5, 1.0]))
    log_prob = (old + delta).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    return log_prob, old, adv


def test_gradient_vanishes_only_where_clipping_binds():
    log_prob, old, adv = _clip_case()
    loss, _ = grpo_loss(log_prob, old, adv, clip_range=CLIP)
    loss.backward()
    grad = log_prob.grad
    # A > 0, ratio > 1 + eps and A < 0, ratio < 1 - eps: the clipped branch is the max, constant.
    assert grad[0].item() == 0.0
    assert grad[1].item() == 0.0
    # The other sides keep the unclipped branch: d(-A ratio)/dlogp / B = -A ratio / 5.
    assert grad[2].item() == pytest.approx(-1.0 * 0.5 / 5)
    assert grad[3].item() == pytest.approx(1.0 * 1.5 / 5)
    assert grad[4].item() == pytest.approx(-2.0 / 5)


def test_kl_term_adds_beta_times_mean_kl():
    log_prob, old, adv = _clip_case()
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    plain, _ = grpo_loss(log_prob, old, adv, clip_range=CLIP)
    with_kl, stats = grpo_loss(log_prob, old, adv, clip_range=CLIP, kl=kl, beta=0.5)
    assert with_kl.item() == pytest.approx(plain.item() + 0.5 * 0.3)
    assert stats["kl"].item() == pytest.approx(0.3)
    with pytest.raises(ValueError, match="beta=0.04 weights a KL term, but no kl was given"):
        grpo_loss(log_prob, old, adv, clip_range=CLIP, beta=0.04)


def test_kl_gradient_reaches_the_kl_input():
    log_prob, old, adv = _clip_case()
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5], requires_grad=True)
    loss, _ = grpo_loss(log_prob, old, adv, clip_range=CLIP, kl=kl, beta=0.5)
    loss.backward()
    assert kl.grad.tolist() == pytest.approx([0.5 / 5] * 5)


def test_stats_by_hand():
    log_prob, old, adv = _clip_case()
    loss, stats = grpo_loss(log_prob, old, adv, clip_range=CLIP)
    # Per-sample max(-A r, -A clip(r)): -1.2, 0.8, -0.5, 1.5, -2.0 -> mean -1.4 / 5.
    assert stats["policy_loss"].item() == pytest.approx(-0.28)
    assert loss.item() == pytest.approx(-0.28)
    assert "kl" not in stats
    assert stats["approx_kl"].item() == pytest.approx((math.log(1.5) ** 2 + math.log(0.5) ** 2) / 5)
    assert stats["clipfrac"].item() == pytest.approx(4 / 5)
    assert stats["clipfrac_high"].item() == pytest.approx(2 / 5)
    assert stats["clipfrac_low"].item() == pytest.approx(2 / 5)
    assert stats["ratio_mean"].item() == pytest.approx(1.0)
    assert stats["ratio_min"].item() == pytest.approx(0.5)
    assert stats["ratio_max"].item() == pytest.approx(1.5)
    assert stats["adv_abs_mean"].item() == pytest.approx(1.2)
    assert all(not v.requires_grad and v.ndim == 0 for v in stats.values())


def test_loss_is_float32_for_bf16_inputs_and_old_log_prob_gets_no_gradient():
    old = torch.tensor([0.1, -0.2], dtype=torch.bfloat16, requires_grad=True)
    log_prob = torch.tensor([0.1, -0.2], dtype=torch.bfloat16, requires_grad=True)
    loss, stats = grpo_loss(log_prob, old, torch.tensor([1.0, -1.0]), clip_range=CLIP)
    assert loss.dtype == torch.float32 and stats["ratio_mean"].dtype == torch.float32
    loss.backward()
    assert old.grad is None and log_prob.grad is not None


def test_bad_inputs_are_refused():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="clip_range must be > 0, got 0"):
        grpo_loss(x, x, x, clip_range=0)
    with pytest.raises(ValueError, match=r"must all be \(B,\)"):
        grpo_loss(x, x, torch.zeros(4), clip_range=CLIP)


def test_select_train_timesteps_shapes_range_and_rounding():
    gen = torch.Generator().manual_seed(0)
    t = select_train_timesteps(8, 10, 0.99, gen)
    assert t.shape == (8, 9) and t.dtype == torch.long
    assert t.min() >= 0 and t.max() < 10
    assert all(len(set(row.tolist())) == 9 for row in t)
    assert select_train_timesteps(2, 100, 0.29, gen).shape == (2, 29)  # not 28 from 28.999...
    assert select_train_timesteps(2, 10, 0.01, gen).shape == (2, 1)  # never 0 steps
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 1.5"):
        select_train_timesteps(2, 10, 1.5, gen)


def test_select_train_timesteps_shuffles_each_sample_on_its_own():
    t = select_train_timesteps(8, 10, 1.0, torch.Generator().manual_seed(1))
    rows = {tuple(row.tolist()) for row in t}
    assert len(rows) == 8, "samples share a permutation"
    assert all(sorted(r) == list(range(10)) for r in rows)


def test_select_train_timesteps_in_order_and_deterministic():
    t = select_train_timesteps(3, 10, 0.5, None, shuffle=False)
    assert t.tolist() == [[0, 1, 2, 3, 4]] * 3
    a = select_train_timesteps(4, 10, 0.6, torch.Generator().manual_seed(5))
    b = select_train_timesteps(4, 10, 0.6, torch.Generator().manual_seed(5))
    c = select_train_timesteps(4, 10, 0.6, torch.Generator().manual_seed(6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def _sde_transition(batch=3, dims=(4, 2, 2), seed=0):
    """x' drawn around the old mean; the current mean moved by d; s per sample."""
    from genrl.math.sde import gaussian_log_prob

    g = torch.Generator().manual_seed(seed)
    old_mean = torch.randn(batch, *dims, generator=g)
    eps = torch.randn(batch, *dims, generator=g)
    d = 0.05 * torch.randn(batch, *dims, generator=g)
    std = torch.tensor([0.3, 0.05, 0.01])[:batch]
    x_next = old_mean + std.reshape(-1, 1, 1, 1) * eps
    mean = (old_mean + d).requires_grad_(True)
    return gaussian_log_prob(x_next, mean, std), gaussian_log_prob(x_next, old_mean, std), mean, old_mean, std, eps, d


def test_guarded_log_ratio_is_the_drift_along_the_drawn_noise():
    """s (logp - logp_old) + mean(d^2) / (2 s) = mean(d eps), by hand: the bias term is gone."""
    from genrl.math.grpo import guarded_log_ratio

    log_prob, old, mean, old_mean, std, eps, d = _sde_transition()
    guarded = guarded_log_ratio(log_prob, old, mean, old_mean, std)
    expected = (d * eps).mean(dim=(1, 2, 3))
    torch.testing.assert_close(guarded, expected, rtol=1e-4, atol=1e-5)
    # The plain log-ratio carries -mean(d^2) / (2 s^2): biased low, most at the smallest s.
    plain = (log_prob - old).detach()
    bias = plain - expected / std
    torch.testing.assert_close(bias, -(d**2).mean(dim=(1, 2, 3)) / (2 * std**2), rtol=1e-3, atol=1e-4)
    assert bias[2] < bias[1] < bias[0] < 0
    # Its gradient in the mean is eps / D whatever s (per-timestep reweighting): no 1/s blow-up.
    guarded.sum().backward()
    torch.testing.assert_close(mean.grad, eps / 16, rtol=1e-4, atol=1e-6)


def test_guarded_log_ratio_is_zero_on_policy_and_on_deterministic_steps():
    from genrl.math.grpo import guarded_log_ratio

    log_prob, _, mean, old_mean, std, _, _ = _sde_transition()
    on_policy = guarded_log_ratio(log_prob, log_prob.detach(), old_mean, old_mean, std)
    assert on_policy.abs().max() < 1e-6
    zero_std = guarded_log_ratio(log_prob, log_prob.detach() - 1, mean, old_mean, torch.zeros(3))
    assert torch.equal(zero_std, torch.zeros(3))


def test_guard_timestep_weights_are_one_over_t_dt():
    from genrl.math.grpo import guard_timestep_weights

    sigmas = torch.tensor([1.0, 0.6, 0.4, 0.3])
    sigmas_next = torch.tensor([0.9, 0.5, 0.2, 0.3])  # dt 0.1, 0.1, 0.2 and a zero-length step
    weights = guard_timestep_weights(sigmas, sigmas_next, num_steps=10)
    torch.testing.assert_close(weights, torch.tensor([1.0, 1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        guard_timestep_weights(sigmas, sigmas_next, num_steps=0)


def test_reweighted_guarded_ratio_trains_short_and_long_steps_alike():
    """Through the real flow_sde step: d(w log r)/dv = -(1 + a^2 / 2) eps / (T D) at any dt, where
    the unweighted gradient is proportional to dt (a shifted schedule's short steps train less)."""
    from genrl.math.grpo import guard_timestep_weights, guarded_log_ratio
    from genrl.math.sde import sde_step_with_logprob

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 2, 2, generator=g)
    eps = torch.randn(2, 2, 2, 2, generator=g)
    old_v = torch.randn(2, 2, 2, 2, generator=g)
    sigmas, sigmas_next, a, steps = torch.tensor([0.8, 0.4]), torch.tensor([0.7, 0.2]), 0.7, 10
    old = sde_step_with_logprob(old_v, sigmas, sigmas_next, x, noise_level=a)
    x_next = old.mean + old.std.reshape(-1, 1, 1, 1) * eps
    old = sde_step_with_logprob(old_v, sigmas, sigmas_next, x, noise_level=a, next_sample=x_next)
    v = old_v.clone().requires_grad_(True)
    new = sde_step_with_logprob(v, sigmas, sigmas_next, x, noise_level=a, next_sample=x_next)
    log_ratio = guarded_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.std)
    (log_ratio * guard_timestep_weights(sigmas, sigmas_next, steps)).sum().backward()
    torch.testing.assert_close(v.grad, -(1 + a**2 / 2) * eps / (steps * eps[0].numel()), rtol=1e-4, atol=1e-6)


def test_grpo_loss_weights_each_sample():
    """L = mean(w max(-A r, -A clip(r))): with r = 1, -mean(w A)."""
    log_prob = torch.zeros(3, requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    weights = torch.tensor([2.0, 0.5, 0.0])
    loss, stats = grpo_loss(log_prob, torch.zeros(3), adv, 0.2, weights=weights)
    assert loss.item() == pytest.approx(-(2.0 * 1.0 + 0.5 * -2.0) / 3)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, -weights * adv / 3)
    with pytest.raises(ValueError, match="weights must be"):
        grpo_loss(log_prob, torch.zeros(3), adv, 0.2, weights=torch.ones(2))


def test_grpo_loss_uses_the_given_log_ratio():
    old = torch.zeros(3)
    log_ratio = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, stats = grpo_loss(torch.zeros(3), old, adv, clip_range=CLIP, log_ratio=log_ratio)
    # max(-A r, -A clip(r)): -1.2, 0.8 (clipped at 0.8), -2.0.
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0) / 3)
    assert stats["ratio_max"].item() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="log_ratio must be"):
        grpo_loss(torch.zeros(3), old, adv, clip_range=CLIP, log_ratio=torch.zeros(2))
