"""PPO's critic on one trainer rank (`rl.objective.type=ppo`): the value model beside the policy, in the same
actor and data-parallel group, with an `LLMTrainer` of its own (its optimizer, schedule and step counter).

`PolicyWorker` holds one `RankCritic` per rank when the objective has a critic: it scores its shard of each batch
(`values`, no grad, in `rl.micro_batch_per_replica` chunks; with `kl_reward_coef` also the reference's log-probs),
takes its step on the returns before the policy's (`train_step`), writes its shards into the policy's checkpoint
under `critic` (`shard_state`) and saves itself as a Hugging Face model (`save_pretrained`). Sharded
(`cluster.sharding=fsdp|hsdp`) it is wrapped like the policy (`infra.workers.distributed.shard_policy`), so its
forwards are collectives every rank runs; with LoRA (`model.lora`) it trains adapters of the same settings and its
whole value head.
"""

from __future__ import annotations

from typing import Any

import torch

CRITIC = "critic"  # its key in a checkpoint's tensors and plain state, its metrics' prefix, its export's directory


class RankCritic:
    """The critic's model and trainer on one rank."""

    def __init__(self, cfg: Any, dp_reducer: Any, device: torch.device, policy_trainer: Any):
        from rl_core.algorithms.context import ObjectiveContext
        from rl_core.algorithms.ppo import value_objective
        from rl_core.algorithms.value_model import value_head_name, value_model
        from rl_core.model import lora
        from rl_core.model.loading import resolve_model_path, torch_dtype
        from rl_core.model.protocol import enable_gradient_checkpointing
        from rl_core.placement.run_shape import shard_mesh
        from rl_core.training.trainer import LLMTrainer

        ppo = cfg.rl.objective
        self.cfg, self.device, self.policy = cfg, device, policy_trainer
        source = ppo.critic_model or cfg.model.name_or_path
        torch.manual_seed(cfg.job.seed + 1)  # the head's draw (critic_head_std > 0), apart from the policy's
        model = value_model(resolve_model_path(source), trust_remote_code=cfg.model.trust_remote_code,
                            head_std=ppo.critic_head_std)
        vocab = policy_trainer.model.config.vocab_size
        if model.config.vocab_size != vocab:
            raise ValueError(f"rl.objective.critic_model={ppo.critic_model!r} has a vocabulary of "
                             f"{model.config.vocab_size} tokens, the policy {vocab}: the critic reads the policy's "
                             "token ids, so it must share the policy's tokenizer")
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if lora.enabled(cfg.model):  # the policy's adapters' settings; the value head trains whole
            model = lora.wrap(model, cfg.model.lora, value_head=value_head_name(model))
        compute = torch_dtype(cfg.model.compute_dtype)
        if mesh := shard_mesh(cfg):
            from infra.workers.distributed import shard_policy

            model = shard_policy(model, device, compute, mesh)
        model.to(device)
        optimizer = cfg.rl.optimizer.model_copy(update={"lr": ppo.critic_lr})
        self.trainer = LLMTrainer(model, value_objective(ppo, ObjectiveContext.from_config(cfg)), optimizer,
                                  dp_reducer=dp_reducer, metric_split=CRITIC, compute_dtype=compute)

    def values(self, shard: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(values [B, T], ref_logp [B, T] or None)` of this rank's rows, on CPU: the critic's value before each
        token (0 off the loss mask), and with `kl_reward_coef` > 0 the reference's log-probs."""
        from rl_core.algorithms.value_model import token_values
        from rl_core.primitives.objective import frozen_scores, frozen_token_logprobs

        rows = self.cfg.rl.micro_batch_per_replica
        with self.trainer.autocast():
            values = frozen_scores(self.trainer.model, shard,
                                   lambda model, chunk: token_values(model, chunk.input_ids, chunk.attention_mask), rows)
        ref = None
        if self.cfg.rl.objective.kl_reward_coef > 0:
            reference = self.policy.auxiliary_models[self.policy.REFERENCE]
            with self.policy.autocast():
                ref = frozen_token_logprobs(reference, shard, temperature=self.cfg.rollout.temperature,
                                            micro_batch_size=rows).cpu()
        return values.cpu(), ref

    def train_step(self, shard: Any, micro: int | None, mini: int | None, max_tokens: int | None) -> dict[str, float]:
        metrics = self.trainer.train_step(shard, micro, mini, max_tokens)
        self.trainer.release_gradients()
        return metrics

    def shard_state(self) -> tuple[dict, dict]:
        """This rank's critic shards and its plain state (the process's RNG is the policy's entry)."""
        tensors, rest = self.trainer.shard_state()
        return tensors, {k: v for k, v in rest.items() if k != "rng"}

    def load_shard_state(self, read: Any, rest: dict) -> None:
        """`read(tensors)`: fills `{"critic": tensors}` from the checkpoint's shards."""
        if CRITIC not in rest:
            raise KeyError("the checkpoint has no critic: it was written by a run without rl.objective.type=ppo")
        self.trainer.load_shard_state(lambda tensors: read({CRITIC: tensors}), rest[CRITIC])

    def save_pretrained(self, path: str, rank: int) -> None:
        """The critic as a transformers directory (`AutoModelForTokenClassification`, one label, safetensors) at
        `path`, with LoRA its adapters merged; sharded, every rank joins the gather and rank 0 writes."""
        from rl_core.model import lora

        state = self.trainer.exported_model_state() if self.trainer.sharded else None
        if rank != 0:
            return
        model = self.trainer.model
        if lora.is_lora(model):
            lora.save_merged(model, path)
        else:
            model.save_pretrained(path, state_dict=state, safe_serialization=True)
