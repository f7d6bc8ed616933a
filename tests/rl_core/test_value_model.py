"""The critic's model (rl_core.algorithms.value_model): the policy's backbone with a one-output head, saved and loaded as a
Hugging Face token-classification model; the value of the state before token t is read from position t − 1."""

from __future__ import annotations

import torch

from rl_core.algorithms.value_model import token_values, value_model
from rl_core.model.loading import build_tiny_model
from rl_core.primitives.logprobs import position_ids_from_mask


def test_the_critic_is_the_policys_backbone_with_a_value_head_read_one_position_back(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    path = tmp_path / "policy"
    build_tiny_model(path, seed=0)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not token_values(value_model(path), torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)).any()
    critic = value_model(path, head_std=0.5).eval()
    backbone = {k: v for k, v in policy.state_dict().items() if k.startswith("model.")}
    assert backbone and all(torch.equal(critic.state_dict()[k], v) for k, v in backbone.items())
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [4, 5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        values = token_values(critic, ids, mask)
        hidden = policy.model(input_ids=ids, attention_mask=mask,
                              position_ids=position_ids_from_mask(mask)).last_hidden_state
        head = critic.score.weight[0].detach()
    for i in range(2):
        for t in range(ids.shape[1]):
            real = bool(mask[i, t]) and t > 0 and bool(mask[i, t - 1])
            want = float(hidden[i, t - 1] @ head) if real else 0.0
            assert abs(float(values[i, t]) - want) < 1e-5, (i, t)
    assert values[0, 2] == 0 and values[0, 3] != 0  # a left-padded row's first real token has no state before it
    critic.save_pretrained(tmp_path / "critic")
    again = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(token_values(again, ids, mask), values)
