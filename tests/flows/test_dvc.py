"""DVC: the quickstart pipeline in a fresh clone, change propagation, local and S3 remotes, and
`posttrain summarize`.

The pipeline tests `git clone` this repository (its committed HEAD: what CI runs) into a temporary
directory, shrink params.yaml there so the whole pipeline takes about a minute on a CPU, and run the
real `dvc` and `posttrain` of this virtual environment. PYTHONPATH points at the clone, so the stages
run the clone's code rather than the checkout the editable install points at. The S3 remote is moto
in server mode on 127.0.0.1, started and stopped (by its pid) here.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
QUICKSTART = ("arithmetic_data", "arithmetic_pairs", "tiny_model", "warm_start", "teacher_warm_start", "train",
              "summarize")
UPSTREAM_OF_TRAIN = ("arithmetic_data", "tiny_model", "warm_start")
GSM8K_STAGE = "pipelines/gsm8k/dvc.yaml:gsm8k_data"
OWN_DATA_STAGE = "pipelines/own_data/dvc.yaml:own_data"
# The pipelines outside the default target, by the output that shows one was built.
GUESS_STAGES = ("pipelines/guess_number/dvc.yaml:guess_number", "pipelines/guess_number/dvc.yaml:guess_warm_start")
CHAT_STAGES = ("pipelines/chat_arithmetic/dvc.yaml:chat_arithmetic", "pipelines/chat_arithmetic/dvc.yaml:chat_warm_start")
TOOL_STAGES = ("pipelines/tool_arithmetic/dvc.yaml:tool_arithmetic",
               "pipelines/tool_arithmetic/dvc.yaml:tool_warm_start")
PPO_STAGE = "pipelines/ppo_arithmetic/dvc.yaml:ppo_train"
RLHF_STAGES = tuple(f"pipelines/rlhf_arithmetic/dvc.yaml:{s}" for s in ("rm_pairs", "rm_train", "rlhf_train"))
JUDGE_STAGES = tuple(f"pipelines/judge_arithmetic/dvc.yaml:{s}" for s in ("judge_data", "judge_model", "judge_train"))
MOE_STAGES = ("pipelines/moe_arithmetic/dvc.yaml:tiny_moe_model", "pipelines/moe_arithmetic/dvc.yaml:moe_warm_start")
CODE_STAGES = ("pipelines/code_arithmetic/dvc.yaml:code_arithmetic",
               "pipelines/code_arithmetic/dvc.yaml:code_warm_start")
OPTIONAL = {GSM8K_STAGE: "data/gsm8k", OWN_DATA_STAGE: "data/own-data", GUESS_STAGES[0]: "data/guess-number",
            GUESS_STAGES[1]: "artifacts/tiny-model/guess-warm", TOOL_STAGES[0]: "data/tool-arithmetic",
            TOOL_STAGES[1]: "artifacts/tiny-model/tool-warm", CHAT_STAGES[0]: "data/chat-arithmetic",
            CHAT_STAGES[1]: "artifacts/tiny-model/chat", MOE_STAGES[0]: "artifacts/tiny-moe/init",
            MOE_STAGES[1]: "artifacts/tiny-moe/warm", CODE_STAGES[0]: "data/code-arithmetic",
            CODE_STAGES[1]: "artifacts/tiny-model/code-warm", PPO_STAGE: "runs/ppo-arithmetic/final_model",
            RLHF_STAGES[0]: "data/arithmetic-rm-pairs", RLHF_STAGES[1]: "runs/rm-arithmetic/final_model",
            RLHF_STAGES[2]: "runs/rlhf-arithmetic/final_model", JUDGE_STAGES[0]: "data/arithmetic-judge",
            JUDGE_STAGES[1]: "artifacts/tiny-model/judge", JUDGE_STAGES[2]: "runs/judge-arithmetic/final_model"}
UP_TO_DATE = "Data and pipelines are up to date."
# Every output of the quickstart stages: what `dvc pull` must bring back.
OUTPUTS = (
    "data/arithmetic",
    "data/arithmetic-pairs",
    "artifacts/tiny-model/init",
    "artifacts/tiny-model/warm",
    "artifacts/tiny-model/teacher",
    "runs/arithmetic/final_model",
    "runs/arithmetic/metrics.jsonl",
    "runs/arithmetic/curve.png",
    "runs/arithmetic/summary.json",
    "runs/arithmetic/curve.json",
)
# A run small enough for CI, as params.yaml's train: values; the validation cadence makes step 0, every step and
# the last step evaluated.
TINY_RUN = {"rollout": {"prompts_per_step": 2, "n": 4}, "rl": {"validation": {"max_prompts": 8, "every_steps": 1}}}
SUMMARY_KEYS = {
    "steps", "final_step", "initial_val_accuracy", "final_val_accuracy", "final_val_step",
    "best_val_accuracy", "best_val_step", "final_reward_mean", "mean_reward_mean", "final_train_loss",
    "mean_train_loss", "mean_step_s", "train_loop_s",
}


# ------------------------------------------------------------------------------------------ helpers


def _env(root: Path, clone: Path | None = None) -> dict[str, str]:
    """The subprocess environment: this venv's tools, quiet local services, nothing of the user's config."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "MLFLOW_", "DVC_", "RAY_", "PREFECT_", "PYTHONPATH"))}
    for name in ("prefect", "dvc-global", "dvc-system", "dvc-site"):
        (root / "env" / name).mkdir(parents=True, exist_ok=True)
    env.update({
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "PREFECT_HOME": str(root / "env" / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "DO_NOT_TRACK": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "DVC_NO_ANALYTICS": "1",
        "DVC_STUDIO_OFFLINE": "true",
        "DVC_GLOBAL_CONFIG_DIR": str(root / "env" / "dvc-global"),
        "DVC_SYSTEM_CONFIG_DIR": str(root / "env" / "dvc-system"),
        "DVC_SITE_CACHE_DIR": str(root / "env" / "dvc-site"),
        "AWS_CONFIG_FILE": str(root / "env" / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(root / "env" / "no-aws-credentials"),
    })
    if clone is not None:
        env["PYTHONPATH"] = str(clone)
    return env


def _sh(args: list[str], cwd: Path, env: dict[str, str], stdout_only: bool = False) -> str:
    """Run a command; fail the test with its output when it exits non-zero. Returns stdout + stderr."""
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} (in {cwd}) exited {proc.returncode}:\n{output[-6000:]}")
    return proc.stdout if stdout_only else output


def _dvc(clone: Path, env: dict[str, str], *args: str) -> str:
    return _sh([str(BIN / "dvc"), *args], clone, env)


def _dvc_json(clone: Path, env: dict[str, str], *args: str):
    return json.loads(_sh([str(BIN / "dvc"), *args, "--json"], clone, env, stdout_only=True))


def _git(cwd: Path, *args: str) -> str:
    return _sh(["git", "-c", "user.name=posttrain-test", "-c", "user.email=test@localhost", *args], cwd,
               dict(os.environ))


def _status(clone: Path, env: dict[str, str], *targets: str) -> dict:
    """`dvc status --json`: {} when up to date, else {stage: [what changed]}."""
    return _dvc_json(clone, env, "status", *targets)


def _lock(clone: Path) -> dict:
    return yaml.safe_load((clone / "dvc.lock").read_text())["stages"]


def _out_md5(lock: dict, stage: str, path: str) -> str:
    return next(o["md5"] for o in lock[stage]["outs"] if o["path"] == path)


def _file_hashes(base: Path, rel: str) -> dict[str, str]:
    """{relative file path: sha256} of a file or every file under a directory."""
    root = base / rel
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    assert files, f"{root} is missing or empty"
    return {str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _merge(tree: dict, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict):
            _merge(tree.setdefault(key, {}), value)
        else:
            tree[key] = value


def _set_train_params(clone: Path, max_steps: int) -> None:
    """params.yaml's train: section with the tiny run's values and `rl.max_steps`."""
    params_path = clone / "params.yaml"
    params = yaml.safe_load(params_path.read_text())
    _merge(params["train"], {**TINY_RUN, "rl": {**TINY_RUN["rl"], "max_steps": max_steps}})
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))


