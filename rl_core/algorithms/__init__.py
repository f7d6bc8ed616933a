"""Objective builders: `build_objective(rl, context) -> Objective`, one module per algorithm family."""

from rl_core.algorithms.context import ObjectiveContext

__all__ = ["ObjectiveContext"]
