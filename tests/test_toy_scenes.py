import os

import numpy as np
import pytest

from genrl.data.toy_scenes import (
    COLORS,
    RELATIONS,
    SHAPES,
    SceneSpec,
    ToyObject,
    all_specs,
    caption,
    parse_caption,
    prompt_splits,
    relation_holds,
    render_clip,
    render_scene,
    sample_scene,
    vocabulary,
    write_prompt_files,
)

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "genrl", "assets", "prompts")


def test_caption_round_trip_over_the_whole_grammar():
    specs = all_specs()
    assert len(specs) == len(set(specs)) == len(COLORS) * len(SHAPES) * (3 + 4 * (len(COLORS) * len(SHAPES) - 1))
    for spec in specs:
        assert parse_caption(caption(spec)) == spec


def test_captions_read_as_english():
    assert caption(SceneSpec((ToyObject("red", "circle", 2),))) == "two red circles"
    spec = SceneSpec((ToyObject("red", "circle"), ToyObject("blue", "square")), "left of")
    assert caption(spec) == "a red circle left of a blue square"
    assert parse_caption("  A Red circle   LEFT OF a blue square. ") == spec
    assert parse_caption("one green triangle") == SceneSpec((ToyObject("green", "triangle", 1),))


@pytest.mark.parametrize(
    "text", ["a purple circle", "two red circle", "a red circles", "four red circles", "a red circle near a blue square", ""]
)
def test_parse_caption_rejects_text_outside_the_grammar(text):
    with pytest.raises(ValueError):
        parse_caption(text)


def test_specs_reject_impossible_scenes():
    with pytest.raises(ValueError, match="different single objects"):
        SceneSpec((ToyObject("red", "circle"), ToyObject("red", "circle")), "above")
    with pytest.raises(ValueError, match="different single objects"):
        SceneSpec((ToyObject("red", "circle", 2), ToyObject("blue", "circle")), "above")
    with pytest.raises(ValueError, match="Unknown relation"):
        SceneSpec((ToyObject("red", "circle"), ToyObject("blue", "circle")), "behind")


def test_vocabulary_covers_every_caption():
    words = set(vocabulary())
    for spec in all_specs():
        assert set(caption(spec).split()) <= words


def test_renderer_is_deterministic_and_seed_dependent():
    spec = parse_caption("three blue triangles")
    a = render_scene(spec, np.random.default_rng(7))
    b = render_scene(spec, np.random.default_rng(7))
    c = render_scene(spec, np.random.default_rng(8))
    assert a.dtype == np.uint8 and a.shape == (32, 32, 3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    image, drawn = sample_scene(np.random.default_rng(3), resolution=48)
    again, drawn_again = sample_scene(np.random.default_rng(3), resolution=48)
    assert image.shape == (48, 48, 3) and drawn == drawn_again and np.array_equal(image, again)


def test_clips_start_from_the_scene_and_move_smoothly_or_jump():
    spec = parse_caption("a red circle left of a blue square")
    smooth = render_clip(spec, np.random.default_rng(5), num_frames=5)
    assert smooth.dtype == np.uint8 and smooth.shape == (5, 32, 32, 3)
    # Frame 0 is the scene render_scene places from the same generator state.
    assert np.array_equal(smooth[0], render_scene(spec, np.random.default_rng(5)))
    still = render_clip(spec, np.random.default_rng(5), num_frames=5, max_speed=0.0)
    assert all(np.array_equal(frame, still[0]) for frame in still)

    def step_change(clip):
        return np.abs(np.diff(clip.astype(float), axis=0)).mean()

    rngs = [np.random.default_rng(s) for s in range(8)]
    moving = [step_change(render_clip(spec, r, 5)) for r in rngs]
    jumping = [step_change(render_clip(spec, r, 5, jumpy=True)) for r in rngs]
    assert 0 < np.mean(moving) < np.mean(jumping) / 2
    with pytest.raises(ValueError, match="num_frames"):
        render_clip(spec, np.random.default_rng(0), num_frames=0)


def test_renderer_draws_only_the_named_colours_on_white():
    spec = parse_caption("a yellow square above a green circle")
    image = render_scene(spec, np.random.default_rng(0)).astype(int)
    assert (image == 255).all(axis=-1).mean() > 0.5  # mostly background
    for name, rgb in COLORS.items():
        exact = (image == np.array(rgb)).all(axis=-1).sum()
        assert (exact > 10) == (name in ("yellow", "green")), name


def test_relation_rule():
    assert relation_holds((5, 10), (20, 10), "left of")
    assert not relation_holds((5, 10), (20, 10), "right of")
    assert relation_holds((10, 2), (10, 20), "above") and relation_holds((10, 20), (10, 2), "below")
    # Mostly vertical offset: not "left of" although A is a little to the left.
    assert not relation_holds((8, 2), (10, 20), "left of")
    assert not relation_holds((9, 10), (10, 10), "left of", min_offset=2.0)
    with pytest.raises(ValueError, match="Unknown relation"):
        relation_holds((0, 0), (1, 1), "near")


def test_position_scenes_place_objects_in_the_named_relation():
    rng = np.random.default_rng(1)
    for relation in RELATIONS:
        spec = SceneSpec((ToyObject("red", "circle"), ToyObject("blue", "square")), relation)
        for _ in range(5):
            image = render_scene(spec, rng).astype(int)
            centres = []
            for rgb in (COLORS["red"], COLORS["blue"]):
                ys, xs = np.nonzero((image == np.array(rgb)).all(axis=-1))
                centres.append((xs.mean(), ys.mean()))
            assert relation_holds(centres[0], centres[1], relation), relation


def test_prompt_splits_are_disjoint_complete_and_keep_mirrored_scenes_together():
    train, test = prompt_splits()
    assert train and test and not set(train) & set(test)
    assert sorted(train + test) == sorted(caption(s) for s in all_specs())
    assert any(parse_caption(p).relation is None for p in test) and any(parse_caption(p).relation for p in test)
    mirror = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
    test_set = set(test)
    for prompt in test:
        spec = parse_caption(prompt)
        if spec.relation:
            mirrored = SceneSpec(spec.objects[::-1], mirror[spec.relation])
            assert caption(mirrored) in test_set
    assert prompt_splits() == (train, test)


def test_shipped_prompt_files_match_the_generator(tmp_path):
    train_path, test_path = write_prompt_files(str(tmp_path))
    for name, path in (("toy_train.txt", train_path), ("toy_test.txt", test_path)):
        with open(path, encoding="utf-8") as f, open(os.path.join(ASSETS, name), encoding="utf-8") as shipped:
            assert f.read() == shipped.read(), f"{name} is stale: regenerate with write_prompt_files"
