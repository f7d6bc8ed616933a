"""The driver-side rollout role: tokenizer, the task's datasets and the prompt sampler (no model weights).

Built once per flow run from the config; the flow hands its parts to the phase tasks. The rollout
engines themselves are Ray actors (`infra.cluster.cluster.Cluster.engines`): the driver only encodes and
shards prompts, gathers completions and scores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_core.config import PosttrainConfig
from rl_core.config.explain import ConfigError
from rl_core.data import CurriculumSampler, PromptSampler, build_sampler
from rl_core.model.loading import load_tokenizer
from rl_core.rollout import sampling_params_from_config
from rl_core.tasks import Example, Task, encode_for, get_task, load_split

ROUND_STRIDE = 2**53  # above sampling_seed * 1_000_003 + step for every seed < 2^32 and step < 2^47


@dataclass
class RolloutRole:
    cfg: PosttrainConfig
    tokenizer: Any
    task: Task
    train: list[Example]
    val: list[Example]
    sampler: PromptSampler | CurriculumSampler  # data.sampler
    prompt_limit: int  # the longest encoded prompt of both splits, in tokens
    episode_tokens: int | None = None  # an agent task's episode budget: rollout.max_episode_tokens or the context

    @classmethod
    def build(cls, cfg: PosttrainConfig) -> RolloutRole:
        """Tokenizer, data and sampler. Bad data fails here with a ConfigError naming the key, before the flow
        touches the run directory."""
        tokenizer = load_tokenizer(cfg.model)
        try:
            task = get_task(cfg.data.task)
        except ValueError as exc:
            raise ConfigError([str(exc)]) from None
        train = _split(cfg, task, "data.train", cfg.data.train)
        val = _split(cfg, task, "data.val", cfg.data.val)
        if cfg.rl.validation.max_prompts is not None:
            val = val[: cfg.rl.validation.max_prompts]
        sampler = build_sampler(cfg.data, len(train), cfg.rollout.prompts_per_step, seed=cfg.job.seed)
        try:
            lengths = encode_for(cfg.data, tokenizer, train + val)
        except ValueError as exc:  # e.g. a chat template the messages do not fit
            raise ConfigError([f"data: {exc}"]) from None
        limit = max(len(ids) for ids in lengths)
        context = model_context(cfg)
        if context is not None and limit + cfg.rollout.max_tokens > context:
            longest = max(range(len(lengths)), key=lambda i: len(lengths[i]))
            split, row = ("data.train", longest) if longest < len(train) else ("data.val", longest - len(train))
            source = (train + val)[longest].row
            where = f"row {row + 1}" + (f" ({source})" if source else "")
            raise ConfigError([(f"{split} {where}: its prompt is {limit} tokens, and with rollout.max_tokens="
                               f"{cfg.rollout.max_tokens} a completion would need {limit + cfg.rollout.max_tokens} "
                               f"positions, more than the model's {context}; shorten or drop long prompts, or lower "
                               "rollout.max_tokens")])
        return cls(cfg, tokenizer, task, train, val, sampler, limit, _episode_tokens(cfg, task, context))

    @property
    def max_model_len(self) -> int:
        """What an engine must hold: the longest prompt plus `rollout.max_tokens`; an agent task's whole episode."""
        if self.episode_tokens is not None:
            return self.episode_tokens
        return self.prompt_limit + self.cfg.rollout.max_tokens

    @property
    def episode_options(self) -> dict[str, Any]:
        """An agent task's episode limits and scheduling, as the rollout and the evaluation take them ({} for a prompt
        task)."""
        if self.episode_tokens is None:
            return {}
        return {"max_turns": self.cfg.rollout.max_turns, "max_episode_tokens": self.episode_tokens,
                "scheduling": self.cfg.rollout.episode_scheduling}

    def prompts(self, rows: list[int]) -> list[list[int]]:
        return encode_for(self.cfg.data, self.tokenizer, [self.train[i] for i in rows])

    def sampling(self, step: int, round: int = 0):
        """Sampling parameters of one step: a per-step seed derived from the run's sampling seed; an extra round of
        dynamic sampling (`round` >= 1) adds `round * ROUND_STRIDE`, above every step's own seed, so no two rounds
        of any steps share one."""
        seed = self.cfg.sampling_seed * 1_000_003 + step + round * ROUND_STRIDE
        return sampling_params_from_config(self.cfg.rollout, seed=seed)


def _split(cfg: PosttrainConfig, task: Task, key: str, source: str) -> list[Example]:
    """The examples of one data split, or a ConfigError naming the key (bad file or row, no examples): a DataError
    listing every bad row, as the run's preflight data check does."""
    from rl_core.preflight.rows import DataError

    try:
        examples = load_split(task, source, cfg.data)
    except (ValueError, FileNotFoundError) as exc:
        raise DataError.of_split(key, source, exc) from None
    if not examples:
        raise ConfigError([f"{key}={source!r}: no examples (the split is empty); point {key} at a split with data"])
    return examples


def _episode_tokens(cfg: PosttrainConfig, task: Task, context: int | None) -> int | None:
    """An agent task's episode budget (None for a prompt task): `rollout.max_episode_tokens`, else the context."""
    if task.environment is None:
        return None
    budget = cfg.rollout.max_episode_tokens
    if budget is None and context is None:
        raise ConfigError([("rollout.max_episode_tokens: the model's config gives no context length to default to; "
                           "set the episode's token budget")])
    if budget is not None and context is not None and budget > context:
        raise ConfigError([(f"rollout.max_episode_tokens={budget}: more than the model's context of {context} "
                           "positions; lower it")])
    return budget if budget is not None else context


def model_context(cfg: PosttrainConfig) -> int | None:
    """The policy's context length (`max_position_embeddings` of its config), or None when it does not say."""
    from transformers import AutoConfig

    from rl_core.model.loading import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.name_or_path),
                                        trust_remote_code=bool(cfg.model.trust_remote_code))
    value = getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None
