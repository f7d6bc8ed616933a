"""Data: arithmetic split sizes and disjointness, GSM8K loading and templates, sampler exact resume."""

from __future__ import annotations

import json
import re

import pytest

from rl_core.data import PromptSampler, make_arithmetic_data, prepare_gsm8k, split_arithmetic
from rl_core.data.gsm8k import GSM8K_INSTRUCTION
from rl_core.model.loading import build_tiny_tokenizer
from rl_core.tasks import Example, encode_prompts, format_prompt, load_examples


def _read(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def test_arithmetic_split_sizes_disjoint_and_correct(tmp_path):
    r = make_arithmetic_data(tmp_path, seed=3, val_size=500)
    train, val = _read(r["train"]), _read(r["val"])
    assert (len(train), len(val)) == (100 * 100 - 500, 500) == (r["n_train"], r["n_val"])
    train_prompts, val_prompts = {x["prompt"] for x in train}, {x["prompt"] for x in val}
    assert len(train_prompts) == len(train) and len(val_prompts) == len(val)
    assert not train_prompts & val_prompts
    for rec in train + val:
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", rec["prompt"]).groups())
        assert 0 <= a <= 99 and 0 <= b <= 99 and rec["answer"] == str(a + b)


def test_arithmetic_split_is_deterministic_by_seed():
    a_train, a_val = split_arithmetic(0, val_size=50, train_size=200)
    b_train, b_val = split_arithmetic(0, val_size=50, train_size=200)
    _c_train, c_val = split_arithmetic(1, val_size=50, train_size=200)
    assert (a_train, a_val) == (b_train, b_val)
    assert a_val != c_val
    assert len(a_train) == 200 and len(a_val) == 50


def test_arithmetic_operators_and_range():
    train, val = split_arithmetic(0, low=0, high=9, operators=("+", "-", "*"), val_size=30)
    allp = train + val
    assert len(allp) == 3 * 10 * 10
    for rec in allp:
        a, op, b = re.fullmatch(r"(\d)([-+*])(\d)=", rec["prompt"]).groups()
        assert rec["answer"] == str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
    with pytest.raises(ValueError, match="operators"):
        split_arithmetic(0, operators=("/",))
    with pytest.raises(ValueError, match="val_size"):
        split_arithmetic(0, high=1, val_size=10)


def _gsm8k_fixture(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    train = [
        {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A pen costs $2. How much do 5 pens cost?", "answer": "5 * 2 = <<5*2=10>>10\n#### 10"},
    ]
    test = [{"question": "What is 6 minus 1?", "answer": "6 - 1 = 5\n#### 5"}]
    for name, rows in (("train", train), ("test", test)):
        (src / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src, train, test


def test_prepare_gsm8k_from_local_dir(tmp_path):
    src, train, test = _gsm8k_fixture(tmp_path)
    r = prepare_gsm8k(src, tmp_path / "out")
    assert (r["n_train"], r["n_test"]) == (2, 1)
    assert _read(r["train"]) == train and _read(r["test"]) == test
    examples = load_examples(r["test"], "gsm8k")
    assert examples == [Example(test[0]["question"], test[0]["answer"])]


def test_gsm8k_hub_source_that_cannot_load_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing can be downloaded here; the error names what was asked
    with pytest.raises(RuntimeError, match=r"could not load GSM8K 'no-such-org/gsm8k' split 'test'"):
        load_examples("no-such-org/gsm8k:test", "gsm8k")


def test_prompt_templates(tmp_path):
    tok = build_tiny_tokenizer()
    q = Example("Tom has 3 apples and buys 4 more. How many?", "#### 7")
    plain = format_prompt(q, tok, "gsm8k", "plain")
    assert plain == "Question: Tom has 3 apples and buys 4 more. How many?\nAnswer:"
    chat = format_prompt(q, tok, "gsm8k", "chat")
    assert q.prompt in chat and GSM8K_INSTRUCTION in chat and "#### <number>" in chat
    assert chat.startswith("<bos>") and chat.endswith("Assistant: ")
    arith = Example("12+34=", "46")
    assert format_prompt(arith, tok, "arithmetic", "plain") == "12+34="
    # plain adds the tokenizer's <bos>; chat relies on the template's own <bos> (exactly one)
    ids_plain, ids_chat = (
        encode_prompts(tok, [arith, arith], "arithmetic", "plain")[0],
        encode_prompts(tok, [arith], "arithmetic", "chat")[0],
    )
    assert ids_plain == [tok.bos_token_id] + tok.convert_tokens_to_ids(list("12+34="))
    assert ids_chat.count(tok.bos_token_id) == 1 and ids_chat[0] == tok.bos_token_id
    with pytest.raises(ValueError, match="prompt_template"):
        format_prompt(arith, tok, "arithmetic", "fancy")


def test_load_examples_arithmetic_missing_file_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="make-data arithmetic"):
        load_examples(tmp_path / "none.jsonl", "arithmetic")


def test_sampler_epochs_are_permutations_and_batches_never_empty():
    s = PromptSampler(num_examples=10, batch_size=4, seed=0)
    batches = [s.next_batch() for _ in range(10)]  # 40 indices = 4 epochs exactly
    assert all(len(b) == 4 for b in batches)
    flat = [i for b in batches for i in b]
    epochs = [flat[k : k + 10] for k in range(0, 40, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # a fresh permutation each epoch
    big = PromptSampler(num_examples=3, batch_size=7, seed=1)
    assert len(big.next_batch()) == 7


def test_sampler_same_seed_same_order_other_seed_differs():
    a = [PromptSampler(50, 8, seed=4).next_batch() for _ in range(2)]
    b = PromptSampler(50, 8, seed=5).next_batch()
    assert a[0] == a[1] and a[0] != b


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5, 7])  # 3 and 5 end exactly at epoch boundaries (15 = 3*5)
def test_sampler_resume_reproduces_sequence_across_epoch_boundary(stop_after):
    ref = PromptSampler(num_examples=15, batch_size=5, seed=9)
    expected = [ref.next_batch() for _ in range(12)]
    s = PromptSampler(num_examples=15, batch_size=5, seed=9)
    head = [s.next_batch() for _ in range(stop_after)]
    state = json.loads(json.dumps(s.state_dict()))  # survives a checkpoint round trip
    resumed = PromptSampler(num_examples=15, batch_size=5, seed=9)
    resumed.load_state_dict(state)
    tail = [resumed.next_batch() for _ in range(12 - stop_after)]
    assert head + tail == expected
    assert all(len(b) == 5 for b in tail)


def test_sampler_refuses_state_of_another_stream():
    s = PromptSampler(15, 5, seed=9)
    with pytest.raises(ValueError, match="num_examples"):
        PromptSampler(16, 5, seed=9).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(15, 5, seed=1).load_state_dict(s.state_dict())


@pytest.mark.parametrize("bad_line, reason", [("{not json", "not a JSON object (Expecting"),
                                               ("[1, 2]", "not a JSON object (a list)")])
def test_a_data_file_line_that_is_not_an_object_is_named_by_file_and_line(tmp_path, bad_line, reason):
    from rl_core.data.gsm8k import read_gsm8k_jsonl
    from rl_core.data.preferences import load_preference_pairs
    from rl_core.tasks import load_examples

    cases = [
        ("arith.jsonl", {"prompt": "1+1=", "answer": "2"}, lambda p: load_examples(p, "arithmetic")),
        ("gsm8k.jsonl", {"question": "q", "answer": "#### 2"}, read_gsm8k_jsonl),
        ("pairs.jsonl", {"prompt": "1+1=", "chosen": "2", "rejected": "3"}, load_preference_pairs),
    ]
    for name, good, load in cases:
        path = tmp_path / name
        path.write_text(json.dumps(good) + "\n\n" + bad_line + "\n")  # the blank line 2 is skipped, line 3 is bad
        with pytest.raises(ValueError) as info:
            load(path)
        assert str(info.value).startswith(f"{path}:3: {reason}"), (name, str(info.value))


# ----------------------------------------------------------------------------- bad data, named


@pytest.mark.parametrize("content, needle", [
    (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "3"}\n', r"split\.jsonl:2: not UTF-8 text"),
    (b'{"prompt": null, "answer": "2"}\n', r"split\.jsonl:1: 'prompt' must be text, got null"),
    (b'{"prompt": "1+1=", "answer": null}\n', r"split\.jsonl:1: 'answer' must be text or a number, got null"),
    (b'{"prompt": "  ", "answer": "2"}\n', r"split\.jsonl:1: 'prompt' is empty"),
    (b'{"prompt": ["1+1="], "answer": "2"}\n', r"split\.jsonl:1: 'prompt' must be text, got list"),
])
def test_bad_arithmetic_rows_are_named_by_file_line_and_field(tmp_path, content, needle):
    path = tmp_path / "split.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=needle):
        load_examples(str(path), "arithmetic")


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "2"}', r":2: nested 100001 levels deep"),
    ('{"prompt": "1+1=", "answer": NaN}', r":2: key 'answer': NaN is not a number JSON allows"),
    ('{"prompt": "1+1=", "answer": -Infinity}', r":2: key 'answer': -Infinity is not a number JSON allows"),
    ('{"prompt": "1+1=", "answer": ' + "7" * 5000 + "}", r":2: key 'answer': a number of 5000 digits"),
    ('{"prompt": "1+1=", "answer": 1e999}', r":2: key 'answer': 1e999 overflows to infinity"),
    ('{"prompt": "1+1=", "answer": "2", "answer": "3"}', r":2: key 'answer' appears twice"),
], ids=["deep", "nan", "infinity", "huge", "overflow", "duplicate"])
def test_bad_json_values_are_refused_naming_file_line_and_key(tmp_path, line, needle):
    """A 100k-deep line raised an uncaught RecursionError; NaN/Infinity answers became "nan"/"inf"; a 5000-digit
    answer's error named no file or line; a duplicate key silently kept the last value."""
    from rl_core.data.preferences import load_preference_pairs

    path = tmp_path / "split.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n' + line + "\n")
    with pytest.raises(ValueError, match=re.escape(str(path)) + needle):
        load_examples(str(path), "arithmetic")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n' + line.replace('"answer"', '"chosen"')
                     .replace('"prompt": "1+1=",', '"prompt": "1+1=", "rejected": "3",', 1) + "\n")
    with pytest.raises(ValueError, match=re.escape(str(pairs)) + needle.replace("answer", "chosen")):
        load_preference_pairs(pairs)


