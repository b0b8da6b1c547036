import math

import numpy as np
import pytest
import torch

from genrl.data.toy_scenes import all_specs, caption, parse_caption, render_scene
from genrl.rewards.toy_geneval import build_toy_geneval_reward, detect_objects, toy_geneval_scores


def as_samples(images: list[np.ndarray]) -> torch.Tensor:
    """uint8 (H, W, 3) images -> float (N, C, F=1, H, W) in [0, 1], as the rollout decodes them."""
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)[:, :, None].float() / 255.0


def render(prompt: str, seed: int = 0, resolution: int = 32) -> np.ndarray:
    return render_scene(parse_caption(prompt), np.random.default_rng(seed), resolution)


def test_ground_truth_scenes_score_one():
    specs = all_specs()
    chosen = specs[:36] + specs[36::9]  # every count scene and a spread of position scenes
    prompts = [caption(s) for s in chosen]
    images = [render_scene(s, np.random.default_rng(i)) for i, s in enumerate(chosen)]
    scores = toy_geneval_scores(as_samples(images), prompts)
    assert torch.all(scores["overall"] == 1.0) and torch.all(scores["strict"] == 1.0)
    for name in ("color", "shape", "count"):
        assert torch.all(scores[name] == 1.0), name
    is_position = torch.tensor([s.relation is not None for s in chosen])
    assert torch.all(scores["position"][is_position] == 1.0)
    assert torch.all(torch.isnan(scores["position"][~is_position]))


def test_ground_truth_survives_mild_noise_and_other_resolutions():
    prompts = ["three green triangles", "a blue square below a yellow circle", "two red circles"]
    generator = torch.Generator().manual_seed(0)
    for resolution in (32, 64):
        samples = as_samples([render(p, i, resolution) for i, p in enumerate(prompts)])
        noisy = (samples + 0.03 * torch.randn(samples.shape, generator=generator)).clamp(0, 1)
        assert torch.all(toy_geneval_scores(noisy, prompts)["overall"] == 1.0), resolution


@pytest.mark.parametrize("fill", [0.0, 1.0, 0.5])
def test_blank_images_score_zero(fill):
    prompts = ["a red circle", "three blue squares", "a green triangle above a yellow square"]
    scores = toy_geneval_scores(torch.full((3, 3, 1, 32, 32), fill), prompts)
    assert torch.all(scores["overall"] == 0.0) and torch.all(scores["strict"] == 0.0)


@pytest.mark.parametrize(
    "drawn, prompt, expected",
    [
        # wrong colour: nothing of the named colour
        ("two blue circles", "two red circles", {"color": 0.0, "shape": 0.0, "count": 0.0, "overall": 0.0}),
        # wrong shape: colour right
        ("two red squares", "two red circles", {"color": 1.0, "shape": 0.0, "count": 0.0, "overall": 1 / 3}),
        # wrong count: colour and shape right
        ("a red circle", "two red circles", {"color": 1.0, "shape": 1.0, "count": 0.0, "overall": 2 / 3}),
        ("three red circles", "two red circles", {"color": 1.0, "shape": 1.0, "count": 0.0, "overall": 2 / 3}),
        # wrong position: objects right, relation mirrored
        (
            "a red circle left of a blue square",
            "a red circle right of a blue square",
            {"color": 1.0, "shape": 1.0, "count": 1.0, "position": 0.0, "overall": 0.75},
        ),
        (
            "a red circle above a blue square",
            "a red circle left of a blue square",
            {"position": 0.0, "overall": 0.75},
        ),
        # one of the two objects has the wrong colour
        (
            "a red circle above a green square",
            "a red circle above a blue square",
            {"color": 0.5, "shape": 0.5, "count": 0.5, "position": 0.0, "overall": 0.375},
        ),
    ],
)
def test_each_category_catches_its_mistake(drawn, prompt, expected):
    scores = toy_geneval_scores(as_samples([render(drawn, seed=3)]), [prompt])
    for name, value in expected.items():
        assert scores[name].item() == pytest.approx(value), name
    assert scores["strict"].item() == 0.0


def test_detections_name_colour_shape_and_place():
    image = render("a yellow triangle left of a blue circle", seed=5)
    detections = sorted(detect_objects(image), key=lambda d: d.center[0])
    assert [(d.color, d.shape) for d in detections] == [("yellow", "triangle"), ("blue", "circle")]
    assert all(6 <= d.size <= 14 for d in detections)


def test_layouts_dtypes_and_frames():
    prompts = ["two green squares", "a red triangle below a blue circle"]
    images = [render(p, i) for i, p in enumerate(prompts)]
    five_d = as_samples(images)
    expected = toy_geneval_scores(five_d, prompts)["overall"]
    assert torch.equal(toy_geneval_scores(five_d[:, :, 0], prompts)["overall"], expected)
    uint8 = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)[:, :, None]
    assert torch.equal(toy_geneval_scores(uint8, prompts)["overall"], expected)
    assert torch.equal(toy_geneval_scores(five_d.numpy(), prompts)["overall"], expected)
    # Two frames, one right and one blank: the mean over frames.
    two_frames = torch.cat([five_d, torch.ones_like(five_d)], dim=2)
    assert torch.allclose(toy_geneval_scores(two_frames, prompts)["overall"], expected / 2)


def test_bad_inputs_fail_with_a_clear_message():
    with pytest.raises(ValueError, match="must match"):
        toy_geneval_scores(torch.zeros(2, 3, 1, 32, 32), ["a red circle"])
    with pytest.raises(ValueError, match=r"\(N, 3, F, H, W\)"):
        toy_geneval_scores(torch.zeros(2, 1, 1, 32, 32), ["a red circle"] * 2)
    with pytest.raises(ValueError, match="Cannot read"):
        toy_geneval_scores(torch.zeros(1, 3, 1, 32, 32), ["a cat on a mat"])


def test_registry_factory():
    prompts = ["a red circle", "a red circle left of a blue square"]
    samples = as_samples([render("a red circle", 1), render("a red circle right of a blue square", 2)])
    overall = build_toy_geneval_reward()(samples, prompts, None)
    assert overall.shape == (2,) and overall.dtype == torch.float32
    assert overall.tolist() == pytest.approx([1.0, 0.75])
    assert build_toy_geneval_reward("toy_geneval_strict")(samples, prompts).tolist() == [1.0, 0.0]
    assert build_toy_geneval_reward("toy_geneval_count", device="cuda")(samples, prompts).tolist() == [1.0, 1.0]
    position = build_toy_geneval_reward("toy_geneval_position")(samples, prompts)
    assert math.isnan(position[0].item()) and position[1].item() == 0.0
    with pytest.raises(ValueError, match="toy_geneval_color"):
        build_toy_geneval_reward("toy_geneval_colour")
    with pytest.raises(ValueError, match="min_area_fraction"):
        build_toy_geneval_reward("toy_geneval", threshold=0.5)
    # Raising the minimum blob area above the objects' size makes every object vanish.
    assert build_toy_geneval_reward(min_area_fraction=0.5)(samples, prompts).tolist() == [0.0, 0.0]
