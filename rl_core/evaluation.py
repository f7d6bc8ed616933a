"""Held-out evaluation: greedy completions scored by the task's reward (exact match).

`accuracy` is the fraction of examples whose reward is 1.0; `mean_reward` the mean reward (the
same number for 0/1 rewards, kept apart for graded rewards).
"""

from __future__ import annotations

from rl_core.data import Example, encode_prompts
from rl_core.rewards import get_reward_fn
from rl_core.rollout.base import SamplingParams


def evaluate_accuracy(
    model,
    tokenizer,
    examples: list[Example],
    *,
    task: str = "arithmetic",
    reward_fn=None,
    reward_mode: str = "strict",
    prompt_template: str = "plain",
    max_tokens: int = 8,
    batch_size: int = 128,
    num_samples: int = 4,
    engine=None,
) -> dict:
    """Greedy-decode every example (batched) and score it.

    `reward_fn(completion, answer)` defaults to the task's reward (`get_reward_fn(task, reward_mode)`).
    `engine` (a `RolloutEngine`) replaces the default HF engine over `model`, e.g. vLLM on GPU.
    Returns `{"accuracy", "mean_reward", "n", "samples"}`; `samples` holds the first `num_samples`
    `{"prompt", "completion", "answer", "reward"}` rows.
    """
    from rl_core.rollout.hf import HFEngine

    if not examples:
        raise ValueError("evaluate_accuracy: no held-out examples")
    examples = [
        ex if isinstance(ex, Example) else Example(str(ex["prompt"]), str(ex["answer"])) for ex in examples
    ]
    reward_fn = reward_fn or get_reward_fn(task, reward_mode)
    if engine is None:
        engine = HFEngine(model, tokenizer)
    greedy = SamplingParams(temperature=1.0, max_tokens=max_tokens, greedy=True, seed=0)
    rewards: list[float] = []
    samples: list[dict] = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        completions = engine.generate(encode_prompts(tokenizer, chunk, task, prompt_template), 1, greedy)
        texts = completions.decode_responses(tokenizer)
        for ex, text in zip(chunk, texts):
            r = float(reward_fn(text, ex.answer))
            rewards.append(r)
            if len(samples) < num_samples:
                samples.append({"prompt": ex.prompt, "completion": text, "answer": ex.answer, "reward": r})
    n = len(rewards)
    return {
        "accuracy": sum(1.0 for r in rewards if r == 1.0) / n,
        "mean_reward": sum(rewards) / n,
        "n": n,
        "samples": samples,
    }
