"""Your own objective by import path: `rl.objective.type=custom` (docs/objectives.md).

    rl.objective = {type: custom, import_path: "package.module:build_objective", kwargs: {clip: 2.0}}

`build_objective(rl, context, **kwargs) -> Objective` is imported and its signature checked when the
config is checked, so a wrong path or parameter fails before anything is placed, naming the key.
`step_loop` picks the loop that runs it; the group-advantage knobs are those of the annotate step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field

from rl_core.algorithms.base import GroupAdvantageKnobs, Report, Topology
from rl_core.user_code import IMPORT_PATH, ImportPathError, call_user_code, load_callable

OBJECTIVE_PARAMS = ("rl", "context")


class CustomObjective(GroupAdvantageKnobs):
    """An objective from your code, called as `build_objective(rl, context, **kwargs)`."""

    type: Literal["custom"] = "custom"
    import_path: str = Field(pattern=IMPORT_PATH, description="'package.module:build_objective', called as build_objective(rl, context, **kwargs) -> Objective (docs/objectives.md).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of your builder: your objective's own knobs, recorded in the objective's identity.")
    step_loop: Literal["on_policy", "offline"] = Field("on_policy", description="The loop that runs it: on_policy (rollout, reward, group advantages, train) or offline (fixed pairs). The teacher loop's annotate step is OPD's own.")
    group_advantages: bool = Field(True, description="Its batches carry group-relative advantages (the gate checks the groups).")

    @property
    def topology(self) -> Topology:
        return self.step_loop

    @property
    def group_relative(self) -> bool:
        return self.group_advantages

    @property
    def reads_reference(self) -> bool:
        return True  # its builder may declare a reference_scorer (rl.reference, or the initial policy)

    def rows_per_prompt(self, n: int) -> int:
        return 2 if self.step_loop == "offline" else n

    def builder(self):
        """The imported builder, checked to take `(rl, context, **kwargs)`; ImportPathError naming the key."""
        return load_callable(self.import_path, "rl.objective.import_path", OBJECTIVE_PARAMS, kwargs=self.kwargs)

    def check(self, cfg: Any, err: Report, warn: Report, n_mini: int) -> None:
        try:
            self.builder()
        except ImportPathError as exc:
            err(str(exc))

    def identity(self, rl: Any, context: Any) -> dict[str, Any]:
        return {"custom_objective": self.import_path, **({"kwargs": dict(self.kwargs)} if self.kwargs else {}),
                **self.truncation_identity()}

    def build(self, rl: Any, context: Any) -> Any:
        from rl_core.primitives.objective import Objective

        where = f"rl.objective.import_path={self.import_path!r}"
        objective = call_user_code(f"{where}: the builder", self.builder(), (rl, context), self.kwargs)
        if not isinstance(objective, Objective):
            raise ImportPathError(f"{where}: the builder returned a "
                                  f"{type(objective).__name__}, not an rl_core.primitives.objective.Objective")
        # the objective's own code raises through `call_user_code` (credentials removed, the import path named)
        scorer = objective.reference_scorer
        return dataclasses.replace(
            objective, fn=UserFunction(objective.fn, f"{where}: the objective's fn"),
            reference_scorer=UserFunction(scorer, f"{where}: the reference_scorer") if scorer is not None else None,
            identity={**self.identity(rl, context), **objective.identity})  # provenance: which code, which arguments


@dataclasses.dataclass(frozen=True)
class UserFunction:
    """A function of a custom objective (`fn`, `reference_scorer`), called through `call_user_code`: what it raises
    is a UserCodeError naming `what`, its message scrubbed of credentials."""

    fn: Any
    what: str

    def __call__(self, *args: Any) -> Any:
        return call_user_code(self.what, self.fn, args)

    def __getattr__(self, name: str) -> Any:
        """The function's own attributes (a loss object's parameters) read through."""
        if name.startswith("__") or name in ("fn", "what"):
            raise AttributeError(name)
        return getattr(self.fn, name)
