"""The nightly regression's checks (flows/regression.py runs them; thresholds in regression/thresholds.yaml).

Pure: no Prefect, MLflow or matplotlib. Each check gives `Check`s named `<group>.<name>`, status
"pass", "fail" or "warn":

1. `arithmetic.*` (`arithmetic_checks`): the fixed run's final held-out accuracy, its gain over step
   0, and the rollout reward of the last steps, each against a minimum (numbers from `run_summary`).
2. `trajectory.*` (`trajectory_checks`): `train/loss` and `train/grad_norm` at every step against the
   reference trajectory, |x - ref| <= atol + rtol |ref|.
3. `objectives.*` (`objective_checks`): the rl_core.primitives / annotators formulas on fixed float64
   tensors against the plain-Python closed forms of `rl_core.evaluation.closed_forms`.
4. `gsm8k_reward.*` (`gsm8k_checks`): `gsm8k_reward` on fixed completions against their known scores.
5. `timing.*` (`timing_checks`): median step time and tokens/s against a baseline: a warning, never a
   failure.

The fixed run is `RECIPE` with `RUN_OVERRIDES`; anything that changes its math changes the trajectory,
so the reference must be regenerated (`python -m flows.regression --write-reference`).
"""

from __future__ import annotations

import hashlib
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from rl_core.evaluation import closed_forms

RECIPE = "recipes/arithmetic.py"
# The fixed run. Anything that changes its math changes the trajectory: regenerate the reference.
RUN_OVERRIDES = [
    "job.name=regression-arithmetic",
    "job.seed=0",
    "rl.max_steps=20",
    "rl.validation.before_training=true",
    "rl.validation.every_steps=0",
    "rl.validation.max_prompts=200",
    "rl.save_every=0",
    "rl.resume=off",
    "job.overwrite=true",
]
TRAJECTORY_KEYS = ("train/loss", "train/grad_norm")


class RegressionFailed(RuntimeError):
    """One or more checks regressed; the message names each."""


@dataclass
class Check:
    name: str
    status: str  # "pass" | "fail" | "warn"
    value: str
    threshold: str
    detail: str = ""


def fmt(x: float | None, digits: int = 4) -> str:
    """A number as the checks and the report print it: `digits` significant digits, "n/a" for None."""
    return "n/a" if x is None else f"{x:.{digits}g}"


# ==================================================================== 1, 2, 5: the fixed run


def model_sha256(model_dir: str | os.PathLike) -> str | None:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def run_summary(records: list[dict]) -> dict[str, float | None]:
    """The numbers checks 1 and 5 read from a run's metrics.jsonl records."""
    acc = [(r["step"], r["val/accuracy"]) for r in records if r.get("val/accuracy") is not None]
    steps = [r for r in records if "train/loss" in r]
    rewards = [r["rollout/reward_mean"] for r in steps if r.get("rollout/reward_mean") is not None]
    timed = steps[1:] or steps  # step 1 pays for warm-up
    return {
        "final_val_accuracy": acc[-1][1] if acc else None,
        "initial_val_accuracy": acc[0][1] if acc and acc[0][0] == 0 else None,
        "reward_mean_last5": statistics.fmean(rewards[-5:]) if rewards else None,
        "median_step_s": statistics.median(r["perf/step_s"] for r in timed) if timed else None,
        "median_tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in timed) if timed else None,
        "steps": len(steps),
    }


def arithmetic_checks(summary: dict, limits: dict) -> list[Check]:
    out = []
    gain = (None if summary["final_val_accuracy"] is None or summary["initial_val_accuracy"] is None
            else summary["final_val_accuracy"] - summary["initial_val_accuracy"])
    for name, value, key in (("final_val_accuracy", summary["final_val_accuracy"], "final_val_accuracy_min"),
                             ("val_accuracy_gain", gain, "val_accuracy_gain_min"),
                             ("reward_mean_last5", summary["reward_mean_last5"], "reward_mean_last5_min")):
        minimum = float(limits[key])
        ok = value is not None and value >= minimum
        out.append(Check(f"arithmetic.{name}", "pass" if ok else "fail", fmt(value), f">= {minimum:g}",
                         "" if ok else f"{name}={fmt(value)} is below the minimum {minimum:g}"))
    return out


def reference_for(reference: dict, model_hash: str | None) -> dict:
    """The reference of the build whose weights hash `model_hash`: the file's own trajectory, or one of its
    `other_builds`. The warm start is built bit-differently on different CPUs (their float kernels differ), and
    each build has its own trajectory. With no match, the file's own (the check then names the differing weights)."""
    for build in reference.get("other_builds", []):
        if model_hash and build.get("model_sha256") == model_hash:
            return {**reference, **build}
    return reference


