"""The objectives `rl.objective.type` selects, and the one way a config becomes its `Objective`.

Each objective is a pydantic class in `rl_core/algorithms/` (its knobs, rules, identity, step loop and
builder); `ObjectiveSpec` below is the union the config schema validates against, told apart by `type`.
Adding a built-in objective is its file plus its class in `OBJECTIVE_CLASSES`; your own is
`rl.objective.type=custom` with an import path (docs/objectives.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Field

from rl_core.algorithms.base import ObjectiveConfig
from rl_core.algorithms.custom import CustomObjective
from rl_core.algorithms.dpo import DPO
from rl_core.algorithms.grpo import GRPO, GSPO, DrGRPO, LegacyPG
from rl_core.algorithms.opd import OPD
from rl_core.algorithms.ppo import PPO
from rl_core.algorithms.reward_model import RewardModel

OBJECTIVE_CLASSES: tuple[type[ObjectiveConfig], ...] = (GRPO, DrGRPO, GSPO, LegacyPG, PPO, OPD, DPO, RewardModel,
                                                       CustomObjective)
OBJECTIVES: dict[str, type[ObjectiveConfig]] = {c.model_fields["type"].default: c for c in OBJECTIVE_CLASSES}
ObjectiveSpec = Annotated[Union[tuple(OBJECTIVE_CLASSES)], Field(discriminator="type")]  # noqa: UP007 - built from the tuple


def build_objective(cfg: Any, context: Any) -> Any:
    """The Objective of this config: `cfg.rl.objective.build(cfg.rl, context)`."""
    return cfg.rl.objective.build(cfg.rl, context)
