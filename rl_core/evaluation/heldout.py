"""Held-out evaluation: greedy completions scored by the configured rewards.

`accuracy` is the fraction of examples the success reward (`data.success_reward`, default the first reward,
`rl_core.rewards.success_reward`) gives full marks by its own value (at least `SUCCESS_VALUE`, 1.0), whatever
the weights of the others; `mean_reward` the mean weighted reward. With the task's own 0/1 reward the two are
the same number.
"""

from __future__ import annotations

from collections.abc import Callable

from rl_core.agents.rollout import display_texts, rollout_episodes
from rl_core.rewards import RewardInputs, Scores, reward_inputs, score_batch, success_reward, successes
from rl_core.rewards.configured import reward_functions
from rl_core.rollout.base import SamplingParams
from rl_core.tasks import Example, Task, encode_prompts, get_task

Scorer = Callable[[RewardInputs], Scores]
EVALUATION_BATCH = 128  # examples per engine call (an agent task: episodes in flight at once)


def evaluate_accuracy(
    model,
    tokenizer,
    examples: list[Example],
    *,
    task: str = "arithmetic",
    data=None,
    scorer: Scorer | None = None,
    prompt_template: str = "plain",
    max_tokens: int = 8,
    batch_size: int = EVALUATION_BATCH,
    num_samples: int = 4,
    engine=None,
    max_turns: int = 1,
    max_episode_tokens: int | None = None,
    scheduling: str = "per_episode",
    environments=None,
) -> dict:
    """Greedy-decode every example (batched) and score it.

    `data` (the `data` config section) gives the task, template, system prompt, instruction and success reward in
    place of `task` / `prompt_template` / the first reward. `scorer(RewardInputs) -> Scores` defaults to the
    configured rewards run here (`data.rewards`, or the task's own); the flows pass the reward pool's.
    `engine` (a `RolloutEngine`) replaces the default HF engine over `model`, e.g. vLLM on GPU.
    An agent task (an environment in `data.task`) plays one greedy episode per example, `max_tokens` per turn, at
    most `max_turns` turns and `max_episode_tokens` tokens (`scheduling`: `rollout.episode_scheduling`), scored over
    the whole conversation; its environments
    live in `environments` (a host, `rl_core.agents.host`; None: this process).
    Returns `{"accuracy", "mean_reward", "n", "success_reward", "samples"}` (`success_reward`: the name of the
    reward that decided `accuracy`); `samples` holds the first `num_samples` `{"prompt", "completion", "answer",
    "reward", "correct"}` rows.
    """
    from rl_core.rollout.hf import HFEngine

    if not examples:
        raise ValueError("evaluate_accuracy: no held-out examples")
    examples = [
        ex if isinstance(ex, Example) else Example(str(ex["prompt"]), str(ex["answer"])) for ex in examples
    ]
    if data is not None:
        task, prompt_template = data.task, data.prompt_template
    if scorer is None:
        from rl_core.config.schema import DataConfig

        functions = reward_functions(data if data is not None else DataConfig(task=task))

        def scorer(inputs):
            return score_batch(functions, inputs)

    if engine is None:
        engine = HFEngine(model, tokenizer)
    agent = task if isinstance(task, Task) else get_task(task)
    if agent.environment is not None and max_episode_tokens is None:
        raise ValueError("evaluate_accuracy: an agent task needs max_episode_tokens (the episode's token budget)")
    greedy = SamplingParams(temperature=1.0, max_tokens=max_tokens, greedy=True, seed=0)
    rewards: list[float] = []
    correct: list[bool] = []
    decider: str | None = None
    samples: list[dict] = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        if agent.environment is not None:
            completions, _ = rollout_episodes(engine, agent, chunk, tokenizer, 1, greedy, max_turns=max_turns,
                                              max_episode_tokens=max_episode_tokens, host=environments,
                                              scheduling=scheduling)
        else:
            completions = engine.generate(encode_prompts(tokenizer, chunk, task, prompt_template, data), 1, greedy)
        texts = display_texts(completions, tokenizer)
        scores = scorer(reward_inputs(chunk, texts, completions.episodes))
        if decider is None:
            decider = success_reward(data.success_reward if data is not None else None, list(scores.values))
        for ex, text, r, ok in zip(chunk, texts, scores.rewards, successes(scores, decider), strict=True):
            rewards.append(float(r))
            correct.append(ok)
            if len(samples) < num_samples:
                samples.append({"prompt": ex.prompt, "completion": text, "answer": ex.answer, "reward": float(r),
                                "correct": ok})
    n = len(rewards)
    return {
        "accuracy": sum(correct) / n,
        "mean_reward": sum(rewards) / n,
        "n": n,
        "success_reward": decider,
        "samples": samples,
    }
