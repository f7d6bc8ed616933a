"""The training-curves figure (`infra.tracking.plots`): which panels it draws, the smoothing, the reward band, the title,
and `posttrain summarize --out-png`. Metrics are built here, in the shape the trainer and flows log them."""

from __future__ import annotations

import json

import numpy as np
import pytest

REWARD = [0.0, 1.0, 0.5, 1.0, 0.0, 1.0, 1.0, 0.5, 1.0, 1.0, 0.0, 1.0]  # 12 steps: an EMA span of 1
REWARD_STD = [0.5, 0.1, 0.4, 0.2, 0.3, 0.0, 0.1, 0.5, 0.2, 0.3, 0.4, 0.1]


def _records(n: int = 12, objective: str = "grpo") -> list[dict]:
    """Step 0 evaluates only; steps 1..n log what an on-policy step logs (clip fraction and KL for GRPO only)."""
    records = [{"step": 0, "val/accuracy": 0.5, "val/mean_reward": 0.5, "val/n": 8}]
    for step in range(1, n + 1):
        record = {"step": step, "rollout/reward_mean": REWARD[(step - 1) % 12],
                  "rollout/reward_std": REWARD_STD[(step - 1) % 12], "rollout/response_len_mean": 3.0 + step % 2,
                  "rollout/response_len_max": 4.0, "rollout/truncation_rate": 0.25 * (step % 2),
                  "train/loss": 1.0 / step, "train/entropy": 0.3 - 0.01 * step, "train/grad_norm": 2.0 + step % 3,
                  "perf/step_s": 0.5}
        if objective == "grpo":
            record.update({"train/clip_frac": 0.1, "train/kl": 0.01 * step, "train/approx_kl_old": 0.001})
        if step % 4 == 0:
            record.update({"val/accuracy": 0.5 + 0.01 * step, "val/n": 8})
        records.append(record)
    return records