def trajectory_checks(records: list[dict], reference: dict, limits: dict, model_hash: str | None) -> list[Check]:
    reference = reference_for(reference, model_hash)
    rtol, atol = float(limits["rtol"]), float(limits["atol"])
    ref_steps = {r["step"]: r for r in reference["steps"]}
    got_steps = {r["step"]: r for r in records if "train/loss" in r}
    notes = []
    if reference.get("overrides") != RUN_OVERRIDES:
        notes.append(f"the reference was generated for overrides {reference.get('overrides')}, the run uses "
                     f"{RUN_OVERRIDES}; regenerate it (python -m flows.regression --write-reference)")
    if reference.get("model_sha256") and model_hash and reference["model_sha256"] != model_hash:
        notes.append(f"the policy's weights differ from the reference's (sha256 {model_hash[:12]} vs "
                     f"{reference['model_sha256'][:12]}): a changed tiny model or warm start changes the trajectory")
    import torch

    if reference.get("torch") and reference["torch"] != torch.__version__:
        notes.append(f"the reference was made with torch {reference['torch']}, this is {torch.__version__}")
    out = []
    for key in limits.get("keys", TRAJECTORY_KEYS):
        worst, worst_step, missing = 0.0, None, []
        for step, ref in sorted(ref_steps.items()):
            got = got_steps.get(step, {}).get(key)
            if got is None:
                missing.append(step)
                continue
            excess = abs(got - ref[key]) / (atol + rtol * abs(ref[key]))  # <= 1 is within tolerance
            if excess > worst:
                worst, worst_step = excess, step
        ok = not missing and worst <= 1.0
        detail = []
        if missing:
            detail.append(f"no {key} at steps {missing}")
        if worst > 1.0:
            r = ref_steps[worst_step][key]
            g = got_steps[worst_step][key]
            detail.append(f"step {worst_step}: {key}={g:.8g} vs reference {r:.8g} "
                          f"(|diff| {abs(g - r):.3g} > {atol:g} + {rtol:g}|ref|)")
        if not ok:
            detail += notes
        out.append(Check(f"trajectory.{key}", "pass" if ok else "fail", f"{worst:.3g} x tol",
                         f"|x-ref| <= {atol:g} + {rtol:g}|ref| at {len(ref_steps)} steps", "; ".join(detail)))
    return out


def timing_checks(summary: dict, baseline: dict) -> list[Check]:
    factor = float(baseline["warn_factor"])
    out = []
    for name, value, base, slower in (
            ("step_s", summary["median_step_s"], float(baseline["step_s"]), lambda v, b: v > b * factor),
            ("tokens_per_s", summary["median_tokens_per_s"], float(baseline["tokens_per_s"]),
             lambda v, b: v < b / factor)):
        warn = value is None or slower(value, base)
        out.append(Check(f"timing.{name}", "warn" if warn else "pass", fmt(value),
                         f"baseline {base:g} (warn beyond x{factor:g})",
                         f"median {name}={fmt(value)} vs baseline {base:g}" if warn else ""))
    return out


# ======================================================================== 3: objective formulas

LOGP = [[-0.5, -1.2, -0.3, -2.0], [-0.1, -0.9, -1.5, -0.7], [-1.0, -0.4, -0.8, -0.2]]
OLD_LOGP = [[-0.6, -1.0, -0.35, -2.5], [-0.4, -0.9, -0.5, -2.0], [-1.1, -1.5, -0.7, -0.25]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
ADV = [1.5, -0.8, 0.3]
EPS_LOW, EPS_HIGH, DUAL_C, MAX_LEN = 0.2, 0.28, 3.0, 4
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]


