"""Helpers shared by the end-to-end run tests (resume, faults, OPD/DPO flows): run the GRPO flow on the
tiny model with a math-bearing config, read its metrics, compare trajectories, read MLflow and checkpoints."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path

from tests.builders import STARTUP_TIMEOUT_S
from tests.conftest import FAST, recipe

VENV_BIN = Path(sys.executable).parent
# non-zero gradients on the random-init model (KL to another random init) and a per-step lr (warmup)
MATH = [*FAST, "rl.objective.kl_beta=0.1", "rl.reference=artifacts/tiny-model/ref", "rl.optimizer.lr=1e-3",
        "rl.optimizer.warmup_steps=8"]


# ------------------------------------------------------------------------------------------ helpers

def trainer_logprobs(model_dir: Path, completions, temperature: float):
    """The trainer's fp32 recomputation of an engine's sampled tokens' log-probs (the loss's formula), 0 elsewhere."""
    import torch

    from rl_core.config.schema import ModelConfig
    from rl_core.model.loading import load_policy
    from rl_core.primitives.logprobs import sequence_token_logprobs

    model, _ = load_policy(ModelConfig(name_or_path=str(model_dir)))
    with torch.no_grad():
        lp = sequence_token_logprobs(model, completions.input_ids, completions.attention_mask, temperature=temperature)
    return lp * completions.response_mask


def run_flow(*overrides: str) -> dict:
    """The flow in-process (cwd is the working directory), with the MATH overrides first."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    from flows.grpo import grpo

    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: STARTUP_TIMEOUT_S}):
        return grpo(recipe("arithmetic"), [*MATH, *overrides])


def read_metrics(run_dir: Path) -> list[dict]:
    """Complete lines only (a writer may be mid-line while a test polls)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]


def math_view(records: list[dict]) -> list[dict]:
    """Every value except timings (perf/*), which differ between any two runs."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


def assert_same_math(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(math_view(got), math_view(want)):
        assert sorted(g) == sorted(w), f"step {w['step']}: keys differ: {sorted(set(g) ^ set(w))}"
        diff = {k: (g[k], w[k]) for k in w if g[k] != w[k]}  # ==: bitwise for the floats JSON round-trips
        assert not diff, f"step {w['step']}: values differ (resumed, straight): {diff}"


def mlflow_client(cwd: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri="sqlite:///" + str(cwd.resolve() / "mlflow.db"))


def artifact_paths(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for f in client.list_artifacts(run_id, path):
        out.extend(artifact_paths(client, run_id, f.path) if f.is_dir else [f.path])
    return out


def provenance(client, run_id: str, attempt: int, dst: Path) -> dict:
    from mlflow.artifacts import download_artifacts

    local = download_artifacts(run_id=run_id, artifact_path=f"provenance/attempt_{attempt}.json",
                               dst_path=str(dst), tracking_uri=client._tracking_client.tracking_uri)
    return json.loads(Path(local).read_text())


def checkpoint_steps(run_dir: Path) -> list[int]:
    from infra.checkpoints.store import CheckpointStore, checkpoint_step

    return [checkpoint_step(p) for p in CheckpointStore(run_dir / "checkpoints").list_valid()]


def run_state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run_state.json").read_text())


# --------------------------------------------------------------------------- plan_resume, directly

def small_config(*overrides: str):
    from rl_core.config import load_config

    return load_config(recipe("arithmetic"), [*MATH, "job.name=plan", *overrides])


def save_checkpoint(store, cfg, step: int, run_id: str = "run-abc") -> None:
    import torch

    from infra.checkpoints.resume import checkpoint_meta

    store.save(step, {"trainer": {"w": torch.full((2, 3), float(step))}, "driver": {"step": step}},
               checkpoint_meta(cfg, mlflow_run_id=run_id))


def phase(task_run_name: str) -> str:
    """The phase of a task run's name: `rollout step 12` (the step loop's tasks), `save_model`, or Prefect's own
    `<name>-<key>` (a task without a name template)."""
    return re.sub(r"( step \d+|-[0-9a-z]+)$", "", task_run_name)


def task_runs(flow_run_id, settle_s: float = 1.5, timeout_s: float = 60.0) -> list:
    """The flow run's task runs as the API has recorded them. The server records task-run states from events, in
    batches (infra.services.prefect_api.PREFECT_SERVER_DEFAULTS: at least once a second), so read until two reads `settle_s`
    apart agree and every run is in a final state."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def fetch():
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    def snapshot(runs) -> list:
        return sorted((str(r.id), r.state.type.value if r.state else None) for r in runs)

    deadline = time.monotonic() + timeout_s
    runs = asyncio.run(fetch())
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        again = asyncio.run(fetch())
        if snapshot(again) == snapshot(runs) and all(r.state is not None and r.state.is_final() for r in again):
            return again
        runs = again
    return runs
