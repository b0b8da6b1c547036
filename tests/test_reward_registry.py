import os
import subprocess
import sys
import textwrap

import cv2
import numpy as np
import pytest
import torch

from genrl.rewards import lifecycle, registry
from genrl.rewards.registry import build_reward_fn, known_rewards, parse_reward_spec, register_reward

QWEN_NAMES = ["hpsv3", "hpsv3_top30", "videoalign_vq", "videoalign_mq", "videoalign_ta", "videoalign_overall"]


pytestmark = pytest.mark.usefixtures("isolated_rewards")


def _batch(n=3, frames=2, seed=0):
    """Rollout-like float (N, C, F, H, W) in [0, 1]."""
    return torch.rand(n, 3, frames, 8, 8, generator=torch.Generator().manual_seed(seed))


# --- parsing -------------------------------------------------------------------------------


def test_parse_names_and_weights():
    assert parse_reward_spec("hpsv3:1.0,videoalign_ta:0.5") == [("hpsv3", 1.0), ("videoalign_ta", 0.5)]
    assert parse_reward_spec(" jpeg_compressibility , temporal_smoothness:-2e-1 ") == [
        ("jpeg_compressibility", 1.0),
        ("temporal_smoothness", -0.2),
    ]


def test_parse_user_functions():
    assert parse_reward_spec("mypkg.rewards:my_fn:0.5") == [("mypkg.rewards:my_fn", 0.5)]
    assert parse_reward_spec("mypkg.rewards:my_fn") == [("mypkg.rewards:my_fn", 1.0)]
    # A function named like a float keyword is still a function, never a weight.
    assert parse_reward_spec("mypkg:inf,hpsv3:.5") == [("mypkg:inf", 1.0), ("hpsv3", 0.5)]


@pytest.mark.parametrize("spec", ["hpsv3:abc", "hpsv3:", "hpsv3:nan", "hpsv3:inf", "mypkg.rewards:my_fn:heavy"])
def test_bad_weight(spec):
    with pytest.raises(ValueError, match="Bad weight"):
        parse_reward_spec(spec)


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="Unknown reward 'imagereward'") as err:
        parse_reward_spec("hpsv3,imagereward:1")
    for name in QWEN_NAMES + ["jpeg_compressibility", "temporal_smoothness"]:
        assert name in str(err.value)


@pytest.mark.parametrize("spec", ["", "  ", "hpsv3,hpsv3:2", "a:b:c:d", "hpsv3,", "1pkg:fn"])
def test_malformed_specs(spec):
    with pytest.raises(ValueError):
        parse_reward_spec(spec)


# --- registration ---------------------------------------------------------------------------