def _max_steps(clone: Path) -> int:
    return yaml.safe_load((clone / "params.yaml").read_text())["train"]["rl"]["max_steps"]


def _commit_lock(clone: Path) -> None:
    """Commit params.yaml and every pipeline's dvc.lock in the temporary clone, so a clone of it sees what was
    reproduced (the agent examples' warm starts are in the DVC cache: their hashes are in their pipelines' locks)."""
    files = ["params.yaml", *(str(p.relative_to(clone)) for p in [clone / "dvc.lock", *clone.glob("pipelines/*/dvc.lock")]
                              if p.is_file())]
    _git(clone, "add", *files)
    if _git(clone, "status", "--porcelain", "--", *files).strip():
        _git(clone, "commit", "-q", "-m", "reproduced in the test")


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _expected_summary(records: list[dict]) -> dict:
    """The summary recomputed here, step by step, from the metrics records."""
    acc = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    reward = [r["rollout/reward_mean"] for r in records if "rollout/reward_mean" in r]
    loss = [r["train/loss"] for r in records if "train/loss" in r]
    step_s = [r["perf/step_s"] for r in records if "perf/step_s" in r]
    best_value = max(v for _, v in acc)
    loop = sum(r.get("perf/step_s", 0.0) + r.get("perf/evaluate_s", 0.0) + r.get("perf/checkpoint_s", 0.0)
               for r in records)
    return {
        "steps": len([r for r in records if r["step"] >= 1]),
        "final_step": records[-1]["step"],
        "initial_val_accuracy": records[0]["val/accuracy"] if records[0]["step"] == 0 else None,
        "final_val_accuracy": acc[-1][1],
        "final_val_step": acc[-1][0],
        "best_val_accuracy": best_value,
        "best_val_step": min(s for s, v in acc if v == best_value),
        "final_reward_mean": reward[-1],
        "mean_reward_mean": sum(reward) / len(reward),
        "final_train_loss": loss[-1],
        "mean_train_loss": sum(loss) / len(loss),
        "mean_step_s": sum(step_s) / len(step_s),
        "train_loop_s": loop,
    }


