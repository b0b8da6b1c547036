import threading
import time

import pytest
import torch

from genrl.rewards import lifecycle
from genrl.rewards.lifecycle import (
    cache_key_of,
    cached_reward_models,
    clear_reward_models,
    get_reward_model,
    move,
    on_device,
)
from genrl.rewards.registry import build_reward_fn, register_reward
from genrl.rewards.scoring import RewardScorer


pytestmark = pytest.mark.usefixtures("isolated_rewards")


def _batch(value: float, n: int = 2) -> torch.Tensor:
    """A constant rollout batch (N, C, F, H, W): its brightness identifies it."""
    return torch.full((n, 3, 2, 4, 4), value)


def _brightness_reward(calls=None, sleep_s=0.0):
    def reward(samples, prompts, metadata):
        if calls is not None:
            calls.append(time.perf_counter())
        time.sleep(sleep_s)
        return samples.float().mean(dim=(1, 2, 3, 4))

    return reward


def _register(name, reward):
    register_reward(name, lambda name, device: reward, overwrite=True)
    return build_reward_fn(name)


# --- sync / async scoring --------------------------------------------------------------------


def test_sync_scores_at_collect_with_one_empty_cache():
    calls, emptied = [], []
    fn = _register("bright", _brightness_reward(calls))
    scorer = RewardScorer(fn, mode="sync", empty_cache=lambda: emptied.append(len(calls)))
    for i in range(3):
        scorer.submit(_batch(0.1 * (i + 1)), ["p", "q"])
    assert calls == [] and emptied == []  # nothing scored while rolling out
    results = scorer.collect()
    assert emptied == [0]  # exactly once, before the first batch was scored
    assert len(calls) == 3
    assert [round(r["bright"][0].item(), 4) for r in results] == [0.1, 0.2, 0.3]  # submission order
    assert scorer.collect() == [] and emptied == [0]  # nothing pending: no extra empty_cache
    # Next epoch: again exactly one call.
    scorer.submit(_batch(0.5), ["p", "q"])
    scorer.collect()
    assert emptied == [0, 3]


def test_async_overlaps_scoring_with_rollout():
    """Batch i is scored while batch i + 1 denoises: each reward call waits until the main
    thread has started the next batch. A scorer that scored inside submit (or only at collect)
    would see the event unset; events, not wall-clock, so a busy machine cannot flake it."""
    started = [threading.Event() for _ in range(3)]  # main thread: "denoising batch i began"
    scored = [threading.Event() for _ in range(3)]
    seen_next_started = []

    def reward(samples, prompts, metadata):
        i = round(samples.float().mean().item() * 10) - 1
        if i + 1 < len(started):
            seen_next_started.append(started[i + 1].wait(timeout=30))
        scored[i].set()
        return samples.float().mean(dim=(1, 2, 3, 4))

    fn = _register("slow", reward)
    with RewardScorer(fn, mode="async", empty_cache=lambda: pytest.fail("async must not empty the cache")) as scorer:
        for i in range(3):
            started[i].set()  # denoising batch i (the previous batch is being scored meanwhile)
            if i > 0:
                assert scored[i - 1].wait(timeout=30), f"batch {i - 1} was not scored during batch {i}"
            scorer.submit(_batch(0.1 * (i + 1)), ["p", "q"])
        results = scorer.collect()
    assert seen_next_started == [True, True]
    assert [round(r["slow"][0].item(), 4) for r in results] == [0.1, 0.2, 0.3]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_raising_reward_surfaces_its_name(mode):
    def reward(samples, prompts, metadata):
        if samples.mean() > 0.15:
            raise ValueError("model exploded")
        return torch.zeros(len(samples))

    fn = _register("fragile", reward)
    scorer = RewardScorer(fn, mode=mode, empty_cache=lambda: None)
    scorer.submit(_batch(0.1), ["p", "q"])
    scorer.submit(_batch(0.2), ["p", "q"])
    with pytest.raises(RuntimeError, match="Reward 'fragile' failed: ValueError: model exploded"):
        scorer.collect()
    # The failed round is dropped; the scorer keeps working.
    scorer.submit(_batch(0.1), ["p", "q"])
    assert scorer.collect()[0]["fragile"].tolist() == [0.0, 0.0]
    scorer.close()


def test_plain_callable_errors_are_named_too():
    def my_scoring(samples, prompts, metadata):
        raise KeyError("missing")

    scorer = RewardScorer(my_scoring, mode="async")
    scorer.submit(_batch(0.1), ["p", "q"])
    with pytest.raises(RuntimeError, match="my_scoring"):
        scorer.collect()
    scorer.close()


def test_submit_detaches_and_keeps_batches_on_cpu():
    seen = []

    def reward(samples, prompts, metadata):
        seen.append((samples.requires_grad, samples.device, metadata))
        return torch.zeros(len(samples))

    scorer = RewardScorer(_register("probe", reward), mode="sync", empty_cache=lambda: None)
    scorer.submit(_batch(0.1).requires_grad_(), ["p", "q"], [{"i": 0}, {"i": 1}])
    scorer.collect()
    assert seen == [(False, torch.device("cpu"), [{"i": 0}, {"i": 1}])]


