"""How long a checkpoint blocks training, and what the driver holds while it is saved.

    python benchmarks/bench_checkpoint.py [--models quickstart,125m]

Two trainer ranks (gloo, one thread each) train one step of a Llama-shaped model with FSDP2, then save their
state two ways; the parent process stands for the driver:

- `gathered`: rank 0 gathers the whole state (`LLMTrainer.state_dict()`), sends it to the driver (pickled through a
  queue, as an actor's return value travels), and the driver writes it (`CheckpointStore.save`: safetensors,
  fsync, sha256) before the step may go on.
- `sharded`: every rank stages its shards and writes them in the background (`LLMTrainer.shard_state`,
  `infra.checkpoints.shards.write_shards`); the driver gets only the small plain state, writes it, and publishes
  the checkpoint (`CheckpointStore.commit`) once the ranks report their files. This is a run's first save: the
  staging buffers are allocated.
- `sharded, later save`: the same after an earlier save and one more step, as every save of a run after its first:
  the staging buffers the first save allocated are refilled.

Printed per model and way: the seconds the step is blocked (the ranks' wait until they may train again), the
seconds until the checkpoint is on disk, and the driver's peak RSS above its baseline during the save (sampled
every 5 ms).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from report import write_section  # benchmarks/ is this script's sys.path[0]

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {  # Llama shapes: (hidden, intermediate, layers, heads, kv heads, vocab)
    "quickstart": None,  # the quickstart's tiny model: rl_core.model.loading.TINY_ARCH and its character tokenizer
    "125m": (768, 2048, 12, 12, 4, 32000),  # 124.7M parameters
}


def shape(name: str) -> tuple[int, int, int, int, int, int]:
    if MODELS[name] is not None:
        return MODELS[name]
    from rl_core.model.loading import TINY_ARCH, build_tiny_tokenizer

    a = TINY_ARCH
    return (a["hidden_size"], a["intermediate_size"], a["num_hidden_layers"], a["num_attention_heads"],
            a["num_key_value_heads"], len(build_tiny_tokenizer()))
MIB = 1024 * 1024


def build_trainer(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from infra.workers.distributed import shard_policy
    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.algorithms.grpo import build_objective
    from rl_core.config import OptimizerConfig, RLConfig
    from rl_core.training.data_parallel import ProcessGroupReducer
    from rl_core.training.trainer import LLMTrainer

    h, i, layers, heads, kv, vocab = shape(name)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64))
    shard_policy(model, torch.device("cpu"), torch.float32, (1, dist.get_world_size()))
    objective = build_objective(RLConfig(), ObjectiveContext(max_response_length=8))
    return LLMTrainer(model, objective, OptimizerConfig(lr=1e-4), dp_reducer=ProcessGroupReducer())


def one_step(trainer, vocab: int) -> None:
    from rl_core.batch.trajectory import Trajectory

    g = torch.Generator().manual_seed(dist.get_rank())
    rows, t = 2, 16
    ids = torch.randint(1, vocab, (rows, t), generator=g)
    loss = torch.zeros(rows, t)
    loss[:, 8:] = 1
    batch = Trajectory(ids, torch.ones_like(ids), loss, -torch.rand(rows, t, generator=g) * loss, torch.ones(rows),
                       torch.zeros(rows, dtype=torch.long), torch.arange(rows), 0, advantages=torch.ones(rows))
    trainer.train_step(batch)


def rank_main(rank: int, world: int, port: int, name: str, directory: str, way: str, up, down) -> None:
    """One trainer rank: one step, then the save `way`; reports wall-clock times (time.time) to the driver."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")  # the checkpoint's own group, as the trainer ranks have
    trainer = build_trainer(name)
    one_step(trainer, shape(name)[5])
    dist.barrier()
    t0 = time.time()
    if way == "gathered":
        state = trainer.state_dict()  # every rank joins the gather; rank 0 gets the tensors
        if rank == 0:
            up.put(("state", t0, state))
            del state
            down.get()  # the driver has written it: the step may go on
            up.put(("blocked", time.time() - t0))
    else:
        from infra.checkpoints.shards import write_shards

        if way == "sharded, later save":  # a run's earlier save, then one more step: the measured save comes after
            write_shards(trainer.shard_state()[0], f"{directory}-earlier", group).result()
            one_step(trainer, shape(name)[5])
            dist.barrier()
            t0 = time.time()
        tensors, rest = trainer.shard_state()
        pending = write_shards(tensors, directory, group)
        blocked = time.time() - t0  # the step may go on now
        up.put(("rest", rank, t0, rest if rank == 0 else {"rng": rest["rng"]}, blocked))
        up.put(("files", rank, pending.result()))
    dist.barrier()
    dist.destroy_process_group()


class PeakRSS:
    """The peak resident memory of this process above its level at start, sampled every 5 ms."""

    def __init__(self):
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self.base = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss - self.base)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(name: str, way: str, root: Path) -> dict:
    """One save of `name` the `way` way; the driver's side runs here."""
    import torch.multiprocessing as mp

    from infra.checkpoints.store import CheckpointStore

    store = CheckpointStore(root / way / "checkpoints")
    ctx = mp.get_context("spawn")
    up, down = ctx.Queue(), ctx.Queue()
    tmp = store.begin(1) if way != "gathered" else None
    with PeakRSS() as rss:
        procs = mp.start_processes(rank_main, args=(2, _free_port(), name, str(tmp), way, up, down), nprocs=2,
                                   join=False, start_method="spawn")
        if way == "gathered":
            _, t0, state = up.get()
            store.save(1, {"trainer": state, "driver": {"step": 1}})
            written = time.time() - t0
            del state
            down.put("saved")
            _, blocked = up.get()
        else:
            parts, files, blocked, t0 = {}, {}, 0.0, None
            for _ in range(4):
                msg = up.get()
                if msg[0] == "rest":
                    _, rank, t0, rest, b = msg
                    parts[f"rank{rank}"] = rest
                    blocked = max(blocked, b)
                else:
                    files.update(msg[2])
            store.write_parts(tmp, {**parts, "driver": {"step": 1}})
            store.commit(tmp, 1, {}, files)
            written = time.time() - t0
        procs.join()
    size = sum(f.stat().st_size for f in store.path_for(1).iterdir())
    return {"blocked_s": blocked, "written_s": written, "driver_peak_mib": rss.peak / MIB, "checkpoint_mib": size / MIB}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="quickstart,125m", help=f"comma-separated, of {', '.join(MODELS)}")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}; 2 gloo ranks, FSDP2, one thread each")
    print(f"{'model':<10} {'way':<19} {'blocked s':>9} {'on disk s':>9} {'driver peak MiB':>15} {'checkpoint MiB':>14}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as root:
        for name in args.models.split(","):
            for way in ("gathered", "sharded", "sharded, later save"):
                r = measure(name, way, Path(root) / name)
                print(f"{name:<10} {way:<19} {r['blocked_s']:>9.2f} {r['written_s']:>9.2f} {r['driver_peak_mib']:>15.1f} "
                      f"{r['checkpoint_mib']:>14.1f}", flush=True)
                rows.append([name, way, f"{r['blocked_s']:.2f}", f"{r['written_s']:.2f}",
                             f"{r['driver_peak_mib']:,.1f}", f"{r['checkpoint_mib']:,.1f}"])
    write_section("checkpoint", ["model", "way", "blocked s", "on disk s", "driver peak MiB", "checkpoint MiB"], rows,
                  ["Two gloo ranks, FSDP2, one torch thread each."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
