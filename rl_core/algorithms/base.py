"""The objective config contract: one pydantic class per objective, told apart by `rl.objective.type`.

An objective class holds its own knobs (fields, with their defaults and descriptions), the rules that
involve only them (field validators), the rules that involve other sections (`check`), what changes
its math (`identity`), the step loop that runs it (`TOPOLOGY`) and how it becomes an `Objective`
(`build`). A knob an objective does not read is not a field of its class, so setting it is an
unknown-key error naming the key. The classes below are shared groups of knobs (mixins).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rl_core.primitives.policy_gradient import LOSS_TYPES, clip_settings_problem

Topology = Literal["on_policy", "teacher", "offline"]
Report = Callable[[str], None]  # err(...) / warn(...) of a preflight report


class ObjectiveConfig(BaseModel):
    """Base of every `rl.objective` class (strict, unknown keys refused, like every config section)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=True)

    TOPOLOGY: ClassVar[Topology] = "on_policy"  # on_policy: rollout → reward → annotate → train; teacher: plus a
    # frozen teacher scoring every batch; offline: fixed pairs, no rollout
    GROUP_RELATIVE: ClassVar[bool] = True  # its batches carry group-relative advantages (the gate checks groups)
    ROWS_PER_PROMPT: ClassVar[int | None] = None  # training rows per prompt; None: rollout.n completions
    TRAINS: ClassVar[Literal["policy", "reward_model"]] = "policy"  # the model the trainer ranks train: the causal-LM
    # policy (sampled by rollout engines), or a sequence-classification reward model (no engines, nothing sampled)

    @property
    def topology(self) -> Topology:
        return self.TOPOLOGY

    @property
    def group_relative(self) -> bool:
        return self.GROUP_RELATIVE

    def rows_per_prompt(self, n: int) -> int:
        """Training rows per prompt, given `rollout.n` completions per prompt."""
        return self.ROWS_PER_PROMPT or n

    @property
    def min_group_size(self) -> int:
        """The fewest completions per prompt (`rollout.n`) it trains on."""
        return 2 if self.group_relative else 1

    @property
    def reads_old_logp(self) -> bool:
        """It trains through an importance ratio against π_old (so sampling and training temperatures must agree)."""
        return True

    @property
    def trains_policy(self) -> bool:
        """The trainer ranks train the policy, which rollout engines sample (else a reward model: no engines)."""
        return self.TRAINS == "policy"

    @property
    def has_critic(self) -> bool:
        """It trains a value model beside the policy (`rl.objective.type=ppo`)."""
        return False

    @property
    def reads_reference(self) -> bool:
        """It needs the frozen reference model's log-probs (`rl.reference`, or the initial policy)."""
        return False

    def identity(self, rl: Any, context: Any) -> dict[str, Any]:
        """Every value that changes the math, as plain data (hashed into checkpoints)."""
        raise NotImplementedError

    def build(self, rl: Any, context: Any) -> Any:
        """The `Objective` of this config (`rl` is the whole rl section, `context` an `ObjectiveContext`)."""
        raise NotImplementedError

    def check(self, cfg: Any, err: Report, warn: Report, n_mini: int) -> None:
        """Rules that involve other config sections: report each problem (`err`) or risky setting (`warn`);
        `n_mini` is the number of optimizer steps one collected batch feeds."""


@dataclass(frozen=True)
class LossSettings:
    """What a loss function reads: its objective's knobs (attributes fall through to `objective`) plus the two
    values that live outside the objective's section, `rollout.temperature` and `rollout.max_tokens`."""

    objective: ObjectiveConfig
    temperature: float
    max_response_length: int

    def __getattr__(self, name: str) -> Any:
        if name == "objective":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.objective, name)


def non_default(model: BaseModel, name: str) -> bool:
    """`model.<name>` differs from its class's default."""
    return getattr(model, name) != type(model).model_fields[name].default


class GroupAdvantageKnobs(ObjectiveConfig):
    """The group-relative advantage `(r − mean) / (std + eps)` the annotate step computes."""

    unbiased_advantage: bool = Field(False, description="Dr-GRPO advantages r - mean instead of (r - mean)/(std + eps).")
    advantage_eps: float = Field(1e-6, gt=0, description="Added to the group std in the advantage denominator.")
    shared_prefix_min_tokens: int = Field(0, ge=0, description="Mask shared group prefixes at least this long whose rewards differ; 0 disables.")
    mask_truncated: bool = Field(False, description="Leave out of the loss every completion or agent episode that a limit cut (finish_reason 'length': rollout.max_tokens, rollout.max_turns, rollout.max_episode_tokens): its loss mask is 0, its reward still counts in its group's advantages (TRL's mask_truncated_completions). False: a cut completion is trained on like any other.")

    def truncation_identity(self) -> dict[str, Any]:
        """The identity's entry of `mask_truncated`: none while it is off, so the runs that predate it keep theirs."""
        return {"mask_truncated": True} if self.mask_truncated else {}


