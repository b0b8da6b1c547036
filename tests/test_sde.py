"""The SDE steps of genrl.math.sde against an independent float64 computation, and their edge cases."""

import math

import pytest
import torch

from genrl.math.sde import MIN_STD, adams_bashforth2_velocity, flow_sde_std, kl_between_means, sde_step_with_logprob

torch.set_num_threads(2)


def _inputs(batch=3, shape=(4, 5, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=g)
    v = torch.randn(batch, *shape, generator=g)
    return x, v


def _reference(x, v, sigma, sigma_next, next_sample, a, sde_type, sigma_max):
    """Float64 mean, std and log-prob of one step, written from the formulas in DESIGN.md."""
    x, v, next_sample = x.double(), v.double(), next_sample.double()
    means, stds, log_probs = [], [], []
    for b in range(x.shape[0]):
        s, s_n = float(sigma[b]), float(sigma_next[b])
        if sde_type == "flow_sde":
            s_hat = sigma_max if s >= 1 else s
            std_t = a * math.sqrt(s / (1 - s_hat)) if s_n > 0 else 0.0
            dt = s_n - s
            mean = x[b] + (v[b] + std_t**2 / (2 * s) * (x[b] + (1 - s) * v[b])) * dt
            std = std_t * math.sqrt(-dt)
            lp = -((next_sample[b] - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
        else:
            std = s_n * math.sin(a * math.pi / 2)
            x0, x1 = x[b] - s * v[b], x[b] + (1 - s) * v[b]
            mean = x0 * (1 - s_n) + x1 * math.sqrt(s_n**2 - std**2)
            lp = -((next_sample[b] - mean) ** 2)
        means.append(mean)
        stds.append(std)
        log_probs.append(lp.mean())
    return torch.stack(means), torch.tensor(stds, dtype=torch.float64), torch.stack(log_probs)


@pytest.mark.parametrize("sde_type", ["flow_sde", "flow_cps"])
def test_step_matches_float64_reference(sde_type):
    x, v = _inputs()
    sigma = torch.tensor([1.0, 0.6, 0.25])  # per-sample, the first at sigma = 1 (uses sigma_max)
    sigma_next = torch.tensor([0.9, 0.45, 0.1])
    sigma_max, a = 0.9, 0.7
    out = sde_step_with_logprob(
        v, sigma, sigma_next, x, noise_level=a, sde_type=sde_type, sigma_max=sigma_max,
        generator=torch.Generator().manual_seed(1),
    )
    mean, std, log_prob = _reference(x, v, sigma, sigma_next, out.next_sample, a, sde_type, sigma_max)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std.double(), std, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.log_prob.double(), log_prob, rtol=1e-5, atol=1e-5)


def test_flow_sde_std_replaces_sigma_one_by_sigma_max():
    std = flow_sde_std(torch.tensor([1.0, 0.5]), torch.tensor([0.8, 0.0]), noise_level=0.5, sigma_max=0.8)
    assert std[0].item() == pytest.approx(0.5 * math.sqrt(1 / (1 - 0.8)), rel=1e-6)
    assert std[1].item() == 0.0  # a step to sigma' = 0 is deterministic


@pytest.mark.parametrize("sde_type", ["flow_sde", "flow_cps"])
@pytest.mark.parametrize("noise_level", [0.0, 1e-30, 1e-20, 1e-12])
def test_log_prob_is_finite_as_std_vanishes(sde_type, noise_level):
    x, v = _inputs()
    out = sde_step_with_logprob(
        v, 0.5, 0.4, x, noise_level=noise_level, sde_type=sde_type, sigma_max=0.9,
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.isfinite(out.log_prob).all()
    assert torch.isfinite(out.next_sample).all()
    # Scoring a sample off the mean must stay finite too (std clamped, never divided by 0).
    scored = sde_step_with_logprob(
        v, 0.5, 0.4, x, noise_level=noise_level, sde_type=sde_type, sigma_max=0.9, next_sample=out.mean + 1e-3
    )
    assert torch.isfinite(scored.log_prob).all()
    if noise_level == 0.0:
        assert (out.std == 0).all() and (out.log_prob == 0).all()
        # Deterministic step = Euler / DDIM: x + (sigma' - sigma) v for both types.
        torch.testing.assert_close(out.next_sample, x + (0.4 - 0.5) * v)


def test_clamp_keeps_std_squared_a_normal_float():
    """Squaring the clamped std in float32 (as the log-prob does) gives a normal float, and a
    difference divided by it stays finite; clamping at `tiny` itself would give 0 and inf."""
    s = torch.tensor(MIN_STD, dtype=torch.float32)
    assert (s * s).item() >= torch.finfo(torch.float32).tiny * 0.99
    assert torch.isfinite(torch.tensor(1e-3) / (2 * s * s))
    tiny = torch.tensor(torch.finfo(torch.float32).tiny)
    assert (tiny * tiny).item() == 0.0


@pytest.mark.parametrize("sde_type", ["flow_sde", "flow_cps"])
def test_empirical_std_of_next_sample(sde_type):
    x, v = _inputs(batch=2, shape=(200, 250))  # 50k draws per sample
    sigma, sigma_next, a, sigma_max = torch.tensor([0.7, 0.3]), torch.tensor([0.6, 0.2]), 0.8, 0.95
    out = sde_step_with_logprob(
        v, sigma, sigma_next, x, noise_level=a, sde_type=sde_type, sigma_max=sigma_max,
        generator=[torch.Generator().manual_seed(10), torch.Generator().manual_seed(11)],
    )
    empirical = (out.next_sample - out.mean).flatten(1).std(dim=1)
    if sde_type == "flow_sde":
        expected = a * torch.sqrt(sigma / (1 - sigma)) * torch.sqrt(sigma - sigma_next)
    else:
        expected = sigma_next * math.sin(a * math.pi / 2)
    torch.testing.assert_close(empirical, expected, rtol=0.02, atol=0)
    torch.testing.assert_close(out.std, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("sde_type", ["flow_sde", "flow_cps"])
def test_scoring_a_given_sample_returns_its_log_prob(sde_type):
    x, v = _inputs()
    drawn = sde_step_with_logprob(
        v, 0.8, 0.7, x, noise_level=0.7, sde_type=sde_type, sigma_max=0.9, generator=torch.Generator().manual_seed(3)
    )
    scored = sde_step_with_logprob(v, 0.8, 0.7, x, noise_level=0.7, sde_type=sde_type, sigma_max=0.9, next_sample=drawn.next_sample)
    assert torch.equal(scored.next_sample, drawn.next_sample)
    torch.testing.assert_close(scored.log_prob, drawn.log_prob, rtol=0, atol=1e-6)
    # A sample farther from the mean is less likely.
    farther = sde_step_with_logprob(
        v, 0.8, 0.7, x, noise_level=0.7, sde_type=sde_type, sigma_max=0.9,
        next_sample=drawn.mean + 2 * (drawn.next_sample - drawn.mean),
    )
    assert (farther.log_prob < drawn.log_prob).all()


def test_bf16_inputs_are_computed_in_fp32():
    x, v = _inputs()
    x16, v16 = x.bfloat16(), v.bfloat16()
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = sde_step_with_logprob(v16, 0.6, 0.5, x16, noise_level=0.7, sigma_max=0.9, next_sample=target)
    ref = sde_step_with_logprob(v16.float(), 0.6, 0.5, x16.float(), noise_level=0.7, sigma_max=0.9, next_sample=target.float())
    for name in ("next_sample", "mean", "log_prob", "std"):
        assert getattr(out, name).dtype == torch.float32, name
        assert torch.equal(getattr(out, name), getattr(ref, name)), name


def test_per_sample_generators_give_batch_independent_noise():
    x, v = _inputs(batch=3)
    seeds = [101, 202, 303]
    batch = sde_step_with_logprob(
        v, 0.6, 0.5, x, noise_level=0.7, sigma_max=0.9, generator=[torch.Generator().manual_seed(s) for s in seeds]
    )
    alone = sde_step_with_logprob(
        v[1:2], 0.6, 0.5, x[1:2], noise_level=0.7, sigma_max=0.9, generator=[torch.Generator().manual_seed(seeds[1])]
    )
    assert torch.equal(batch.next_sample[1:2], alone.next_sample)
    assert not torch.equal(batch.next_sample[0] - batch.mean[0], batch.next_sample[2] - batch.mean[2])
    with pytest.raises(ValueError, match="generators"):
        sde_step_with_logprob(v, 0.6, 0.5, x, noise_level=0.7, generator=[torch.Generator()])


def test_unknown_sde_type_is_rejected():
    x, v = _inputs()
    with pytest.raises(ValueError, match="sde_type"):
        sde_step_with_logprob(v, 0.6, 0.5, x, noise_level=0.7, sde_type="ode")


def test_kl_between_means_matches_float64_and_vanishes_without_noise():
    mean, ref_mean = _inputs()
    std = torch.tensor([0.3, 0.05, 0.0])
    kl = kl_between_means(mean, ref_mean, std)
    expected = ((mean.double() - ref_mean.double()) ** 2).flatten(1).mean(1)[:2] / (2 * std[:2].double() ** 2)
    torch.testing.assert_close(kl[:2].double(), expected, rtol=1e-5, atol=0)
    assert kl[2] == 0


def test_kl_forms_divide_by_the_transition_or_the_sde_variance():
    """transition: mean(dmu^2) / (2 (std_t sqrt|dt|)^2); sde_variance (Flow-GRPO's SD3 script):
    mean(dmu^2) / (2 std_t^2), written out here from flow_sde_std."""
    from genrl.math.sde import flow_sde_std, kl_between_means, kl_in_form

    sigma, sigma_next = torch.tensor([0.9, 0.5]), torch.tensor([0.7, 0.45])
    mean, ref = torch.zeros(2, 3), torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.1, 0.0]])
    std_t = flow_sde_std(sigma, sigma_next, noise_level=0.7, sigma_max=0.95)
    step_std = std_t * (sigma - sigma_next).sqrt()
    d2 = ((mean - ref) ** 2).mean(dim=1)
    kl = kl_between_means(mean, ref, step_std)
    torch.testing.assert_close(kl_in_form(kl, sigma, sigma_next, "transition"), d2 / (2 * step_std**2))
    torch.testing.assert_close(kl_in_form(kl, sigma, sigma_next, "sde_variance"), d2 / (2 * std_t**2))
    with pytest.raises(ValueError, match="KL form"):
        kl_in_form(kl, sigma, sigma_next, "nats")


def test_adams_bashforth2_velocity_hand_value():
    # r = dt / dt_prev = -0.2 / -0.4 = 0.5: v_eff = v + 0.25 (v - v_prev).
    v, v_prev = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 2.0])
    got = adams_bashforth2_velocity(v, v_prev, -0.2, -0.4)
    assert torch.allclose(got, torch.tensor([0.5, -3.0]))
    assert torch.equal(adams_bashforth2_velocity(v, v, -0.1, -0.3), v), "a constant velocity is integrated exactly"


