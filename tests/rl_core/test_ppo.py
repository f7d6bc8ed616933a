"""PPO with a critic (rl_core.algorithms.ppo): the annotate step's GAE over a batch against a hand computation, the
critic's value loss against its formula and under the objective contract's splits, the config's refusals."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from rl_core.agents import Environment, Episode, Reply
from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.ppo import PPO, ppo_annotate, value_objective
from rl_core.algorithms.value_model import token_values, value_model
from rl_core.batch.trajectory import Trajectory
from rl_core.config import OptimizerConfig, config_from_dict
from rl_core.model.loading import build_tiny_model
from rl_core.preflight.rules import preflight
from rl_core.primitives.objective import OBJECTIVE_WEIGHT_SUM
from rl_core.training.trainer import LLMTrainer
from tests.builders import objective_problems


def _batch(mask: list[list[int]], rewards: list[float], seed: int = 0) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    loss = torch.tensor(mask, dtype=torch.float32)
    b, t = loss.shape
    return Trajectory(input_ids=torch.randint(3, 50, (b, t), generator=g), attention_mask=torch.ones(b, t, dtype=torch.long),
                      loss_mask=loss, rollout_logp=-torch.rand(b, t, generator=g) * loss,
                      rewards=torch.tensor(rewards), group_ids=torch.arange(b), sample_ids=torch.arange(b) + 10,
                      policy_version=0)


def _by_hand(values, rewards_at, actions, gamma, lam, bootstrap):
    """One row's (advantages, returns) at its action positions, from the definitions: δ_k = r_k + γ V_{k+1} − V_k over
    the row's action tokens in order (V past the last: its own value when bootstrapped, else 0), A_k = Σ_j (γλ)^j δ_{k+j}."""
    v = [float(values[p]) for p in actions]
    r = [rewards_at.get(p, 0.0) for p in actions]
    after = v[-1] if bootstrap else 0.0
    deltas = [r[k] + gamma * (v[k + 1] if k + 1 < len(v) else after) - v[k] for k in range(len(v))]
    adv = [sum((gamma * lam) ** j * deltas[k + j] for j in range(len(v) - k)) for k in range(len(v))]
    return adv, [a + x for a, x in zip(adv, v)]


def test_ppo_annotate_is_gae_whitened_over_the_batch_with_earlier_samples_and_cut_rows_bootstrapped():
    """Row 0 ends on its own (reward 1); row 1 is an episode whose earlier sample is row 2 (the reward 2 is on row 1
    alone, row 2's return goes on past its end); row 3 was cut by a limit (it bootstraps) and has a hole; the KL
    penalty is on every action token. Advantages are whitened over the batch's action tokens (unbiased variance)."""
    mask = [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 1, 1, 0, 0, 0], [1, 1, 0, 0, 1, 1]]
    batch = _batch(mask, [1.0, 2.0, 2.0, -1.0])
    table = pd.DataFrame({"sample_id": [10, 11, 12, 13], "sample_of": [10, 11, 11, 13],
                          "truncated": [False, False, False, True], "advantage": [0.0] * 4})
    values = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    ref = batch.rollout_logp - 0.3 * torch.tensor(mask)
    ppo = PPO(gamma=0.9, lam=0.8, kl_reward_coef=0.1)
    out, table2, stats = ppo_annotate(batch, table, values, ppo, ref)

    raw, rets, where = [], [], []
    for i, row in enumerate(mask):
        actions = [t for t, m in enumerate(row) if m]
        rewards_at = {t: -0.1 * 0.3 for t in actions}  # −β (log π_rollout − log π_ref) on every action token
        if i != 2:  # the earlier sample carries no reward of its own
            rewards_at[actions[-1]] += [1.0, 2.0, 0.0, -1.0][i]
        adv, ret = _by_hand(values[i], rewards_at, actions, 0.9, 0.8, bootstrap=i in (2, 3))
        raw += adv
        rets += ret
        where += [(i, t) for t in actions]
    mean = sum(raw) / len(raw)
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / (len(raw) - 1) + 1e-8)
    for (i, t), a, ret in zip(where, raw, rets):
        assert out.advantages[i, t].item() == pytest.approx((a - mean) / std, abs=1e-5)
        assert out.returns[i, t].item() == pytest.approx(ret, abs=1e-5)
        assert out.old_values[i, t].item() == pytest.approx(float(values[i, t]))
    off = torch.tensor(mask) == 0
    assert not out.advantages[off].any() and not out.returns[off].any() and not out.old_values[off].any()
    assert stats["rollout/kl_reward"] == pytest.approx(0.3)
    row0 = [(a - mean) / std for (i, _), a in zip(where, raw) if i == 0]
    assert table2["advantage"][0] == pytest.approx(sum(row0) / 3, abs=1e-5)
    assert out.ref_logp is not None  # the trainer's KL anchor reuses it (kl_beta > 0) instead of scoring again