def test_importing_rewards_imports_no_reward_model():
    code = (
        "import sys, genrl.rewards as r; "
        "heavy = ('transformers', 'genrl.rewards.hpsv3', 'genrl.rewards.videoalign', 'genrl.rewards.pickscore'); "
        "print(sorted(m for m in sys.modules if m in heavy)); "
        "print(r.known_rewards())"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    out = result.stdout.splitlines()
    assert out[0] == "[]"
    for name in QWEN_NAMES + ["pickscore"]:
        assert name in out[1]


def test_qwen_rewards_point_at_their_factories():
    for name in QWEN_NAMES:
        assert name in known_rewards()
    # Stored as paths until used (another test may have resolved them: then the same function).
    for name in ("hpsv3", "hpsv3_top30"):
        assert registry._target(registry._REGISTRY[name]) == "genrl.rewards.hpsv3:build_hpsv3_reward"
    for name in QWEN_NAMES[2:]:
        assert registry._target(registry._REGISTRY[name]) == "genrl.rewards.videoalign:build_videoalign_reward"


def test_register_conflicts_and_bad_names():
    register_reward("my_reward", "genrl.rewards.rule_based:build_jpeg_reward")
    register_reward("my_reward", "genrl.rewards.rule_based:build_jpeg_reward")  # same target: fine
    with pytest.raises(ValueError, match="already registered"):
        register_reward("my_reward", "genrl.rewards.rule_based:build_temporal_smoothness_reward")
    register_reward("my_reward", "genrl.rewards.rule_based:build_temporal_smoothness_reward", overwrite=True)
    for bad in ("a:b", "a,b", "total", "", "has space"):
        with pytest.raises(ValueError):
            register_reward(bad, lambda **kw: None)
    with pytest.raises(ValueError, match="module:function"):
        register_reward("x", "not a path")


def test_lazy_path_is_imported_on_first_use(tmp_path, monkeypatch):
    (tmp_path / "lazy_reward_mod.py").write_text(
        textwrap.dedent(
            """
            import torch
            def build(name, device, offset=0.0):
                return lambda samples, prompts, metadata: torch.full((len(samples),), offset)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    register_reward("lazy_reward", "lazy_reward_mod:build")
    assert "lazy_reward_mod" not in sys.modules
    fn = build_reward_fn("lazy_reward:2", options={"lazy_reward": {"offset": 1.5}})
    assert "lazy_reward_mod" in sys.modules
    out = fn(_batch(), ["p"] * 3)
    assert out["lazy_reward"].tolist() == [1.5] * 3 and out["total"].tolist() == [3.0] * 3
    monkeypatch.delitem(sys.modules, "lazy_reward_mod")


def test_unimportable_factory_names_the_reward():
    register_reward("ghost", "genrl_no_such_module:build")
    with pytest.raises(ImportError, match="ghost"):
        build_reward_fn("ghost")


# --- building and calling ---------------------------------------------------------------------


class _TinyScorer:
    """A reward model stand-in: a real module, one forward per call, counted."""

    def __init__(self, device):
        self.model = torch.nn.Linear(3, 3)
        self.device = device
        self.forwards = 0

    def __call__(self, samples):
        self.forwards += 1
        mean = samples.float().mean(dim=(2, 3, 4))  # (N, C)
        return {"fam_a": mean[:, 0], "fam_b": mean[:, 1], "fam_c": mean[:, 2]}


def _register_family(builds):
    def factory(name, device, checkpoint="ckpt-1"):
        def build(dev):
            builds.append((name, checkpoint, str(dev)))
            return _TinyScorer(dev)

        def reward(samples, prompts, metadata):
            return lifecycle.get_reward_model("tiny", checkpoint, device, build)(samples)

        return reward

    for name in ("fam_a", "fam_b", "fam_c"):
        register_reward(name, factory)


def test_names_of_one_factory_share_model_and_forward():
    builds = []
    _register_family(builds)
    fn = build_reward_fn("fam_b:2,fam_a:1")
    x = _batch()
    out = fn(x, ["p"] * 3)
    assert len(builds) == 1
    scorer = lifecycle.cached_reward_models()[0]
    assert scorer.forwards == 1  # one forward for both names
    mean = x.mean(dim=(2, 3, 4))
    torch.testing.assert_close(out["fam_a"], mean[:, 0])
    torch.testing.assert_close(out["fam_b"], mean[:, 1])
    torch.testing.assert_close(out["total"], 2 * mean[:, 1] + mean[:, 0])
    assert list(out) == ["fam_b", "fam_a", "total"] and fn.names == ["fam_b", "fam_a"] and fn.weights == [2.0, 1.0]


def test_different_options_build_different_models():
    builds = []
    _register_family(builds)
    fn = build_reward_fn("fam_a,fam_c", options={"fam_c": {"checkpoint": "ckpt-2"}})
    fn(_batch(), ["p"] * 3)
    assert sorted(b[1] for b in builds) == ["ckpt-1", "ckpt-2"]
    assert all(s.forwards == 1 for s in lifecycle.cached_reward_models())


def test_tensor_rewards_of_one_factory_are_called_each(monkeypatch):
    calls = []

    def factory(name, device):
        def reward(samples, prompts, metadata):
            calls.append(name)
            return torch.full((len(samples),), 1.0 if name == "t_one" else 2.0)

        return reward

    register_reward("t_one", factory)
    register_reward("t_two", factory)
    out = build_reward_fn("t_one:1,t_two:10")(_batch(), ["p"] * 3)
    assert calls == ["t_one", "t_two"]
    assert out["t_two"].tolist() == [2.0] * 3 and out["total"].tolist() == [21.0] * 3


def test_user_function_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_user_rewards.py").write_text(
        textwrap.dedent(
            """
            from genrl.rewards.layouts import prepare_images
            def brightness(samples, prompts, metadata, scale=1.0):
                return (prepare_images(samples).mean(axis=(1, 2, 3, 4)) / 255 * scale).tolist()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    x = _batch()
    options = {"my_user_rewards:brightness": {"scale": 2}}
    fn = build_reward_fn("my_user_rewards:brightness:0.5,jpeg_compressibility:0", options=options)
    out = fn(x, ["a", "b", "c"])
    expected = torch.round(x * 255).mean(dim=(1, 2, 3, 4)) / 255 * 2
    torch.testing.assert_close(out["my_user_rewards:brightness"], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["total"], 0.5 * expected, atol=1e-5, rtol=0)
    monkeypatch.delitem(sys.modules, "my_user_rewards")


def test_missing_user_function_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "my_empty_mod.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="my_empty_mod.nothing"):
        build_reward_fn("my_empty_mod:nothing")


@pytest.mark.parametrize(
    "output, match",
    [
        (lambda n: torch.zeros(n + 1), r"'bad' returned shape \(4,\), expected \(3,\)"),
        (lambda n: torch.zeros(n, 2), r"'bad' returned shape"),
        (lambda n: torch.tensor([0.0, float("nan"), 1.0]), "'bad' returned non-finite"),
        (lambda n: {"other": torch.zeros(n)}, "none named 'bad'"),
    ],
)
def test_bad_outputs_name_the_reward(output, match):
    register_reward("bad", lambda name, device: (lambda samples, prompts, metadata: output(len(samples))))
    fn = build_reward_fn("bad")
    with pytest.raises(ValueError, match=match):
        fn(_batch(), ["p"] * 3)


def test_nan_only_when_allowed():
    register_reward("partial", lambda name, device: (lambda s, p, m: torch.tensor([1.0, float("nan"), 0.0])))
    with pytest.raises(ValueError, match="'partial' returned non-finite"):
        build_reward_fn("partial")(_batch(), ["p"] * 3)
    out = build_reward_fn("partial:2", allow_nan=True)(_batch(), ["p"] * 3)
    assert out["total"][0] == 2.0 and out["total"][1].isnan() and out["total"][2] == 0.0
    register_reward("infinite", lambda name, device: (lambda s, p, m: torch.tensor([1.0, float("inf"), 0.0])))
    with pytest.raises(ValueError, match="'infinite' returned non-finite"):
        build_reward_fn("infinite", allow_nan=True)(_batch(), ["p"] * 3)


def test_zero_weight_rewards_are_reported_but_stay_out_of_the_total():
    register_reward("partial", lambda name, device: (lambda s, p, m: torch.tensor([1.0, float("nan"), 0.0])))
    out = build_reward_fn("jpeg_compressibility:1,partial:0", allow_nan=True)(_batch(), ["p"] * 3)
    assert out["partial"][1].isnan()
    torch.testing.assert_close(out["total"], out["jpeg_compressibility"])


def test_raising_reward_names_itself():
    def factory(name, device):
        def reward(samples, prompts, metadata):
            raise RuntimeError("CUDA out of memory (pretend)")

        return reward

    register_reward("explodes", factory)
    with pytest.raises(RuntimeError, match="Reward 'explodes' failed: RuntimeError: CUDA out of memory"):
        build_reward_fn("jpeg_compressibility,explodes")(_batch(), ["p"] * 3)


def test_options_for_absent_rewards_and_prompt_count_are_checked():
    with pytest.raises(ValueError, match="not in the spec"):
        build_reward_fn("jpeg_compressibility", options={"hpsv3": {}})
    with pytest.raises(ValueError, match="2 prompts for 3 samples"):
        build_reward_fn("jpeg_compressibility")(_batch(), ["a", "b"])


def test_factory_receives_name_device_and_options():
    seen = {}

    def factory(**kwargs):
        seen.update(kwargs)
        return lambda samples, prompts, metadata: torch.zeros(len(samples))

    register_reward("probe", factory)
    fn = build_reward_fn("probe", device="cpu", options={"probe": {"checkpoint": "x"}})
    assert seen == {"name": "probe", "device": torch.device("cpu"), "checkpoint": "x"}
    assert fn.device == torch.device("cpu")


def test_factory_failure_names_the_reward():
    def factory(name, device, checkpoint):
        raise FileNotFoundError(f"no checkpoint at {checkpoint}")

    register_reward("needs_ckpt", factory)
    with pytest.raises(RuntimeError, match="Could not build reward 'needs_ckpt': FileNotFoundError: no checkpoint at /x"):
        build_reward_fn("needs_ckpt", options={"needs_ckpt": {"checkpoint": "/x"}})


# --- rule-based rewards --------------------------------------------------------------------------


def test_jpeg_rewards_rank_noise_below_flat_images():
    flat = torch.full((1, 3, 2, 32, 32), 0.5)
    noisy = torch.rand(1, 3, 2, 32, 32, generator=torch.Generator().manual_seed(0))
    fn = build_reward_fn("jpeg_compressibility,jpeg_incompressibility")
    out = fn(torch.cat([flat, noisy]), ["p", "p"])
    comp, incomp = out["jpeg_compressibility"], out["jpeg_incompressibility"]
    assert comp[0] > comp[1] and torch.equal(incomp, -comp)
    # Size in kB of the frames, mean over frames, as cv2 encodes them at quality 95.
    frames = (noisy[0].permute(1, 2, 3, 0) * 255).round().to(torch.uint8).numpy()
    sizes = [cv2.imencode(".jpg", f[..., ::-1].copy(), [cv2.IMWRITE_JPEG_QUALITY, 95])[1].size / 1000 for f in frames]
    assert incomp[1].item() == pytest.approx(np.mean(sizes), rel=1e-6)


def test_temporal_smoothness():
    fn = build_reward_fn("temporal_smoothness")
    static = torch.full((1, 3, 4, 8, 8), 0.3)
    flicker = torch.zeros(1, 3, 4, 8, 8)
    flicker[:, :, 1::2] = 1.0  # black, white, black, white
    one_frame = torch.rand(1, 3, 1, 8, 8)
    out = fn(torch.cat([static, flicker]), ["p", "p"])["temporal_smoothness"]
    assert out.tolist() == [0.0, -1.0]
    assert fn(one_frame, ["p"])["temporal_smoothness"].tolist() == [0.0]
    # Same video in another layout, same score.
    video = torch.rand(2, 3, 3, 8, 8)
    a = fn(video, ["p", "p"])["temporal_smoothness"]
    b = fn((video.permute(0, 2, 3, 4, 1) * 255).round().to(torch.uint8).numpy(), ["p", "p"])["temporal_smoothness"]
    torch.testing.assert_close(a, b)
    assert (a < 0).all()
