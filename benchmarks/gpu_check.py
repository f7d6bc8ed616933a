"""GPU check for a bare GPU machine: the trainer's GPU paths, with torch, transformers and safetensors only.

`make gpu-smoke` (benchmarks/gpu_smoke.py) runs whole flows with vLLM, Ray and Prefect on a user's GPU machine. This
script needs none of them: it runs on a stock image with torch, transformers and safetensors (no network), with
pydantic and its few pure dependencies carried as wheels when the image lacks them (`--wheels DIR`, unpacked into a
temporary directory put first on `sys.path`; `--download-wheels DIR` fetches them where there is a network, at
constraints.txt's versions: benchmarks/gpu_wheels.py). Before anything imports pydantic it checks that the
pydantic-core found is the release that pydantic requires (pydantic refuses to import beside any other), and reports
a mismatch in `gpu_check.json` (`error`, no checks run; exit 1) instead of a traceback.

On one GPU (about 4 minutes on an H200) it checks, with a randomly initialised Qwen2 model of Qwen2.5-0.5B's shape
(hidden 896, 24 layers, 14 heads, 2 KV heads, the 151,936-token vocabulary; random weights, so no download):

- `precision`: TF32 for float32 matmuls after `enable_tf32`, and kept when an engine resets it (what a colocated
  vLLM does as it starts: `matmul_precision_kept`);
- `train_step`: posttrain's `LLMTrainer` on the device: bf16 compute with float32 master weights, the default
  unpadded rows and fused log-prob head, rows grouped under a token budget (`rl.micro_batch_max_tokens`); the loss
  and gradient norm finite, every parameter still float32 and changed; training tokens/s (loss tokens / median step
  seconds); the device memory held after a step and the peak of a step against the memory plan's prediction for the
  same config (`rl_core.placement`, the trainer's resident items and its forward/backward and optimizer phases,
  less the CUDA runtime the allocator does not see);
- `export`: the trained policy written as posttrain writes `final_model/` (`save_policy`, safetensors) and loaded
  back with `from_pretrained`: the same log-probs (float32, max |diff| <= 1e-5);
- `fsdp`: one-rank FSDP2 over NCCL (gloo in the dry run): the meta-device sharded load (`load_sharded_policy`,
  the rank reading its own rows of the safetensors files) holds exactly the plain load's tensors, and a train step
  on it is finite;
- `dcp`: that trainer's state written with torch.distributed.checkpoint (`write_shards`) and read into a second
  trainer (`read_shards`): model and optimizer state bitwise equal.

It writes `gpu_check.json` (every check's numbers and `ok`) under `--out` (default `$OUT`, else the working
directory) and exits 1 when a check fails. `--cpu-dry-run` runs the same checks on CPU with a tiny shape (so
`make test` runs it): there, TF32 is expected off and no device memory is measured.

    python benchmarks/gpu_check.py [--out DIR] [--wheels DIR] [--cpu-dry-run]
    python benchmarks/gpu_check.py --download-wheels DIR [--python-version 3.12]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # run as a file too (runpy): its helper modules beside it
from gpu_wheels import download_command, pydantic_problem, use_wheels

# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B) on a GPU; a tiny one for the dry run
GPU_SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936}
DRY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 1024}
# the batch: prompts x n completions, GSM8K-shaped lengths (prompt ~120 tokens, long-tailed responses)
GPU_BATCH = {"prompts": 8, "n": 8, "prompt_tokens": 128, "max_tokens": 512, "budget": 8192, "steps": 4}
DRY_BATCH = {"prompts": 2, "n": 4, "prompt_tokens": 12, "max_tokens": 16, "budget": 64, "steps": 2}
EXPORT_ATOL = 1e-5  # float32 log-probs of the same weights, two loads


def build_model(out: Path, shape: dict, seed: int = 0) -> Path:
    """A randomly initialised Qwen2 model of `shape` (float32, tied embeddings), saved as safetensors with the tiny
    character tokenizer (the checks need a tokenizer beside the weights, not a real one)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl_core.model.loading import build_tiny_tokenizer

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True)).float()
    model.save_pretrained(out, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out)
    return out