def _axes(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def test_every_panel_with_data_is_drawn_titled_and_labelled():
    from infra.tracking.plots import curve_figure, curve_title

    fig = curve_figure(_records(), curve_title("gsm8k-grpo", "grpo"))
    assert fig._suptitle.get_text() == "gsm8k-grpo — grpo"
    axes = _axes(fig)
    assert list(axes) == ["reward (mean ± std over the batch)", "held-out accuracy", "loss", "KL divergence",
                          "entropy", "response length", "truncation", "clip fraction", "grad norm"]
    for ax in axes.values():
        assert ax.get_xlabel() == "step" and ax.get_ylabel()
    assert axes["entropy"].get_ylabel() == "nats / token"
    assert axes["response length"].get_ylabel() == "tokens / completion"
    # KL: the two KL keys the run logged, each a line; no line for OPD's reverse KL
    labels = axes["KL divergence"].get_legend_handles_labels()[1]
    assert labels == ["train/kl", "train/approx_kl_old"]
    # held-out accuracy: the sparse evaluations as measured (step 0 and every 4th step)
    (line,) = axes["held-out accuracy"].lines
    assert list(line.get_xdata()) == [0, 4, 8, 12]
    assert list(line.get_ydata()) == pytest.approx([0.5, 0.54, 0.58, 0.62])


def test_a_metric_the_run_never_logged_gets_no_panel():
    """legacy_pg logs no ratio (no clip fraction) and no KL; a DPO run has no rollout reward."""
    from infra.tracking.plots import curve_figure

    axes = _axes(curve_figure(_records(objective="legacy_pg")))
    assert "clip fraction" not in axes and "KL divergence" not in axes
    assert {"reward (mean ± std over the batch)", "entropy", "grad norm"} <= set(axes)

    dpo = [{"step": s, "train/loss": 0.7 - 0.1 * s, "train/grad_norm": 1.0, "val/loss": 0.7, "val/reward_accuracy": 0.6}
           for s in range(1, 4)]
    assert list(_axes(curve_figure(dpo))) == ["held-out accuracy", "loss", "grad norm"]
    assert len(curve_figure([{"step": 0}]).axes) == 1  # nothing logged yet: one empty axis saying so


def test_the_smoothed_line_is_the_ema_of_the_raw_series():
    from infra.tracking.plots import curve_figure, ema, smoothing_span

    # by hand: y0 = x0, y_t = (1 - a) y_(t-1) + a x_t, a = 2 / (span + 1)
    xs, span = [1.0, 3.0, 2.0, 6.0], 3
    a = 2 / (span + 1)
    expected = [1.0]
    for x in xs[1:]:
        expected.append((1 - a) * expected[-1] + a * x)
    assert expected == [1.0, 2.0, 2.0, 4.0]
    assert ema(xs, span) == pytest.approx(expected)
    assert ema(xs, 1) == xs

    records = _records(n=40)  # 40 steps: span 4
    assert smoothing_span(40) == 4 and smoothing_span(5) == 1 and smoothing_span(10_000) == 50
    ax = _axes(curve_figure(records))["grad norm"]
    smoothed, raw = ax.lines
    raw_values = [2.0 + s % 3 for s in range(1, 41)]
    assert list(raw.get_ydata()) == raw_values and raw.get_alpha() == 0.25  # the raw series, faint
    a = 2 / (4 + 1)
    by_hand = [raw_values[0]]
    for x in raw_values[1:]:
        by_hand.append((1 - a) * by_hand[-1] + a * x)
    assert list(smoothed.get_ydata()) == pytest.approx(by_hand)
    assert smoothed.get_label() == "train/grad_norm (EMA 4)"


def test_the_reward_band_is_the_smoothed_mean_plus_and_minus_the_smoothed_std():
    from infra.tracking.plots import curve_figure

    records = _records(n=24)  # span 2
    ax = _axes(curve_figure(records))["reward (mean ± std over the batch)"]
    a = 2 / (2 + 1)

    def by_hand(xs):
        out = [xs[0]]
        for x in xs[1:]:
            out.append((1 - a) * out[-1] + a * x)
        return np.array(out)

    mean = by_hand([r["rollout/reward_mean"] for r in records[1:]])
    std = by_hand([r["rollout/reward_std"] for r in records[1:]])
    assert list(ax.lines[0].get_ydata()) == pytest.approx(mean.tolist())
    (band,) = ax.collections
    vertices = band.get_paths()[0].vertices
    steps = np.arange(1, 25)
    # fill_between's outline: along the lower bound, then back along the upper bound
    lower = {x: y for x, y in vertices[1:25]}
    upper = {x: y for x, y in vertices[26:50]}
    assert sorted(lower) == sorted(upper) == steps.tolist()
    assert [lower[s] for s in steps] == pytest.approx((mean - std).tolist())
    assert [upper[s] for s in steps] == pytest.approx((mean + std).tolist())


def test_plot_curve_writes_a_png_and_summarize_redraws_it_titled_from_the_run(tmp_path, capsys):
    import yaml
    from matplotlib.image import imread

    from cli.main import main
    from infra.tracking.plots import plot_curve

    png = plot_curve(_records(), tmp_path / "a" / "curve.png", "run — grpo")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = imread(png).shape[:2]
    assert width > height > 300  # three columns of three panels

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    (run / "config_resolved.yaml").write_text(yaml.safe_dump({"job": {"name": "mine"},
                                                              "rl": {"objective": {"type": "gspo"}}}))
    assert main(["summarize", str(run), "--out-png", str(tmp_path / "fig.png")]) == 0
    assert f"figure -> {tmp_path / 'fig.png'}" in capsys.readouterr().out
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from cli.report import _run_title

    assert _run_title(run) == "mine — gspo"
    assert _run_title(tmp_path) is None  # no config_resolved.yaml: summarize titles the figure with the directory
