import pytest
import torch

from genrl.training.ema import EMA, ema_decay


def make_params():
    torch.manual_seed(0)
    trainable = torch.nn.Parameter(torch.randn(3, 4))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    return trainable, frozen


def test_shadow_changes_only_on_interval_steps_and_matches_hand_computed_ema():
    p, frozen = make_params()
    ema = EMA([p, frozen], decay=0.9, update_interval=3)
    assert len(ema.shadow) == 1, "frozen parameters must not be tracked"
    expected = p.detach().clone()
    for step in range(1, 10):
        with torch.no_grad():
            p.add_(1.0)  # an "optimizer step"
        before = ema.shadow[0].clone()
        updated = ema.step(step)
        assert updated == (step % 3 == 0)
        if updated:
            expected = 0.9 * expected + 0.1 * p.detach()
        else:
            assert torch.equal(ema.shadow[0], before)
        torch.testing.assert_close(ema.shadow[0], expected, rtol=0, atol=1e-6)
    assert ema.num_updates == 3


def test_shadow_is_fp32_for_bf16_weights():
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    ema = EMA([p], decay=0.5)
    assert ema.shadow[0].dtype == torch.float32


def test_warmup_decay():
    assert ema_decay(0.99, 0, warmup=True) == pytest.approx(0.1)
    assert ema_decay(0.99, 10**6, warmup=True) == 0.99
    assert ema_decay(0.99, 0, warmup=False) == 0.99


def test_swap_in_and_out_restores_trained_weights():
    p, _ = make_params()
    ema = EMA([p], decay=0.5)
    with torch.no_grad():
        p.mul_(3)
    trained = p.detach().clone()
    ema.update()
    with ema.swapped_in():
        torch.testing.assert_close(p.detach(), ema.shadow[0])
        assert not torch.equal(p.detach(), trained)
    assert torch.equal(p.detach(), trained)


def test_state_dict_round_trip_and_mismatch_error():
    p, _ = make_params()
    ema = EMA([p], decay=0.9, update_interval=2)
    ema.update()
    restored = EMA([torch.nn.Parameter(torch.zeros(3, 4))], decay=0.9, update_interval=2)
    restored.load_state_dict(ema.state_dict())
    assert torch.equal(restored.shadow[0], ema.shadow[0]) and restored.num_updates == 1
    with pytest.raises(ValueError, match="does not fit"):
        EMA([torch.nn.Parameter(torch.zeros(5))]).load_state_dict(ema.state_dict())


def test_bad_settings_are_refused():
    p, _ = make_params()
    with pytest.raises(ValueError, match="decay"):
        EMA([p], decay=1.0)
    with pytest.raises(ValueError, match="interval"):
        EMA([p], update_interval=0)


def test_an_update_with_a_given_decay_uses_it_instead_of_its_own():
    p = torch.nn.Parameter(torch.tensor([0.0, 4.0]))
    ema = EMA([p], decay=0.9)
    p.data = torch.tensor([2.0, 0.0])
    ema.update(decay=0.25)  # 0.25 * old + 0.75 * new
    assert torch.equal(ema.shadow[0], torch.tensor([1.5, 1.0]))
    ema.update(decay=0.0)  # a decay of 0 copies the weights
    assert torch.equal(ema.shadow[0], torch.tensor([2.0, 0.0]))


def test_zero3_writes_go_in_groups_of_one_kind_and_bounded_size(monkeypatch):
    """Under ZeRO-3 swaps rebuild the parameters a group at a time (one all-gather each): a group
    holds consecutive parameters of one dtype and device, at most WRITE_GROUP_ELEMENTS full
    elements, and a larger parameter goes alone. (The writes themselves run in the 2-process
    ZeRO-3 tests, whose EMA export must equal DDP's.)"""
    from types import SimpleNamespace

    from genrl.training import ema as ema_module
    monkeypatch.setattr(ema_module, "WRITE_GROUP_ELEMENTS", 10)

    def param(numel, dtype=torch.float32):  # what ZeRO-3 leaves: a 1-D shard and the full size
        return SimpleNamespace(ds_tensor=torch.zeros(1, dtype=dtype), ds_numel=numel)

    params = [param(4), param(6), param(3), param(25), param(2), param(2, torch.bfloat16), param(2, torch.bfloat16)]
    assert list(ema_module._write_groups(params)) == [[0, 1], [2], [3], [4], [5, 6]]
    assert list(ema_module._write_groups([])) == []