# ----------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, prefect_api, ray_address):
    """A fresh clone with tiny params in which `dvc repro` ran: (root, clone, env, repro output). The train stages'
    `posttrain` runs report to the module's Prefect API server and run on the session's Ray (`ray_address`)."""
    root = tmp_path_factory.mktemp("dvc")
    clone = root / "clone"
    _sh(["git", "clone", "-q", str(REPO), str(clone)], root, dict(os.environ))
    assert (clone / "dvc.yaml").is_file(), "dvc.yaml is not committed: the clone has no pipeline"
    env = {**_env(root, clone), "PREFECT_API_URL": prefect_api, "RAY_ADDRESS": ray_address}
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["warm_start"].update(steps=5, batch_size=8)
    params["teacher_warm_start"].update(steps=7, batch_size=8)
    params_path = clone / "params.yaml"
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))
    _set_train_params(clone, max_steps=2)
    started = time.monotonic()
    output = _dvc(clone, env, "repro")
    print(f"dvc repro of the quickstart: {time.monotonic() - started:.1f}s")
    return root, clone, env, output


# ------------------------------------------------------------------------------------- the pipeline


@pytest.mark.e2e
@pytest.mark.slow
def test_dvc_repro_reproduces_the_quickstart_in_a_fresh_clone(pipeline):
    root, clone, env, output = pipeline
    for stage in QUICKSTART:
        assert f"Running stage '{stage}'" in output, output
    assert "gsm8k" not in output  # the GSM8K pipeline is not part of the default target
    for rel in OUTPUTS:
        assert (clone / rel).exists(), rel
    for model in ("artifacts/tiny-model/init", "artifacts/tiny-model/warm", "runs/arithmetic/final_model"):
        assert (clone / model / "config.json").is_file(), model
        assert list((clone / model).glob("*.safetensors")), model

    lock = _lock(clone)
    steps = _max_steps(clone)  # 2, or one more if the experiment test ran first
    assert set(lock) == set(QUICKSTART)
    assert lock["warm_start"]["params"]["params.yaml"]["warm_start"]["steps"] == 5
    assert "--steps 5 " in lock["warm_start"]["cmd"]
    assert lock["train"]["params"]["params.yaml"]["train"]["rl"]["max_steps"] == steps

    # the run used the train: values of params.yaml plus the stage's fixed ones
    config = yaml.safe_load((clone / "runs/arithmetic/config_resolved.yaml").read_text())
    assert config["rl"]["max_steps"] == steps and config["rollout"]["n"] == 4
    assert config["rl"]["resume"] == "off" and config["job"]["overwrite"] is True

    records = _read_jsonl(clone / "runs/arithmetic/metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps + 1))
    summary = json.loads((clone / "runs/arithmetic/summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS
    assert summary == pytest.approx(_expected_summary(records), rel=1e-12, abs=1e-12)
    curve = json.loads((clone / "runs/arithmetic/curve.json").read_text())
    assert [p["step"] for p in curve] == [r["step"] for r in records]
    for point, record in zip(curve, records, strict=True):
        for field in ("rollout_reward_mean", "rollout_reward_std", "val_accuracy", "train_entropy", "train_grad_norm"):
            assert point[field] == record.get(field.replace("_", "/", 1)), field
        assert point["train_clip_frac"] is None  # legacy_pg has no ratio to clip

    # DVC sees the metrics and the plots
    (shown,) = _dvc_json(clone, env, "metrics", "show").values()  # the workspace, the only revision
    assert shown["data"]["runs/arithmetic/summary.json"]["data"] == summary
    plots = _dvc_json(clone, env, "plots", "show", "-o", str(root / "dvc_plots"))
    assert not plots.get("errors"), plots.get("errors")  # every field dvc.yaml names is in curve.json
    for name in ("reward (mean and std over the batch)", "held-out accuracy", "entropy", "grad norm"):
        assert plots["data"][name], name
    assert any(name.endswith("curve.png") for name in plots["data"])  # the train stage's figure

    # the MLflow run of the train stage is tagged with the dvc.lock hashes of its data and model
    with sqlite3.connect(clone / "mlflow.db") as db:
        tags = dict(db.execute("SELECT key, value FROM tags WHERE key LIKE 'posttrain.dvc.%'").fetchall())
    assert tags == {
        "posttrain.dvc.data/arithmetic": _out_md5(lock, "arithmetic_data", "data/arithmetic"),
        "posttrain.dvc.artifacts/tiny-model/warm": _out_md5(lock, "warm_start", "artifacts/tiny-model/warm"),
    }

    assert UP_TO_DATE in _dvc(clone, env, "status", "dvc.yaml")
    # `dvc status` of the whole repository lists only the pipelines outside the default target, unless a test
    # built them
    assert set(_status(clone, env)) == {stage for stage, out in OPTIONAL.items() if not (clone / out).exists()}
    # every output is git-ignored: git sees only the edited params and the new lock file
    porcelain = set(_git(clone, "status", "--porcelain").splitlines())
    assert porcelain <= {" M params.yaml", "M  params.yaml", "?? dvc.lock", "A  dvc.lock"}, porcelain


@pytest.mark.e2e
@pytest.mark.slow
def test_dvc_exp_run_varies_train_params_reruns_only_train_and_exp_show_compares_the_runs(pipeline):
    """`dvc exp run -S train.rl.optimizer.lr=... -S train.rl.max_steps=...` (a params.yaml edit and a repro, kept as
    an experiment) reruns train and summarize only: the data and the models upstream are reused, their dvc.lock
    entries unchanged; the run trained with the varied values; `dvc exp show` lists the parameter and the
    summary's metrics of the baseline and the experiment."""
    _, clone, env, _ = pipeline
    assert _status(clone, env, "dvc.yaml") == {}
    _commit_lock(clone)  # the experiment's baseline: the reproduced pipeline, committed
    before = _lock(clone)
    baseline_steps = _max_steps(clone)
    baseline_lr = yaml.safe_load((clone / "params.yaml").read_text())["train"]["rl"]["optimizer"]["lr"]
    git_identity = {f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")
                    for what, value in (("NAME", "posttrain-test"), ("EMAIL", "test@localhost"))}
    output = _dvc(clone, {**env, **git_identity}, "exp", "run", "-n", "lr-2e-4", "-S", "train.rl.optimizer.lr=2e-4",
                  "-S", f"train.rl.max_steps={baseline_steps + 1}")
    assert "Running stage 'train'" in output and "Running stage 'summarize'" in output, output
    for stage in UPSTREAM_OF_TRAIN:
        assert f"Stage '{stage}' didn't change, skipping" in output, output
        assert f"Running stage '{stage}'" not in output

    # the experiment is applied to the workspace: its lock, params and run
    after = _lock(clone)
    for stage in UPSTREAM_OF_TRAIN:
        assert after[stage]["outs"] == before[stage]["outs"]
    assert after["train"]["outs"] != before["train"]["outs"]
    assert _max_steps(clone) == baseline_steps + 1
    config = yaml.safe_load((clone / "runs/arithmetic/config_resolved.yaml").read_text())
    assert config["rl"]["optimizer"]["lr"] == 2e-4 != baseline_lr  # through run-params
    assert config["rl"]["max_steps"] == baseline_steps + 1
    records = _read_jsonl(clone / "runs/arithmetic/metrics.jsonl")
    assert records[-1]["step"] == baseline_steps + 1
    summary = json.loads((clone / "runs/arithmetic/summary.json").read_text())
    assert summary["steps"] == baseline_steps + 1
    assert summary == pytest.approx(_expected_summary(records), rel=1e-12, abs=1e-12)

    shown = _dvc_json(clone, env, "exp", "show")
    (baseline,) = [entry for entry in shown if entry["rev"] != "workspace"]
    (experiment,) = [rev for group in baseline["experiments"] for rev in group["revs"] if rev["name"] == "lr-2e-4"]

    def lr(entry: dict) -> float:
        return entry["data"]["params"]["params.yaml"]["data"]["train"]["rl"]["optimizer"]["lr"]

    def metrics(entry: dict) -> dict:
        return entry["data"]["metrics"]["runs/arithmetic/summary.json"]["data"]

    assert (lr(baseline), lr(experiment)) == (baseline_lr, 2e-4)
    assert metrics(experiment) == summary
    assert set(metrics(baseline)) == SUMMARY_KEYS and metrics(baseline)["steps"] == baseline_steps
    assert _status(clone, env, "dvc.yaml") == {}


@pytest.mark.e2e
@pytest.mark.slow
def test_the_gsm8k_own_data_and_agent_pipelines_build(pipeline):
    """`dvc repro pipelines/gsm8k/dvc.yaml` with gsm8k_data.source pointing at official-format JSONL, the
    own-data example's pipeline (its rows load as the example's task reads them), the two agent examples'
    (their rows and a two-step warm start on their games), the chat example's (its rows and a two-step warm start
    of the quickstart's warm start on its conversations) and PPO's run (one step)."""
    root, clone, env, _ = pipeline
    source = root / "gsm8k-source"
    source.mkdir()
    splits = {
        "train": [{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=7\n#### 7"},
                  {"question": "What is 10 minus 6?", "answer": "10-6=4\n#### 4"}],
        "test": [{"question": "What is 2 times 5?", "answer": "2*5=10\n#### 10"}],
    }
    for split, records in splits.items():
        (source / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    params_path = clone / "params.yaml"
    params = yaml.safe_load(params_path.read_text())
    params["gsm8k_data"]["source"] = str(source)
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))

    assert _status(clone, env, "dvc.yaml") == {}  # the quickstart does not read gsm8k_data
    output = _dvc(clone, env, "repro", "pipelines/gsm8k/dvc.yaml")
    assert f"Running stage '{GSM8K_STAGE}'" in output and "Running stage 'train'" not in output
    for split, records in splits.items():
        assert _read_jsonl(clone / "data/gsm8k" / f"{split}.jsonl") == records

    output = _dvc(clone, env, "repro", "pipelines/own_data/dvc.yaml")
    assert f"Running stage '{OWN_DATA_STAGE}'" in output and "Running stage 'train'" not in output
    from rl_core.config.schema import DataConfig
    from rl_core.tasks import load_examples

    chat = DataConfig(task="prompts", prompt_template="chat")
    train, val = (load_examples(clone / "data/own-data" / f"{s}.jsonl", "prompts", chat) for s in ("train", "val"))
    assert (len(train), len(val)) == (2000, 200) and not {e.prompt for e in train} & {e.prompt for e in val}
    assert all(int(e.columns["max_chars"]) == len(e.answer) for e in val)

    params = yaml.safe_load(params_path.read_text())
    for warm in ("guess_warm_start", "tool_warm_start", "chat_warm_start", "moe_warm_start", "code_warm_start"):
        params[warm]["steps"] = 2  # the stage as it runs, not its full length
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))
    for example, stages, model in (("guess_number", GUESS_STAGES, "tiny-model/guess-warm"),
                                   ("tool_arithmetic", TOOL_STAGES, "tiny-model/tool-warm"),
                                   ("chat_arithmetic", CHAT_STAGES, "tiny-model/chat"),
                                   ("moe_arithmetic", MOE_STAGES, "tiny-moe/warm"),
                                   ("code_arithmetic", CODE_STAGES, "tiny-model/code-warm")):
        output = _dvc(clone, env, "repro", f"pipelines/{example}/dvc.yaml")
        assert all(f"Running stage '{stage}'" in output for stage in stages) and "Running stage 'train'" not in output
        assert (clone / "artifacts" / model / "model.safetensors").is_file()
    moe = json.loads((clone / "artifacts/tiny-moe/warm/config.json").read_text())
    assert (moe["model_type"], moe["num_local_experts"], moe["num_experts_per_tok"]) == ("mixtral", 4, 2)
    # the tool example's warm start keeps the example's template, which renders tools
    assert "tool_call" in (clone / "artifacts/tiny-model/tool-warm/chat_template.jinja").read_text()
    params = yaml.safe_load(params_path.read_text())
    params["ppo_train"]["max_steps"] = 1  # PPO's run, one step: the critic is trained and exported beside the policy
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))
    output = _dvc(clone, env, "repro", "pipelines/ppo_arithmetic/dvc.yaml")
    assert f"Running stage '{PPO_STAGE}'" in output and "Running stage 'train'" not in output
    assert [r["step"] for r in _read_jsonl(clone / "runs/ppo-arithmetic/metrics.jsonl") if "critic/loss" in r] == [1]
    assert (clone / "runs/ppo-arithmetic/final_model/critic/model.safetensors").is_file()
    params = yaml.safe_load(params_path.read_text())
    params["rlhf"].update(samples=1, rm_steps=2, rl_steps=1)  # RLHF: pairs, a reward model, a policy step it rewards
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))
    output = _dvc(clone, env, "repro", "pipelines/rlhf_arithmetic/dvc.yaml")
    assert all(f"Running stage '{stage}'" in output for stage in RLHF_STAGES) and "Running stage 'train'" not in output
    exported = json.loads((clone / "runs/rm-arithmetic/final_model/config.json").read_text())
    assert exported["architectures"] == ["LlamaForSequenceClassification"] and len(exported["id2label"]) == 1
    rlhf = _read_jsonl(clone / "runs/rlhf-arithmetic/metrics.jsonl")
    assert [r["step"] for r in rlhf if "rollout/rewards/rm/mean" in r] == [1]
    params = yaml.safe_load(params_path.read_text())
    params["judge"].update(steps=2, rl_steps=1)  # the judge example: its rows, a judge, a policy step it rewards
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))
    output = _dvc(clone, env, "repro", "pipelines/judge_arithmetic/dvc.yaml")
    assert all(f"Running stage '{stage}'" in output for stage in JUDGE_STAGES) and "Running stage 'train'" not in output
    rows = _read_jsonl(clone / "data/arithmetic-judge/val.jsonl")
    assert len(rows) == 2 * len(_read_jsonl(clone / "data/arithmetic-rm-pairs/val.jsonl"))
    judged = _read_jsonl(clone / "runs/judge-arithmetic/metrics.jsonl")
    assert [r["step"] for r in judged if "rollout/rewards/judge/unparsable" in r] == [1]
    assert _status(clone, env) == {}  # now the whole repository is up to date


