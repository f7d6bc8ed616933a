"""posttrain from a Python script (flows/api.py): function objects as rewards, in-memory datasets, a config object;
resolved to a recipe file the same checks read, then run as `posttrain run` runs it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from examples.chat_arithmetic import accuracy_reward, format_reward, make_rows
from tests.conftest import LEAN


def _config():
    from rl_core.config import PosttrainConfig

    cfg = PosttrainConfig()
    cfg.data.task = "prompts"
    cfg.data.prompt_template = "chat"
    return cfg


def test_a_config_object_function_rewards_and_datasets_resolve_to_a_recipe_file(tmp_path, monkeypatch):
    from datasets import Dataset

    from flows.api import resolved_recipe
    from rl_core.config import load_config
    from rl_core.config.schema import DataConfig
    from rl_core.tasks import load_examples

    monkeypatch.chdir(tmp_path)
    rows = make_rows(0)
    train, val = Dataset.from_list(rows["train"][:20]), rows["val"][:5]
    path = resolved_recipe(_config(), ["rl.max_steps=3", "job.name=scripted"],
                           reward_funcs=[accuracy_reward, format_reward], reward_weights=[1.0, 0.2],
                           train_dataset=train, eval_dataset=val)
    cfg = load_config(path)
    assert [(r.path, r.weight) for r in cfg.data.rewards] == [("examples.chat_arithmetic:accuracy_reward", 1.0),
                                                              ("examples.chat_arithmetic:format_reward", 0.2)]
    assert (cfg.rl.max_steps, cfg.job.name, cfg.data.task) == (3, "scripted", "prompts")  # the overrides come last
    for split, source, n in (("train", cfg.data.train, 20), ("val", cfg.data.val, 5)):
        file = tmp_path / source
        assert file.name == f"{split}.parquet" and file.parent.parent == tmp_path / "artifacts" / "datasets"
        assert hashlib.sha256(file.read_bytes()).hexdigest().startswith(file.parent.name)  # content-addressed
        # the prompts task reads the Parquet rows as it reads the same rows from JSONL
        jsonl = tmp_path / f"{split}.jsonl"
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in (rows["train"][:20] if split == "train" else val)))
        data = DataConfig(task="prompts", prompt_template="chat")
        parquet_rows, jsonl_rows = load_examples(str(file), "prompts", data), load_examples(str(jsonl), "prompts", data)
        assert [(e.messages, e.answer, dict(e.columns)) for e in parquet_rows] == \
               [(e.messages, e.answer, dict(e.columns)) for e in jsonl_rows] and len(parquet_rows) == n
    # the same inputs name the same files, written once
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "artifacts").rglob("*") if p.is_file()}
    again = resolved_recipe(_config(), ["rl.max_steps=3", "job.name=scripted"],
                            reward_funcs=[accuracy_reward, format_reward], reward_weights=[1.0, 0.2],
                            train_dataset=Dataset.from_list(rows["train"][:20]), eval_dataset=val)
    assert again == path
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "artifacts").rglob("*") if p.is_file()} == written
    # a recipe file works as the config (here the resolved one); without reward_funcs its rewards stay
    assert load_config(resolved_recipe(path)) == cfg


def test_what_a_script_passes_wrong_is_refused_together_naming_the_argument(tmp_path, monkeypatch):
    from datasets import Dataset, DatasetDict

    from flows.api import resolved_recipe
    from rl_core.config import ConfigError

    monkeypatch.chdir(tmp_path)
    one = Dataset.from_list(make_rows(0)["val"][:3])
    with pytest.raises(ConfigError) as err:
        resolved_recipe(_config(), reward_funcs=[accuracy_reward], reward_weights=[1.0, 0.2],
                        train_dataset=DatasetDict(train=one), eval_dataset={"prompt": "x"})
    text = str(err.value)
    assert "reward_weights: 2 weights for 1 reward_funcs" in text
    assert "train_dataset: a DatasetDict (train); pass one split, e.g. dataset['train']" in text
    assert "eval_dataset: a datasets.Dataset, a list of row dicts, a path or a hub id, not dict" in text
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\]: a lambda has no import path"):
        resolved_recipe(_config(), reward_funcs=[lambda completions, **_: [1.0] * len(completions)])
    with pytest.raises(ConfigError, match="reward_weights: given without reward_funcs"):
        resolved_recipe(_config(), reward_weights=[1.0])
    assert not (tmp_path / "artifacts" / "api").exists()  # nothing is written for a refused call


@pytest.mark.e2e
@pytest.mark.slow
def test_train_runs_the_flow_with_function_rewards_and_a_dataset(in_workdir):
    from datasets import Dataset

    from flows.api import train

    rows = make_rows(0)
    result = train(_config(), ["model.name_or_path=artifacts/tiny-model/init", "rollout.prompts_per_step=4",
                               "rollout.n=4", "rollout.max_tokens=4", "rl.max_steps=2", "rl.validation.every_steps=2",
                               "job.name=from-python", *LEAN],
                   reward_funcs=[accuracy_reward, format_reward], reward_weights=[1.0, 0.2],
                   train_dataset=Dataset.from_list(rows["train"][:40]), eval_dataset=rows["val"][:8])
    records = [json.loads(line) for line in Path(result["metrics"]).read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # both functions scored every completion, weighted as given
        acc, fmt = r["rollout/rewards/accuracy_reward/mean"], r["rollout/rewards/format_reward/mean"]
        assert r["rollout/reward_mean"] == pytest.approx(1.0 * acc + 0.2 * fmt, abs=1e-6)
    resolved = (in_workdir / "runs" / "from-python" / "config_resolved.yaml").read_text()
    assert "examples.chat_arithmetic:format_reward" in resolved and "artifacts/datasets/" in resolved


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _resolve(rows: list[dict]) -> tuple[Path, Path]:
    """The recipe file and the train dataset's file of a call with `rows` as the train dataset."""
    from flows.api import resolved_recipe
    from rl_core.config import load_config

    path = resolved_recipe(_config(), ["rl.max_steps=3"], train_dataset=rows)
    return path, Path(load_config(path).data.train)