def test_a_directory_given_as_a_data_file_is_named_as_one(tmp_path):
    """It was reported as a file that "does not exist"."""
    from rl_core.data.preferences import load_preference_pairs

    for load in (lambda p: load_examples(str(p), "arithmetic"), load_preference_pairs):
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: is a directory, not a JSONL file")):
            load(tmp_path)


def test_gsm8k_null_question_is_named(tmp_path):
    path = tmp_path / "split.jsonl"
    path.write_text('{"question": "q?", "answer": "#### 1"}\n{"question": null, "answer": "#### 2"}\n')
    with pytest.raises(ValueError, match=r"split\.jsonl:2: 'question' must be text, got null"):
        load_examples(str(path), "gsm8k")


def test_numeric_answers_are_accepted_as_text(tmp_path):
    path = tmp_path / "split.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n')
    assert load_examples(str(path), "arithmetic") == [Example("1+1=", "2")]


def test_rollout_role_names_the_key_of_an_empty_split_and_a_prompt_beyond_the_context(tmp_path):
    from infra.cluster.roles import RolloutRole
    from rl_core.config import ConfigError, load_config
    from rl_core.model.loading import build_tiny_model

    model = build_tiny_model(tmp_path / "model")  # context: 2048 positions
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    base = [f"model.name_or_path={model}", f"data.val={good}"]
    with pytest.raises(ConfigError, match=r"data\.train=.*empty\.jsonl.*no examples"):
        RolloutRole.build(load_config("recipes/arithmetic.py", [*base, f"data.train={empty}"]))
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "1+1=", "answer": "2"}\n' + json.dumps({"prompt": "9" * 2040, "answer": "1"}) + "\n")
    with pytest.raises(ConfigError, match=r"data\.train row 2 \(.*long\.jsonl:2\): its prompt is 2041 tokens.*more than the model.s 2048"):
        RolloutRole.build(load_config("recipes/arithmetic.py", [*base, f"data.train={long}", "rollout.max_tokens=16"]))
    role = RolloutRole.build(load_config("recipes/arithmetic.py", [*base, f"data.train={good}"]))
    assert role.prompt_limit == 5  # <bos> + 4 characters


def test_a_seed_beyond_2_to_the_32_is_refused_at_validation():
    from rl_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"job\.seed=100000000000000000000000: must be <= 4294967295"):
        load_config("recipes/arithmetic.py", ["job.seed=100000000000000000000000"])
