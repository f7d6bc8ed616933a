"""PPO's critic on one trainer rank (infra.workers.critic.RankCritic), in process: it scores a batch (0 off the loss
mask), trains on the returns, comes back from its checkpoint shards bit for bit (weights, optimizer, schedule), and
exports as a Hugging Face token-classification model that scores as it does; with LoRA it trains the policy's
adapter settings and its whole value head."""

from __future__ import annotations

import pytest
import torch

from infra.checkpoints.shards import read_shards, write_shards
from infra.workers.critic import CRITIC, RankCritic
from infra.workers.trainer_build import build_trainer
from rl_core.algorithms.value_model import token_values
from rl_core.batch.trajectory import Trajectory
from rl_core.config import config_from_dict
from rl_core.model.loading import build_tiny_model

CPU = torch.device("cpu")


def _batch() -> Trajectory:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0]]).float()
    ids = torch.randint(3, 60, (4, 6), generator=g)
    return Trajectory(input_ids=ids, attention_mask=torch.ones(4, 6, dtype=torch.long), loss_mask=mask,
                      rollout_logp=-torch.rand(4, 6, generator=g) * mask, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
                      group_ids=torch.arange(4), sample_ids=torch.arange(4), policy_version=0,
                      old_values=torch.zeros(4, 6), returns=torch.randn(4, 6, generator=g) * mask)


@pytest.mark.parametrize("lora_r", [0, 4])
def test_a_rank_critic_scores_trains_resumes_bitwise_and_exports(tmp_path, lora_r):
    from transformers import AutoModelForTokenClassification

    build_tiny_model(tmp_path / "policy", seed=0)
    cfg = config_from_dict({"model": {"name_or_path": str(tmp_path / "policy"), "lora": {"r": lora_r}},
                            "rl": {"objective": {"type": "ppo", "critic_lr": 1e-2, "critic_head_std": 0.1}},
                            "rollout": {"n": 1}})

    def rank_critic() -> RankCritic:
        policy, _ = build_trainer(cfg, None, CPU)
        return RankCritic(cfg, None, CPU, policy)

    critic = rank_critic()
    trained = [n for n, p in critic.trainer.model.named_parameters() if p.requires_grad]
    if lora_r:  # the adapters and the whole value head, nothing of the base
        assert any("score" in n for n in trained) and all("lora_" in n or "score" in n for n in trained)
    else:
        assert len(trained) == len(list(critic.trainer.model.parameters()))
    batch = _batch()
    values, ref = critic.values(batch)
    assert ref is None and values.shape == (4, 6) and not values[batch.loss_mask == 0].any()
    assert values[batch.loss_mask > 0].abs().min() > 0  # the head is drawn with std 0.1: every value moves
    first = critic.train_step(batch, 2, 2, None)
    assert critic.trainer.step == 2 and first["critic/loss"] > 0
    assert not torch.equal(critic.values(batch)[0], values)  # it learned

    tensors, rest = critic.shard_state()
    write_shards({CRITIC: tensors}, tmp_path / "ckpt").result()
    again = rank_critic()
    again.load_shard_state(lambda t: read_shards(t, tmp_path / "ckpt"), {CRITIC: rest})
    assert torch.equal(again.values(batch)[0], critic.values(batch)[0])
    assert again.train_step(batch, 2, 2, None) == critic.train_step(batch, 2, 2, None)  # optimizer and schedule too
    assert again.trainer.step == critic.trainer.step == 4
    with pytest.raises(KeyError, match="no critic"):
        again.load_shard_state(lambda t: None, {})

    critic.save_pretrained(str(tmp_path / "export"), rank=0)
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "export").eval()
    assert not any("lora" in name for name, _ in exported.named_parameters())  # merged
    with torch.no_grad():
        scored = token_values(exported, batch.input_ids, batch.attention_mask) * batch.loss_mask
    assert torch.allclose(scored, critic.values(batch)[0], atol=1e-5)