def objective_checks(limits: dict) -> list[Check]:
    """The primitives on fixed float64 tensors against the closed forms of `rl_core.evaluation.closed_forms`."""
    import torch

    from rl_core.annotators.advantage import group_advantages
    from rl_core.primitives.kl import kl_penalty
    from rl_core.primitives.policy_gradient import (
        LOSS_TYPES,
        clipped_policy_gradient_loss,
        legacy_policy_gradient_loss,
        reduce_policy_gradient_loss,
    )

    atol = float(limits["atol"])
    def t(x):
        return torch.tensor(x, dtype=torch.float64)

    logp, old, mask, adv = t(LOGP), t(OLD_LOGP), t(MASK), t(ADV)

    def masked_diff(got: torch.Tensor, want: list[list[float]]) -> float:
        return max(abs(float(got[i, j]) - want[i][j]) for i in range(len(MASK)) for j in range(len(MASK[0]))
                   if MASK[i][j])

    def closed_clipped(level: str, dual: float) -> list[list[float]]:
        return closed_forms.clipped_loss(LOGP, OLD_LOGP, ADV, MASK, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                         lower_bound_ratio=dual, importance_sampling_level=level)

    results: list[tuple[str, float]] = []
    token, _ = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                            lower_bound_ratio=0.0)
    results.append(("clipped_token", masked_diff(token, closed_clipped("token", 0.0))))
    dual, _ = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                           lower_bound_ratio=DUAL_C)
    closed_dual = closed_clipped("token", DUAL_C)
    results.append(("clipped_token_dual_clip", masked_diff(dual, closed_dual)))
    seq, _ = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                          importance_sampling_level="sequence")
    results.append(("gspo_sequence", masked_diff(seq, closed_clipped("sequence", 0.0))))
    legacy = legacy_policy_gradient_loss(logp, adv, mask)
    results.append(("legacy_pg", masked_diff(legacy, closed_forms.legacy_pg_loss(LOGP, ADV))))
    for loss_type in LOSS_TYPES:
        num, weight = reduce_policy_gradient_loss(dual, mask, loss_type, max_response_length=MAX_LEN)
        want = closed_forms.reduce_loss(closed_dual, MASK, loss_type, max_response_length=MAX_LEN)
        results.append((f"reduce.{loss_type}", abs(float(num / weight) - want)))
    for estimator in ("k1", "k2", "k3"):
        results.append((f"kl.{estimator}", masked_diff(kl_penalty(logp, old, estimator),
                                                       closed_forms.kl_penalty(LOGP, OLD_LOGP, estimator))))
    for label, unbiased in (("grpo", False), ("dr_grpo", True)):
        got = group_advantages(t(REWARDS), torch.tensor(GROUPS), unbiased=unbiased, eps=1e-6)
        want = closed_forms.group_advantages(REWARDS, GROUPS, unbiased=unbiased, eps=1e-6)
        results.append((f"group_advantage.{label}", max(abs(float(g) - w) for g, w in zip(got, want))))
    return [Check(f"objectives.{name}", "pass" if err <= atol else "fail", f"{err:.2e}", f"<= {atol:g}",
                  "" if err <= atol else f"max |primitive - closed form| = {err:.3g}") for name, err in results]


# ============================================================================ 4: GSM8K reward

GSM8K_CASES = [  # (completion, answer, mode, expected reward)
    ("so the answer is #### 18", "18", "strict", 1.0),
    ("#### 18.00", "Natalia sold 48 clips in April ... #### 18", "strict", 1.0),
    ("#### $1,234.", "1234", "strict", 1.0),
    ("#### 17 wait, no: #### 18", "18", "strict", 1.0),
    ("#### 18 wait, no: #### 17", "18", "strict", 0.0),
    ("#### 18 and more text after the answer", "18", "strict", 1.0),
    ("the answer is 18", "18", "strict", 0.0),
    ("the answer is 18", "18", "flexible", 1.0),
    ("it is 3, not 4", "4", "flexible", 1.0),
    ("18.01", "18", "flexible", 0.0),
    ("#### -5", "-5", "strict", 1.0),
    ("#### \u22125", "-5", "strict", 1.0),
    ("", "18", "strict", 0.0),
    ("#### ", "18", "strict", 0.0),
    ("#### 18", "no number here", "strict", 0.0),
]


def gsm8k_checks(limits: dict) -> list[Check]:
    from rl_core.rewards.gsm8k import gsm8k_reward

    wrong = [(c, a, m, want, got) for c, a, m, want in GSM8K_CASES
             if (got := gsm8k_reward(c, a, m)) != want]
    accuracy = 1 - len(wrong) / len(GSM8K_CASES)
    minimum = float(limits["agreement_min"])
    ok = accuracy >= minimum
    detail = "; ".join(f"{c!r} vs {a!r} ({m}): {got} != {want}" for c, a, m, want, got in wrong[:5])
    return [Check("gsm8k_reward.fixed_completions", "pass" if ok else "fail", f"{accuracy:.3f}",
                  f">= {minimum:g} of {len(GSM8K_CASES)} cases", detail)]
