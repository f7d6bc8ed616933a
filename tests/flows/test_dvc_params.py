"""params.yaml's `train:` section and `posttrain run-params` (the DVC train stage's command), and the train
stage's dependencies. No DVC and no training here: `tests/flows/test_dvc.py` runs `dvc repro` and
`dvc exp run` on the real pipeline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.test_layout import _graph, _sources

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "arithmetic.py")


def _params_file(tmp_path: Path, train) -> str:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"run": {"recipe": RECIPE}, "train": train}, sort_keys=False))
    return str(path)


def test_the_train_section_flattens_to_overrides_the_loader_reads_back():
    """Nested keys become dotted ones in file order, `rl.objective.type` first (a switch keeps the knobs set after
    it); a dict-valued config field (`rl.objective.kwargs`) and lists pass whole; null, bools and small floats
    survive the text round trip."""
    from cli.params import flatten_section
    from rl_core.config import load_config
    from rl_core.config.loader import flatten

    section = {"rl": {"optimizer": {"lr": 2e-6, "betas": [0.8, 0.99]}, "objective": {"kl_beta": 0.05, "type": "grpo"},
                      "validation": {"max_prompts": None}},
               "job": {"overwrite": True}, "rollout": {"n": 3}}
    overrides = flatten_section(section)
    assert overrides == ["rl.objective.type=grpo", "rl.optimizer.lr=2e-06", "rl.optimizer.betas=[0.8, 0.99]",
                         "rl.objective.kl_beta=0.05", "rl.validation.max_prompts=null", "job.overwrite=true",
                         "rollout.n=3"]
    resolved = flatten(load_config(RECIPE, overrides))
    assert resolved["rl.objective.type"] == "grpo" and resolved["rl.objective.kl_beta"] == 0.05
    assert resolved["rl.optimizer.lr"] == 2e-6 and resolved["rl.optimizer.betas"] == [0.8, 0.99]
    assert resolved["rl.validation.max_prompts"] is None and resolved["job.overwrite"] is True
    assert resolved["rollout.n"] == 3

    custom = {"rl": {"objective": {"type": "custom", "import_path": "examples.custom_objective:build_objective",
                                   "kwargs": {"clip": 1.5}}}}
    assert flatten_section(custom)[2] == 'rl.objective.kwargs={"clip": 1.5}'


def test_params_yaml_train_values_mirror_the_recipe():
    """`dvc repro` and `posttrain run recipes/arithmetic.py` train the same run: every value under params.yaml's
    train: equals the recipe's own."""
    from cli.params import params_overrides
    from rl_core.config import load_config
    from rl_core.config.loader import flatten, parse_dotlist

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    overrides = params_overrides(REPO / "params.yaml", "train")
    assert "rl.optimizer.lr=0.0001" in overrides and len(overrides) >= 10
    recipe = flatten(load_config(REPO / params["run"]["recipe"]))
    assert {key: value for key, value, _ in parse_dotlist(overrides)} == {key: recipe[key] for key, _, _ in
                                                                         parse_dotlist(overrides)}
    # and PPO's pipeline runs its recipe's own steps
    assert params["ppo_train"]["max_steps"] == load_config(REPO / "recipes/ppo_arithmetic.py").rl.max_steps
    # and the RLHF pipeline its recipes' own
    assert params["rlhf"]["rm_steps"] == load_config(REPO / "recipes/rm_arithmetic.py").rl.max_steps
    assert params["rlhf"]["rl_steps"] == load_config(REPO / "recipes/rlhf_arithmetic.py").rl.max_steps
    # and the judge example's its recipe's own
    assert params["judge"]["rl_steps"] == load_config(REPO / "recipes/judge_arithmetic.py").rl.max_steps


