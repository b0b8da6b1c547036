import pytest
import torch

from genrl.rewards.frame_selection import select_frame_indices, uniform_frame_count

FPS_VALUES = [4.0, 8.0, 16.0, 24.0, 30.0]


def _upstream_multi_pts(total, fps, per_point=6, points=4, target_fps=8):
    """VideoAlign's original multi_pts selection, written out as a reference (valid only
    where it was correct: grid longer than per_point)."""
    grid_size = int(total * target_fps // fps)
    grid = torch.linspace(0, total - 1, grid_size).round().long().tolist()
    start, end = per_point // 2, grid_size - per_point // 2 - 1
    anchors = torch.linspace(start, end, points).round().long().tolist()
    return [i for a in anchors for i in grid[a - per_point // 2 : a + per_point // 2]]


@pytest.mark.parametrize("fps", FPS_VALUES)
def test_uniform_in_range_non_decreasing_even(fps):
    for total in range(1, 201):
        idx = select_frame_indices(total, fps, "uniform")
        assert all(0 <= i < total for i in idx), (total, fps, idx)
        assert all(a <= b for a, b in zip(idx, idx[1:])), (total, fps, idx)
        assert len(idx) % 2 == 0 and len(idx) == uniform_frame_count(total, fps)
        assert idx[0] == 0 and idx[-1] == total - 1  # spans the whole video
        if total >= 4:
            # Between the minimum of 4 and the (even) frames there are, never more than 768.
            assert 4 <= len(idx) <= total
        else:
            assert len(idx) == 2  # a 1-3 frame video: two frames (repeated when total == 1)
        if total > 1:
            assert len(set(idx)) == len(idx)  # no frame taken twice when enough exist


def test_uniform_counts_by_hand():
    # 100 frames at 25 fps, sampled at 2 fps: 4 s -> 8 frames; 99 / 7 = 14.14 apart.
    assert select_frame_indices(100, 25.0, "uniform") == [0, 14, 28, 42, 57, 71, 85, 99]
    # 5 frames at 16 fps: 0.6 requested -> raised to the minimum 4.
    assert select_frame_indices(5, 16.0) == [0, 1, 3, 4]
    # A one-frame video still gives the two frames a temporal patch needs.
    assert select_frame_indices(1, 16.0) == [0, 0]
    assert select_frame_indices(3, 16.0) == [0, 2]
    # Long video: capped at 768.
    assert uniform_frame_count(5000, 1.0) == 768
    # 81 frames at 16 fps, 2 fps -> 10.125 -> 10 frames.
    assert uniform_frame_count(81, 16.0) == 10
    # An explicit count, rounded to even and capped at the frames there are.
    assert uniform_frame_count(81, 16.0, num_frames=17) == 16
    assert uniform_frame_count(7, 16.0, num_frames=40) == 6
    assert uniform_frame_count(200, 1.0, max_frames=7) == 6


@pytest.mark.parametrize("fps", FPS_VALUES)
def test_multi_pts_in_range_and_windows_ordered(fps):
    for total in range(1, 201):
        idx = select_frame_indices(total, fps, "multi_pts")
        assert len(idx) == 24, (total, fps)  # 4 anchors x 6 frames, never a lost window
        assert all(0 <= i < total for i in idx), (total, fps, idx)
        windows = [idx[k : k + 6] for k in range(0, 24, 6)]
        for w in windows:
            assert all(a <= b for a, b in zip(w, w[1:])), (total, fps, idx)
        starts = [w[0] for w in windows]
        assert all(a <= b for a, b in zip(starts, starts[1:])), (total, fps, idx)


def test_multi_pts_grid_of_exactly_six():
    # 12 frames at 16 fps re-gridded at 8 fps: 6 grid points. Upstream's last anchor was 2 < 3:
    # descending anchors and a slice starting at -1 that came back empty.
    grid = torch.linspace(0, 11, 6).round().long().tolist()
    upstream = _upstream_multi_pts(12, 16.0)
    assert len(upstream) < 24  # the seed's bug, reproduced by the reference
    assert select_frame_indices(12, 16.0, "multi_pts") == grid * 4


def test_multi_pts_matches_upstream_where_upstream_was_right():
    for total in range(8, 201):
        for fps in FPS_VALUES:
            if int(total * 8 // fps) > 6:
                assert select_frame_indices(total, fps, "multi_pts") == _upstream_multi_pts(total, fps), (total, fps)


def test_multi_pts_long_video_is_strictly_increasing():
    idx = select_frame_indices(81, 16.0, "multi_pts")  # grid of 40: anchors 3, 14, 25, 36
    assert all(a < b for a, b in zip(idx, idx[1:]))


def test_short_video_repeats_frames_in_order():
    assert select_frame_indices(3, 16.0, "multi_pts")[:6] == [0, 0, 1, 1, 2, 2]
    assert select_frame_indices(1, 16.0, "multi_pts") == [0] * 24


@pytest.mark.parametrize(
    "args, match",
    [((0, 16.0), "at least one frame"), ((10, 0.0), "fps"), ((10, float("nan")), "fps"), ((10, 16.0, "random"), "mode")],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        select_frame_indices(*args)