def test_bad_mode():
    with pytest.raises(ValueError, match="'fast'"):
        RewardScorer(lambda *a: {}, mode="fast")


# --- reward-model cache and device lifecycle ----------------------------------------------------


class _Scorer:
    def __init__(self, model):
        self.model = model
        self.device = None


class _WhereModule(torch.nn.Module):
    """Records where it was sent (CPU-only machines have a single real device)."""

    def __init__(self):
        super().__init__()
        self.trips = []

    def to(self, device):
        self.trips.append(str(device))
        return self


def test_cache_builds_once_per_key_even_from_threads():
    builds = []

    def build(device):
        time.sleep(0.05)
        builds.append(str(device))
        return _Scorer(torch.nn.Linear(2, 2))

    got = []
    threads = [threading.Thread(target=lambda: got.append(get_reward_model("m", "ck", "cpu", build))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builds == ["cpu"] and all(g is got[0] for g in got)
    assert got[0].device == torch.device("cpu") and cache_key_of(got[0]) == ("m", "ck", "cpu")
    other = get_reward_model("m", "ck-2", "cpu", build)
    assert other is not got[0] and len(builds) == 2


def test_cache_key_follows_a_real_move():
    scorer = get_reward_model("m", "ck", "cpu", lambda d: _Scorer(torch.nn.Linear(2, 2)))
    move(scorer, "meta")
    assert cache_key_of(scorer) == ("m", "ck", "meta")
    assert scorer.device == torch.device("meta") and scorer.model.weight.device.type == "meta"
    # The meta entry is found where it now is; asking for the CPU builds a new copy.
    assert get_reward_model("m", "ck", "meta", lambda d: pytest.fail("rebuilt")) is scorer
    fresh = get_reward_model("m", "ck", "cpu", lambda d: _Scorer(torch.nn.Linear(2, 2)))
    assert fresh is not scorer
    with pytest.raises(ValueError, match="another copy"):
        move(fresh, "meta")
    assert cache_key_of(fresh) == ("m", "ck", "cpu") and fresh.model.weight.device.type == "cpu"


def test_on_device_moves_in_and_back_with_one_cleanup():
    a = get_reward_model("a", "ck", "cpu", lambda d: _Scorer(_WhereModule()))
    b = get_reward_model("b", "ck", "meta", lambda d: _Scorer(_WhereModule()))
    cleanups = []
    with on_device([a, b], "cuda:0", cleanup=lambda: cleanups.append(1)):
        assert a.device == b.device == torch.device("cuda:0")
        assert cache_key_of(a) == ("a", "ck", "cuda:0") and cache_key_of(b) == ("b", "ck", "cuda:0")
        assert cleanups == []
    assert a.model.trips == ["cuda:0", "cpu"] and b.model.trips == ["cuda:0", "meta"]
    assert a.device == torch.device("cpu") and cache_key_of(b) == ("b", "ck", "meta")
    assert cleanups == [1]


def test_on_device_restores_and_cleans_up_when_scoring_fails(monkeypatch):
    a = get_reward_model("a", "ck", "cpu", lambda d: _Scorer(_WhereModule()))
    cleanups = []
    monkeypatch.setattr(lifecycle, "free_memory", lambda: cleanups.append(1))  # the default cleanup is patchable
    with pytest.raises(RuntimeError, match="boom"):
        with on_device(cached_reward_models(), "cuda:1"):
            raise RuntimeError("boom")
    assert a.device == torch.device("cpu") and a.model.trips == ["cuda:1", "cpu"] and cleanups == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_device_really_moves_parameters_on_gpu():
    scorer = get_reward_model("g", "ck", "cpu", lambda d: _Scorer(torch.nn.Linear(256, 256)))
    with on_device([scorer], "cuda"):
        assert scorer.model.weight.is_cuda and cache_key_of(scorer)[2].startswith("cuda:")
        before = torch.cuda.memory_allocated()
        assert before > 0
    assert scorer.model.weight.device.type == "cpu" and cache_key_of(scorer) == ("g", "ck", "cpu")
    assert torch.cuda.memory_allocated() < before


def test_clear_frees_models_and_they_rebuild_on_next_use():
    builds = []

    def build(device):
        builds.append(1)
        return _Scorer(torch.nn.Linear(4, 4))

    old = get_reward_model("m", "ck", "cpu", build)
    get_reward_model("n", "ck", "cpu", build)
    cleanups = []
    assert clear_reward_models(cleanup=lambda: cleanups.append(1)) == 2
    assert cleanups == [1] and cached_reward_models() == []
    assert old.model.weight.device.type == "meta"  # storage released even though `old` is still referenced
    new = get_reward_model("m", "ck", "cpu", build)
    assert new is not old and len(builds) == 3 and new.model.weight.device.type == "cpu"