def test_run_params_dry_run_prints_the_resolved_values(tmp_path, capsys):
    from cli.main import main

    params = _params_file(tmp_path, {"rl": {"optimizer": {"lr": 2e-4}, "max_steps": 7}})
    assert main(["run-params", RECIPE, "rl.max_steps=9", "--params", params, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rl.optimizer.lr=0.0002\n" in out
    assert "rl.max_steps=9\n" in out and "rl.max_steps=7\n" not in out  # the command line's items come last and win


def test_run_params_names_what_is_wrong_in_params_yaml(tmp_path, capsys):
    """Every error comes before any flow starts, naming the params.yaml key or the run directory."""
    from cli.main import main

    params = _params_file(tmp_path, {"rl": {"optimizer": {"lrr": 2e-4}}})
    assert main(["run-params", RECIPE, "--params", params, "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "train.rl.optimizer.lrr: unknown key; closest valid keys: rl.optimizer.lr" in err, err

    params = _params_file(tmp_path, {"rl": {"max_steps": "many"}})
    assert main(["run-params", RECIPE, "--params", params]) == 1
    assert "train.rl.max_steps='many'" in capsys.readouterr().err

    params = _params_file(tmp_path, ["rl.max_steps=3"])
    assert main(["run-params", RECIPE, "--params", params]) == 1
    assert "train must be a mapping of config keys" in capsys.readouterr().err

    (tmp_path / "other.yaml").write_text(yaml.safe_dump({"run": {"recipe": RECIPE}}))
    assert main(["run-params", RECIPE, "--params", str(tmp_path / "other.yaml")]) == 1
    assert "no key 'train'" in capsys.readouterr().err

    params = _params_file(tmp_path, {"job": {"name": "elsewhere"}})
    assert main(["run-params", RECIPE, "--params", params, "--run-dir", "runs/arithmetic"]) == 1
    err = capsys.readouterr().err
    assert "the run directory is 'runs/elsewhere'" in err and "runs/arithmetic" in err


def _closure(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        module = stack.pop()
        if module not in seen:
            seen.add(module)
            stack.extend(graph.get(module, ()))
    return seen


def test_the_train_stage_depends_on_exactly_the_code_the_training_imports():
    """dvc.yaml's train stage reruns when code it runs changes, and only then: its code deps are the command's
    module and the packages of everything that imports (every import statement, function-level ones too), read
    from the source like tests/test_layout.py does."""
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    deps = [d.replace("${run.recipe}", params["run"]["recipe"]) for d in stage["deps"]]
    code = {d for d in deps if (REPO / d).is_dir() and any((REPO / d).rglob("*.py")) or d.endswith(".py")}
    assert stage["cmd"].startswith("posttrain run-params ")  # cli/params.py

    modules = _sources()
    files = {name: str(path.relative_to(REPO)) for name, path in modules.items()}
    recipe_module = params["run"]["recipe"].removesuffix(".py").replace("/", ".")
    imported = _closure(_graph(modules), ["cli.params", recipe_module])
    # cli/__init__.py (a docstring) is the one module outside the deps
    uncovered = [files[m] for m in imported
                 if m != "cli" and not any(files[m] == d or files[m].startswith(d + "/") for d in code)]
    assert not uncovered, f"the train stage runs code it does not depend on: {uncovered}"
    unused = [d for d in code if not any(files[m] == d or files[m].startswith(d + "/") for m in imported)]
    assert not unused, f"the train stage depends on code it never imports: {unused}"
    assert {"rl_core", "flows", "tasks", "infra", "cli/params.py"} <= code
    assert not {"tests", "docs", "benchmarks", "pipelines", "cli"} & set(deps)


@pytest.mark.e2e
@pytest.mark.slow
def test_dvc_exp_run_sets_a_train_value_through_run_params(tmp_path):
    """A DVC project of the train stage's shape, without the training: `resolve` runs the real `posttrain
    run-params --dry-run` on the real recipe and params.yaml, `summarize` the real `posttrain summarize`.
    `dvc exp run -S train.rl.optimizer.lr=2e-4` changes the value the config resolves to, and `dvc exp show`
    lists the parameter of the baseline and the experiment, and the summary's metrics.
    (tests/flows/test_dvc.py runs `dvc exp run` on the real pipeline, training included.)"""
    import json
    import shutil
    import subprocess

    from tests.flows.test_dvc import BIN, _env

    repo = tmp_path / "project"
    (repo / "recipes").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "arithmetic.py", repo / "recipes")
    shutil.copy(REPO / "params.yaml", repo)
    (repo / "run").mkdir()
    records = [{"step": 0, "val/accuracy": 0.5}, {"step": 1, "rollout/reward_mean": 0.25, "train/loss": 0.5,
                                                  "val/accuracy": 0.75}]
    (repo / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "resolve": {"cmd": "posttrain run-params ${run.recipe} --dry-run > resolved.txt",
                    "deps": ["${run.recipe}"], "params": ["run.recipe", "train"], "outs": ["resolved.txt"]},
        "summarize": {"cmd": "posttrain summarize run", "deps": ["run/metrics.jsonl"],
                      "metrics": ["run/summary.json"], "outs": ["run/curve.json"]},
    }}, sort_keys=False))
    env = {**_env(tmp_path, REPO), "GIT_AUTHOR_NAME": "posttrain-test", "GIT_AUTHOR_EMAIL": "test@localhost",
           "GIT_COMMITTER_NAME": "posttrain-test", "GIT_COMMITTER_EMAIL": "test@localhost"}

    def sh(*args: str) -> str:
        proc = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        return proc.stdout

    sh("git", "init", "-q")
    sh(str(BIN / "dvc"), "init", "-q")
    sh(str(BIN / "dvc"), "repro")
    assert "rl.optimizer.lr=0.0001\n" in (repo / "resolved.txt").read_text()
    sh("git", "add", "-A")
    sh("git", "commit", "-q", "-m", "baseline")

    sh(str(BIN / "dvc"), "exp", "run", "-n", "faster", "-S", "train.rl.optimizer.lr=2e-4")
    resolved = (repo / "resolved.txt").read_text()
    assert "rl.optimizer.lr=0.0002\n" in resolved and "rl.max_steps=300\n" in resolved

    shown = json.loads(sh(str(BIN / "dvc"), "exp", "show", "--json"))
    (baseline,) = [entry for entry in shown if entry["rev"] != "workspace"]
    (experiment,) = [rev for group in baseline["experiments"] for rev in group["revs"] if rev["name"] == "faster"]
    for entry, lr in ((baseline, 1e-4), (experiment, 2e-4)):
        assert entry["data"]["params"]["params.yaml"]["data"]["train"]["rl"]["optimizer"]["lr"] == lr
        summary = entry["data"]["metrics"]["run/summary.json"]["data"]
        assert (summary["initial_val_accuracy"], summary["final_val_accuracy"]) == (0.5, 0.75)
