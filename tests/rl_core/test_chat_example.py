"""The chat example's data and TRL-style rewards (examples/chat_arithmetic.py, recipes/chat_arithmetic.py): rows in
TRL's conversational format that the prompts task reads as chat, splits that do not leak, rewards checked by hand."""

from __future__ import annotations

import json

from examples.chat_arithmetic import SYSTEM, accuracy_reward, format_reward, main, make_rows


def test_the_rows_are_trl_conversations_and_the_held_out_split_leaks_nowhere(tmp_path):
    from rl_core.config.schema import DataConfig
    from rl_core.tasks import load_examples

    main(["--out", str(tmp_path), "--seed", "3"])
    rows = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            for name in ("train", "val", "warm-train", "warm-val")}
    assert {k: len(v) for k, v in rows.items()} == {"train": 2000, "val": 200, "warm-train": 1900, "warm-val": 100}
    first = rows["val"][0]
    a, b = (int(x) for x in first["prompt"][1]["content"].removeprefix("What is ").removesuffix("?").split("+"))
    assert first == {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}+{b}?"}],
                     "solution": str(a + b), "difficulty": "easy" if a + b < 100 else "hard"}
    held_out = {json.dumps(r["prompt"]) for r in rows["val"]}
    assert not held_out & {json.dumps(r["prompt"]) for r in rows["train"]}
    warm = {json.dumps(c["messages"][:-1]) for name in ("warm-train", "warm-val") for c in rows[name]}
    assert not held_out & warm and warm <= {json.dumps(r["prompt"]) for r in rows["train"]}
    assert all(c["messages"][-1]["role"] == "assistant" for c in rows["warm-train"])
    assert make_rows(3) == rows  # the seed decides the rows

    data = DataConfig(task="prompts", prompt_template="chat", train=str(tmp_path / "train.jsonl"),
                      val=str(tmp_path / "val.jsonl"))
    example = load_examples(data.val, "prompts", data)[0]  # the prompts task reads them as chat rows
    assert example.messages == tuple(first["prompt"]) and example.prompt == f"What is {a}+{b}?"
    assert example.columns["solution"] == str(a + b) and example.columns["difficulty"] == first["difficulty"]


def test_the_rewards_score_as_trl_writes_them():
    said = [[{"role": "assistant", "content": c}] for c in ("46", " 46\n", "47", "46!", "", "x")]
    solution = ["46"] * len(said)
    assert accuracy_reward(said, solution) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert format_reward(said) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert accuracy_reward(["46", "12"], solution=["46", "21"], difficulty=["easy", "easy"]) == [1.0, 0.0]
    # the recipe's weights: an exact sum scores 1.2, a well-formed wrong one 0.2
    weighted = [1.0 * acc + 0.2 * fmt for acc, fmt in zip(accuracy_reward(said, solution), format_reward(said))]
    assert weighted == [1.2, 1.2, 0.2, 0.0, 0.0, 0.0]
