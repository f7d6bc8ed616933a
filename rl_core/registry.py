"""The one registry of algorithms (`job.algorithm`) and the loader of user code by import path.

Everything that depends on the algorithm reads it from here: the config schema (which names exist),
preflight (the knobs an algorithm fixes or never reads), the flows (which step loop runs it), the
cluster (which builder makes the objective) and the CLI. Adding an algorithm is one `AlgorithmSpec`.

User code: `rl.custom_objective`, `data.rewards` and `data.task` name a function or task by import path
(`package.module:function`), imported and checked (`load_callable`) when the config is checked, so a
wrong path or signature fails before anything is placed, naming the key. See docs/objectives.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

Topology = Literal["on_policy", "teacher", "offline"]

# Knobs that only one algorithm family reads: set anywhere else, they are an error naming their owner.
OPD_KNOBS = ("opd_kl_coef", "opd_discount", "opd_task_reward_weight", "distillation_mode")
DPO_KNOBS = ("dpo_beta",)
# Knobs of the policy-gradient surrogates and group advantages, which DPO (offline pairs) never reads.
POLICY_GRADIENT_KNOBS = ("grpo_surrogate", "importance_sampling_level", "epsilon_low", "epsilon_high",
                         "lower_bound_ratio", "loss_type", "unbiased_advantage", "advantage_eps", "kl_beta",
                         "kl_estimator", "shared_prefix_min_tokens", "certified_deterministic_forward",
                         "certified_forward_atol")


@dataclass(frozen=True)
class AlgorithmSpec:
    """What `job.algorithm=<name>` means.

    - `builder`: import path of `build_objective(rl, context) -> Objective`.
    - `topology`: the step loop that runs it: `on_policy` (rollout → reward → annotate → train),
      `teacher` (the same with a frozen teacher scoring every batch) or `offline` (fixed pairs, no rollout).
    - `group_relative`: its batches carry group-relative advantages (the gate checks the groups).
    - `requires`: `rl` knobs the algorithm fixes; a config that sets another value is refused, so the
      label and the math cannot disagree.
    - `owns`: `rl` knobs only this algorithm reads (an error under any other).
    - `unread`: `rl` knobs it never reads (an error when set to a non-default value).
    - `section`: the config section the builder reads.
    """

    name: str
    builder: str
    topology: Topology
    group_relative: bool
    summary: str
    requires: Mapping[str, Any] = field(default_factory=dict)
    owns: tuple[str, ...] = ()
    unread: tuple[str, ...] = ()
    section: str = "rl"

    def __post_init__(self) -> None:
        object.__setattr__(self, "requires", MappingProxyType(dict(self.requires)))


_GRPO = "rl_core.algorithms.grpo:build_objective"
ALGORITHMS: Mapping[str, AlgorithmSpec] = MappingProxyType({spec.name: spec for spec in (
    AlgorithmSpec("grpo", _GRPO, "on_policy", True, "clipped GRPO: token ratios, group-normalised advantages",
                  requires={"grpo_surrogate": "clipped", "importance_sampling_level": "token"}),
    AlgorithmSpec("dr_grpo", _GRPO, "on_policy", True,
                  "Dr-GRPO: clipped GRPO with mean-centred advantages and the fixed divisor rollout.max_tokens",
                  requires={"grpo_surrogate": "clipped", "importance_sampling_level": "token",
                            "unbiased_advantage": True, "loss_type": "seq-mean-token-sum-fixed"}),
    AlgorithmSpec("gspo", _GRPO, "on_policy", True, "GSPO: clipped GRPO with sequence-level ratios",
                  requires={"grpo_surrogate": "clipped", "importance_sampling_level": "sequence"}),
    AlgorithmSpec("legacy_pg", _GRPO, "on_policy", True,
                  "legacy policy gradient: −A·ℓ on-policy, no ratio (the CPU quickstart)",
                  requires={"grpo_surrogate": "legacy_pg"}),
    AlgorithmSpec("opd", "rl_core.algorithms.opd:build_objective", "teacher", True,
                  "on-policy distillation: the clipped surrogate against a frozen teacher's log-probs",
                  requires={"grpo_surrogate": "clipped", "kl_beta": 0.0}, owns=OPD_KNOBS),
    AlgorithmSpec("dpo", "rl_core.algorithms.dpo:build_objective", "offline", False,
                  "DPO on fixed (chosen, rejected) pairs against a frozen reference",
                  owns=DPO_KNOBS, unread=POLICY_GRADIENT_KNOBS),
)})


def algorithm(name: str) -> AlgorithmSpec:
    """The spec of `job.algorithm=name`; a ValueError lists the known names."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"job.algorithm={name!r} is not registered; known: {', '.join(ALGORITHMS)}") from None


