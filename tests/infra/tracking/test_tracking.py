"""MLflow tracking (infra/tracking/tracker.py): params, tags, metrics, artifacts, resume, redaction; MLflow's own objects
(standard tags, system metrics, dataset inputs, the completions table, the final model as a registered LoggedModel,
the experiment from $MLFLOW_EXPERIMENT_NAME, the UI address).

Against MLflow's SQLite store in a temporary working directory and against a real `mlflow server`
on loopback. Expected values are computed here independently of the tracker's own helpers.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import yaml

from infra.tracking.items import using_tracking_uri
from infra.tracking.tracker import RunTracker, TrackingError, redact, redact_text, resolve_tracking_uri
from rl_core.config import config_hash, load_config
from rl_core.config.loader import config_dict, flatten

ROOT = Path(__file__).resolve().parents[3]
ARITH = ROOT / "recipes" / "arithmetic.py"
OVERRIDES = ["job.name=track-test", "rl.max_steps=5", "tracking.experiment=posttrain-test"]
IDENTITY = {
    "objective": "grpo", "grpo_surrogate": "legacy_pg", "loss_type": "token-mean", "fixed_divisor": None,
    "temperature": 1.0, "kl_beta": 0.0, "unbiased_advantage": False, "advantage_eps": 1e-6,
    "shared_prefix_min_tokens": 0, "policy": {"name_or_path": "artifacts/tiny-model/warm", "compute_dtype": "float32"},
}
DVC = {"data/arithmetic/train.jsonl": "0f3a9c1e2b4d5f6a7b8c9d0e1f2a3b4c",
       "artifacts/tiny-model/warm": "1234567890abcdef1234567890abcdef.dir"}
# Fake metrics.jsonl lines: step 0 is the pre-training evaluation; None/NaN/strings are not metrics.
RECORDS = [
    {"step": 0, "val/accuracy": 0.05},
    {"step": 1, "train/loss": 0.9, "rollout/reward_mean": 0.1, "perf/tokens_per_s": 1200.0, "train/grad_norm": None},
    {"step": 2, "train/loss": 0.7, "rollout/reward_mean": 0.3, "perf/tokens_per_s": 1300.5, "note": "text"},
    {"step": 3, "train/loss": 0.5, "rollout/reward_mean": 0.6, "perf/tokens_per_s": float("nan"),
     "val/accuracy": 0.4, "perf/policy_version": 3},
]
RESUMED = [
    {"step": 3, "train/loss": 0.45, "rollout/reward_mean": 0.62, "perf/tokens_per_s": 1250.0},
    {"step": 4, "train/loss": 0.3, "rollout/reward_mean": 0.8, "perf/tokens_per_s": 1400.0},
    {"step": 5, "train/loss": 0.2, "rollout/reward_mean": 0.9, "val/accuracy": 0.7},
]


def expected_history(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                out.setdefault(k, []).append((r["step"], float(v)))
    return out


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def all_artifacts(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for f in client.list_artifacts(run_id, path):
        out.extend(all_artifacts(client, run_id, f.path) if f.is_dir else [f.path])
    return out


def download_text(client, run_id: str, path: str, dst: Path) -> str:
    from mlflow.artifacts import download_artifacts

    local = download_artifacts(run_id=run_id, artifact_path=path, dst_path=str(dst),
                               tracking_uri=client._tracking_client.tracking_uri)
    return Path(local).read_text()


def logged_models(uri: str, experiment_id: str) -> list:
    """`mlflow.search_logged_models` of an experiment, with `uri` as the process's tracking URI for the call."""
    import mlflow

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        return mlflow.search_logged_models(experiment_ids=[experiment_id], output_format="list")


