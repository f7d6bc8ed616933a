"""The data check (rl_core/preflight/rows.py): both splits read as the run reads them, every bad row reported at
once (up to a cap, then counted), each naming the key, the file and the row; what it does not read, said with why;
and `run`'s preflight (`check`) stopping on it before anything starts."""

from __future__ import annotations

import json

import pytest

from rl_core.config import load_config
from rl_core.data.jsonl import RowErrors
from rl_core.preflight.rows import MAX_LISTED, DataError, check_data
from rl_core.tasks import Task
from tests.conftest import recipe

OWN = recipe("own_data_lora")
GOOD = {"prompt": [{"role": "user", "content": "1+2="}], "answer": "3", "max_chars": 1}


def jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def own(train, val, *more):
    return load_config(OWN, [f"data.train={train}", f"data.val={val}", *more])


def test_every_bad_row_of_both_splits_is_reported_with_its_file_and_line(tmp_path):
    train = jsonl(tmp_path / "train.jsonl", [GOOD, {"answer": "3", "max_chars": 1}, GOOD, "not json",
                                             {**GOOD, "prompt": ""}, GOOD])
    val = jsonl(tmp_path / "val.jsonl", [GOOD, '{"prompt": "1+1=", "answer": "2", "max_chars": NaN}'])
    report = check_data(own(train, val))
    assert not report.ok
    assert report.errors == [
        (f"data.train={train!r}: {train}:2: column 'prompt' is missing (row {train}:1 has it); give every row the "
         "same columns"),
        (f"data.train={train!r}: {train}:4: not a JSON object (Expecting value); each line holds a prompt row "
         "{prompt or messages, ...}"),
        f"data.train={train!r}: {train}:5: column 'prompt' is empty; write the prompt, or drop the row",
        (f"data.val={val!r}: {val}:2: key 'max_chars': NaN is not a number JSON allows (NaN); write a finite number "
         "of at most 100 characters"),
    ]
    text = report.render()
    assert text.splitlines()[:3] == ["data: FAILED (4 problem(s))", f"  data.train={train!r}: 3 bad row(s)",
                                     f"  data.val={val!r}: 1 bad row(s)"]
    assert all(f"  error: {e}" in text for e in report.errors)


def test_the_listing_stops_at_the_cap_and_counts_the_rest(tmp_path):
    rows = [GOOD] + [{"answer": str(i), "max_chars": 1} for i in range(MAX_LISTED + 7)]
    train = jsonl(tmp_path / "train.jsonl", rows)
    report = check_data(own(train, train))
    total = 2 * (MAX_LISTED + 7)
    assert len(report.errors) == total  # every bad row is found
    listed = [line for line in report.render().splitlines() if line.startswith("  error: ")]
    assert len(listed) == MAX_LISTED + 1 and listed[-1] == f"  error: ... and {total - MAX_LISTED} more"
    assert listed[0].endswith(f"{train}:2: column 'prompt' is missing (row {train}:1 has it); give every row the "
                              "same columns")
    with pytest.raises(DataError) as raised:
        report.raise_errors()
    lines = str(raised.value).splitlines()
    assert lines[0] == f"bad data: {total} problem(s) in the data splits; fix them (`posttrain " \
                       "validate` lists them)"
    assert len(lines) == 1 + MAX_LISTED + 1 and lines[-1] == f"  - ... and {total - MAX_LISTED} more"
    assert len(raised.value.problems) == total


def test_parquet_and_arithmetic_rows_are_all_reported(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["1+1=", "2+2=", "3+3="], "answer": ["2", "4", "6"],
                      "max_chars": [1.0, float("nan"), float("inf")]})
    pq.write_table(table, tmp_path / "train.parquet")
    good = jsonl(tmp_path / "val.jsonl", [GOOD])
    report = check_data(own(tmp_path / "train.parquet", good, "data.prompt_template=chat"))
    assert [e.split(": column")[0] for e in report.errors] == [
        f"data.train='{tmp_path}/train.parquet': {tmp_path}/train.parquet row 2",
        f"data.train='{tmp_path}/train.parquet': {tmp_path}/train.parquet row 3"]

    arith = jsonl(tmp_path / "arith.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="},
                                             {"prompt": "", "answer": "4"}, "[1]"])
    report = check_data(load_config(recipe("arithmetic"), [f"data.train={arith}", f"data.val={arith}"]))
    assert [e.split(": ", 2)[1] for e in report.errors] == [f"{arith}:{n}" for n in (2, 3, 4)] * 2


