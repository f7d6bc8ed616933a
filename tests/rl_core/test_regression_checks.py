"""The nightly regression's trajectory check picks the reference of the warm-start build it runs on."""

from __future__ import annotations

from rl_core.evaluation.regression_checks import (
    RUN_OVERRIDES,
    TRAJECTORY_KEYS,
    reference_for,
    trajectory_checks,
)

LIMITS = {"rtol": 1e-4, "atol": 1e-6}


def steps(loss0: float) -> list[dict]:
    return [{"step": s, **{k: loss0 + 0.01 * s for k in TRAJECTORY_KEYS}} for s in (1, 2, 3)]


REFERENCE = {"overrides": RUN_OVERRIDES, "model_sha256": "a" * 64, "steps": steps(1.0),
             "other_builds": [{"model_sha256": "b" * 64, "steps": steps(2.0), "machine": "x86_64"}]}


def test_each_build_is_checked_against_its_own_trajectory():
    assert reference_for(REFERENCE, "b" * 64)["steps"] == steps(2.0)
    assert reference_for(REFERENCE, "a" * 64)["steps"] == steps(1.0)
    assert all(c.status == "pass" for c in trajectory_checks(steps(1.0), REFERENCE, LIMITS, "a" * 64))
    assert all(c.status == "pass" for c in trajectory_checks(steps(2.0), REFERENCE, LIMITS, "b" * 64))
    # build b's trajectory does not pass as build a's, and a build the file does not know is named
    assert all(c.status == "fail" for c in trajectory_checks(steps(2.0), REFERENCE, LIMITS, "a" * 64))
    unknown = trajectory_checks(steps(2.0), REFERENCE, LIMITS, "c" * 64)
    assert all(c.status == "fail" and "weights differ from the reference's" in c.detail for c in unknown)
