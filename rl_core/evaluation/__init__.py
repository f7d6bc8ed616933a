"""Measuring a policy: `heldout` (greedy held-out evaluation with the configured rewards), `closed_forms` (the loss
formulas of docs/objectives.md in plain Python) and `regression_checks` (the nightly regression's checks)."""