def no_fluent_leftovers() -> None:
    """After a tracker: no active fluent run in this thread, the process's tracking URI as it was (unset here)."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    assert mlflow.active_run() is None
    assert utils._tracking_uri is None
    assert "MLFLOW_TRACKING_URI" not in os.environ


def exercise(cfg, tracker_uri: str | None, tmp_path: Path, model_dir: Path) -> tuple[str, str]:
    """Run a two-attempt tracked run and check everything MLflow holds; returns (uri, run_id)."""
    from mlflow import MlflowClient

    uri = tracker_uri or resolve_tracking_uri(cfg)
    client = MlflowClient(tracking_uri=uri)
    run_dir = tmp_path / "runs" / cfg.job.name

    # ---- attempt 1: a clean run
    with RunTracker(tracker_uri) as tracker:
        run_id = tracker.start(cfg, recipe="recipes/arithmetic.py", overrides=OVERRIDES,
                               objective_identity=IDENTITY, prefect_flow_run_id="flow-run-1", dvc_hashes=DVC)
        assert tracker.tracking_uri == uri
        assert client.get_run(run_id).info.status == "RUNNING"
        for r in RECORDS:
            tracker.log_metrics(r, step=r["step"])
        tracker.log_curve(RECORDS, run_dir / "curve.png")
        info = tracker.log_model(model_dir, cfg, step=3)
    assert (run_dir / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if tracker_uri is None:
        no_fluent_leftovers()

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == cfg.job.name
    assert client.get_experiment(run.info.experiment_id).name == cfg.tracking.experiment

    # params: the flattened resolved config, as MLflow stores values (str)
    assert run.data.params == {k: str(v) for k, v in flatten(cfg).items()}

    # tags
    tags = run.data.tags
    sha = git("rev-parse", "HEAD").strip()
    dirty = "true" if git("status", "--porcelain").strip() else "false"
    canonical = json.dumps(IDENTITY, sort_keys=True, separators=(",", ":"))
    expected_tags = {
        "posttrain.algorithm": "legacy_pg",
        "posttrain.job_name": "track-test",
        "posttrain.recipe": "recipes/arithmetic.py",
        "posttrain.config_hash": config_hash(cfg),
        "posttrain.objective_hash": hashlib.sha256(canonical.encode()).hexdigest()[:16],
        "posttrain.git_sha": sha,
        "posttrain.git_dirty": dirty,
        "posttrain.prefect_flow_run_id": "flow-run-1",
        "posttrain.dvc.data/arithmetic/train.jsonl": DVC["data/arithmetic/train.jsonl"],
        "posttrain.dvc.artifacts/tiny-model/warm": DVC["artifacts/tiny-model/warm"],
        "posttrain.version.python": platform.python_version(),
        "posttrain.attempts": "1",
    }
    for name in ("torch", "transformers", "vllm"):
        try:
            expected_tags[f"posttrain.version.{name}"] = version(name)
        except PackageNotFoundError:
            assert f"posttrain.version.{name}" not in tags
    assert {k: tags.get(k) for k in expected_tags} == expected_tags
    assert "posttrain.version.torch" in tags  # torch is a dependency: its tag must be there
    assert json.loads(tags["posttrain.objective_identity"]) == IDENTITY
    assert json.loads(tags["posttrain.overrides"]) == OVERRIDES

    # metrics: every numeric, finite key at its step (MLflow's system/* samples besides)
    want = expected_history(RECORDS)
    assert {k for k in run.data.metrics if not k.startswith("system/")} == set(want)
    for key, points in want.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert got == points, key

    # artifacts
    names = all_artifacts(client, run_id)
    for name in ("config_resolved.yaml", "provenance/attempt_1.json", "plots/curve.png"):
        assert name in names, (name, names)
    # the model is a LoggedModel of the run (its files under the model, not the run's artifacts)
    (model,) = logged_models(uri, run.info.experiment_id)
    assert (model.model_id, model.source_run_id, model.name) == (info.model_id, run_id, cfg.job.name)
    assert [(o.model_id, o.step) for o in run.outputs.model_outputs] == [(info.model_id, 3)]
    resolved = download_text(client, run_id, "config_resolved.yaml", tmp_path / "dl1")
    assert config_hash(load_config(Path(tmp_path / "dl1" / "config_resolved.yaml"))) == config_hash(cfg)
    assert yaml.safe_load(resolved) == config_dict(cfg)
    prov = json.loads(download_text(client, run_id, "provenance/attempt_1.json", tmp_path / "dl1"))
    assert prov["config_hash"] == config_hash(cfg)
    assert (prov["git_sha"], prov["git_dirty"]) == (sha, dirty)
    assert prov["python"] == platform.python_version()
    assert prov["resumed_from"] is None
    assert prov["hostname"] == socket.gethostname()
    when = datetime.fromisoformat(prov["attempt_time_utc"])
    assert when.utcoffset().total_seconds() == 0 and abs(datetime.now(UTC) - when).total_seconds() < 600
    from mlflow.artifacts import download_artifacts

    png = download_artifacts(run_id=run_id, artifact_path="plots/curve.png", dst_path=str(tmp_path / "dl1"),
                             tracking_uri=uri)
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[0] > 100 and image.shape[1] > 100

    # ---- attempt 2: resume the same run with a changed cadence key; it fails mid-way
    cfg2 = cfg.model_copy(deep=True)
    cfg2.rl.save_every = 7
    with pytest.raises(RuntimeError, match="worker died"), RunTracker(tracker_uri) as tracker:
        assert tracker.start(cfg2, recipe="recipes/arithmetic.py", overrides=[*OVERRIDES, "rl.save_every=7"],
                             objective_identity=IDENTITY, run_id=run_id, resumed_from="runs/track-test/ckpt/step_2",
                             prefect_flow_run_id="flow-run-2", dvc_hashes=DVC) == run_id
        assert client.get_run(run_id).info.status == "RUNNING"
        for r in RESUMED:
            tracker.log_metrics(r, step=r["step"])
        raise RuntimeError("worker died")
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    if tracker_uri is None:
        no_fluent_leftovers()  # the failed attempt left MLflow's active-run stack too
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert run.data.params["rl.save_every"] == str(cfg.rl.save_every)  # params keep their first value
    assert run.data.tags["posttrain.prefect_flow_run_id"] == "flow-run-2"
    assert run.data.tags["posttrain.resumed_from"] == "runs/track-test/ckpt/step_2"
    assert run.data.tags["posttrain.config_hash"] == config_hash(cfg2) != config_hash(cfg)
    names = all_artifacts(client, run_id)
    assert "provenance/attempt_1.json" in names and "provenance/attempt_2.json" in names
    prov2 = json.loads(download_text(client, run_id, "provenance/attempt_2.json", tmp_path / "dl2"))
    assert prov2["attempt"] == 2
    assert prov2["resumed_from"] == "runs/track-test/ckpt/step_2"
    assert prov2["config_hash"] == config_hash(cfg2)
    assert prov2["params_changed_since_first_attempt"] == {"rl.save_every": {"logged": str(cfg.rl.save_every), "now": "7"}}
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "rollout/reward_mean"))
    assert history == sorted(expected_history(RECORDS)["rollout/reward_mean"]
                             + expected_history(RESUMED)["rollout/reward_mean"])
    assert run.data.metrics["rollout/reward_mean"] == 0.9  # the latest step's value
    return uri, run_id


# -------------------------------------------------------------------------------- SQLite store


def test_tracking_uri_resolution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(ARITH, OVERRIDES)
    uri = resolve_tracking_uri(cfg)
    assert uri == "sqlite:///" + str(tmp_path.resolve() / "mlflow.db")
    assert uri.startswith("sqlite:////")  # absolute: four slashes
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert resolve_tracking_uri(cfg) == "http://127.0.0.1:5999"
    cfg.tracking.mlflow_uri = "http://mlflow.internal:5000"
    assert resolve_tracking_uri(cfg) == "http://mlflow.internal:5000"


def test_an_experiment_whose_artifacts_are_elsewhere_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A caller who may create experiments names one whose artifact location is theirs (tracking.experiment is
    allowlisted for flow runs): the run is refused naming it, for a new run and for a resumed run in it, and nothing
    is written there; the operator's own experiment is created under the store's root."""
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = "sqlite:///" + str(tmp_path / "mlflow.db")
    client = MlflowClient(tracking_uri=uri)
    theirs = tmp_path / "callers"
    planted = client.create_experiment("theirs", artifact_location=theirs.as_uri())
    planted_run = client.create_run(planted).info.run_id

    cfg = load_config(ARITH, [*OVERRIDES, "tracking.experiment=theirs"])
    with pytest.raises(TrackingError) as refused, RunTracker(tracking_uri=uri) as tracker:
        tracker.start(cfg, recipe="recipes/arithmetic.py", overrides=[], objective_identity=IDENTITY)
    message = str(refused.value)
    assert "'theirs'" in message and theirs.as_uri() in message and "tracking.experiment" in message
    with pytest.raises(TrackingError, match="'theirs'"), RunTracker(tracking_uri=uri) as tracker:
        tracker.start(load_config(ARITH, OVERRIDES), recipe="recipes/arithmetic.py", overrides=[],
                      objective_identity=IDENTITY, run_id=planted_run)  # a resume names the run, not the experiment
    assert not theirs.exists()
    assert [r.info.run_id for r in client.search_runs([planted])] == [planted_run]  # no run was started in it

    from infra.tracking.tracker import experiment_in_root, sqlite_artifact_location

    ours = experiment_in_root(client, uri, "posttrain-test")
    assert client.get_experiment(ours).artifact_location == sqlite_artifact_location(uri)
    assert experiment_in_root(client, uri, "posttrain-test") == ours


