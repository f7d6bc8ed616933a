"""The OPD flow end to end on CPU: real Prefect, Ray (policy workers + the teacher actor) and MLflow on SQLite."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import LEAN, recipe
from tests.run_helpers import phase, read_metrics, task_runs

PHASES = ("rollout", "reward", "annotate", "teacher", "distill", "validate", "train", "sync")
# the random-init student, a briefly warm-started teacher (different weights: a non-zero signal)
OPD_FAST = [
    "model.name_or_path=artifacts/tiny-model/init",
    "model.teacher=artifacts/tiny-model/fast-teacher",
    "rollout.prompts_per_step=4",
    "rollout.n=4",
    "rl.validation.max_prompts=16",
    "rl.validation.every_steps=2",
    "rl.optimizer.lr=1e-3",
    *LEAN,
]
# the module's run, and the run the resume test compares with: two teacher replicas on the one trainer rank (every
# step's batch is scored in two shards), a checkpoint at step 2
OPD_RUN = [*OPD_FAST, "rl.save_every=2", "cluster.teacher_replicas=2"]


@pytest.fixture(scope="module")
def opd_dir(workdir, tmp_path_factory) -> Path:
    """A copy of the work directory with a fast teacher (20 supervised steps from the init)."""
    from rl_core.training.warm_start import warm_start

    root = tmp_path_factory.mktemp("opd")
    shutil.copytree(workdir / "data", root / "data")
    shutil.copytree(workdir / "artifacts", root / "artifacts")
    warm_start(root / "artifacts/tiny-model/init", root / "data/arithmetic/train.jsonl",
               root / "data/arithmetic/val.jsonl", root / "artifacts/tiny-model/fast-teacher", steps=20,
               max_val_examples=8)
    return root


@pytest.fixture(scope="module")
def opd_run(opd_dir):
    import os

    from flows.opd import opd

    cwd = os.getcwd()
    os.chdir(opd_dir)
    try:
        state = opd(recipe("opd_arithmetic"), [*OPD_RUN, "job.name=opd-fast", "rl.max_steps=3"], return_state=True)
    finally:
        os.chdir(cwd)
    return state, opd_dir / "runs" / "opd-fast"


@pytest.mark.e2e
def test_every_phase_runs_each_step(opd_run):
    state, _ = opd_run
    assert state.is_completed(), state.message
    names = Counter(phase(r.name) for r in task_runs(state.state_details.flow_run_id))
    for name in PHASES:
        assert names[name] == 3, f"{name}: {names[name]} task runs for 3 steps"
    assert names["evaluate"] == 3  # before training, step 2 (every_steps) and the final step 3
    assert names["checkpoint"] == 2


@pytest.mark.e2e
def test_metrics_keys_and_teacher_signal(opd_run):
    _, run_dir = opd_run
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "val/accuracy" in records[0]
    step1 = records[1]
    for key in ("train/loss", "train/reverse_kl", "train/grad_norm", "train/entropy", "rollout/reward_mean",
                "rollout/logp_abs_diff", "opd/teacher_reverse_kl", "opd/teacher_logp_mean",
                "opd/kl_advantage_mean", "perf/teacher_s", "perf/distill_s", "perf/train_s", "perf/step_s"):
        assert key in step1, key
    # the student samples its own tokens; the teacher disagrees: a non-zero reverse KL on them
    assert step1["opd/teacher_reverse_kl"] != 0.0 and step1["opd/teacher_logp_mean"] < 0
    assert step1["rollout/logp_abs_diff"] < 1e-4
    assert "val/accuracy" in records[2] and "val/accuracy" in records[3]


@pytest.mark.e2e
def test_the_teacher_replicas_run_beside_the_trainer_rank(opd_run):
    _, run_dir = opd_run
    where = json.loads((run_dir / "placement.json").read_text())
    trainer, teachers = where["trainers"][0], where["teachers"]
    assert trainer["float32_matmul_precision"] == "highest"  # the rank's own setting: TF32 is for CUDA only
    assert len(teachers) == 2 and len({t["pid"] for t in teachers} | {trainer["pid"]}) == 3
    assert all(t["node_id"] == trainer["node_id"] and t["device"] == "cpu" for t in teachers)


@pytest.mark.e2e
def test_checkpoints_and_mlflow_run(opd_run):
    from mlflow import MlflowClient

    _, run_dir = opd_run
    from tests.run_helpers import checkpoint_steps

    assert checkpoint_steps(run_dir) == [2, 3]
    assert (run_dir / "final_model" / "config.json").is_file()
    run_id = json.loads((run_dir / "run_state.json").read_text())["mlflow_run_id"]
    client = MlflowClient(tracking_uri="sqlite:///" + str((run_dir.parents[1] / "mlflow.db").resolve()))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["rl.objective.type"] == "opd"
    assert [m.step for m in client.get_metric_history(run_id, "opd/teacher_reverse_kl")] == [1, 2, 3]


@pytest.mark.e2e
def test_exact_resume(opd_run, opd_dir, monkeypatch):
    """Two steps, then a resume from the step-2 checkpoint to step 3, equal the module's straight 3-step run."""
    from flows.opd import opd
    from tests.run_helpers import assert_same_math

    monkeypatch.chdir(opd_dir)
    opd(recipe("opd_arithmetic"), [*OPD_RUN, "job.name=opd-resumed", "rl.max_steps=2"])
    opd(recipe("opd_arithmetic"), [*OPD_RUN, "job.name=opd-resumed", "rl.max_steps=3"])
    straight = read_metrics(opd_run[1])
    resumed = read_metrics(opd_dir / "runs" / "opd-resumed")
    assert_same_math(resumed, straight)


