"""MLflow contents of real flow runs: the default SQLite store in the working directory, and a real
`mlflow server` on loopback. Expected values are computed here from the config, the run directory,
git and package metadata, not read back from the tracker.

Both runs carry credentials in the environment (and the server run one in its tracking URI,
$MLFLOW_TRACKING_URI: `tracking.mlflow_uri` refuses credentials); none of them may reach MLflow params,
tags, metrics or artifacts, nor the run's printed output.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from importlib.metadata import version
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.builders import STARTUP_TIMEOUT_S
from tests.conftest import FAST, recipe

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.e2e  # in-process flows on Ray, an MLflow server
SECRETS = {
    "HF_TOKEN": "hf_supersecret-xyz-5d1c9a",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-0b7e4f2a9c-do-not-log",
    "WANDB_API_KEY": "wandb-key-6a3f81e2c4",
    "DATABASE_PASSWORD": "db-pass-93be17d0",
}
URI_SECRET = "uri-pass-4f0e2b8d71"
# what FAST leaves out and these runs check: the completions table and MLflow's system metrics
TRACKED = ["tracking.sample_completions_every=10", "tracking.system_metrics=true"]


# ------------------------------------------------------------------------------------------ helpers

def make_cwd(path: Path, workdir: Path) -> Path:
    """A private working directory (own runs/ and mlflow.db) sharing the session's data and model."""
    (path / "artifacts").mkdir(parents=True)
    (path / "data").symlink_to(workdir / "data", target_is_directory=True)
    (path / "artifacts" / "tiny-model").symlink_to(workdir / "artifacts" / "tiny-model", target_is_directory=True)
    return path


