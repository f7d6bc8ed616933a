"""The progress display's time left (rich's estimate from the step rate), on a terminal and in plain lines."""

from __future__ import annotations

import io

from rich.console import Console

from flows.progress import RunProgress


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_shows_the_time_left_from_the_step_rate(capsys):
    clock = Clock()
    with RunProgress(total=10, name="x", every=1, clock=clock) as progress:  # not a terminal: plain lines
        progress.update({"step": 0, "val/accuracy": 0.5})
        for step in (1, 2, 3):  # a step every 10 s: 7 steps left = 70 s
            clock.now += 10
            progress.update({"step": step, "train/loss": 0.5})
        assert progress.eta() == "0:01:10"
        screen = Console(record=True, width=200, file=io.StringIO())  # the live view, drawn
        screen.print(progress.progress.get_renderable())
        assert "eta 0:01:10" in screen.export_text()
        clock.now += 40  # a slow step (an evaluation): the rate is over every step since the first
        progress.update({"step": 4, "train/loss": 0.5})
        assert progress.eta() == "0:02:00"  # 3 steps in 60 s, 6 left
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "step 0/10: acc 0.500"  # no estimate before two steps are timed
    assert "eta" not in lines[1] and lines[3].endswith("| eta 0:01:10") and lines[4].endswith("| eta 0:02:00")


def test_progress_has_no_time_left_at_the_end(capsys):
    clock = Clock()
    with RunProgress(total=2, name="x", every=1, clock=clock) as progress:
        for step in (1, 2):
            clock.now += 5
            progress.update({"step": step, "train/loss": 0.1})
        assert progress.eta() is None
    assert "eta" not in capsys.readouterr().err