class Check:
    """The shared state of the checks: the device, the model directory, the config and the batch."""

    def __init__(self, device, model_dir: Path, work: Path, batch_shape: dict):
        import torch

        from rl_core.config import PosttrainConfig

        self.device, self.model_dir, self.work, self.b = device, model_dir, work, batch_shape
        self.on_gpu = device.type == "cuda"
        cfg = PosttrainConfig()
        cfg.model.name_or_path = str(model_dir)
        cfg.model.compute_dtype = "bfloat16"
        cfg.rollout.n, cfg.rollout.prompts_per_step = batch_shape["n"], batch_shape["prompts"]
        cfg.rollout.max_tokens = batch_shape["max_tokens"]
        cfg.rl.micro_batch_max_tokens = batch_shape["budget"]
        cfg.cluster.placement = "separate"  # the trainer's own memory: no engine beside it
        cfg.cluster.gpus_per_worker = 1.0 if self.on_gpu else 0.0
        cfg.cluster.gpus_per_engine = 1.0 if self.on_gpu else 0.0
        self.cfg = cfg
        self.trainer = None  # the trained unsharded trainer (train_step), exported by `export`
        self.sharded = None  # the one-rank FSDP trainer (fsdp), saved and restored by `dcp`
        self.checkpoint_group = None  # a gloo group for the checkpoint's collectives (fsdp)
        self.tokenizer = None
        self.dtype = torch.bfloat16

    def batch(self, seed: int = 0):
        import numpy as np
        from bench_train import random_batch

        rng = np.random.default_rng(seed)
        rows = self.b["prompts"] * self.b["n"]
        prompts = [int(x) for x in rng.integers(self.b["prompt_tokens"] // 2, self.b["prompt_tokens"] + 1,
                                                 self.b["prompts"]) for _ in range(self.b["n"])]
        responses = np.clip(np.round(rng.lognormal(math.log(self.b["max_tokens"] / 3), 0.8, rows)), 4,
                            self.b["max_tokens"]).astype(int).tolist()
        vocab = json.loads((self.model_dir / "config.json").read_text())["vocab_size"]
        return random_batch(prompts, responses, vocab, self.b["n"], seed).to(self.device)

    def make_trainer(self, model):
        from rl_core.algorithms.context import ObjectiveContext
        from rl_core.algorithms.grpo import build_objective
        from rl_core.training.data_parallel import ProcessGroupReducer, is_sharded
        from rl_core.training.trainer import LLMTrainer

        objective = build_objective(self.cfg.rl, ObjectiveContext(self.cfg.rollout.max_tokens))
        reducer = ProcessGroupReducer() if is_sharded(model) else None  # the sharded weights' and metrics' group
        return LLMTrainer(model, objective, self.cfg.rl.optimizer, dp_reducer=reducer, compute_dtype=self.dtype)

    def synchronize(self) -> None:
        import torch

        if self.on_gpu:
            torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------- the checks

