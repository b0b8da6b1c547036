import numpy as np
import pytest
import torch

from genrl.rewards.video_io import DEFAULT_FPS, fps_or_default, read_video, write_video


def _video(frames=7, height=32, width=48):
    """uint8 (F, H, W, 3): smooth content the codec keeps, a distinct brightness per frame,
    red on the left half and blue on the right so a BGR/RGB swap shows."""
    v = np.zeros((frames, height, width, 3), np.uint8)
    v[:, :, : width // 2, 0] = 200
    v[:, :, width // 2 :, 2] = 200
    v[..., 1] = (np.arange(frames) * 30)[:, None, None]
    return v


def test_mp4_round_trip(tmp_path):
    video = _video()
    # Written from the rollout's float (C, F, H, W) layout.
    path = write_video(tmp_path / "sub" / "a.mp4", torch.from_numpy(video).permute(3, 0, 1, 2).float() / 255, fps=12)
    frames, fps = read_video(path)
    assert frames.shape == video.shape and frames.dtype == np.uint8
    assert fps == pytest.approx(12.0)
    assert np.abs(frames.astype(int) - video).mean() < 6  # lossy codec, same picture
    # Colours kept: red left, blue right.
    assert frames[:, :, :20, 0].mean() > 150 and frames[:, :, :20, 2].mean() < 50
    assert frames[:, :, -20:, 2].mean() > 150 and frames[:, :, -20:, 0].mean() < 50
    # Frame order kept: green rises 30 per frame.
    green = frames[..., 1].reshape(len(frames), -1).mean(1)
    assert np.all(np.diff(green) > 15)


def test_file_url_and_time_window(tmp_path):
    path = write_video(tmp_path / "b.mp4", _video(), fps=12)
    frames, _ = read_video(f"file://{path}")
    assert len(frames) == 7
    # Frames sit at i / 12 s: 0.1 <= t <= 0.35 keeps i = 2, 3, 4.
    window, _ = read_video(path, start_time=0.1, end_time=0.35)
    np.testing.assert_array_equal(window, frames[2:5])
    with pytest.raises(ValueError, match="between 5"):
        read_video(path, start_time=5.0, end_time=6.0)


def test_odd_sizes_are_padded_not_cropped(tmp_path):
    video = _video(frames=3, height=33, width=47)
    frames, _ = read_video(write_video(tmp_path / "odd.mp4", video, fps=8))
    assert frames.shape == (3, 34, 48, 3)
    assert np.abs(frames[:, :33, :47].astype(int) - video).mean() < 6


@pytest.mark.parametrize("content", [b"", b"not a video at all" * 50])
def test_unreadable_file_raises_naming_the_path(tmp_path, content):
    path = tmp_path / "broken.mp4"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="broken.mp4"):
        read_video(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.mp4"):
        read_video(f"file://{tmp_path}/nope.mp4")


def test_fps_fallback():
    assert fps_or_default(24.0) == 24.0
    for missing in (None, 0.0, -1.0, float("nan"), float("inf")):
        assert fps_or_default(missing) == DEFAULT_FPS == 30.0


def test_write_rejects_bad_fps(tmp_path):
    with pytest.raises(ValueError, match="fps"):
        write_video(tmp_path / "c.mp4", _video(), fps=0)