def test_without_bootstrap_a_cut_row_ends_where_it_was_cut():
    mask = [[1, 1, 1, 0], [0, 1, 1, 1]]
    batch = _batch(mask, [0.0, 1.0])
    table = pd.DataFrame({"sample_id": [10, 11], "sample_of": [10, 11], "truncated": [True, False],
                          "advantage": [0.0, 0.0]})
    values = torch.full((2, 4), 0.5)
    cut = ppo_annotate(batch, table, values, PPO(), None)[0]
    ended = ppo_annotate(batch, table, values, PPO(bootstrap_truncated=False), None)[0]
    assert cut.returns[0, 2].item() == pytest.approx(0.5)  # γ = λ = 1: the value past the cut is its last token's
    assert ended.returns[0, 2].item() == pytest.approx(0.0)
    assert ended.returns[1].tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0])


def _critic_batch(tmp_path):
    build_tiny_model(tmp_path / "policy", seed=0)
    critic = value_model(tmp_path / "policy", head_std=0.3)
    mask = [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]
    batch = _batch(mask, [1.0, 0.0, 1.0, 0.0], seed=3)
    g = torch.Generator().manual_seed(4)
    m = batch.loss_mask
    batch = batch.replace(old_values=torch.randn(4, 6, generator=g) * m, returns=torch.randn(4, 6, generator=g) * m)
    return critic, batch


def test_the_value_loss_is_the_clipped_formula_and_any_split_gives_the_unsplit_gradient(tmp_path):
    critic, batch = _critic_batch(tmp_path)
    objective = value_objective(PPO(value_clip=0.2, value_loss_coef=0.5), ObjectiveContext(max_response_length=6))
    loss, metrics = objective.fn(critic, batch)
    with torch.no_grad():
        v = token_values(critic, batch.input_ids, batch.attention_mask)
    terms = []
    for i in range(4):
        for t in range(6):
            if batch.loss_mask[i, t]:
                old, ret, new = float(batch.old_values[i, t]), float(batch.returns[i, t]), float(v[i, t])
                clipped = old + max(-0.2, min(0.2, new - old))
                terms.append(0.5 * 0.5 * max((new - ret) ** 2, (clipped - ret) ** 2))
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert metrics[OBJECTIVE_WEIGHT_SUM].item() == len(terms)

    def gradient(chunks):
        critic.zero_grad()
        total = 0.0
        for chunk in chunks:
            loss, metrics = objective.fn(critic, chunk)
            (loss * metrics[OBJECTIVE_WEIGHT_SUM]).backward()
            total += float(metrics[OBJECTIVE_WEIGHT_SUM])
        return [p.grad.clone() / total for p in critic.parameters() if p.grad is not None]

    whole = gradient([batch])
    for split in (batch.split(1), batch.split(3), batch.token_budget_split(8)):
        for a, b in zip(whole, gradient(split)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)  # float rounding of sums in another order


def test_the_critic_takes_several_updates_on_one_batch_and_fits_its_returns(tmp_path):
    critic, batch = _critic_batch(tmp_path)
    objective = value_objective(PPO(value_clip=10.0), ObjectiveContext(max_response_length=6))
    trainer = LLMTrainer(critic, objective, OptimizerConfig(lr=1e-2), metric_split="critic")
    first = trainer.train_step(batch, micro_batch_size=2, mini_batch_size=2)
    for _ in range(30):
        last = trainer.train_step(batch, micro_batch_size=2, mini_batch_size=2)
    assert trainer.step == 62  # two optimizer steps a batch: the value loss needs no π_old
    assert last["critic/loss"] < 0.2 * first["critic/loss"]
    trainer.skip_batch()
    assert trainer.policy_version == 32 and trainer.step == 62


def test_ppo_config_rules():
    ok = config_from_dict({"rl": {"objective": {"type": "ppo"}}, "rollout": {"n": 1}})
    assert preflight(ok).ok, preflight(ok).render()
    assert not ok.rl.objective.group_relative and ok.rl.objective.has_critic and not ok.rl.objective.reads_reference
    assert config_from_dict({"rl": {"objective": {"type": "ppo", "kl_reward_coef": 0.01}}}).rl.objective.reads_reference
    for knob, value in (("unbiased_advantage", True), ("shared_prefix_min_tokens", 4), ("beta", 0.1)):
        assert any(e.startswith(f"rl.objective.{knob}=") for e in objective_problems(type="ppo", **{knob: value})), knob
    assert any("rl.objective.gamma" in e for e in objective_problems(type="ppo", gamma=1.5))
    lora = config_from_dict({"rl": {"objective": {"type": "ppo"}}, "rollout": {"n": 1}, "model": {"lora": {"r": 8}}})
    assert preflight(lora).ok, preflight(lora).render()  # the critic takes the policy's adapter settings
    for section, change, key in (("rollout", {"filter_groups": True, "n": 4}, "rollout.filter_groups=true"),):
        data = {"rl": {"objective": {"type": "ppo"}}, "rollout": {"n": 1}}
        data[section] = {**data.get(section, {}), **change}
        errors = preflight(config_from_dict(data)).errors
        assert any(key in e and "ppo" in e for e in errors), (key, errors)