def test_a_server_experiment_must_sit_at_its_default_location():
    """Against a server the root is its default artifact root, read from the Default experiment (`<root>/0`): an
    experiment is accepted only at `<root>/<its id>`, not at a foreign file://, s3:// or mlflow-artifacts:// host."""
    from types import SimpleNamespace

    from infra.tracking.tracker import check_artifact_location

    class Server:
        def __init__(self, default: str):
            self.default = default

        def get_experiment(self, experiment_id):
            assert experiment_id == "0"
            return SimpleNamespace(artifact_location=self.default)

    def exp(location: str, experiment_id: str = "7"):
        return SimpleNamespace(name="x", experiment_id=experiment_id, artifact_location=location)

    served = Server("mlflow-artifacts:/0")
    assert check_artifact_location(served, "http://127.0.0.1:5000", exp("mlflow-artifacts:/7")) == "7"
    for foreign in ("file:///home/caller/loot", "s3://callers-bucket/x", "mlflow-artifacts://evil:80/7",
                    "mlflow-artifacts:/3", "mlflow-artifacts:/7/../3"):
        with pytest.raises(TrackingError, match="not under the artifact root"):
            check_artifact_location(served, "http://127.0.0.1:5000", exp(foreign))
    on_s3 = Server("s3://team/mlflow/0")
    assert check_artifact_location(on_s3, "http://127.0.0.1:5000", exp("s3://team/mlflow/7")) == "7"
    with pytest.raises(TrackingError, match="s3://team/mlflow-other/7"):
        check_artifact_location(on_s3, "http://127.0.0.1:5000", exp("s3://team/mlflow-other/7"))
    with pytest.raises(TrackingError, match="artifact root .* is not known"):
        check_artifact_location(Server("s3://team/odd"), "http://127.0.0.1:5000", exp("s3://team/odd/7"))