def test_what_is_not_read_says_why_and_is_no_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a fresh checkout: no quickstart data yet
    report = check_data(load_config(recipe("arithmetic")))
    assert report.ok and report.render().splitlines() == [
        "data: not checked",
        ("  data.train='data/arithmetic/train.jsonl': not checked: not built yet: the run builds it first "
         "(`posttrain make-data`)"),
        ("  data.val='data/arithmetic/val.jsonl': not checked: not built yet: the run builds it first "
         "(`posttrain make-data`)")]
    cfg = load_config(recipe("grpo_gsm8k"), ["data.val=openai/gsm8k:test"])
    report = check_data(cfg, read_hub=False)  # validate --no-env: never the network
    train, val = report.splits
    assert report.ok and train.not_checked.startswith("no such file; build it with `dvc repro")
    assert val.not_checked.startswith("not a local file (a hub dataset id): validate --no-env does not fetch it")


def test_a_hub_id_is_read_through_datasets_as_the_run_reads_it(tmp_path, monkeypatch):
    import datasets

    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return [{"prompt": "1+1=", "answer": "2"}, {"prompt": "  ", "answer": "4"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = load_config(recipe("arithmetic"), ["data.task=prompts", "data.train=my-org/sums:validation",
                                             "data.val=my-org/sums:test"])
    report = check_data(cfg)
    assert calls == [("my-org/sums", None, "validation"), ("my-org/sums", None, "test")]
    assert report.errors == [
        ("data.train='my-org/sums:validation': my-org/sums (validation) row 2: column 'prompt' is empty; write the "
         "prompt, or drop the row"),
        ("data.val='my-org/sums:test': my-org/sums (test) row 2: column 'prompt' is empty; write the prompt, or drop "
         "the row")]


def test_chat_rows_and_text_rows_across_the_splits_are_refused_under_auto(tmp_path):
    chat = jsonl(tmp_path / "chat.jsonl", [GOOD])
    text = jsonl(tmp_path / "text.jsonl", [{"prompt": "1+2=", "answer": "3", "max_chars": 1}])
    (problem,) = check_data(own(chat, text, "data.prompt_template=auto")).errors
    assert problem == (f"data.train, data.val: {chat}:1 has a chat-format prompt (messages) and {text}:1 a text "
                       "prompt: data.prompt_template=auto renders a run's prompts one way; set "
                       "data.prompt_template=chat (a text prompt becomes the user's turn), or write every row alike")
    assert check_data(own(chat, text, "data.prompt_template=chat")).ok


def test_preference_pairs_are_read_and_gated(tmp_path):
    pairs = jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                                             {"prompt": "2+2=", "chosen": "4"}, "nope",
                                             {"prompt": "3+3=", "chosen": "6", "rejected": "6"}])
    report = check_data(load_config(recipe("dpo_arithmetic"), [f"data.train={pairs}", f"data.val={pairs}"]))
    train = report.splits[0].problems
    assert train[:2] == [
        (f"data.train={pairs!r}: {pairs}:2: a preference pair needs ['prompt', 'chosen', 'rejected'], got "
         "['chosen', 'prompt']"),
        (f"data.train={pairs!r}: {pairs}:3: not a JSON object (Expecting value); each line holds a preference pair "
         "{prompt, chosen, rejected}")]
    fine = jsonl(tmp_path / "fine.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                                           {"prompt": "3+3=", "chosen": "6", "rejected": "6"}])
    (gate,) = check_data(load_config(recipe("dpo_arithmetic"), [f"data.train={fine}", f"data.val={fine}"])).splits[0].problems
    assert gate.startswith(f"data.train={fine!r}: ") and "chosen!=rejected" in gate


def test_run_preflight_stops_on_bad_rows_before_anything_starts(tmp_path):
    """`posttrain run` checks the config, this machine, then the rows (`check`, before the flow): a DataError (a
    ConfigError, printed by the CLI as one block) listing every bad row."""
    from rl_core.config import ConfigError
    from rl_core.preflight.rules import check

    bad = jsonl(tmp_path / "bad.jsonl", [GOOD, {"answer": "1", "max_chars": 1}, {**GOOD, "prompt": []}])
    with pytest.raises(DataError) as raised:
        check(own(bad, bad))
    assert isinstance(raised.value, ConfigError) and len(raised.value.problems) == 4
    assert f"{bad}:3: column 'prompt' must be text or a non-empty list" in str(raised.value)


class ListedRows(Task):
    """A task of your own that reports every bad row (`RowErrors`), one of them quoting a credential."""

    name = "listed"

    def load(self, source, data):
        raise RowErrors([f"{source}:2: no label", f"{source}:5: fetched with https://user:hunter2@example.com/x"])


def test_a_task_of_your_own_lists_every_bad_row_through_row_errors(tmp_path):
    rows = jsonl(tmp_path / "rows.jsonl", [{"text": "x"}])
    cfg = load_config(recipe("arithmetic"), ["data.task=tests.rl_core.test_data_check:ListedRows",
                                             f"data.train={rows}", f"data.val={rows}"])
    train = check_data(cfg).splits[0].problems
    assert len(train) == 2 and train[0] == f"data.train={rows!r}: {rows}:2: no label"
    assert train[1].startswith(f"data.train={rows!r}: {rows}:5: fetched with https://") and "hunter2" not in train[1]
