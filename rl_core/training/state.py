"""The trainer's checkpoint state (a mixin of `rl_core.training.trainer.LLMTrainer`, whose `__init__` sets the model,
optimizer, scheduler, objective and counters it reads): `state_dict` / `load_state_dict`, full (gathered) tensors
in either sharding mode, and `shard_state` / `load_shard_state`, each rank's own shards; both with the RNG states
and counters an exact resume needs."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import numpy as np
import torch

from rl_core.model import lora


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        # plain types only, so that torch.load(weights_only=True) accepts the checkpoint
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value):
    if isinstance(value, list):
        return tuple(_as_tuple(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_as_tuple(v) for v in value)
    return value


def optimizer_by_index(state: Mapping, names: list[str]) -> dict:
    """A name-keyed full optimizer state (torch.distributed.checkpoint) in `torch.optim`'s index-keyed form."""
    if not state:
        return {}
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in state["param_groups"]]}


def optimizer_by_name(state: Mapping, names: list[str]) -> dict:
    """The inverse of `optimizer_by_index`."""
    return {"state": {names[int(i)]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[int(p)] for p in g["params"]]} for g in state["param_groups"]]}


def model_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors in a checkpoint, in this process's layout: the trained ones (with LoRA the adapters) by
    parameter name, DTensor shards when sharded. What `TrainerState.shard_state` writes and `load_model_shards`
    reads."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))


def load_model_shards(model: torch.nn.Module, fill: Callable[[dict], None]) -> None:
    """The model half of `TrainerState.load_shard_state`, for a model without a trainer (an export): `fill(tensors)`
    reads `{"model": model_shards(model)}` in place (`infra.checkpoints.shards.read_shards`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    tensors = model_shards(model)
    fill({"model": tensors})
    # not strict: with LoRA the frozen base is not in it (the read refuses any tensor the checkpoint lacks)
    set_model_state_dict(model, tensors, options=StateDictOptions(strict=False))


class TrainerState:
    """Saving and restoring an `LLMTrainer`'s state (model, optimizer, scheduler, RNG, counters)."""

    def state_dict(self) -> dict:
        """Everything an exact resume needs: model, optimizer, scheduler, RNG states, counters.

        With LoRA (`rl_core.model.lora`) the model entry holds only the adapters, and `base_model` names the
        frozen base model they were trained on (refused on load when it differs).

        Model and optimizer tensors are full (unsharded) in both modes, and the optimizer state is
        keyed by parameter index as `torch.optim` does. Sharded: every rank must call it (it gathers);
        rank 0 gets the tensors, on CPU, the other ranks empty model/optimizer entries.
        """
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_state = get_model_state_dict(self.model, options=opts)
            optim_state = optimizer_by_index(get_optimizer_state_dict(self.model, self.optimizer, options=opts),
                                              self._param_names())
        else:
            model_state, optim_state = lora.trained_state(self.model), self.optimizer.state_dict()
        return {
            **lora.identity_entry(self.model),  # LoRA: the base model the adapters were trained on
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "counters": {"step": self.step, "policy_version": self.policy_version},
            "objective_identity": dict(self.objective.identity),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore `state_dict()` output of either mode (sharded: every rank calls it with the full state)."""
        missing = [k for k in ("model", "optimizer", "scheduler", "rng", "counters") if k not in state]
        if missing:
            raise KeyError(f"trainer checkpoint lacks {missing}")
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, dict(state["model"]), options=opts)
            set_optimizer_state_dict(self.model, self.optimizer,
                                     optimizer_by_name(state["optimizer"], self._param_names()), options=opts)
        else:
            lora.check_base(self.model, state)
            lora.load_trained_state(self.model, state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step = int(state["counters"]["step"])
        self.policy_version = int(state["counters"]["policy_version"])

    def shard_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """This rank's part of the state, for a checkpoint written by every rank: `(tensors, rest)`.

        `tensors`: `{"model": ..., "optimizer": ...}` keyed by parameter name (the optimizer's state as
        `{name: {"exp_avg": ..., ...}}`); sharded, each is this rank's DTensor shard, which
        torch.distributed.checkpoint writes and reads by global offsets, so the state loads onto any number of
        ranks in either mode. With LoRA only the adapters. Nothing is gathered. `rest`: everything else
        (optimizer hyperparameters, scheduler, RNG, counters, identities), small plain values.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model = model_shards(self.model)
        optimizer = get_optimizer_state_dict(self.model, self.optimizer)
        rest = {
            **lora.identity_entry(self.model),
            "param_groups": optimizer["param_groups"],
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "counters": {"step": self.step, "policy_version": self.policy_version},
            "objective_identity": dict(self.objective.identity),
        }
        return {"model": model, "optimizer": optimizer["state"]}, rest

    def load_shard_state(self, fill: Callable[[dict], None], rest: Mapping) -> None:
        """Restore a `shard_state()` checkpoint: `fill(tensors)` reads this rank's layout of the tensors in place
        (`infra.checkpoints.shards.read_shards`), `rest` is the saved plain state (without `rng`, a rank the checkpoint
        had not: its own generators stay as they are)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        lora.check_base(self.model, rest)
        missing = [k for k in ("param_groups", "scheduler", "counters") if k not in rest]
        if missing:
            raise KeyError(f"trainer checkpoint lacks {missing}")
        tensors, _ = self.shard_state()  # this rank's layout (a fresh optimizer's state is created to be filled)
        fill(tensors)
        # not strict: with LoRA the frozen base is not in it (the read above refused any tensor the checkpoint lacks)
        set_model_state_dict(self.model, tensors["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(self.model, self.optimizer,
                                 {"state": tensors["optimizer"], "param_groups": rest["param_groups"]})
        self.scheduler.load_state_dict(rest["scheduler"])
        if "rng" in rest:
            set_rng_state(rest["rng"])
        self.step = int(rest["counters"]["step"])
        self.policy_version = int(rest["counters"]["policy_version"])

    def _param_names(self) -> list[str]:
        """Names of the trained parameters in optimizer order (the same in both modes)."""
        return [name for name, p in self.model.named_parameters() if p.requires_grad]


class WarmupConstant:
    """LR factor: linear warmup over `warmup_steps` optimizer steps ((s + 1) / W), then 1.

    The first update uses lr / W and update W (1-based) the full lr; `warmup_steps = 0` is constant.
    A class (not a lambda) so that the scheduler state is picklable.
    """

    def __init__(self, warmup_steps: int):
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step: int) -> float:
        if self.warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / self.warmup_steps)
