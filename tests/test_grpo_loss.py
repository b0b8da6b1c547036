import math

import pytest
import torch

from genrl.grpo import grpo_loss, select_train_timesteps

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
