"""The `posttrain` command's help, hints, version, key listing and validate's machine checks (in process)."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from cli.main import main
from tests.conftest import recipe

ARITH = recipe("arithmetic")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's --help / --version / usage errors
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------------------------------------ help, hint, version


@pytest.mark.parametrize("command", ["validate", "run"])
def test_help_shows_the_override_form_with_real_keys(capsys, command):
    from rl_core.config.explain import all_keys

    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0
    assert f"posttrain {command} recipes/arithmetic.py -- rl.optimizer.lr=2e-4 rl.max_steps=50" in out
    examples = [line for line in out.splitlines() if " -- " in line and line.strip().startswith("posttrain")]
    keys = {item.split("=", 1)[0].strip('"') for line in examples for item in line.split(" -- ", 1)[1].split()
            if "=" in item and not item.startswith(("{", "'"))}
    assert keys and keys <= set(all_keys()), keys - set(all_keys())  # every example names a key that exists


def test_top_level_help_shows_the_override_form(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and "-- rl.optimizer.lr=2e-4" in out and "keys" in out


@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_forgotten_double_dash_gets_the_command_that_was_meant(capsys, command):
    rc, _, err = run(capsys, command, "recipes/x.py", "rl.optimizer.lr=1e-4", "rl.max_steps=3")
    assert rc == 2
    assert f"did you mean: posttrain {command} recipes/x.py -- rl.optimizer.lr=1e-4 rl.max_steps=3?" in err
    assert "unrecognized arguments" not in err


def test_validate_checks_several_recipes_in_turn_and_names_the_one_with_errors(capsys):
    """`make demo` validates every recipe in one process: each gets the overrides and prints what validating it
    alone prints; a bad one is named after its errors and makes the exit status 1, the others still run."""
    from rl_core.config import config_hash, load_config

    dpo, missing = recipe("dpo_arithmetic"), str(recipe("no_such_recipe"))
    rc, out, err = run(capsys, "validate", "--no-env", str(ARITH), missing, str(dpo), "--", "rl.max_steps=5")
    assert rc == 1
    assert [line for line in out.splitlines() if line.startswith("# =====")] == [
        f"# ===== {ARITH}", f"# ===== {missing}", f"# ===== {dpo}"]
    for path in (ARITH, dpo):
        assert f"# config hash: {config_hash(load_config(path, ['rl.max_steps=5']))}" in out
    assert f"posttrain validate: {missing} has errors (above)" in err and "no such file" in err
    assert err.count("has errors") == 1
    rc, alone, _ = run(capsys, "validate", "--no-env", str(dpo), "--", "rl.max_steps=5")
    assert rc == 0 and "# =====" not in alone and alone in out


def test_other_unknown_arguments_are_still_refused(capsys):
    rc, _, err = run(capsys, "run", "recipes/x.py", "--bogus")
    assert rc == 2 and "unrecognized arguments: --bogus" in err and "did you mean" not in err


def test_version(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.strip() == f"posttrain {version('posttrain')}"


# ------------------------------------------------------------------------------------------ keys


def _schema_leaves():
    """Every leaf key of the schema, walked here independently of cli/keys.py: `(key, objective type, field)`."""
    from pydantic import BaseModel

    from rl_core.algorithms.registry import OBJECTIVES
    from rl_core.config.schema import PosttrainConfig

    out = []

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            key = prefix + name
            if key == "rl.objective":
                out.extend((f"{key}.{k}", kind, f) for kind, cls in OBJECTIVES.items()
                           for k, f in cls.model_fields.items())
            elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                walk(field.annotation, key + ".")
            else:
                out.append((key, "", field))

    walk(PosttrainConfig, "")
    return out


def _listed(out: str) -> dict[tuple[str, str], str]:
    """`{(key, objective type): its line}` of `posttrain keys` output."""
    rows, kind = {}, ""
    for line in out.splitlines():
        if line.startswith("# rl.objective.type="):
            kind = line.split("=", 1)[1]
        elif line.strip():
            key = line.split()[0]
            rows[(key, kind if key.startswith("rl.objective.") else "")] = line
    return rows


def test_keys_lists_every_leaf_with_type_default_and_description(capsys):
    rc, out, _ = run(capsys, "keys")
    assert rc == 0
    rows = _listed(out)
    leaves = _schema_leaves()
    assert len(leaves) > 60
    for key, kind, field in leaves:
        assert (key, kind) in rows, (key, kind)
        if field.description:
            assert rows[(key, kind)].endswith(field.description), key
    assert "float" in rows[("rl.optimizer.lr", "")] and "1e-06" in rows[("rl.optimizer.lr", "")]
    assert "'hf' | 'vllm'" in rows[("rollout.backend", "")]
    assert "0.0003" in rows[("rl.objective.epsilon_low", "gspo")] and "0.2" in rows[("rl.objective.epsilon_low", "grpo")]


def test_keys_prefix_and_objective_type_filter(capsys):
    rc, out, _ = run(capsys, "keys", "rl.optimizer")
    assert rc == 0 and {k for k, _ in _listed(out)} == {k for k, _, _ in _schema_leaves() if k.startswith("rl.optimizer.")}
    rc, out, _ = run(capsys, "keys", "rl.objective", "--type", "gspo")
    from rl_core.algorithms.registry import OBJECTIVES

    assert rc == 0 and set(_listed(out)) == {(f"rl.objective.{k}", "gspo") for k in OBJECTIVES["gspo"].model_fields}
    rc, _, err = run(capsys, "keys", "rl.lr")
    assert rc == 1 and "rl.optimizer.lr" in err


# ------------------------------------------------------------------------------------------ validate


def test_validate_makes_the_environment_checks_that_run_makes(capsys, monkeypatch):
    """A missing data file stops `run` (preflight.check); validate reports it too, and --no-env skips it."""
    from rl_core.config import ConfigError, load_config
    from rl_core.preflight.rules import check

    bad = ["data.train=missing/train.jsonl", "model.name_or_path=./missing/model"]
    with pytest.raises(ConfigError) as stopped:  # what `run` does before the flow
        check(load_config(ARITH, bad))
    rc, _, err = run(capsys, "validate", ARITH, "--", *bad)
    assert rc == 1
    for problem in stopped.value.problems:
        assert problem in err
    assert "data.train='missing/train.jsonl': no such file" in err and "model.name_or_path='./missing/model': no such local directory" in err
    rc, _, err = run(capsys, "validate", "--no-env", ARITH, "--", *bad)
    assert rc == 0 and "missing/train.jsonl" not in err


def test_validate_does_not_fail_on_the_quickstart_artifacts_run_builds(capsys, tmp_path, monkeypatch):
    """A fresh machine (no tiny model, no data): `run` builds them, so validate accepts them missing."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, "validate", ARITH)
    assert rc == 0, err
    assert "preflight: ok" in out


