"""The parameters of a training flow run (`grpo`, `opd`, `dpo`) and what each flow does with them first.

A flow run takes `recipe` (a file under `recipes/`), `overrides` (a dotlist, `key=value`) and `knobs`
(`RunKnobs`): the recipe knobs changed most often, typed and described from the config schema, so
the Prefect UI's run form shows them as fields. Each knob set is one more override (`RunKnobs.KEYS`);
a key given both as a knob and in `overrides` is refused. `knobs` is a parameter of its own, not a
part of one model with `recipe`, because Prefect merges a deployment's parameters with a run's one
level deep: `--param knobs='{"max_steps": 20}'` keeps the deployment's recipe.

`open_run` is the start of every training flow: the guard on the parameters of a run created on the
API (flows/guard.py, on the overrides the knobs make too), the checked config, and the flow run
renamed after `job.name` (a deployment's run is created with a generated name; `posttrain run` names
it when it creates it, `flows.entry`).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from rl_core.config import PosttrainConfig
from rl_core.config.explain import ConfigError
from rl_core.redact import redact_text

log = logging.getLogger("posttrain")


def _described(key: str) -> str:
    """`key: <its description in the config schema>` (the schema is the one owner of what a key means)."""
    model: Any = PosttrainConfig
    *sections, name = key.split(".")
    for section in sections:
        model = model.model_fields[section].annotation
    return f"{key}: {model.model_fields[name].description}"


class RunKnobs(BaseModel):
    """Recipe knobs as typed fields; unset (null) keeps the recipe's value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    KEYS: ClassVar[dict[str, str]] = {"max_steps": "rl.max_steps", "lr": "rl.optimizer.lr", "seed": "job.seed",
                                      "experiment": "tracking.experiment"}

    max_steps: int | None = Field(None, title="steps", description=_described("rl.max_steps"))
    lr: float | None = Field(None, title="learning rate", description=_described("rl.optimizer.lr"))
    seed: int | None = Field(None, title="seed", description=_described("job.seed"))
    experiment: str | None = Field(None, title="MLflow experiment", description=_described("tracking.experiment"))

    def overrides(self) -> list[str]:
        """The knobs set, as overrides (`rl.max_steps=20`); the config checks their values."""
        return [f"{self.KEYS[name]}={value}" for name, value in self if value is not None]


NO_KNOBS = RunKnobs()  # the flows' default: the recipe as it is


def run_overrides(overrides: list[str] | None, knobs: RunKnobs | dict | None) -> list[str]:
    """`overrides` then the knobs' overrides; a key in both is refused (which one was meant is not known)."""
    overrides = list(overrides or [])
    knobs = RunKnobs.model_validate(knobs or {})
    extra = knobs.overrides()
    given = {item.partition("=")[0].strip() for item in overrides if isinstance(item, str)}
    twice = [item.partition("=")[0] for item in extra if item.partition("=")[0] in given]
    if twice:
        raise ConfigError([f"{key}: given both in knobs and in overrides; give it once" for key in twice],
                          "parameters")
    return overrides + extra


def open_run(recipe: str, overrides: list[str] | None, knobs: RunKnobs | dict | None) -> tuple[list[str], Any]:
    """`(overrides, checked config)` of a training flow run: its logs redacted (`flows.logs`), the driver's threads
    set (`DRIVER_THREADS`), its
    parameters guarded when a caller of the API chose them, the config checked (preflight: before any placement
    or model construction), the run named `job.name`."""
    from flows.guard import check_run_parameters
    from flows.logs import redact_run_logs
    from infra.processes import DRIVER_THREADS, use_threads
    from rl_core.preflight.rules import load_checked

    redact_run_logs()  # before anything is logged: no credential reaches the run's log rows or stderr
    use_threads(DRIVER_THREADS)  # the driver holds no model; the actors' threads get the cores
    overrides = run_overrides(overrides, knobs)
    check_run_parameters(recipe, overrides)  # a deployment's parameters are untrusted input
    cfg = load_checked(recipe, overrides)
    name_flow_run(cfg.job.name)
    return overrides, cfg


def name_flow_run(name: str) -> None:
    """Rename this flow run `name` unless it has that name (a name is for people: a failure is only logged)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id or flow_run.name == name:
        return
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_name(flow_run.id, name)
    except Exception as exc:  # noqa: BLE001 - the run goes on under its generated name
        log.warning("the flow run keeps its name %r (renaming it %r failed: %s)", flow_run.name, name,
                    redact_text(str(exc))[:200])
