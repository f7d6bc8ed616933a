"""GAE, whitening and the clipped value loss (rl_core.primitives.gae): a row worked by hand (a hole between two turns,
padding after), verl's compute_gae_advantage_return and masked_whiten written out element by element as the
reference on random batches with holes, and the value loss by hand."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rl_core.primitives.gae import clipped_value_loss, gae, masked_whiten, token_rewards

# one row: turn 1 is t0-t1, t2 the environment's reply (a hole), turn 2 is t3, t4 padding; reward 1 on t3
MASK = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0]])
VALUES = torch.tensor([[0.5, 0.2, 9.0, 0.4, 7.0]])  # 9.0 and 7.0 sit where no action is: they must not count


def test_a_row_with_a_hole_worked_by_hand():
    rewards = token_rewards(torch.tensor([1.0]), MASK)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]]
    advantages, returns = gae(rewards, VALUES, MASK, gamma=0.9, lam=0.8)
    # t3: δ = 1 + 0.9·0 − 0.4 = 0.6;  t2 (hole) carries 0.6;  t1: δ = 0.9·0.4 − 0.2 = 0.16, A = 0.16 + 0.72·0.6;
    # t0: δ = 0.9·0.2 − 0.5 = −0.32, A = −0.32 + 0.72·0.592;  t4 (after the end): 0
    expected = [-0.32 + 0.72 * 0.592, 0.16 + 0.72 * 0.6, 0.6, 0.6, 0.0]
    assert advantages[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert returns[0].tolist() == pytest.approx([a + v for a, v in zip(expected, VALUES[0].tolist())], abs=1e-6)
    # cut by a limit: the last action's value stands for what follows, V' = 0.4 at the end
    cut, _ = gae(rewards, VALUES, MASK, gamma=0.9, lam=0.8, bootstrap=torch.tensor([True]))
    a3 = 1 + 0.9 * 0.4 - 0.4
    a1 = 0.16 + 0.72 * a3
    assert cut[0].tolist() == pytest.approx([-0.32 + 0.72 * a1, a1, a3, a3, 0.0], abs=1e-6)


def verl_gae(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return (with its hole handling) and masked_whiten, element by element."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for i in range(B):
        next_value, last = 0.0, 0.0
        for t in reversed(range(T)):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            lastgaelam = delta + gamma * lam * last
            next_value = values[i][t] * mask[i][t] + (1 - mask[i][t]) * next_value
            last = lastgaelam * mask[i][t] + (1 - mask[i][t]) * last
            adv[i][t] = last
    returns = [[adv[i][t] + values[i][t] for t in range(T)] for i in range(B)]
    on = [adv[i][t] for i in range(B) for t in range(T) if mask[i][t]]
    mean = sum(on) / len(on)
    var = sum((a - mean) ** 2 for a in on) / (len(on) - 1)
    white = [[(adv[i][t] - mean) / math.sqrt(var + 1e-8) for t in range(T)] for i in range(B)]
    return adv, returns, white


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_and_whitening_equal_verls_on_batches_with_holes(seed):
    rng = random.Random(seed)
    B, T = 4, 12
    mask = [[0.0] * T for _ in range(B)]
    for i in range(B):  # a prompt, then turns of actions with replies between them, then padding
        t = rng.randint(0, 2)
        while t < T - 2:
            for _ in range(rng.randint(1, 3)):
                if t < T:
                    mask[i][t] = 1.0
                    t += 1
            t += rng.randint(1, 3)
    scores = torch.tensor([rng.uniform(-1, 1) for _ in range(B)])
    kl = torch.tensor([[rng.uniform(0, 0.2) for _ in range(T)] for _ in range(B)])
    values = [[rng.uniform(-1, 1) for _ in range(T)] for _ in range(B)]
    m = torch.tensor(mask)
    rewards = token_rewards(scores, m, kl=kl, kl_coef=0.1)
    adv, ret, white = verl_gae(rewards.tolist(), values, mask, 0.99, 0.95)
    advantages, returns = gae(rewards, torch.tensor(values), m, gamma=0.99, lam=0.95)
    assert torch.allclose(advantages, torch.tensor(adv), atol=1e-5)  # every position, the holes' too
    assert torch.allclose(returns, torch.tensor(ret), atol=1e-5)
    assert torch.allclose(masked_whiten(advantages, m), torch.tensor(white), atol=1e-4)
    # the KL penalty: −0.1·kl on every action token, the score on each row's last
    for i in range(B):
        last = max(t for t in range(T) if mask[i][t])
        for t in range(T):
            want = -0.1 * float(kl[i, t]) * mask[i][t] + (float(scores[i]) if t == last else 0.0)
            assert float(rewards[i, t]) == pytest.approx(want, abs=1e-6)


def test_turn_rewards_land_on_each_turns_last_action_and_must_match_the_turns():
    rewards = token_rewards(torch.tensor([1.0]), MASK, turn_rewards=[[0.25, 0.5]])
    assert rewards.tolist() == [[0.0, 0.25, 0.0, 1.5, 0.0]]  # turn 1 ends at t1, turn 2 (and the episode) at t3
    with pytest.raises(ValueError, match="row 0 has 2 turns but 1 turn rewards"):
        token_rewards(torch.tensor([1.0]), MASK, turn_rewards=[[0.25]])


def test_the_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.6, 5.0]])
    old = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, fraction = clipped_value_loss(values, old, returns, mask, clip=0.2)
    # t0: V moved 0.5 past V_old, clipped to 0.7: max((1−2)², (0.7−2)²) = 1.69;  t1: inside the clip, 0.36 both
    assert loss[0].tolist() == pytest.approx([0.5 * 1.69, 0.5 * 0.36, 0.0], abs=1e-6)
    assert float(fraction) == pytest.approx(0.5)