@pytest.mark.e2e
def test_sqlite_default_store_run_contents_and_resume(tmp_path, monkeypatch, workdir):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(ARITH, OVERRIDES)
    uri, run_id = exercise(cfg, None, tmp_path, workdir / "artifacts" / "tiny-model" / "init")
    assert uri == "sqlite:///" + str(tmp_path.resolve() / "mlflow.db")
    assert (tmp_path / "mlflow.db").is_file()
    from mlflow import MlflowClient

    artifact_uri = MlflowClient(tracking_uri=uri).get_run(run_id).info.artifact_uri
    assert artifact_uri.startswith((tmp_path.resolve() / "mlartifacts").as_uri())
    assert (tmp_path / "mlartifacts").is_dir()
    assert list((tmp_path / "mlartifacts").rglob("attempt_2.json"))


@pytest.mark.e2e
def test_finish_statuses_and_misuse(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mlflow import MlflowClient

    uri = "sqlite:///" + str(tmp_path.resolve() / "m.db")
    cfg = load_config(ARITH, OVERRIDES)
    with pytest.raises(TrackingError, match="start"):
        RunTracker(uri).log_metrics({"train/loss": 1.0}, step=1)
    tracker = RunTracker(uri)
    run_id = tracker.start(cfg, recipe="r.py", overrides=[], objective_identity=IDENTITY)
    with pytest.raises(ValueError, match="KILLED"):
        tracker.finish("DONE")
    tracker.finish("KILLED")
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "KILLED"
    no_fluent_leftovers()
    with pytest.raises(TrackingError, match="not a saved model directory"):
        tracker.log_model(tmp_path / "missing", cfg, step=1)
    with pytest.raises(TrackingError, match="not active"):  # a fluent call after finish would open a new run
        tracker.log_datasets(cfg, train=[], val=[])


# ---------------------------------------------------------------------------------- secrets

SECRET = "supersecret"


def test_redact_rule():
    kept = {"rollout.max_tokens": 4, "perf/tokens_per_s": 1.5, "rl.shared_prefix_min_tokens": 3,
            "rl.kl_estimator": "k3", "tracking.keep_checkpoints": 3, "max_new_tokens": 8, "eos_token": "<eos>",
            "model.name_or_path": "Qwen/Qwen2.5-0.5B", "tokenizer": "char"}
    assert redact(kept) == kept
    hidden = {"api_token": SECRET, "hf_token": SECRET, "auth_token": SECRET, "HF_TOKEN": SECRET,
              "AWS_SECRET_ACCESS_KEY": SECRET, "password": SECRET, "db.passwd": SECRET, "apiKey": SECRET,
              "AWS_ACCESS_KEY_ID": SECRET, "x.private_key": SECRET, "GITHUB_TOKEN": SECRET,
              "credentials": {"user": "me", "pw": SECRET}}
    assert redact(hidden) == {k: "***" for k in hidden}
    assert redact({"a": {"b": {"client_secret": SECRET, "n": 1}}}) == {"a": {"b": {"client_secret": "***", "n": 1}}}
    assert redact({"uri": f"https://user:{SECRET}@host/x"}) == {"uri": "https://***@host/x"}
    assert redact({"uris": [f"s3://AKIA:{SECRET}@bucket/p"]}) == {"uris": ["s3://***@bucket/p"]}
    assert redact_text(f"http://u:{SECRET}@127.0.0.1:5000/api") == "http://***@127.0.0.1:5000/api"
    assert redact_text(f"s3://AKIA:ab/{SECRET}@bucket/p") == "s3://***@bucket/p"  # AWS keys hold "/"
    assert redact_text(f"https://h/x?token={SECRET}&X-Amz-Signature={SECRET}&page=2") == \
        "https://h/x?token=***&X-Amz-Signature=***&page=2"
    assert redact_text("https://host:8080/path s3://bucket/prefix") == "https://host:8080/path s3://bucket/prefix"


@pytest.mark.e2e
def test_secrets_never_reach_mlflow(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    from rl_core.config import ConfigError, write_resolved

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    store = tmp_path / "store"
    store.mkdir()
    uri = "sqlite:///" + str(store.resolve() / "mlflow.db")
    overrides = [*OVERRIDES, f"tracking.mlflow_uri=http://user:{SECRET}@127.0.0.1:9/",
                 f"tracking.checkpoint_uri=s3://AKIAEXAMPLE:{SECRET}@bucket/prefix"]
    with pytest.raises(ConfigError) as refused:  # credentials in URI fields are refused at load ...
        load_config(ARITH, overrides)
    assert SECRET not in str(refused.value)
    # ... so such a config only exists unvalidated (a hand-built one, an old run directory's file):
    # the tracker still scrubs it
    cfg = load_config(ARITH, OVERRIDES)
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={
        "mlflow_uri": f"http://user:{SECRET}@127.0.0.1:9/",
        "checkpoint_uri": f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix"})})
    config_file = write_resolved(cfg, tmp_path / "run")  # the run directory's copy holds the secret
    assert SECRET in config_file.read_text()
    identity = {**IDENTITY, "reference": f"https://user:{SECRET}@hub.example/model"}
    with RunTracker(uri) as tracker:
        run_id = tracker.start(cfg, recipe="recipes/arithmetic.py", overrides=overrides, objective_identity=identity,
                               resumed_from=f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix/step_2",
                               config_path=config_file, dvc_hashes=DVC)
        tracker.log_metrics({"step": 1, "train/loss": 1.0}, step=1)
        tracker.log_curve(RECORDS, tmp_path / "run" / "curve.png")

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    params, tags = run.data.params, run.data.tags
    assert params["tracking.mlflow_uri"] == "http://***@127.0.0.1:9/"
    assert params["tracking.checkpoint_uri"] == "s3://***@bucket/prefix"
    assert params["rollout.max_tokens"] == str(cfg.rollout.max_tokens)
    assert json.loads(tags["posttrain.objective_identity"])["reference"] == "https://***@hub.example/model"
    # the hash is of the real identity, so two runs with different references still differ
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    assert tags["posttrain.objective_hash"] == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    for k, v in [*params.items(), *tags.items()]:
        assert SECRET not in k and SECRET not in v, (k, v)
    dst = tmp_path / "download"
    download_artifacts(run_id=run_id, artifact_path="", dst_path=str(dst), tracking_uri=uri)
    files = [p for p in dst.rglob("*") if p.is_file()]
    assert {p.relative_to(dst).as_posix() for p in files} >= {"config_resolved.yaml", "provenance/attempt_1.json"}
    for p in files:
        assert SECRET.encode() not in p.read_bytes(), p
    resolved = yaml.safe_load((dst / "config_resolved.yaml").read_text())
    assert resolved["tracking"]["checkpoint_uri"] == "s3://***@bucket/prefix"
    assert resolved["rollout"] == config_dict(cfg)["rollout"]
    # nothing in the store itself (database rows, artifact files) holds the secret either
    for p in store.rglob("*"):
        if p.is_file():
            assert SECRET.encode() not in p.read_bytes(), p


@pytest.mark.e2e
@pytest.mark.parametrize("userinfo", [f"user:{SECRET}", SECRET], ids=["user-password", "bare-token"])
def test_connection_error_text_is_redacted(tmp_path, monkeypatch, caplog, capsys, userinfo):
    """$MLFLOW_TRACKING_URI with basic-auth credentials (refused in tracking.mlflow_uri, allowed in the
    environment): an MLflow failure names the server, not the password, in the error, logs and output."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://{userinfo}@127.0.0.1:{port}")
    cfg = load_config(ARITH, OVERRIDES)
    with caplog.at_level("DEBUG"), pytest.raises(TrackingError) as info:
        RunTracker().start(cfg, recipe="r.py", overrides=[], objective_identity=IDENTITY)
    text = str(info.value)
    assert f"http://***@127.0.0.1:{port}" in text  # the message still says where it failed ...
    assert SECRET not in text  # ... without the password MLflow's own error quotes
    assert info.value.__cause__ is None and info.value.__suppress_context__
    printed = capsys.readouterr()
    assert SECRET not in caplog.text + printed.out + printed.err


# ------------------------------------------------------------------------------ mlflow server


@pytest.mark.e2e
def test_mlflow_server_run_contents_and_resume(mlflow_server, tmp_path, monkeypatch, capsys, workdir):
    url, artifact_root = mlflow_server
    monkeypatch.chdir(tmp_path)  # a fallback to the default store would land here, not in the repo
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(ARITH, [*OVERRIDES, f"tracking.mlflow_uri={url}"])
    flat_params = {k: str(v) for k, v in flatten(cfg).items()}
    assert flat_params["tracking.mlflow_uri"] == url
    uri, run_id = exercise(cfg, None, tmp_path, workdir / "artifacts" / "tiny-model" / "init")
    assert uri == url
    from mlflow import MlflowClient

    # artifacts went through the server's proxy into its destination directory
    assert MlflowClient(tracking_uri=url).get_run(run_id).info.artifact_uri.startswith("mlflow-artifacts:")
    assert list(artifact_root.rglob("attempt_2.json")) and list(artifact_root.rglob("curve.png"))

    # credentials in the server URI (HTTP basic auth, from $MLFLOW_TRACKING_URI: tracking.mlflow_uri refuses
    # them) reach neither params/tags nor printed text
    host = url.removeprefix("http://")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:{SECRET}@{host}")
    cfg = load_config(ARITH, [*OVERRIDES, "job.name=with-creds"])
    capsys.readouterr()
    with RunTracker() as tracker:
        run_id = tracker.start(cfg, recipe="recipes/arithmetic.py", overrides=[], objective_identity=IDENTITY)
        tracker.log_metrics({"train/loss": 0.5}, step=1)
    printed = capsys.readouterr()
    assert f"http://***@{host}" in printed.out  # MLflow's "View run" line, scrubbed
    assert SECRET not in printed.out + printed.err
    run = MlflowClient(tracking_uri=url).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics == {"train/loss": 0.5}
    assert run.data.params["tracking.mlflow_uri"] == "None"
    for k, v in [*run.data.params.items(), *run.data.tags.items()]:
        assert SECRET not in v, (k, v)

    # the server has no authentication: an experiment created with a location of the caller's is refused by name,
    # while the experiments above (at the server's own mlflow-artifacts:/<id>) were accepted
    theirs = tmp_path / "callers"
    MlflowClient(tracking_uri=url).create_experiment("theirs", artifact_location=theirs.as_uri())
    cfg = load_config(ARITH, [*OVERRIDES, f"tracking.mlflow_uri={url}", "tracking.experiment=theirs"])
    with pytest.raises(TrackingError, match="'theirs'"), RunTracker() as tracker:
        tracker.start(cfg, recipe="recipes/arithmetic.py", overrides=[], objective_identity=IDENTITY)
    assert not theirs.exists()


# --------------------------------------------------------------------- MLflow 3 objects of a run

def test_experiment_name_resolution(monkeypatch):
    from infra.tracking.tracker import resolve_experiment

    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    cfg = load_config(ARITH, ["job.name=track-test"])
    assert cfg.tracking.experiment is None
    assert resolve_experiment(cfg) == "posttrain"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    assert resolve_experiment(cfg) == "from-env"
    assert resolve_experiment(load_config(ARITH, OVERRIDES)) == "posttrain-test"  # the config's own name wins


def test_run_url_and_ui_command():
    from infra.tracking.tracker import run_url, ui_command

    assert run_url("http://127.0.0.1:5123", "7", "abc") == "http://127.0.0.1:5123/#/experiments/7/runs/abc"
    assert run_url(f"https://user:{SECRET}@mlflow.example/team/?x=1", "2", "r") == \
        "https://mlflow.example/team/#/experiments/2/runs/r"
    assert run_url("sqlite:////tmp/x/mlflow.db", "0", "r") == "http://127.0.0.1:5000/#/experiments/0/runs/r"
    assert ui_command("sqlite:////tmp/x/mlflow.db") == "mlflow ui --backend-store-uri sqlite:////tmp/x/mlflow.db"
    assert ui_command("http://127.0.0.1:5000") is None


def test_completion_rows_are_spread_over_the_batch():
    from infra.tracking.items import completions_frame
    from rl_core.tasks import Example

    examples = [Example(f"{i}+1=", str(i + 1)) for i in range(10)]
    texts = [f"text {i}" for i in range(10)]
    rewards = [float(i) / 10 for i in range(9)] + [None]
    frame = completions_frame(4, 2, examples, texts, rewards, 4, ["stop"] * 9 + ["length"])
    assert len(frame) == 4 and set(frame["step"]) == {4} and set(frame["attempt"]) == {2}
    picked = [int(t.split()[1]) for t in frame["completion"]]
    assert picked[0] == 0 and picked[-1] == 9 and len(set(picked)) == 4 and picked == sorted(picked)
    for _, row in frame.iterrows():  # each row keeps its own prompt, answer, reward and finish reason together
        i = int(row["completion"].split()[1])
        assert (row["prompt"], row["answer"]) == (examples[i].prompt, examples[i].answer)
        assert (row["reward"] == rewards[i]) if rewards[i] is not None else math.isnan(row["reward"])
        assert row["finish_reason"] == ("length" if i == 9 else "stop")
    assert len(completions_frame(1, 1, examples[:2], texts[:2], rewards[:2], 8)) == 2


def test_completion_rows_carry_the_rows_data_columns_and_each_rewards_value():
    from infra.tracking.items import completions_frame
    from rl_core.tasks import Example

    # TRL-style rows: the reference is `solution`, with other columns beside it; one column is named like a fixed one
    examples = [Example(f"q{i}", "", None, {"solution": str(i * 11), "difficulty": i % 2, "tags": ["sum", i],
                                            "reward": "from the data"}) for i in range(4)]
    texts = ["0", "11 ", "x", "33"]
    values = {"accuracy_reward": [1.0, 1.0, 0.0, 1.0], "format_reward": [1.0, 1.0, None, 1.0],
              "completion": [0.5, 0.5, 0.5, 0.5]}
    totals = [1.2 + 0.5, 1.2 + 0.5, 0.5, 1.2 + 0.5]  # 1.0 · accuracy + 0.2 · format (None: not applied) + 0.5 · 1
    frame = completions_frame(3, 1, examples, texts, totals, 3, ["stop"] * 4, values)
    assert list(frame.columns) == ["step", "attempt", "prompt", "solution", "difficulty", "tags", "data:reward",
                                   "completion", "reward", "accuracy_reward", "format_reward", "reward:completion",
                                   "finish_reason"]
    assert list(frame["prompt"]) == ["q0", "q2", "q3"]  # 3 of 4 spread: the first, the last and one between
    assert list(frame["solution"]) == ["0", "22", "33"] and list(frame["difficulty"]) == [0, 0, 1]
    assert list(frame["tags"]) == ['["sum", 0]', '["sum", 2]', '["sum", 3]']  # nested values as JSON text
    assert set(frame["data:reward"]) == {"from the data"}
    assert list(frame["reward"]) == pytest.approx([1.7, 0.5, 1.7])
    assert list(frame["accuracy_reward"]) == [1.0, 0.0, 1.0]
    assert frame["format_reward"][0] == 1.0 and math.isnan(frame["format_reward"][1]) and frame["format_reward"][2] == 1.0
    assert list(frame["reward:completion"]) == [0.5, 0.5, 0.5]
    # the built-in tasks' rows: the reference column is `answer`; no reward values, no reward columns
    plain = completions_frame(1, 1, [Example("1+2=", "3")], ["3"], [1.0], 8)
    assert list(plain.columns) == ["step", "attempt", "prompt", "answer", "completion", "reward", "finish_reason"]
    assert plain["answer"][0] == "3"


def _documented_table_call() -> str:
    """The python block of docs/tracking.md that reads the completions table back."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "tracking.md").read_text(), re.DOTALL)
    (block,) = [b for b in blocks if "completions.json" in b]
    return "\n".join(line.removeprefix("  ") for line in block.splitlines())  # a list item's


@pytest.mark.e2e  # RunTracker.start reads the git revision (a subprocess)
def test_the_documented_call_reads_the_completions_table_back(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import fluent

    from rl_core.tasks import Example

    monkeypatch.chdir(tmp_path)  # the default store: sqlite:///mlflow.db here, as the documented call reads it
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(ARITH, ["job.name=table-doc", "tracking.system_metrics=false"])
    examples = [Example(f"{i}+{i}=", "", None, {"solution": str(2 * i)}) for i in range(4)]
    texts = ["0", "2", "5", "6"]
    values = {"accuracy_reward": [1.0, 1.0, 0.0, 1.0], "format_reward": [1.0, 1.0, 1.0, 1.0]}
    totals = [1.2, 1.2, 0.2, 1.2]
    with RunTracker() as tracker:
        run_id = tracker.start(cfg, recipe="recipes/arithmetic.py", overrides=[], objective_identity=IDENTITY)
        for step in (1, 2):
            tracker.log_completions(step, examples, texts, totals, count=4, reward_values=values)
    no_fluent_leftovers()

    scope = {"run_id": run_id}
    exec(_documented_table_call(), scope)  # noqa: S102 - the documentation's own code, as a reader runs it
    table = scope["table"]
    assert list(table["step"]) == [1] * 4 + [2] * 4
    assert [str(v) for v in table["solution"]] == ["0", "2", "4", "6"] * 2  # (read back, "0" comes as a number)
    assert list(table["accuracy_reward"]) == [1.0, 1.0, 0.0, 1.0] * 2
    assert list(table["format_reward"]) == [1.0] * 8
    assert list(table["reward"]) == pytest.approx(totals * 2)

    # the fluent call reads the active experiment only: as the page says, set the run's experiment first
    docs = (ROOT / "docs" / "tracking.md").read_text()
    assert 'mlflow.set_experiment("posttrain")' in docs and 'mlflow.load_table("completions.json", run_ids=[run_id])' in docs
    monkeypatch.setattr(fluent, "_active_experiment_id", None)  # what set_experiment changes, put back afterwards
    try:
        with using_tracking_uri("sqlite:///mlflow.db"):
            with pytest.raises(mlflow.exceptions.MlflowException):  # without it: not in the Default experiment
                mlflow.load_table("completions.json", run_ids=[run_id])
            mlflow.set_experiment("posttrain")
            fluent_table = mlflow.load_table("completions.json", run_ids=[run_id])
    finally:
        os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
    assert fluent_table.equals(table)


def test_dataset_sources_name_the_file_or_the_hub_dataset(tmp_path):
    from infra.tracking.items import dataset_source

    local = tmp_path / "train.jsonl"
    local.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert dataset_source(str(local), None) == local.resolve().as_uri()
    hub = dataset_source("openai/gsm8k:test", "main")
    assert (type(hub).__name__, hub.path, hub.split, hub.config_name) == ("HuggingFaceDatasetSource", "openai/gsm8k",
                                                                          "test", "main")
    assert dataset_source("org/prompts", None).split == "train"  # what the tasks load when no split is named


@pytest.mark.e2e
@pytest.mark.slow
def test_mlflow3_objects_on_a_server(mlflow_server, workdir, tmp_path, monkeypatch):
    """One tracked run on a loopback `mlflow server`: MLflow's standard tags, system metrics, the experiment from
    $MLFLOW_EXPERIMENT_NAME, the two data splits as dataset inputs, the completions table, the final model as a
    registered LoggedModel that loads back with the same weights, and the run's UI address."""
    import mlflow
    import pandas as pd
    from mlflow import MlflowClient
    from safetensors.torch import load_file

    from rl_core.tasks import get_task

    url, _ = mlflow_server
    monkeypatch.chdir(workdir)  # the config's data paths are relative to it
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    model_dir = workdir / "artifacts" / "tiny-model" / "init"
    cfg = load_config(ARITH, ["job.name=mlflow3", f"tracking.mlflow_uri={url}",
                              "tracking.registered_model_name=posttrain-tiny"])
    task = get_task(cfg.data.task)
    train, val = task.load(cfg.data.train, cfg.data), task.load(cfg.data.val, cfg.data)
    batch = train[:6]
    texts = [f"{e.answer} done {i}" for i, e in enumerate(batch)]
    rewards = [1.0, 0.0, 0.5, 1.0, 0.25, 0.0]

    with RunTracker() as tracker:
        run_id = tracker.start(cfg, recipe="recipes/arithmetic.py", overrides=[], objective_identity=IDENTITY)
        tracker.log_datasets(cfg, train=train, val=val)
        for step in (1, 2):
            tracker.log_metrics({"train/loss": 1.0 / step}, step=step)
            tracker.log_completions(step, batch, texts, rewards, count=3, finish_reasons=["stop"] * 6)
        time.sleep(2.5)  # a few system-metrics samples at a 1 s interval
        info = tracker.log_model(model_dir, cfg, step=2)
        assert tracker.url == f"{url}/#/experiments/{tracker.experiment_id}/runs/{run_id}"
    no_fluent_leftovers()

    client = MlflowClient(tracking_uri=url)
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "from-env"
    tags = run.data.tags
    assert tags["mlflow.user"] == getpass.getuser()
    assert tags["mlflow.source.name"] == sys.argv[0] and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.git.commit"] == git("rev-parse", "HEAD").strip()
    assert tags["mlflow.runName"] == "mlflow3"
    system = {k for k in run.data.metrics if k.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system, system

    # dataset inputs: the two splits, by context, each with its source file and its row count
    inputs = {t.value: d.dataset for d in run.inputs.dataset_inputs for t in d.tags if t.key == "mlflow.data.context"}
    assert set(inputs) == {"training", "validation"}
    for context, key, rows in (("training", cfg.data.train, train), ("validation", cfg.data.val, val)):
        ds = inputs[context]
        assert ds.name == key and ds.source_type == "local"
        assert json.loads(ds.source)["uri"] == (workdir / key).resolve().as_uri()
        assert json.loads(ds.profile)["num_rows"] == len(rows) == len((workdir / key).read_text().splitlines())
    assert inputs["training"].digest != inputs["validation"].digest

    # the completions table: 3 rows per logged step, each a completion of the batch with its own reward
    local = client.download_artifacts(run_id, "completions.json", str(tmp_path))
    table = pd.read_json(local, orient="split")
    assert list(table["step"]) == [1, 1, 1, 2, 2, 2] and set(table["attempt"]) == {1}
    for _, row in table.iterrows():
        i = texts.index(row["completion"])
        assert (row["prompt"], row["reward"]) == (batch[i].prompt, rewards[i])
    assert {"path": "completions.json", "type": "table"} in json.loads(tags["mlflow.loggedArtifacts"])

    # the final model: a LoggedModel of the run, registered, that loads back with the trained weights
    (model,) = logged_models(url, run.info.experiment_id)
    assert (model.model_id, model.source_run_id, model.name) == (info.model_id, run_id, "mlflow3")
    assert model.tags["posttrain.job_name"] == "mlflow3"
    version = client.get_model_version("posttrain-tiny", "1")
    assert (version.source, version.run_id) == (f"models:/{model.model_id}", run_id)
    with monkeypatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", url)
        loaded = mlflow.transformers.load_model(f"models:/{model.model_id}", return_type="components")
    saved = load_file(model_dir / "model.safetensors")
    state = loaded["model"].state_dict()
    assert set(saved) <= set(state)
    assert all(state[k].equal(v) for k, v in saved.items())
    from transformers import AutoTokenizer

    assert loaded["tokenizer"]("12+34=")["input_ids"] == AutoTokenizer.from_pretrained(model_dir)("12+34=")["input_ids"]
