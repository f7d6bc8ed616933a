"""Builders shared by the tests, defined once: the tiny random Llama, the rollout-layout batch, start-up timeouts.

Each builder reproduces exactly what the modules that used to define their own built (same seeds, same order
of random draws), so every numeric assertion written against those holds unchanged. torch and transformers
are imported inside the builders: `tests/conftest.py` imports this module for the timeouts.
"""

from __future__ import annotations

# How long a test waits for a service it starts to come up on a loaded 2-core machine: Prefect's ephemeral API
# server (its own default of 20 s is too short there), a Ray cluster of several nodes, an MLflow or moto server.
STARTUP_TIMEOUT_S = 180
# Eight arithmetic preference pairs (chosen: the answer; rejected: a wrong one) of the DPO and reward-model tests.
PREFERENCE_PAIRS = [
    {"prompt": "12+34=", "chosen": "46", "rejected": "47"},
    {"prompt": "5+5=", "chosen": "10", "rejected": "11"},
    {"prompt": "99+1=", "chosen": "100", "rejected": "90"},
    {"prompt": "7+0=", "chosen": "7", "rejected": "8"},
    {"prompt": "31+62=", "chosen": "93", "rejected": "83"},
    {"prompt": "0+0=", "chosen": "0", "rejected": "1"},
    {"prompt": "45+45=", "chosen": "90", "rejected": "91"},
    {"prompt": "8+13=", "chosen": "21", "rejected": "2"},
]


def tiny_model(seed: int = 0, dropout: float = 0.0, *, vocab_size: int = 20, intermediate_size: int = 64,
               max_position_embeddings: int = 64):
    """A 2-layer random Llama (hidden 32, 4 heads, 2 KV heads, untied embeddings) from `torch.manual_seed(seed)`.

    `dropout` is the attention dropout; the keyword sizes cover the variants the tests need (DPO's vocabulary
    is the tiny tokenizer's, LoRA's MLP is 48 wide, the unpadded tests use 97 tokens and 128 positions).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=intermediate_size, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                      attention_dropout=dropout, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def rollout_layout(prompt, resp, generator, vocab_size: int = 20):
    """`(input_ids, attention_mask, loss_mask)` in the rollout layout: row i's `prompt[i]` prompt tokens
    left-padded to the longest prompt, then its `resp[i]` response tokens padded after their end; token ids
    drawn from `generator` row by row in [1, vocab_size)."""
    import torch

    b, p = len(resp), max(prompt)
    t = p + max(resp)
    ids = torch.zeros(b, t, dtype=torch.long)
    att = torch.zeros(b, t, dtype=torch.long)
    loss = torch.zeros(b, t)
    for i, (n_p, n_r) in enumerate(zip(prompt, resp)):
        ids[i, p - n_p:p + n_r] = torch.randint(1, vocab_size, (n_p + n_r,), generator=generator)
        att[i, p - n_p:p + n_r] = 1
        loss[i, p:p + n_r] = 1
    return ids, att, loss


def grpo_batch(resp, prompt, seed: int = 0, policy_version: int = 0, vocab_size: int = 20):
    """A GRPO batch in the rollout layout (`rollout_layout`, generator seeded with `seed`): rewards in {0, 1, 2}
    with +1 on even rows (no all-equal pair), groups of two rows, group advantages (5.0 for a single row),
    row ids from 100, sampling log-probs 0."""
    import torch

    from rl_core.annotators.advantage import group_advantages
    from rl_core.batch.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    ids, att, loss = rollout_layout(prompt, resp, g, vocab_size)
    b, t = ids.shape
    rewards = torch.randint(0, 3, (b,), generator=g).float()
    rewards[::2] += 1  # no all-equal pair
    groups = torch.arange(b) // 2
    adv = group_advantages(rewards, groups) if b > 1 else torch.tensor([5.0])
    return Trajectory(ids, att, loss, torch.zeros(b, t), rewards, groups, torch.arange(b) + 100, policy_version,
                      advantages=adv)


def objective_problems(**objective) -> list[str]:
    """The config errors of an `rl.objective` (its own rules, or preflight's), each naming its key."""
    from rl_core.config import ConfigError, config_from_dict
    from rl_core.preflight.rules import preflight

    try:
        cfg = config_from_dict({"rl": {"objective": objective}})
    except ConfigError as exc:
        return exc.problems
    return preflight(cfg).errors


def scored_round(rows, rewards, seed: int = 0, successes=None, vocab_size: int = 20, eos: int = 2):
    """A scored dynamic-sampling `Round` (rl_core/batch/dynamic_sampling.py): prompt `rows[i]` with one completion per
    reward of `rewards[i]`, in the rollout layout (`build_completions`: random prompts of 3 to 5 tokens, responses of
    0 to 5 random tokens then EOS, ids in [3, vocab_size), pad 0, sampling log-prob -1 per token); one reward
    function, `correct`; a completion succeeds when its reward is at least 1 unless `successes` (per group) says."""
    import torch

    from rl_core.batch.dynamic_sampling import Round
    from rl_core.rewards import Scores
    from rl_core.rollout.base import build_completions

    g = torch.Generator().manual_seed(seed)
    n = len(rewards[0])

    def tokens(low: int, high: int) -> list[int]:
        return torch.randint(3, vocab_size, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()

    prompts = [tokens(3, 6) for _ in rows]
    responses = [tokens(0, 6) + [eos] for _ in range(len(rows) * n)]
    completions = build_completions(prompts, responses, [[-1.0] * len(r) for r in responses], n=n, eos_token_id=eos,
                                    pad_token_id=0, max_tokens=16, policy_version=0)
    flat = [float(r) for group in rewards for r in group]
    ok = [r >= 1 for r in flat] if successes is None else [bool(s) for group in successes for s in group]
    return Round(list(rows), completions, Scores(flat, {"rollout/rewards/correct/mean": sum(flat) / len(flat)},
                                                 {"correct": flat}), ok)
