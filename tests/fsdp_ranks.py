"""Two gloo ranks on CPU that train the same batches unsharded and with FSDP2; run by tests/infra/workers/test_fsdp.py.

    python tests/fsdp_ranks.py OUT.json [--checkpointing] [--bf16] [--hsdp] | OUT.json --one-rank DIR

Each rank trains on its own half of every batch (the data-parallel split) for 3 steps of 2
mini-batches each, in micro-batches of one row; rank 1's last row has no loss token, so rank 1
takes a weight-0 chunk that rank 0 does not (FSDP's backward collectives must still line up).
Cross-mode resume: 2 steps in one mode, the trainer state loaded into a fresh trainer of the other
mode, the 3rd step there. A rank-written checkpoint (`rank_written_checkpoint`, `--one-rank DIR`: its resume
on one unsharded rank, no process group). Token budgets: FSDP with chunks cut by tokens, 2 per mini-batch on rank 0
and 1 on rank 1, which pads to 2 with a weight-0 chunk. `--bf16`: bf16 compute (autocast unsharded, FSDP's bf16 gathers sharded). `--hsdp`: four ranks, each
with a quarter of every batch, unsharded against HSDP on a 2 x 2 mesh (two shard groups of two ranks,
replicas of each other), and an HSDP checkpoint after 2 steps resumed unsharded. Rank 0 writes the
largest differences (and how far the weights moved) to OUT.json.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS = 3
ROWS = 8  # per step, 4 per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_model():
    from tests.builders import tiny_model

    return tiny_model(0)


def batch(step: int, rank: int, world: int | None = None):
    """Rank `rank`'s contiguous share of step `step`'s batch (the same batch on every rank before the split)."""
    from rl_core.annotators.advantage import group_advantages
    from rl_core.batch.trajectory import Trajectory

    g = torch.Generator().manual_seed(100 + step)
    prompt, resp = 3, 6
    t = prompt + resp
    ids = torch.randint(1, 20, (ROWS, t), generator=g)
    att = torch.ones(ROWS, t, dtype=torch.long)
    loss = torch.zeros(ROWS, t)
    lengths = torch.randint(1, resp + 1, (ROWS,), generator=g)
    for i in range(ROWS):
        loss[i, prompt: prompt + int(lengths[i])] = 1
    loss[ROWS - 1] = 0  # rank 1's last row: no loss token (a weight-0 chunk at micro-batch 1)
    rewards = torch.arange(ROWS, dtype=torch.float32) % 3
    groups = torch.arange(ROWS) // 2
    adv = group_advantages(rewards, groups)
    sampling = -torch.rand(ROWS, t, generator=g) * loss
    full = Trajectory(ids, att, loss, sampling, rewards, groups, torch.arange(ROWS) + 1000 * step, step,
                      advantages=adv)
    share = ROWS // (world or dist.get_world_size())
    return full.select(list(range(rank * share, (rank + 1) * share)))


def make_trainer(sharded: bool, checkpointing: bool, compute=torch.float32, mesh=None):
    from infra.workers.distributed import shard_policy
    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.algorithms.grpo import build_objective
    from rl_core.config import OptimizerConfig, RLConfig
    from rl_core.training.data_parallel import ProcessGroupReducer
    from rl_core.training.trainer import LLMTrainer

    model = base_model()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if sharded:
        shard_policy(model, torch.device("cpu"), compute, mesh)
    rl = RLConfig(mini_batch_per_replica=2, loss_type="token-mean")
    objective = build_objective(rl, ObjectiveContext(max_response_length=6))
    return LLMTrainer(model, objective, OptimizerConfig(lr=1e-3, max_grad_norm=0.5), dp_reducer=ProcessGroupReducer(),
                       compute_dtype=compute)


def train(trainer, steps, max_tokens=None):
    for step in steps:
        trainer.train_step(batch(step, dist.get_rank()), micro_batch_size=1 if max_tokens is None else None,
                           mini_batch_size=2, micro_batch_max_tokens=max_tokens)


def full_state(trainer) -> dict:
    """The trainer's full state on every rank (rank 0 gathers when sharded, then broadcasts)."""
    state = trainer.state_dict()
    box = [state if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def optimizer_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for i, sa in a["state"].items():
        for name, value in sa.items():
            worst = max(worst, float((value.float() - b["state"][i][name].float()).abs().max()))
    return worst


def rank_main(rank: int, world: int, port: int, out: str, checkpointing: bool, bf16: bool, hsdp: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if bf16:
            return bf16_main(rank, out, checkpointing)
        if hsdp:
            return hsdp_main(rank, out, checkpointing)
        initial = {k: v.clone() for k, v in base_model().state_dict().items()}
        plain = make_trainer(False, checkpointing)
        train(plain, range(STEPS))
        sharded = make_trainer(True, checkpointing)
        train(sharded, range(STEPS))
        plain_state, sharded_state = full_state(plain), full_state(sharded)

        # cross-mode resume, both ways
        half_sharded = make_trainer(True, checkpointing)
        train(half_sharded, range(STEPS - 1))
        resumed_plain = make_trainer(False, checkpointing)
        resumed_plain.load_state_dict(full_state(half_sharded))
        train(resumed_plain, [STEPS - 1])
        half_plain = make_trainer(False, checkpointing)
        train(half_plain, range(STEPS - 1))
        resumed_sharded = make_trainer(True, checkpointing)
        resumed_sharded.load_state_dict(full_state(half_plain))
        train(resumed_sharded, [STEPS - 1])
        from_sharded, from_plain = full_state(resumed_plain), full_state(resumed_sharded)
        # token budgets that cut rank 0's mini-batches into 2 chunks and rank 1's into 1: rank 1 adds a padding chunk
        budgeted = make_trainer(True, checkpointing)
        train(budgeted, range(STEPS), max_tokens=9 if rank == 0 else 18)
        budgeted_state = full_state(budgeted)
        loaded = sharded_load(rank, out + ".model", (1, 2))
        written = rank_written_checkpoint(rank, out + ".ckpt", checkpointing)
        if rank == 0:
            result = {
                "moved": max_diff(plain_state["model"], initial),
                "fsdp_vs_plain": max_diff(sharded_state["model"], plain_state["model"]),
                "fsdp_vs_plain_optimizer": optimizer_diff(sharded_state["optimizer"], plain_state["optimizer"]),
                "optimizer_keys_equal": sorted(sharded_state["optimizer"]["state"]) == sorted(
                    plain_state["optimizer"]["state"]),
                "sharded_is_dtensor": type(next(iter(sharded.model.parameters()))).__name__,
                "resume_fsdp_to_plain": max_diff(from_sharded["model"], plain_state["model"]),
                "resume_plain_to_fsdp": max_diff(from_plain["model"], sharded_state["model"]),
                "resume_fsdp_to_plain_optimizer": optimizer_diff(from_sharded["optimizer"], plain_state["optimizer"]),
                "fsdp_budget_vs_plain": max_diff(budgeted_state["model"], plain_state["model"]),
                "steps": [plain.step, sharded.step, resumed_plain.step, resumed_sharded.step, budgeted.step],
                **loaded, **written,
            }
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def bf16_main(rank: int, out: str, checkpointing: bool) -> None:
    """bf16 compute: FSDP (bf16 gathers, float32 reduce) against unsharded autocast, both on float32 masters."""
    initial = {k: v.clone() for k, v in base_model().state_dict().items()}
    plain = make_trainer(False, checkpointing, torch.bfloat16)
    train(plain, range(STEPS))
    sharded = make_trainer(True, checkpointing, torch.bfloat16)
    train(sharded, range(STEPS))
    a, b = full_state(plain)["model"], full_state(sharded)["model"]
    if rank == 0:
        va = torch.cat([(a[k] - initial[k]).reshape(-1) for k in a])
        vb = torch.cat([(b[k] - initial[k]).reshape(-1) for k in a])
        with open(out, "w") as f:
            json.dump({"master_dtypes": sorted({str(v.dtype) for v in b.values()}),
                       "update_cosine": float(torch.nn.functional.cosine_similarity(va, vb, dim=0)),
                       "moved": float(va.abs().max()), "diff": max_diff(a, b)}, f)


def sharded_load(rank: int, model_dir: str, mesh) -> dict:
    """`infra.workers.sharded_load.load_sharded_policy` of a saved `base_model()`: every rank's shards, gathered, must be the
    saved weights bit for bit, the rotary buffers too, and each rank must hold only its share, having read its own
    rows of the saved file (no broadcast from rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from infra.workers.sharded_load import load_sharded_policy
    from rl_core.config.schema import ModelConfig
    from rl_core.model.loading import build_tiny_tokenizer

    saved = base_model()
    if rank == 0:
        saved.save_pretrained(model_dir)
        build_tiny_tokenizer().save_pretrained(model_dir)
    dist.barrier()
    model, _ = load_sharded_policy(ModelConfig(name_or_path=model_dir), torch.device("cpu"), torch.float32, mesh)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    param = next(iter(model.parameters()))
    buffers = {k: v for k, v in model.named_buffers()}
    return {"load_vs_saved": max_diff(full, saved.state_dict()) if rank == 0 else None,
            "load_buffers_equal": all(torch.equal(v, buffers[k]) for k, v in saved.named_buffers()),
            "load_local_fraction": param.to_local().numel() / param.numel(), "load_path": model.posttrain_load}


def rank_written_checkpoint(rank: int, directory: str, checkpointing: bool) -> dict:
    """A sharded checkpoint after 2 steps, written by both ranks in the background while the 3rd step trains
    (`infra.checkpoints.shards`), then resumed on two sharded ranks for the 3rd step. Rank 0 leaves in `directory`
    what a one-rank resume needs (`one_rank_main`): the shards, rank 0's plain state, the straight run's weights."""
    from safetensors.torch import save_file

    from infra.checkpoints.shards import read_shards, write_shards

    group = dist.new_group(backend="gloo")  # the checkpoint's collectives, apart from training's

    def trained_two_steps(sharded: bool, into: str):
        if rank == 0:
            os.makedirs(into)
        dist.barrier()
        trainer = make_trainer(sharded, checkpointing)
        train(trainer, range(STEPS - 1))
        return trainer

    straight = trained_two_steps(True, directory)
    tensors, rest = straight.shard_state()
    local = {k: v.to_local().clone() for k, v in tensors["model"].items()}
    pending = write_shards(tensors, directory, group)
    train(straight, [STEPS - 1])  # the weights change while the shards are written: the staged copy is written
    files = pending.result()
    straight_state = full_state(straight)
    resumed = make_trainer(True, checkpointing)
    resumed.load_shard_state(lambda t: read_shards(t, directory, group), rest)
    reloaded = {k: v.to_local().clone() for k, v in resumed.shard_state()[0]["model"].items()}
    train(resumed, [STEPS - 1])
    resumed_state = full_state(resumed)
    names = sorted(n for n in os.listdir(directory))
    # unsharded replicas: each rank writes every other tensor, and a fresh replica reads them all back
    replicas = directory + ".replicas"
    plain = trained_two_steps(False, replicas)
    plain_tensors, plain_rest = plain.shard_state()
    plain_files = write_shards(plain_tensors, replicas, group, (rank, 2)).result()
    fresh = make_trainer(False, checkpointing)
    fresh.load_shard_state(lambda t: read_shards(t, replicas, group), plain_rest)
    fresh_tensors = fresh.shard_state()[0]
    replica_equal = all(torch.equal(plain_tensors[part][k] if part == "model" else plain_tensors[part][k][n],
                                    fresh_tensors[part][k] if part == "model" else fresh_tensors[part][k][n])
                        for part in ("model", "optimizer") for k in plain_tensors[part]
                        for n in ([None] if part == "model" else plain_tensors[part][k]))
    shard_bytes = [0, 0]
    dist.all_gather_object(shard_bytes, sum(e["size"] for f, e in plain_files.items() if f.endswith(".distcp")))
    if rank == 0:
        torch.save(rest, os.path.join(directory, "rest.pt"))
        save_file(straight_state["model"], os.path.join(directory, "straight.safetensors"))
    return {"dcp_files": files, "dcp_names": names,
            "dcp_reloaded_local_equal": all(torch.equal(local[k], reloaded[k]) for k in local),
            "dcp_resume_2_to_2": max_diff(resumed_state["model"], straight_state["model"]),
            "dcp_resume_2_to_2_optimizer": optimizer_diff(resumed_state["optimizer"], straight_state["optimizer"]),
            "dcp_steps": [straight.step, resumed.step],
            "replica_equal": replica_equal, "replica_shard_bytes": shard_bytes}


def one_rank_main(out: str, directory: str) -> None:
    """A one-rank unsharded trainer (no process group, as `cluster.num_workers=1` runs) resumed from the checkpoint two
    sharded ranks wrote, trained for the 3rd step on the whole batch, its mini-batches holding the rows the two
    ranks' did; against the two ranks' straight run."""
    from safetensors.torch import load_file

    from infra.checkpoints.shards import read_shards
    from rl_core.training.trainer import LLMTrainer

    trainer = make_trainer(False, False)
    trainer.dp_reducer = None
    trainer.load_shard_state(lambda t: read_shards(t, directory), torch.load(os.path.join(directory, "rest.pt"),
                                                                             weights_only=True))
    step = STEPS - 1
    whole = batch(step, 0, world=1).select([0, 1, 4, 5, 2, 3, 6, 7])  # mini-batch k: each rank's k-th two rows
    trainer.train_step(whole, micro_batch_size=1, mini_batch_size=4)
    straight = load_file(os.path.join(directory, "straight.safetensors"))
    with open(out, "w") as f:
        json.dump({"dcp_resume_2_to_1": max_diff(trainer.model.state_dict(), straight), "step": trainer.step,
                   "is_trainer": isinstance(trainer, LLMTrainer)}, f)


def hsdp_main(rank: int, out: str, checkpointing: bool) -> None:
    """Four ranks: HSDP on a 2 x 2 mesh against the unsharded trainer, and an HSDP checkpoint resumed unsharded."""
    from torch.distributed.tensor import Replicate, Shard

    initial = {k: v.clone() for k, v in base_model().state_dict().items()}
    plain = make_trainer(False, checkpointing)
    train(plain, range(STEPS))
    hsdp = make_trainer(True, checkpointing, mesh=(2, 2))
    train(hsdp, range(STEPS))
    param = next(iter(hsdp.model.parameters()))
    half = make_trainer(True, checkpointing, mesh=(2, 2))
    train(half, range(STEPS - 1))
    resumed = make_trainer(False, checkpointing)
    resumed.load_state_dict(full_state(half))
    train(resumed, [STEPS - 1])
    plain_state, hsdp_state, resumed_state = full_state(plain), full_state(hsdp), full_state(resumed)
    local = param.to_local().numel()
    sizes = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, param.to_local().sum().reshape(1))  # each group's two ranks hold the two halves
    loaded = sharded_load(rank, out + ".model", (2, 2))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"mesh": list(param.device_mesh.shape), "placements": [str(p) for p in param.placements],
                       "replicate_shard": list(param.placements) == [Replicate(), Shard(0)],
                       "local_fraction": local / param.numel(),
                       "replica_sums_equal": [float(sizes[0]), float(sizes[1])] == [float(sizes[2]), float(sizes[3])],
                       "moved": max_diff(plain_state["model"], initial),
                       "hsdp_vs_plain": max_diff(hsdp_state["model"], plain_state["model"]),
                       "hsdp_vs_plain_optimizer": optimizer_diff(hsdp_state["optimizer"], plain_state["optimizer"]),
                       "resume_hsdp_to_plain": max_diff(resumed_state["model"], plain_state["model"]),
                       "steps": [plain.step, hsdp.step, resumed.step], **loaded}, f)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    if "--one-rank" in sys.argv:
        torch.set_num_threads(1)
        one_rank_main(sys.argv[1], sys.argv[sys.argv.index("--one-rank") + 1])
        sys.exit(0)
    world = 4 if "--hsdp" in sys.argv else 2
    mp.spawn(rank_main, args=(world, _free_port(), sys.argv[1], "--checkpointing" in sys.argv, "--bf16" in sys.argv,
                              "--hsdp" in sys.argv), nprocs=world)