# -------------------------------------------------------------------------------------- the remotes


@pytest.mark.e2e
@pytest.mark.slow
def test_local_remote_push_then_pull_into_a_fresh_clone(pipeline):
    """`dvc push` to the default remote; a clone with no cache gets every output back with `dvc pull`."""
    root, clone, env, _ = pipeline
    assert _status(clone, env, "dvc.yaml") == {}
    _dvc(clone, env, "push")
    store = root / "posttrain-dvc-store"  # the default remote `local` is ../posttrain-dvc-store
    assert store.is_dir() and any(p.is_file() for p in store.rglob("*"))

    _commit_lock(clone)
    pulled = root / "pulled"
    _sh(["git", "clone", "-q", str(clone), str(pulled)], root, dict(os.environ))
    env_pulled = _env(root, pulled)
    assert not (pulled / ".dvc" / "cache").exists() and not (pulled / "data").exists()
    output = _dvc(pulled, env_pulled, "pull")
    assert "Running stage" not in output
    for rel in OUTPUTS:
        assert _file_hashes(pulled, rel) == _file_hashes(clone, rel), rel
    assert UP_TO_DATE in _dvc(pulled, env_pulled, "status", "dvc.yaml")


@pytest.mark.e2e
@pytest.mark.slow
def test_s3_remote_push_and_pull_against_moto(pipeline, moto_server):
    """An S3 remote (moto's server via `endpointurl`): push the data stage, pull it into a clone."""
    import boto3

    root, clone, env, _ = pipeline
    bucket = f"dvc-{uuid.uuid4().hex[:12]}"
    credentials = {"AWS_ACCESS_KEY_ID": "testing-access-key", "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
                   "AWS_DEFAULT_REGION": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1",
                      aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"])
    s3.create_bucket(Bucket=bucket)

    def add_remote(repo: Path, repo_env: dict[str, str]) -> None:
        _dvc(repo, repo_env, "remote", "add", "--local", "s3remote", f"s3://{bucket}/dvc")
        _dvc(repo, repo_env, "remote", "modify", "--local", "s3remote", "endpointurl", moto_server)

    env_s3 = {**env, **credentials}
    add_remote(clone, env_s3)
    _dvc(clone, env_s3, "push", "-r", "s3remote", "arithmetic_data")
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="dvc/").get("Contents", [])}
    dir_md5 = _out_md5(_lock(clone), "arithmetic_data", "data/arithmetic")
    assert f"dvc/files/md5/{dir_md5[:2]}/{dir_md5[2:]}" in keys  # the directory manifest
    assert len(keys) == 3  # the manifest, train.jsonl and val.jsonl: only the pushed stage

    _commit_lock(clone)
    pulled = root / "pulled-s3"
    _sh(["git", "clone", "-q", str(clone), str(pulled)], root, dict(os.environ))
    env_pulled = {**_env(root, pulled), **credentials}
    add_remote(pulled, env_pulled)
    _dvc(pulled, env_pulled, "pull", "-r", "s3remote", "arithmetic_data")
    assert _file_hashes(pulled, "data/arithmetic") == _file_hashes(clone, "data/arithmetic")
    assert _status(pulled, env_pulled, "arithmetic_data") == {}