def names(*, topology: Topology | None = None, group_relative: bool | None = None) -> tuple[str, ...]:
    """Registered names, optionally only those of one topology / with group-relative advantages."""
    return tuple(n for n, s in ALGORITHMS.items()
                 if (topology is None or s.topology == topology)
                 and (group_relative is None or s.group_relative == group_relative))


# ----------------------------------------------------------------------------- user code by path

class ImportPathError(ValueError):
    """A `module:function` path that does not import, or a function with the wrong signature."""


def load_object(path: str, key: str) -> Any:
    """Import `module:attr` for config key `key`; ImportPathError naming the key, the path and what to fix."""
    module_name, sep, attr = str(path).partition(":")
    if not sep or not module_name or not attr:
        raise ImportPathError(f"{key}={path!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix; say which
        raise ImportPathError(f"{key}={path!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
                              "install it or put its directory on PYTHONPATH (Ray workers need it too)") from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ImportPathError(f"{key}={path!r}: module {module_name!r} has no {attr!r}")
    return obj


def load_callable(path: str, key: str, params: tuple[str, ...], *, by_keyword: bool = False) -> Callable[..., Any]:
    """Import `module:function` for config key `key` and check it can be called with `params` (positionally, or
    as keywords with `by_keyword`).

    Raises ImportPathError naming the key, the path and what to fix.
    """
    attr = str(path).partition(":")[2]
    fn = load_object(path, key)
    if not callable(fn):
        raise ImportPathError(f"{key}={path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        if by_keyword:  # the other arguments (dataset columns) are known only when the data is loaded
            inspect.signature(fn).bind_partial(**dict.fromkeys(params))
        else:
            inspect.signature(fn).bind(*params)
    except TypeError as exc:
        call = ", ".join(f"{p}=..." for p in params) if by_keyword else ", ".join(params)
        raise ImportPathError(f"{key}={path!r}: {attr}{inspect.signature(fn)} cannot be called as "
                              f"{attr}({call}) ({exc})") from None
    except ValueError:  # a builtin without a signature: accept, it is checked when called
        pass
    return fn


OBJECTIVE_PARAMS = ("rl", "context")
REWARD_PARAMS = ("completions",)  # by keyword, as TRL calls reward_funcs; prompts and columns when it takes them


def objective_builder(cfg: Any) -> Callable[[Any, Any], Any]:
    """`build_objective(rl, context)` of this config: `rl.custom_objective` when set, else the registry's."""
    custom = cfg.rl.custom_objective
    if custom:
        return load_callable(custom, "rl.custom_objective", OBJECTIVE_PARAMS)
    return load_callable(algorithm(cfg.job.algorithm).builder, "job.algorithm", OBJECTIVE_PARAMS)


def build_objective(cfg: Any, context: Any) -> Any:
    """The Objective of this config (built-in or `rl.custom_objective`), checked to be one."""
    from rl_core.primitives.objective import Objective

    objective = objective_builder(cfg)(cfg.rl, context)
    if not isinstance(objective, Objective):
        key = "rl.custom_objective" if cfg.rl.custom_objective else "job.algorithm"
        raise ImportPathError(f"{key}: the builder returned a {type(objective).__name__}, not an "
                              "rl_core.primitives.objective.Objective")
    if cfg.rl.custom_objective:  # provenance: which user code made the math
        objective = dataclasses.replace(objective, identity={"custom_objective": cfg.rl.custom_objective,
                                                              **objective.identity})
    return objective


def user_code_problems(cfg: Any) -> list[str]:
    """Import and signature problems of the config's user code (`rl.custom_objective`, `data.rewards`,
    `data.task` by import path)."""
    problems = []
    checks = [("rl.custom_objective", cfg.rl.custom_objective, OBJECTIVE_PARAMS, False)]
    checks += [(f"data.rewards[{i}].path", entry.path, REWARD_PARAMS, True) for i, entry in enumerate(cfg.data.rewards)]
    for key, path, params, by_keyword in checks:
        if path:
            try:
                load_callable(path, key, params, by_keyword=by_keyword)
            except ImportPathError as exc:
                problems.append(str(exc))
    from rl_core.tasks import get_task

    try:
        get_task(cfg.data.task)
    except ValueError as exc:
        problems.append(str(exc))
    return problems
