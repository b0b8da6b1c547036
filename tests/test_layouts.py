import warnings

import numpy as np
import pytest
import torch

from genrl.rewards.layouts import infer_layout, prepare_images, prepare_images_tensor, prepare_video

N, H, W = 2, 5, 4  # H, W not in {1, 3}: only the dims under test are ambiguous


def _truth(frames: int, seed: int = 0) -> np.ndarray:
    """Distinct random pixels, uint8 (N, F, H, W, 3)."""
    return np.random.default_rng(seed).integers(0, 256, size=(N, frames, H, W, 3), dtype=np.uint8)


# Each layout built from the (N, F, H, W, C) truth by the permutation that defines it.
LAYOUTS = {
    "NFHWC": lambda v: v,
    "NFCHW": lambda v: v.transpose(0, 1, 4, 2, 3),
    "NCFHW": lambda v: v.transpose(0, 4, 1, 2, 3),
    "NHWC": lambda v: v[:, 0],
    "NCHW": lambda v: v[:, 0].transpose(0, 3, 1, 2),
}


def _variants(x: np.ndarray):
    """The same batch as numpy/torch and uint8/float in [0, 1]."""
    yield "numpy-uint8", x
    yield "numpy-float", x.astype(np.float32) / 255
    yield "torch-uint8", torch.from_numpy(np.ascontiguousarray(x))
    yield "torch-float", torch.from_numpy(np.ascontiguousarray(x)).float() / 255
    yield "torch-float64", torch.from_numpy(np.ascontiguousarray(x)).double() / 255


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("frames", [1, 2, 4])
def test_every_layout_lands_on_the_right_pixels(layout, frames):
    truth = _truth(frames)
    if layout in ("NHWC", "NCHW"):
        truth = truth[:, :1]
    x = LAYOUTS[layout](truth)
    assert infer_layout(x.shape) == layout
    for kind, v in _variants(x):
        out = prepare_images(v)
        assert isinstance(out, np.ndarray) and out.dtype == np.uint8, kind
        np.testing.assert_array_equal(out, truth, err_msg=f"{layout} {kind}")


@pytest.mark.parametrize(
    "shape, build, frames",
    [
        # (N, 3, 1, H, W): ONE RGB frame in the rollout's (C, F) layout — the seed misread it
        # as three one-channel frames.
        ((N, 3, 1, H, W), LAYOUTS["NCFHW"], 1),
        # (N, 1, 3, H, W): ONE RGB frame in (F, C) layout, not three grey frames.
        ((N, 1, 3, H, W), LAYOUTS["NFCHW"], 1),
        # (N, 3, 3, H, W): three RGB frames in the rollout's (C, F) layout.
        ((N, 3, 3, H, W), LAYOUTS["NCFHW"], 3),
        # (N, 1, H, W, 3): one channels-last RGB frame.
        ((N, 1, H, W, 3), LAYOUTS["NFHWC"], 1),
    ],
)
def test_ambiguous_shapes(shape, build, frames):
    truth = _truth(frames, seed=1)
    x = build(truth)
    assert x.shape == shape
    for kind, v in _variants(x):
        np.testing.assert_array_equal(prepare_images(v), truth, err_msg=f"{shape} {kind}")


def test_three_by_three_prefers_channels_first():
    # The same (N, 3, 3, H, W) array built as (F, C) data is NOT what comes back: (C, F) wins.
    truth = _truth(3, seed=2)
    as_fc = LAYOUTS["NFCHW"](truth)
    assert infer_layout(as_fc.shape) == "NCFHW"
    np.testing.assert_array_equal(prepare_images(as_fc), truth.transpose(0, 4, 2, 3, 1))


def test_grey_is_repeated_to_rgb():
    rng = np.random.default_rng(3)
    grey = rng.integers(0, 256, size=(N, 2, H, W, 1), dtype=np.uint8)  # (N, F, H, W, 1)
    expected = np.repeat(grey, 3, axis=-1)
    for x in (grey, grey.transpose(0, 4, 1, 2, 3), grey.transpose(0, 1, 4, 2, 3), grey[:, :1, :, :, 0][:, None]):
        out = prepare_images(x)
        ref = expected if out.shape[1] == 2 else expected[:, :1]
        np.testing.assert_array_equal(out, ref)
    # (N, 3, H, W, 1): channels-last wins -> three grey frames, not one 1-pixel-wide RGB frame.
    three = rng.integers(0, 256, size=(N, 3, H, W, 1), dtype=np.uint8)
    np.testing.assert_array_equal(prepare_images(three), np.repeat(three, 3, axis=-1))


def test_float_rounding_and_clamping():
    x = torch.tensor([0.0, 0.5, 1.0, -0.01, 1.01, 0.2]).reshape(1, 1, 2, 1, 3)  # (N, F, H, W, C)
    out = prepare_images(x).reshape(-1).tolist()
    assert out == [0, 128, 255, 0, 255, 51]  # round(255 * x), clamped


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.zeros((2, 2, 5, 4, 4), np.uint8), "Cannot read"),  # no dim of size 1 or 3
        (np.zeros((2, 5, 4), np.uint8), "Cannot read"),  # ndim 3
        (np.zeros((2, 1, 1, 5, 4, 3), np.uint8), "Cannot read"),  # ndim 6
        (np.full((1, 4, 4, 3), -0.8, np.float32), r"\[0, 1\]"),  # [-1, 1] data
        (np.full((1, 4, 4, 3), 200.0, np.float32), r"\[0, 1\]"),  # [0, 255] floats
        (np.full((1, 4, 4, 3), np.nan, np.float32), r"\[0, 1\]"),
        (np.full((1, 4, 4, 3), 300, np.int64), r"\[0, 255\]"),
        (np.zeros((1, 4, 4, 3), bool), "dtype"),
    ],
)
def test_bad_inputs_fail_with_one_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        prepare_images(bad)


def test_torch_variant_keeps_tensor_and_device():
    truth = _truth(2, seed=4)
    x = torch.from_numpy(LAYOUTS["NCFHW"](truth).copy()).float() / 255
    out = prepare_images_tensor(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.device == x.device
    assert out.is_contiguous()
    np.testing.assert_array_equal(out.numpy(), truth)


def test_read_only_numpy_and_integer_input():
    truth = _truth(1, seed=5)
    ro = LAYOUTS["NHWC"](truth).copy()
    ro.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(prepare_images(ro), truth)
    np.testing.assert_array_equal(prepare_images(ro.astype(np.int64)), truth)


def test_prepare_video_takes_one_sample():
    truth = _truth(3, seed=6)[0]  # (F, H, W, 3)
    np.testing.assert_array_equal(prepare_video(truth), truth)
    np.testing.assert_array_equal(prepare_video(torch.from_numpy(truth.transpose(3, 0, 1, 2).copy())), truth)