# ------------------------------------------------------------------------------ posttrain summarize

HAND_WRITTEN = [
    {"step": 0, "val/accuracy": 0.25, "val/mean_reward": 0.25, "val/n": 8},
    {"step": 1, "train/loss": 0.5, "rollout/reward_mean": 0.2, "perf/step_s": 1.0},
    {"step": 2, "train/loss": 0.3, "rollout/reward_mean": 0.4, "perf/step_s": 2.0, "val/accuracy": 0.5,
     "perf/evaluate_s": 0.5},
    {"step": 3, "train/loss": 0.1, "rollout/reward_mean": 0.6, "perf/step_s": 1.5, "perf/checkpoint_s": 0.25},
    {"step": 4, "train/loss": -0.1, "rollout/reward_mean": 0.8, "perf/step_s": 1.5, "val/accuracy": 0.5,
     "perf/evaluate_s": 0.5, "perf/checkpoint_s": 0.25},
]


def test_summarize_a_hand_written_metrics_file(tmp_path, capsys):
    from cli.main import main
    from infra.tracking.plots import PANELS

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in HAND_WRITTEN) + "\n")
    summary_path, curve_path = tmp_path / "out" / "summary.json", tmp_path / "out" / "curve.json"
    assert main(["summarize", str(run_dir), "--out-summary", str(summary_path),
                 "--out-curve", str(curve_path)]) == 0
    assert str(summary_path) in capsys.readouterr().out
    summary = json.loads(summary_path.read_text())
    assert summary == pytest.approx({
        "steps": 4,
        "final_step": 4,
        "initial_val_accuracy": 0.25,
        "final_val_accuracy": 0.5,
        "final_val_step": 4,
        "best_val_accuracy": 0.5,
        "best_val_step": 2,  # the first step that reached the best accuracy
        "final_reward_mean": 0.8,
        "mean_reward_mean": 0.5,  # (0.2 + 0.4 + 0.6 + 0.8) / 4
        "final_train_loss": -0.1,
        "mean_train_loss": 0.2,  # (0.5 + 0.3 + 0.1 - 0.1) / 4
        "mean_step_s": 1.5,
        "train_loop_s": 7.5,  # steps 6.0 + evaluations 1.0 + checkpoints 0.5
    })
    curve = json.loads(curve_path.read_text())
    # one point per step, every panel's field (null where the step or the run has none): dvc.yaml's plots always
    # find their fields
    fields = {"step"} | {k.replace("/", "_") for p in PANELS for k in (*p.keys, *((p.band,) if p.band else ()))}
    assert all(set(point) == fields for point in curve)
    assert [(p["step"], p["rollout_reward_mean"], p["val_accuracy"], p["train_loss"], p["train_kl"]) for p in curve] == [
        (0, None, 0.25, None, None),
        (1, 0.2, None, 0.5, None),
        (2, 0.4, 0.5, 0.3, None),
        (3, 0.6, None, 0.1, None),
        (4, 0.8, 0.5, -0.1, None),
    ]
    # default output paths: next to metrics.jsonl
    assert main(["summarize", str(run_dir)]) == 0
    assert json.loads((run_dir / "summary.json").read_text()) == summary


def test_summarize_without_validation_reports_none(tmp_path):
    from cli.main import main

    (tmp_path / "metrics.jsonl").write_text(json.dumps(HAND_WRITTEN[1]) + "\n")
    assert main(["summarize", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["final_reward_mean"] == 0.2
    assert summary["initial_val_accuracy"] is None and summary["best_val_accuracy"] is None
    assert summary["final_val_accuracy"] is None and summary["best_val_step"] is None


def test_summarize_names_what_is_wrong_with_the_metrics_file(tmp_path, capsys):
    from cli.main import main

    assert main(["summarize", str(tmp_path)]) == 1
    assert f"{tmp_path / 'metrics.jsonl'}: no such file" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(json.dumps(HAND_WRITTEN[0]) + "\n{not json\n")
    assert main(["summarize", str(tmp_path)]) == 1
    assert "metrics.jsonl:2: not a JSON object" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"loss": 1.0}\n')
    assert main(["summarize", str(tmp_path)]) == 1
    assert "metrics.jsonl:1: a metrics record needs an integer 'step'" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()