class LossTypeKnob(ObjectiveConfig):
    loss_type: str = Field("token-mean", description=f"Reduction of per-token losses over the step: one of {', '.join(LOSS_TYPES)} (docs/objectives.md).")

    @field_validator("loss_type")
    @classmethod
    def _registered_reduction(cls, value: str) -> str:
        if value not in LOSS_TYPES:
            raise ValueError(f"{value!r} is not a registered loss reduction; one of: {', '.join(LOSS_TYPES)}")
        return value


class KLKnobs(ObjectiveConfig):
    """The KL anchor to the frozen reference."""

    kl_beta: float = Field(0.0, ge=0, description="Weight of the KL anchor to the reference (rl.reference); 0 disables it.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator (docs/objectives.md).")

    @model_validator(mode="after")
    def _estimator_needs_beta(self):
        if self.kl_beta == 0 and non_default(self, "kl_estimator"):
            raise ValueError(f"kl_estimator={self.kl_estimator!r} is not read while kl_beta=0; set kl_beta > 0 or "
                             "remove it")
        return self

    @property
    def reads_reference(self) -> bool:
        return self.kl_beta > 0


class ClipKnobs(ObjectiveConfig):
    """The clipped importance-ratio surrogate against π_old."""

    importance_sampling_level: Literal["token", "sequence"] = Field("token", description="Ratio level of the clipped surrogate; 'sequence' is GSPO (docs/objectives.md).")
    epsilon_low: float = Field(0.2, gt=0, lt=1, description="Lower clip range: ratio >= 1 - epsilon_low.")
    epsilon_high: float = Field(0.2, gt=0, description="Upper clip range: ratio <= 1 + epsilon_high.")
    lower_bound_ratio: float = Field(3.0, ge=0, description="Dual-clip constant c > 1 for negative advantages; 0 disables.")
    certified_deterministic_forward: bool = Field(False, description="Check that the pi_old pass and the first training forward agree: bit for bit on CPU, within certified_forward_atol on a GPU.")
    certified_forward_atol: float = Field(1e-5, ge=0, description="certified_deterministic_forward on a GPU: the largest |difference| of a token's log-prob between the two forwards (CUDA kernels need not give bitwise-equal results); CPU checks are always bitwise.")
    rollout_correction: Literal["off", "tis", "mis"] = Field("off", description="Importance weights pi_old / pi_rollout between the trainer and the sampler, multiplying each token's loss: tis truncates them at rollout_correction_cap, mis drops tokens (or sequences) whose weight is outside [1/cap, cap] (docs/objectives.md).")
    rollout_correction_level: Literal["token", "sequence"] = Field("token", description="Rollout correction per token, or one weight per sequence (the product of its token ratios).")
    rollout_correction_cap: float = Field(2.0, gt=1, description="Rollout correction's C: tis weights are at most C; mis keeps weights within [1/C, C].")

    @model_validator(mode="after")
    def _clip_rules(self):
        if problem := clip_settings_problem(self.lower_bound_ratio, self.importance_sampling_level):
            raise ValueError(problem)
        if self.rollout_correction == "off":
            for knob in ("rollout_correction_level", "rollout_correction_cap"):
                if non_default(self, knob):
                    raise ValueError(f"{knob}={getattr(self, knob)!r} is read only with rollout_correction=tis|mis; "
                                     "set that, or remove this")
        if non_default(self, "certified_forward_atol") and not self.certified_deterministic_forward:
            raise ValueError(f"certified_forward_atol={self.certified_forward_atol:g} is read only with "
                             "certified_deterministic_forward=true; set that, or remove this")
        return self

    def correction_identity(self) -> dict[str, Any]:
        """The rollout correction's values, for the objective's identity (nothing while it is off)."""
        if self.rollout_correction == "off":
            return {}
        return {"rollout_correction": self.rollout_correction, "rollout_correction_level": self.rollout_correction_level,
                "rollout_correction_cap": self.rollout_correction_cap}

    def check(self, cfg: Any, err: Report, warn: Report, n_mini: int) -> None:
        super().check(cfg, err, warn, n_mini)
        if cfg.rl.async_steps and self.certified_deterministic_forward:
            err("rl.objective.certified_deterministic_forward=true with rl.async_steps: pi_old of a stale batch is the "
                "rollout's log-probs, not a trainer forward that could be certified; turn one of them off")
        if cfg.rl.async_steps and self.rollout_correction != "off":
            warn(f"rl.objective.rollout_correction={self.rollout_correction} with rl.async_steps: pi_old of a stale "
                 "batch is its rollout log-probs, so its weights are 1 (the clipped ratio carries the lag); the "
                 "correction acts on the batches sampled by the current weights")
        if cfg.rollout.top_p < 1:
            warn(f"rollout.top_p={cfg.rollout.top_p} < 1 under a ratio-based surrogate: sampling log-probs come from the "
                 "truncated distribution the trainer does not model")
