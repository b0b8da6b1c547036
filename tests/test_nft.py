"""The likelihood-free objectives' math (genrl/math/nft.py) against hand-derived values."""

import pytest
import torch

from genrl.math.nft import awm_loss, forward_noise, nft_loss, optimality_weight, soft_update_decay, velocity_kl


def _scalar_case(advantage: float):
    """One sample, one element: v = 1, v_old = 0.5, x_t = 0.2, x0 = 0, sigma = 0.5."""
    v = torch.tensor([[1.0]], requires_grad=True)
    return v, torch.tensor([[0.5]]), torch.tensor([[0.2]]), torch.tensor([[0.0]]), torch.tensor([0.5]), torch.tensor([advantage])


def test_forward_noise_interpolates_clean_and_noise():
    clean, noise = torch.full((2, 3), 2.0), torch.full((2, 3), -1.0)
    x_t = forward_noise(clean, noise, torch.tensor([0.0, 0.25]))
    assert torch.equal(x_t[0], clean[0])
    assert torch.allclose(x_t[1], torch.full((3,), 0.75 * 2.0 - 0.25))


def test_optimality_weight_maps_clipped_advantages_to_probabilities():
    r = optimality_weight(torch.tensor([-10.0, -5.0, 0.0, 2.5, 5.0]), adv_clip_max=5.0)
    assert torch.allclose(r, torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0]))
    with pytest.raises(ValueError, match="adv_clip_max"):
        optimality_weight(torch.zeros(1), 0.0)


def test_nft_loss_hand_values():
    # A = A_max: only the positive term. x0+ = 0.2 - 0.5 * 1 = -0.3, w+ = 0.3,
    # loss = A_max / beta * 0.09 / 0.3 = 5 * 0.3.
    v, v_old, x_t, x0, sigma, adv = _scalar_case(5.0)
    loss, _ = nft_loss(v, v_old, x_t, x0, sigma, adv, nft_beta=1.0, adv_clip_max=5.0)
    assert loss.item() == pytest.approx(1.5, rel=1e-6)
    # A = -A_max: only the negative term. v- = 2 * 0.5 - 1 = 0, x0- = 0.2, w- = 0.2,
    # loss = 5 * 0.04 / 0.2 = 1.0.
    v, v_old, x_t, x0, sigma, adv = _scalar_case(-5.0)
    loss, _ = nft_loss(v, v_old, x_t, x0, sigma, adv, nft_beta=1.0, adv_clip_max=5.0)
    assert loss.item() == pytest.approx(1.0, rel=1e-6)
    # beta = 0.5, A = A_max: v+ = 0.5 * 1 + 0.5 * 0.5 = 0.75, x0+ = 0.2 - 0.375 = -0.175,
    # loss = 5 / 0.5 * 0.175^2 / 0.175 = 1.75.
    v, v_old, x_t, x0, sigma, adv = _scalar_case(5.0)
    loss, _ = nft_loss(v, v_old, x_t, x0, sigma, adv, nft_beta=0.5, adv_clip_max=5.0)
    assert loss.item() == pytest.approx(1.75, rel=1e-6)


def test_nft_gradient_on_policy_is_the_advantage_weighted_x0_error():
    """At v_theta = v_old: dL/dv = -2 sigma A (x0_hat - x0) / (w B D) for any beta and clip."""
    torch.manual_seed(0)
    b, d = 4, 6
    v_old = torch.randn(b, d)
    x0, x_t = torch.randn(b, d), torch.randn(b, d)
    sigma = torch.rand(b) * 0.9 + 0.05
    adv = torch.tensor([-2.0, -0.5, 1.0, 3.0])
    x0_hat = x_t - sigma[:, None] * v_old
    w = (x0_hat - x0).abs().mean(dim=1, keepdim=True)
    expected = -2 * sigma[:, None] * adv[:, None] * (x0_hat - x0) / (w * b * d)
    for beta, clip in [(1.0, 5.0), (0.1, 3.0)]:
        v = v_old.clone().requires_grad_(True)
        loss, stats = nft_loss(v, v_old, x_t, x0, sigma, adv, nft_beta=beta, adv_clip_max=clip)
        loss.backward()
        assert torch.allclose(v.grad, expected, atol=1e-6), (beta, clip)
        assert stats["old_deviation"].item() == 0.0


def test_nft_loss_validates_its_inputs():
    v, v_old, x_t, x0, sigma, adv = _scalar_case(1.0)
    with pytest.raises(ValueError, match="nft_beta"):
        nft_loss(v, v_old, x_t, x0, sigma, adv, nft_beta=0.0, adv_clip_max=5.0)
    with pytest.raises(ValueError, match="one shape"):
        nft_loss(v, torch.zeros(1, 2), x_t, x0, sigma, adv, nft_beta=1.0, adv_clip_max=5.0)


def test_awm_loss_hand_value_and_sign():
    # target = eps - x0 = 0.5, error = (1 - 0.5)^2 = 0.25, loss = A * error.
    v = torch.tensor([[1.0]], requires_grad=True)
    loss, stats = awm_loss(v, torch.zeros(1, 1), torch.zeros(1, 1), torch.full((1, 1), 0.5), torch.tensor([2.0]))
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    assert v.grad.item() == pytest.approx(2.0 * 2 * 0.5)  # a good sample pulls v towards the target
    v.grad = None
    loss, _ = awm_loss(v, torch.zeros(1, 1), torch.zeros(1, 1), torch.full((1, 1), 0.5), torch.tensor([-2.0]))
    loss.backward()
    assert v.grad.item() < 0  # a bad one pushes it away
    assert stats["fm_error"].item() == pytest.approx(0.25)


def test_velocity_kl_is_per_sample_mean_square():
    kl = velocity_kl(torch.tensor([[1.0, 3.0], [0.0, 0.0]]), torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    assert torch.allclose(kl, torch.tensor([2.5, 0.0]))


def test_soft_update_decay_rises_linearly_to_its_cap():
    # DiffusionNFT's schedule: eta_i = min(0.001 i, 0.5).
    assert soft_update_decay(0, 0.001, 0.5) == 0.0
    assert soft_update_decay(1, 0.001, 0.5) == pytest.approx(0.001)
    assert soft_update_decay(300, 0.001, 0.5) == pytest.approx(0.3)
    assert soft_update_decay(500, 0.001, 0.5) == pytest.approx(0.5)
    assert soft_update_decay(10_000, 0.001, 0.5) == 0.5
    assert soft_update_decay(7, 0.0, 0.5) == 0.0, "rate 0 is on-policy"
    for rate, cap in ((-0.1, 0.5), (0.001, 1.0), (0.001, -0.1)):
        with pytest.raises(ValueError, match="soft update"):
            soft_update_decay(1, rate, cap)