@pytest.mark.parametrize("solver, order", [("euler", 1), ("ab2", 2)])
def test_ab2_is_second_order_on_a_non_uniform_grid(solver, order):
    # dx/dsigma = x cos(sigma) from sigma = 1 to 0: x(0) = x(1) exp(-sin 1). Shifted grids
    # (non-uniform, as the schedulers' are); AB2 starts with one Euler step.
    def integrate(steps: int) -> float:
        sigmas = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
        sigmas = sigmas * 3 / (1 + 2 * sigmas)  # diffusers' time shift 3
        x, prev, prev_dt = torch.tensor([1.0], dtype=torch.float64), None, None
        for i in range(steps):
            dt = float(sigmas[i + 1] - sigmas[i])
            v = x * math.cos(float(sigmas[i]))
            step_v = v if solver == "euler" or prev is None else adams_bashforth2_velocity(v, prev, dt, prev_dt).double()
            x, prev, prev_dt = x + dt * step_v, v, dt
        return float(x)

    exact = math.exp(-math.sin(1.0))
    errors = [abs(integrate(n) - exact) for n in (20, 40, 80)]
    ratios = [errors[0] / errors[1], errors[1] / errors[2]]
    assert all(2 ** order * 0.8 < r < 2 ** order * 1.25 for r in ratios), (errors, ratios)