def git_head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def run_flow(cwd: Path, overrides: list[str], secrets: dict[str, str]) -> dict:
    """One in-process flow run in `cwd` with `secrets` in the environment; what a test needs to check it."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    from flows.grpo import grpo

    heads = {git_head()}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        for name, value in secrets.items():
            mp.setenv(name, value)
        with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: STARTUP_TIMEOUT_S}):
            state = grpo(recipe("arithmetic"), overrides, return_state=True)
    heads.add(git_head())  # someone may commit while the run goes
    assert state.is_completed(), state.message
    return {"cwd": cwd, "overrides": overrides, "result": state.result(),
            "flow_run_id": str(state.state_details.flow_run_id), "git_heads": heads}


def all_artifacts(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for f in client.list_artifacts(run_id, path):
        out.extend(all_artifacts(client, run_id, f.path) if f.is_dir else [f.path])
    return out


def download_all(client, run_id: str, dst: Path) -> Path:
    from mlflow.artifacts import download_artifacts

    return Path(download_artifacts(run_id=run_id, artifact_path="", dst_path=str(dst),
                                   tracking_uri=client._tracking_client.tracking_uri))


def numeric_history(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out.setdefault(k, []).append((r["step"], float(v)))
    return out


def check_run(client, run: dict, tmp_path: Path, *, expected_params: dict[str, str], resolved_yaml: dict) -> str:
    """Everything MLflow holds for one finished flow run; returns the run id."""
    from mlflow.entities import ViewType

    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.algorithms.registry import build_objective
    from rl_core.config import config_hash, load_config

    cwd, overrides = run["cwd"], run["overrides"]
    cfg = load_config(recipe("arithmetic"), overrides)
    run_dir = cwd / "runs" / cfg.job.name
    run_id = run["result"]["mlflow_run_id"]

    experiment = client.get_experiment_by_name("posttrain")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{cfg.job.name}'",
                              run_view_type=ViewType.ALL)
    assert [r.info.run_id for r in runs] == [run_id]
    mlrun = client.get_run(run_id)
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == cfg.job.name

    # params: every flattened config value, as MLflow stores it (str)
    assert mlrun.data.params == expected_params

    # tags
    tags = mlrun.data.tags
    identity = build_objective(cfg, ObjectiveContext.from_config(cfg)).identity
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    assert tags["posttrain.algorithm"] == cfg.rl.objective.type == "legacy_pg"
    assert tags["posttrain.job_name"] == cfg.job.name
    assert tags["posttrain.recipe"] == recipe("arithmetic")
    assert tags["posttrain.config_hash"] == config_hash(cfg)
    assert json.loads(tags["posttrain.objective_identity"]) == json.loads(canonical)
    assert tags["posttrain.objective_hash"] == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert tags["posttrain.git_sha"] in run["git_heads"]
    assert tags["posttrain.git_dirty"] in ("true", "false")
    assert tags["posttrain.prefect_flow_run_id"] == run["flow_run_id"]
    assert tags["posttrain.version.torch"] == version("torch")
    assert tags["posttrain.version.transformers"] == version("transformers")
    assert tags["posttrain.attempts"] == "1"

    # metrics: every numeric key of metrics.jsonl (train/*, rollout/*, perf/*, val/*) at its steps
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(cfg.rl.max_steps + 1))
    want = numeric_history(records)
    for family in ("train/", "rollout/", "perf/", "val/"):
        assert any(k.startswith(family) for k in want), family
    assert {k for k in mlrun.data.metrics if not k.startswith("system/")} == set(want)  # system/*: MLflow's samples
    for key, points in want.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert got == points, key

    # artifacts
    names = all_artifacts(client, run_id)
    for name in ("config_resolved.yaml", "provenance/attempt_1.json", "plots/curve.png", "completions.json"):
        assert name in names, (name, names)
    assert not any(n.startswith("provenance/attempt_2") for n in names)
    local = download_all(client, run_id, tmp_path / "artifacts")
    assert yaml.safe_load((local / "config_resolved.yaml").read_text()) == resolved_yaml
    prov = json.loads((local / "provenance" / "attempt_1.json").read_text())
    assert prov["attempt"] == 1 and prov["config_hash"] == config_hash(cfg) and prov["resumed_from"] is None
    assert prov["prefect_flow_run_id"] == run["flow_run_id"] and prov["git_sha"] == tags["posttrain.git_sha"]
    assert (local / "plots" / "curve.png").read_bytes() == (run_dir / "curve.png").read_bytes()
    assert (local / "plots" / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # sample completions of the last step (tracking.sample_completions_every is longer than the run), with rewards
    table = pd.read_json(local / "completions.json", orient="split")
    batch = cfg.rollout.prompts_per_step * cfg.rollout.n
    assert list(table["step"]) == [cfg.rl.max_steps] * min(cfg.tracking.sample_completions, batch)
    assert table["reward"].between(0.0, 1.0).all() and table["prompt"].str.fullmatch(r"\d+\+\d+=").all()

    # the data splits as dataset inputs
    inputs = {t.value: d.dataset.name for d in mlrun.inputs.dataset_inputs for t in d.tags}
    assert inputs == {"training": cfg.data.train, "validation": cfg.data.val}

    # the final model: a LoggedModel of the run at the last step, its files those of final_model/
    (model,) = client.search_logged_models([experiment.experiment_id], filter_string=f"source_run_id = '{run_id}'")
    assert model.name == cfg.job.name
    assert [(o.model_id, o.step) for o in mlrun.outputs.model_outputs] == [(model.model_id, cfg.rl.max_steps)]
    files = download_model(client, model, tmp_path / "model") / "model"
    final = run_dir / "final_model"
    assert sorted(p.name for p in files.iterdir()) == sorted(p.name for p in final.iterdir())
    for p in final.iterdir():
        assert (files / p.name).read_bytes() == p.read_bytes(), p.name
    assert run["result"]["mlflow_url"].endswith(f"/#/experiments/{experiment.experiment_id}/runs/{run_id}")
    return run_id


def download_model(client, model, dst: Path) -> Path:
    from mlflow.artifacts import download_artifacts

    return Path(download_artifacts(artifact_uri=model.artifact_location, dst_path=str(dst),
                                   tracking_uri=client._tracking_client.tracking_uri))


def assert_no_secret_in_mlflow(client, run_id: str, dst: Path, secrets: list[str]) -> None:
    mlrun = client.get_run(run_id)
    texts = [*mlrun.data.params, *mlrun.data.params.values(), *mlrun.data.tags, *mlrun.data.tags.values(),
             *mlrun.data.metrics]
    files = [p for p in download_all(client, run_id, dst).rglob("*") if p.is_file()]
    assert len(files) >= 4
    models = client.search_logged_models([mlrun.info.experiment_id], filter_string=f"source_run_id = '{run_id}'")
    assert len(models) == 1
    for model in models:  # the final model: its params (the run's), tags and files
        files += [p for p in download_model(client, model, dst / "models" / model.model_id).rglob("*") if p.is_file()]
        texts += [*model.params.values(), *model.tags.values()]
    for secret in secrets:
        assert not [t for t in texts if secret in t], secret
    for path in files:
        data = path.read_bytes()
        for secret in secrets:
            assert secret.encode() not in data, (secret, path)


# -------------------------------------------------------------------------------------- SQLite

@pytest.fixture(scope="module")
def sqlite_run(tmp_path_factory, workdir) -> dict:
    cwd = make_cwd(tmp_path_factory.mktemp("track") / "cwd", workdir)
    return run_flow(cwd, [*FAST, *TRACKED, "job.name=track-e2e", "rl.max_steps=3"], SECRETS)


def test_sqlite_store_holds_params_tags_metrics_and_artifacts(sqlite_run, tmp_path):
    from mlflow import MlflowClient

    from rl_core.config import load_config
    from rl_core.config.loader import config_dict, flatten

    cwd = sqlite_run["cwd"]
    assert (cwd / "mlflow.db").is_file()  # the default store: ./mlflow.db of the working directory
    cfg = load_config(recipe("arithmetic"), sqlite_run["overrides"])
    client = MlflowClient(tracking_uri="sqlite:///" + str((cwd / "mlflow.db").resolve()))
    run_id = check_run(client, sqlite_run, tmp_path, expected_params={k: str(v) for k, v in flatten(cfg).items()},
                       resolved_yaml=config_dict(cfg))
    assert client.get_run(run_id).info.artifact_uri.startswith((cwd / "mlartifacts").resolve().as_uri())


def test_sqlite_run_holds_no_secret_from_the_environment(sqlite_run, tmp_path):
    from mlflow import MlflowClient

    cwd = sqlite_run["cwd"]
    client = MlflowClient(tracking_uri="sqlite:///" + str((cwd / "mlflow.db").resolve()))
    assert_no_secret_in_mlflow(client, sqlite_run["result"]["mlflow_run_id"], tmp_path / "dl", list(SECRETS.values()))
    # nor the local outputs of the run
    for path in (cwd / "runs" / "track-e2e").rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".yaml"):
            text = path.read_text(errors="replace")
            assert not [s for s in SECRETS.values() if s in text], path


# -------------------------------------------------------------------------------- mlflow server

@pytest.mark.slow
def test_mlflow_server_holds_the_run_and_no_secret(mlflow_server, tmp_path, workdir, capfd):
    """A flow run tracked by a loopback `mlflow server`, its URI ($MLFLOW_TRACKING_URI) carrying basic-auth
    credentials."""
    from mlflow import MlflowClient

    from rl_core.config import load_config
    from rl_core.config.loader import config_dict, flatten

    url, artifact_root = mlflow_server
    host = url.removeprefix("http://")
    uri = f"http://posttrain:{URI_SECRET}@{host}"
    cwd = make_cwd(tmp_path / "cwd", workdir)
    overrides = [*FAST, *TRACKED, "job.name=track-server", "rl.max_steps=2"]
    capfd.readouterr()
    run = run_flow(cwd, overrides, {**SECRETS, "MLFLOW_TRACKING_URI": uri})
    printed = capfd.readouterr()
    assert not (cwd / "mlflow.db").exists()  # nothing fell back to the default store

    cfg = load_config(recipe("arithmetic"), overrides)
    params = {k: str(v) for k, v in flatten(cfg).items()}
    assert params["tracking.mlflow_uri"] == "None"
    resolved = config_dict(cfg)
    client = MlflowClient(tracking_uri=url)
    run_id = check_run(client, run, tmp_path, expected_params=params, resolved_yaml=resolved)
    assert client.get_run(run_id).info.artifact_uri.startswith("mlflow-artifacts:")
    assert list(artifact_root.rglob("attempt_1.json")) and list(artifact_root.rglob("model.safetensors"))

    secrets = [*SECRETS.values(), URI_SECRET]
    assert_no_secret_in_mlflow(client, run_id, tmp_path / "dl", secrets)
    assert not [s for s in secrets if s in printed.out + printed.err]
    assert f"http://***@{host}" in printed.out  # MLflow's "View run ... at" line, scrubbed