def test_validate_reads_the_data_and_reports_every_bad_row(capsys, tmp_path):
    """A split with rows missing their prompt: validate exits 1 naming each row (run would stop at them); --no-env
    reads local files too (no network needed), and a hub id there is said not to be checked."""
    rows = ['{"prompt": "1+1=", "answer": "2"}', '{"answer": "3"}', '{"prompt": "2+2=", "answer": "4"}',
            '{"answer": "5"}']
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows) + "\n")
    for flags in ([], ["--no-env"]):
        rc, out, err = run(capsys, "validate", *flags, ARITH, "--", "data.task=prompts", f"data.train={bad}",
                           "data.rewards=[{path: 'examples.own_data:exact_answer'}]")
        assert rc == 1, err
        assert f"data.train={str(bad)!r}: 2 bad row(s)" in err and "data.val='data/arithmetic/val.jsonl'" in err
        for line in (2, 4):
            assert (f"  error: data.train={str(bad)!r}: {bad}:{line}: column 'prompt' is missing (row {bad}:1 has "
                    "it); give every row the same columns") in err
    good = tmp_path / "good.jsonl"
    good.write_text(rows[0] + "\n")
    rc, out, err = run(capsys, "validate", "--no-env", ARITH, "--", "data.task=prompts", f"data.train={good}",
                       "data.val=my-org/sums:test", "data.rewards=[{path: 'examples.own_data:exact_answer'}]")
    assert rc == 0, err
    assert f"  data.train={str(good)!r}: 1 rows ok" in out
    assert "  data.val='my-org/sums:test': not checked: not a local file (a hub dataset id)" in out


@pytest.mark.e2e
def test_run_reports_bad_rows_once_in_one_block_before_anything_starts(tmp_path):
    """`posttrain run` on data with bad rows: exit 1 within seconds (no Ray, no Prefect), every bad row named once,
    in one block on stderr, no traceback."""
    import subprocess
    import sys

    from tests.conftest import REPO

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"answer": "3"}\n{"prompt": "", "answer": "4"}\n')
    cmd = [sys.executable, "-m", "cli.main", "run", ARITH, "--", "data.task=prompts", f"data.train={bad}",
           f"data.val={bad}", "data.rewards=[{path: 'examples.own_data:exact_answer'}]"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and done.stdout == ""
    problems = [f"data.{key}={str(bad)!r}: {bad}:{row}" for key in ("train", "val")
                for row in ("2: column 'prompt' is missing", "3: column 'prompt' is empty")]
    lines = done.stderr.splitlines()
    assert lines[0] == "bad data: 4 problem(s) in the data splits; fix them (`posttrain validate` lists them)"
    assert len(lines) == 5 and all(sum(p in line for line in lines) == 1 for p in problems), done.stderr
    assert "Traceback" not in done.stderr


def test_validate_a_gpu_recipe_on_a_cpu_machine(capsys, monkeypatch):
    from rl_core.preflight import machine

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(machine, "visible_gpus", lambda: 0)  # this machine's GPUs, as torch would report none
    rc, _, err = run(capsys, "validate", recipe("grpo_gsm8k"))
    assert rc == 1 and "no GPU on this machine" in err and "recipes/grpo_gsm8k_cpu.py" in err
    rc, _, _ = run(capsys, "validate", "--no-env", recipe("grpo_gsm8k"))
    assert rc == 0


def test_the_hint_quotes_an_override_as_the_shell_needs_it(capsys):
    rc, _, err = run(capsys, "run", "recipes/x.py", "data.rewards=[{path: 'my_pkg.rewards:correct'}]")
    assert rc == 2
    assert "-- \"data.rewards=[{path: 'my_pkg.rewards:correct'}]\"?" in err


def test_run_params_help_shows_its_override_form(capsys):
    rc, out, _ = run(capsys, "run-params", "--help")
    assert rc == 0 and "posttrain run-params recipes/arithmetic.py rl.optimizer.lr=2e-4 rl.max_steps=50" in out