def test_the_files_are_named_by_the_sha256_of_their_bytes_and_a_changed_one_is_written_again(tmp_path, monkeypatch):
    from rl_core.config import load_config
    from rl_core.tasks import load_examples

    monkeypatch.chdir(tmp_path)
    rows, other = make_rows(0)["train"][:8], make_rows(0)["train"][8:12]
    path, data = _resolve(rows)
    assert path.parent == Path("artifacts/api") and path.name == f"{_sha256(path)}.yaml"  # the whole sha256
    assert data.parent.parent == Path("artifacts/datasets") and data.parent.name == _sha256(data)
    recipe, parquet = path.read_bytes(), data.read_bytes()
    _, other_data = _resolve(other)
    # changed, or planted under a name that claims other content: each is written again, whole
    path.write_text(path.read_text().replace("max_steps: 3", "max_steps: 99999"))
    data.write_bytes(other_data.read_bytes())
    assert _resolve(rows) == (path, data)
    assert (path.read_bytes(), data.read_bytes()) == (recipe, parquet)
    assert load_config(path).rl.max_steps == 3
    assert len(load_examples(str(data), "prompts", load_config(path).data)) == len(rows)
    assert not [p for p in Path("artifacts").rglob("*") if p.name.startswith((".tmp", "tmp"))]  # no staging left


def test_a_symlink_where_the_content_addressed_files_go_is_refused_naming_it(tmp_path, monkeypatch):
    from rl_core.config import ConfigError

    monkeypatch.chdir(tmp_path)
    rows = make_rows(0)["train"][:8]
    path, data = _resolve(rows)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for link in (data, data.parent, Path("artifacts/datasets"), path, Path("artifacts/api")):
        target = elsewhere / link.name
        link.rename(target)
        link.symlink_to(target.resolve(), target_is_directory=target.is_dir())
        before = {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
        with pytest.raises(ConfigError, match=rf"{link} is a symlink"):
            _resolve(rows)
        assert {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()} == before  # nothing written there
        link.unlink()
        target.rename(link)
    assert _resolve(rows) == (path, data)