@pytest.mark.e2e
def test_cli_refuses_opd_without_a_teacher(opd_dir, monkeypatch, capsys):
    from cli.main import main

    monkeypatch.chdir(opd_dir)
    rc = main(["run", recipe("opd_arithmetic"), "--", *OPD_FAST[:1], "model.teacher=null", "job.name=no-teacher",
               "rl.max_steps=1"])
    assert rc == 1
    assert "model.teacher is not set" in capsys.readouterr().err
    assert not (opd_dir / "runs" / "no-teacher" / "metrics.jsonl").exists()


@pytest.mark.e2e
def test_cli_runs_opd(opd_dir, monkeypatch, capsys):
    from cli.main import main

    monkeypatch.chdir(opd_dir)
    rc = main(["run", recipe("opd_arithmetic"), "--", *OPD_FAST, "job.name=opd-cli", "rl.max_steps=1"])
    assert rc == 0
    assert "held-out accuracy" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(opd_dir / "runs" / "opd-cli")] == [0, 1]


@pytest.mark.e2e
@pytest.mark.slow
def test_opd_moves_the_student_toward_the_teacher(workdir, warm_model, teacher_model, tmp_path, monkeypatch):
    """The recipe's warm student (0.72) and its teacher, the warm start trained further (session fixtures, built
    by the same params as the flow's auto-build)."""
    from flows.opd import opd
    from infra.artifacts import load_params
    from rl_core.config import ModelConfig
    from rl_core.evaluation.heldout import evaluate_accuracy
    from rl_core.model.loading import load_policy
    from rl_core.tasks import load_examples

    shutil.copytree(workdir / "data", tmp_path / "data")
    shutil.copytree(warm_model[0], tmp_path / "artifacts" / "tiny-model" / "warm")
    shutil.copytree(teacher_model[0], tmp_path / "artifacts" / "tiny-model" / "teacher")
    monkeypatch.chdir(tmp_path)
    assert load_params()["teacher_warm_start"]["steps"] > 0  # the teacher is the warm start trained further
    assert teacher_model[1]["val_accuracy_before"] == warm_model[1]["val_accuracy"]  # (it starts from the warm)
    result = opd(recipe("opd_arithmetic"), ["job.name=opd-learn", "rl.max_steps=40", "rl.validation.every_steps=20",
                                            "rl.validation.max_prompts=200", "rl.save_every=0"])
    records = read_metrics(Path(result["run_dir"]))
    acc = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    model, tok = load_policy(ModelConfig(name_or_path="artifacts/tiny-model/teacher"))
    teacher = evaluate_accuracy(model, tok, load_examples("data/arithmetic/val.jsonl", "arithmetic")[:200],
                                task="arithmetic", max_tokens=4)["accuracy"]
    print(f"student {acc[0]:.3f} -> {acc[-1]:.3f}, teacher {teacher:.3f}")
    assert teacher > acc[0] + 0.1, "the teacher must be better than the student"
    assert acc[-1] >= acc[0] + 0.05, f"OPD did not move the student toward the teacher: {acc}"


def test_missing_teacher_is_built_from_the_warm_start(workdir, tmp_path, monkeypatch):
    """What `opd` does before its first step when the recipe's models are missing: warm start, then the teacher
    trained further from it (params.yaml of the working directory; tiny step counts here)."""
    import yaml
    from safetensors.torch import load_file

    from infra.artifacts import ensure_quickstart_artifacts
    from rl_core.config import load_config
    from rl_core.training.warm_start import warm_start

    shutil.copytree(workdir / "data", tmp_path / "data")
    shutil.copytree(workdir / "artifacts", tmp_path / "artifacts")
    params = yaml.safe_load((Path(recipe("opd_arithmetic")).parents[1] / "params.yaml").read_text())
    params["warm_start"].update(steps=4, batch_size=8)
    params["teacher_warm_start"].update(steps=3, batch_size=8)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(tmp_path)
    messages: list[str] = []
    built = ensure_quickstart_artifacts(load_config(recipe("opd_arithmetic")), announce=messages.append)
    assert built == ["warm_start", "teacher_warm_start"]
    init, warm, teacher = (load_file(tmp_path / "artifacts" / "tiny-model" / d / "model.safetensors")
                           for d in ("init", "warm", "teacher"))
    assert any(not warm[k].equal(init[k]) for k in warm) and any(not teacher[k].equal(warm[k]) for k in warm)
    assert any("further into the tiny teacher" in m for m in messages)
    # the same training from the warm start, by hand, gives the same weights
    data = tmp_path / "data" / "arithmetic"
    warm_start(tmp_path / "artifacts" / "tiny-model" / "warm", data / "train.jsonl", data / "val.jsonl",
               tmp_path / "by-hand", **params["teacher_warm_start"])
    by_hand = load_file(tmp_path / "by-hand" / "model.safetensors")
    assert all(teacher[k].equal(by_hand[k]) for k in teacher)
    assert ensure_quickstart_artifacts(load_config(recipe("opd_arithmetic")), announce=messages.append) == []