def test_the_policys_step_on_per_token_advantages_is_the_same_under_any_split():
    """PPO's policy half (the clipped surrogate on GAE's per-token advantages, the KL anchor in the loss): one step
    on the whole batch, on micro-batches of one row and under a token budget give the same weights."""
    from tests.builders import tiny_model
    from tests.rl_core.test_objective_contract import make_batch

    batch = make_batch()
    batch = batch.replace(advantages=torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(2))
                          * batch.loss_mask)
    cfg = config_from_dict({"rl": {"objective": {"type": "ppo", "kl_beta": 0.05}}, "rollout": {"n": 1}})
    context = ObjectiveContext(max_response_length=24)
    reference = tiny_model(seed=1)
    weights = []
    for micro, budget in ((None, None), (1, None), (None, 24)):
        model = tiny_model()
        trainer = LLMTrainer(model, cfg.rl.objective.build(cfg.rl, context), OptimizerConfig(lr=1e-2, max_grad_norm=1e9),
                             auxiliary_models={"reference": reference})
        metrics = trainer.train_step(batch, micro, micro_batch_max_tokens=budget)
        assert metrics["train/kl"] >= 0
        weights.append([p.detach().clone() for p in model.parameters()])
    for other in weights[1:]:
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(weights[0], other))
    assert any(not torch.equal(a, p.detach()) for a, p in zip(weights[0], tiny_model().parameters()))


class Graded(Environment):
    """Rewards its first turn on its own (0.5), then ends the episode after the second."""

    def reset(self):
        self.answered = 0
        return [{"role": "user", "content": self.example.prompt}]

    def respond(self, turn):
        self.answered += 1
        return Reply([{"role": "user", "content": "and again"}], reward=0.5) if self.answered == 1 else Reply(done=True)

    def reward(self):
        return 1.0


def test_a_turns_own_reward_reaches_gae_on_that_turns_last_token_and_survives_the_layout(tmp_path):
    """`Reply(reward=...)` sits on the answered turn's last sampled token through the episode, its completions
    (saved, cut to rows, joined) and the annotated batch; with γ = λ = 1 and zero values every token of turn 1
    returns 0.5 + 1 and every token of turn 2 returns 1."""
    from rl_core.agents.rollout import episodes_to_completions
    from rl_core.annotate import annotate
    from rl_core.config import RLConfig
    from rl_core.rollout.completions import Completions, concat_completions
    from rl_core.tasks import Example
    from tests.rl_core.test_agents import sample, tokenizer

    tok = tokenizer()
    episode = Episode(Graded(Example("2+2", "4")), tok, max_turns=3, max_tokens=200)
    sample(episode, "first")
    sample(episode, "second")
    assert episode.done and sum(episode.rewards) == 0.5
    sampled = [i for i, s in enumerate(episode.sampled) if s]
    turn_one_end = next(i for i in sampled if i + 1 not in sampled)
    assert episode.rewards[turn_one_end] == 0.5
    done = episodes_to_completions([episode], n=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                   policy_version=0)
    assert float(done.turn_rewards.sum()) == 0.5 and done.rows([0, 0]).turn_rewards.sum() == 1.0
    done.save(tmp_path / "rollout.safetensors")  # the rollout cache
    assert torch.equal(Completions.load(tmp_path / "rollout.safetensors").turn_rewards, done.turn_rewards)
    joined = concat_completions([done, done])
    assert joined.turn_rewards.shape == joined.input_ids.shape and float(joined.turn_rewards.sum()) == 1.0

    rl = RLConfig.model_validate({"objective": {"type": "ppo"}})
    annotated = annotate(done, [1.0], [0], rl=rl, first_sample_id=0)
    batch = annotated.batch
    values = torch.zeros(batch.input_ids.shape)
    out, _, _ = ppo_annotate(batch, annotated.table, values, rl.objective)
    mask = batch.loss_mask[0] > 0
    turn_one = [t for t in range(batch.seq_len) if mask[t] and t <= int(batch.turn_rewards[0].nonzero()[0])]
    turn_two = [t for t in range(batch.seq_len) if mask[t] and t not in turn_one]
    assert turn_one and turn_two
    assert all(out.returns[0, t].item() == pytest.approx(1.5) for t in turn_one)
    assert all(out.returns[0, t].item() == pytest.approx(1.0) for t in turn_two)


def test_a_flow_syntax_section_reads_exponents_as_numbers():
    """YAML reads 1e-4 (no dot) as text; in a whole-section override it is the number it is on a command line,
    as in a key=value override, and a quoted string stays a string."""
    from rl_core.config import load_config

    recipe = "recipes/ppo_arithmetic.py"
    cfg = load_config(recipe, ["rl.objective={type: ppo, critic_lr: 1e-4, value_clip: 2E-1, gamma: .99}"])
    assert (cfg.rl.objective.critic_lr, cfg.rl.objective.value_clip, cfg.rl.objective.gamma) == (1e-4, 0.2, 0.99)
    assert load_config(recipe, ["rl.objective.critic_lr=3e-5"]).rl.objective.critic_lr == 3e-5
    assert load_config(recipe, ["rl.objective={type: ppo, critic_model: '1e5'}"]).rl.objective.critic_model == "1e5"