def check_precision(c: Check) -> dict:
    import torch

    from rl_core.model.loading import enable_tf32, matmul_precision_kept

    enable_tf32(c.device)
    set_to = torch.get_float32_matmul_precision()
    with matmul_precision_kept():
        torch.set_float32_matmul_precision("highest")  # what vLLM's GPU worker does as it starts
    kept = torch.get_float32_matmul_precision()
    want = "high" if c.on_gpu else "highest"
    return {"ok": set_to == want and kept == set_to, "after_enable_tf32": set_to, "after_engine_start": kept,
            "expected": want, "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32)}


def planned(c: Check) -> dict:
    """The memory plan's trainer role for this config: resident bytes and its forward/backward and step phases,
    less what the CUDA caching allocator never holds (the runtime: context, cuBLAS and NCCL workspaces)."""
    from rl_core.placement.formulas import FORWARD, STEP
    from rl_core.placement.memory import memory_plan
    from rl_core.placement.model_shape import probe_model_shape

    shape, why = probe_model_shape(str(c.model_dir))
    if shape is None:
        raise RuntimeError(f"the memory plan could not read the model's shape: {why}")
    role = memory_plan(c.cfg, shape, prompt_tokens=c.b["prompt_tokens"]).role("trainer")
    outside = sum(it.bytes for it in role.items if it.name.startswith(("CUDA runtime", "NCCL buffers")))
    phases = role.phase_bytes()
    return {"resident": sum(it.bytes for it in role.items if it.phases is None) - outside,
            "step_peak": max(phases[FORWARD], phases[STEP]) - outside}


def check_train_step(c: Check) -> dict:
    import torch

    from rl_core.config import ModelConfig
    from rl_core.model.loading import load_policy

    model, c.tokenizer = load_policy(ModelConfig(name_or_path=str(c.model_dir)), device=c.device)
    trainer = c.make_trainer(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = c.batch()
    tokens = float(batch.loss_mask.sum())
    seconds, metrics = [], []
    if c.on_gpu:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(c.b["steps"]):
        model.train()
        c.synchronize()
        t = time.perf_counter()
        metrics.append(trainer.train_step(batch, None, None, c.b["budget"]))
        c.synchronize()
        seconds.append(time.perf_counter() - t)
    finite = all(math.isfinite(m["train/loss"]) and math.isfinite(m["train/grad_norm"]) for m in metrics)
    masters = all(p.dtype == torch.float32 for p in model.parameters())
    changed = sum(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    out = {"loss": metrics[-1]["train/loss"], "grad_norm": metrics[-1]["train/grad_norm"],
           "loss_tokens": int(tokens), "rows": int(batch.input_ids.shape[0]),
           "tokens_per_s": tokens / statistics.median(seconds[1:] or seconds),
           "step_s": [round(s, 4) for s in seconds], "float32_masters": masters,
           "parameters_changed": f"{changed}/{len(before)}"}
    plan = planned(c)
    out["plan_resident_bytes"], out["plan_step_peak_bytes"] = plan["resident"], plan["step_peak"]
    ok = finite and masters and changed == len(before)
    if c.on_gpu:  # the allocator's own figures: resident after a step, and the peak of the steps
        out["measured_resident_bytes"] = torch.cuda.memory_allocated()
        out["measured_step_peak_bytes"] = torch.cuda.max_memory_allocated()
        out["plan_holds"] = out["measured_step_peak_bytes"] <= plan["step_peak"]
        ok = ok and out["plan_holds"]
    c.trainer = trainer
    return {"ok": ok, **out}


def logprobs(model, ids):
    """The trainer's own log-probs of `ids` (`sequence_token_logprobs`), every token read."""
    import torch

    from rl_core.primitives.logprobs import sequence_token_logprobs

    with torch.no_grad():
        return sequence_token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)


def check_export(c: Check) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rl_core.model.loading import save_policy

    if c.trainer is None:
        raise RuntimeError("needs the trained policy of train_step, which failed")
    path = save_policy(c.trainer.model, c.tokenizer, c.work / "final_model")
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(c.device).eval()
    c.trainer.model.eval()
    ids = c.batch(seed=1).input_ids[:4, -64:].clamp(min=1)
    gap = float((logprobs(loaded, ids) - logprobs(c.trainer.model, ids)).abs().max())
    files = sorted(p.name for p in Path(path).iterdir())
    return {"ok": gap <= EXPORT_ATOL and "model.safetensors" in files, "logp_max_abs_diff": gap, "files": files}


def check_fsdp(c: Check) -> dict:
    import torch
    import torch.distributed as dist

    from infra.workers.sharded_load import load_sharded_policy
    from rl_core.config import ModelConfig
    from rl_core.model.loading import load_policy

    if not dist.is_initialized():
        dist.init_process_group("nccl" if c.on_gpu else "gloo", init_method=f"file://{c.work / 'pg'}",
                                rank=0, world_size=1)
        c.checkpoint_group = dist.new_group(backend="gloo")  # DCP's async save needs a CPU backend, as the ranks have
    cfg = ModelConfig(name_or_path=str(c.model_dir))
    sharded, _ = load_sharded_policy(cfg, c.device, c.dtype, (1, 1))
    plain, _ = load_policy(cfg)
    plain_state = plain.state_dict()
    differ = [name for name, value in sharded.state_dict().items()
              if not torch.equal(value.full_tensor().cpu() if hasattr(value, "full_tensor") else value.cpu(),
                                 plain_state[name])]
    c.sharded = c.make_trainer(sharded)
    sharded.train()
    m = c.sharded.train_step(c.batch(), None, None, c.b["budget"])
    finite = math.isfinite(m["train/loss"]) and math.isfinite(m["train/grad_norm"])
    return {"ok": not differ and finite and sharded.posttrain_load == "own shards", "backend": dist.get_backend(),
            "load": sharded.posttrain_load, "tensors": len(plain_state),
            "differ_from_plain_load": differ[:10], "loss": m["train/loss"], "grad_norm": m["train/grad_norm"]}


def check_dcp(c: Check) -> dict:
    import torch

    from infra.checkpoints.shards import read_shards, write_shards
    from infra.workers.sharded_load import load_sharded_policy
    from rl_core.config import ModelConfig

    if c.sharded is None:
        raise RuntimeError("needs the FSDP trainer of the fsdp check, which failed")
    directory = c.work / "checkpoint"
    directory.mkdir()
    tensors, rest = c.sharded.shard_state()
    t = time.perf_counter()
    pending = write_shards(tensors, directory, c.checkpoint_group)
    staged_s = time.perf_counter() - t
    files = pending.result()
    written_s = time.perf_counter() - t
    fresh, _ = load_sharded_policy(ModelConfig(name_or_path=str(c.model_dir)), c.device, c.dtype, (1, 1))
    restored = c.make_trainer(fresh)
    t = time.perf_counter()
    restored.load_shard_state(lambda layout: read_shards(layout, directory, c.checkpoint_group), rest)
    read_s = time.perf_counter() - t

    def full(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from full(value, f"{prefix}{key}.")
            elif isinstance(value, torch.Tensor):
                yield f"{prefix}{key}", value.full_tensor() if hasattr(value, "full_tensor") else value

    saved, back = dict(full(c.sharded.shard_state()[0])), dict(full(restored.shard_state()[0]))
    differ = [k for k in saved if k not in back or not torch.equal(saved[k], back[k])]
    return {"ok": not differ and saved.keys() == back.keys(), "tensors": len(saved), "differ": differ[:10],
            "bytes": sum(f["size"] for f in files.values()), "staged_s": staged_s, "written_s": written_s,
            "read_s": read_s}


CHECKS = {"precision": check_precision, "train_step": check_train_step, "export": check_export,
          "fsdp": check_fsdp, "dcp": check_dcp}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where gpu_check.json goes ($OUT)")
    parser.add_argument("--wheels", help="a directory of wheels to import from (pydantic on a bare image)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same checks on CPU, with a tiny shape")
    parser.add_argument("--download-wheels", metavar="DIR", help="where there is a network: download the pinned "
                        "pydantic wheels (constraints.txt's) a bare image needs into DIR, then stop")
    parser.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                        help="with --download-wheels: the GPU image's Python (default: this one's)")
    args = parser.parse_args(argv)
    if args.download_wheels:
        command = download_command(Path(args.download_wheels), args.python_version)
        print(" ".join(command[1:]), flush=True)
        return subprocess.run(command, check=False).returncode
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading bars
    os.environ.setdefault("TQDM_DISABLE", "1")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="posttrain-gpu-check-") as tmp:
        work = Path(tmp)
        wheels = use_wheels(Path(args.wheels), work / "wheels") if args.wheels else []
        if problem := pydantic_problem() or _import_problem("pydantic"):  # before anything imports it
            print(f"gpu_check: {problem}", file=sys.stderr)
            return _write(Path(args.out), {"error": problem, "wheels": wheels, "checks": {}}, started)
        sys.path.insert(0, str(REPO))
        import torch
        import transformers

        if not torch.cuda.is_available() and not args.cpu_dry_run:
            print("no CUDA GPU here: --cpu-dry-run runs the same checks on CPU with a tiny shape", file=sys.stderr)
            return 2
        device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.cpu_dry_run else torch.device("cpu")
        shape, batch = (GPU_SHAPE, GPU_BATCH) if device.type == "cuda" else (DRY_SHAPE, DRY_BATCH)
        report = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)",
                  "torch": torch.__version__, "transformers": transformers.__version__, "wheels": wheels,
                  "shape": shape, "batch": batch, "checks": {}}
        check = Check(device, build_model(work / "model", shape), work, batch)
        for name, run in CHECKS.items():
            t = time.perf_counter()
            try:
                result = run(check)
            except Exception as exc:  # noqa: BLE001 - reported in the JSON; the other checks still run
                result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            result["seconds"] = round(time.perf_counter() - t, 3)
            report["checks"][name] = result
            print(f"{name}: {'ok' if result['ok'] else 'FAILED'} ({result['seconds']:.1f} s)"
                  + ("" if result["ok"] else f" {json.dumps(result)[:600]}"), flush=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return _write(Path(args.out), report, started)


def _import_problem(module: str) -> str | None:
    """Why `module` does not import (e.g. a compiled wheel built for another Python), or None."""
    try:
        __import__(module)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return (f"{module} does not import ({type(exc).__name__}: {exc}); were its wheels downloaded for this "
                f"Python ({sys.version_info[0]}.{sys.version_info[1]}: --python-version)?")
    return None


def _write(out: Path, report: dict, started: float) -> int:
    """gpu_check.json under `out`; 0 when every check passed (a report with an `error` ran none: 1)."""
    report["seconds"] = round(time.perf_counter() - started, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"{out / 'gpu_check.json'}: {sum(r['ok'] for r in report['checks'].values())}/{len(CHECKS)} checks ok "
          f"in {report['seconds']} s")
    return 0 if report["checks"] and all(r["ok"] for r in report["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
