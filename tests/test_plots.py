import json

import cv2
import numpy as np
import pytest

from genrl.evaluation.plots import plot_training_curves, read_metrics, reward_names, training_curves_figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_jsonl(path, records, tail=""):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(tail)


def _assert_png(path, min_width=200):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    image = cv2.imread(str(path))
    assert image is not None and image.shape[1] >= min_width and image.ndim == 3
    return image


def test_plot_writes_a_png_with_curves(tmp_path):
    records = []
    for step in range(1, 21):
        r = {"step": step, "epoch": step // 5, "reward/jpeg_compressibility_mean": 0.1 * step,
             "reward/jpeg_compressibility_std": 0.05, "train/approx_kl": 1e-3 * step, "train/clipfrac": 0.01 * step,
             "train/kl": 2e-3 * step, "train/loss": -0.1}
        if step % 5 == 0:
            r["eval/jpeg_compressibility_mean"] = 0.1 * step + 0.2
        records.append(r)
    metrics = tmp_path / "logs" / "metrics.jsonl"
    metrics.parent.mkdir()
    _write_jsonl(metrics, records)

    out = plot_training_curves(str(metrics), str(tmp_path / "plots" / "curves.png"))
    assert out == str(tmp_path / "plots" / "curves.png")
    image = _assert_png(out)
    # Coloured curves were drawn: the image is not just white/grey axes.
    saturation = cv2.cvtColor(image, cv2.COLOR_BGR2HSV)[..., 1]
    assert (saturation > 100).sum() > 500


def test_plot_is_robust_to_missing_keys_and_a_truncated_line(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # no KL, no clipfrac, eval only; a line without "step"; a NaN; a crash mid-line.
    _write_jsonl(
        metrics,
        [{"step": 1, "eval/hps_mean": 0.3}, {"eval/hps_mean": 0.4}, {"step": 3, "eval/hps_mean": float("nan")}, {}],
        tail='{"step": 4, "eval/hps_me',
    )
    series = read_metrics(str(metrics))
    assert series == {"eval/hps_mean": [(1, 0.3), (1, 0.4)]}  # line index 1 stands in for the step
    _assert_png(plot_training_curves(str(metrics), str(tmp_path / "c.png")))


def test_plot_of_an_empty_log_still_writes_a_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    _assert_png(plot_training_curves(str(metrics), str(tmp_path / "c.png")))


def test_plot_names_a_missing_metrics_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_training_curves(str(tmp_path / "logs" / "metrics.jsonl"), str(tmp_path / "c.png"))
    assert not (tmp_path / "c.png").exists()


def test_reward_band_follows_the_logged_std(tmp_path):
    """A wide std draws a visibly larger filled band than a tiny one (catches std ignored)."""
    def coloured_pixels(std):
        metrics = tmp_path / f"m{std}.jsonl"
        # eval points at -2 and 2 pin the y range, so the band's height is comparable
        _write_jsonl(metrics, [{"step": s, "reward/r_mean": 0.0, "reward/r_std": std} for s in range(10)]
                     + [{"step": 0, "eval/r_mean": -2.0}, {"step": 9, "eval/r_mean": 2.0}])
        image = cv2.imread(plot_training_curves(str(metrics), str(tmp_path / f"c{std}.png")))
        return int((np.abs(image.astype(int) - 255).sum(-1) > 20).sum())

    assert coloured_pixels(1.0) > coloured_pixels(1e-6) + 1000


def _default_run_like_series() -> dict:
    """One trained reward, its evaluation with a weight-0 breakdown and the total it repeats."""
    series = {"reward/toy_geneval_mean": [(s, 0.3 + 0.01 * s) for s in range(0, 21, 2)],
              "reward/toy_geneval_std": [(s, 0.1) for s in range(0, 21, 2)]}
    for name, value in (("toy_geneval", 0.4), ("total", 0.4), ("toy_geneval_color", 0.8), ("toy_geneval_position", 0.1)):
        series[f"eval/{name}_mean"] = [(0, value), (20, value + 0.1)]
    return series


def test_the_evaluation_total_is_not_drawn_twice():
    series = _default_run_like_series()
    assert reward_names(series) == ["toy_geneval", "toy_geneval_color", "toy_geneval_position"]
    series["eval/total_mean"] = [(0, 0.9), (20, 1.0)]  # two weighted rewards: the total is news
    assert "total" in reward_names(series)


def test_legends_do_not_cover_the_curves():
    fig = training_curves_figure(_default_run_like_series())
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
            assert box.y1 <= area.y0, f"the legend of {ax.get_title()!r} overlaps its axes"
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "eval total" not in labels and "eval toy_geneval" in labels
