"""Tool use: sums too long for the tiny model to do in its head, and a `calculator` it may call (docs/agents.md;
recipes/tool_arithmetic.py trains with it).

Each row is a sum of three 3-digit numbers (`prompt`, e.g. "123+456+789") and its `answer`. The environment
offers one tool, `calculator`; a turn with a call is answered with the result, and the first turn without one
is the answer, rewarded 1.0 when it is exactly the sum. The tiny model's chat template (`TEMPLATE`) lists the tools
and renders calls in the Hermes form the parser reads, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
and results as a `Tool:` line.

The warm start (`make_transcripts`) teaches the format from two kinds of games: a quarter call the calculator with
the row's sum and copy its result as the answer, the rest write the answer at once (which a model this small gets
wrong). So the warm start mostly answers at once, and greedily always; RL has to find that calling pays.

The DVC stages `tool_arithmetic` (rows, games and the template) and `tool_warm_start` build it:
`dvc repro pipelines/tool_arithmetic/dvc.yaml`.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

from rl_core.agents import Environment, Reply, Turn

TEMPLATE = (
    "{{ bos_token }}{% if tools %}Tools: {% for t in tools %}{{ t.function.name }}{% if not loop.last %}, {% endif %}"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}User: {{ m.content }}\n"
    "{% elif m.role == 'tool' %}Tool: {{ m.content }}\n"
    "{% elif m.role == 'assistant' %}Assistant: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% else %}{{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}"
)
SUM = re.compile(r"^\d{1,6}(\+\d{1,6}){0,5}$")


def calculator(expression: str) -> str:
    """Add integers.

    Args:
        expression: at most six integers of at most six digits joined by +, e.g. "123+456+789"
    """
    expression = expression.replace(" ", "")
    if not SUM.match(expression):
        raise ValueError(f"{expression!r} is not integers joined by + (at most six, six digits each)")
    return str(sum(int(x) for x in expression.split("+")))


def call_text(expression: str) -> str:
    """The assistant turn that calls the calculator, as the model writes it."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


class ToolArithmetic(Environment):
    """One sum: the row's prompt as the question, `calculator` as the tool, the row's answer as the reward's key."""

    tools = (calculator,)

    def reset(self) -> list[dict]:
        self.final = None
        return super().reset()

    def respond(self, turn: Turn) -> Reply:
        if not turn.calls:
            self.final = turn.content.strip()
        return super().respond(turn)  # the calls' results, or the end of the episode

    def reward(self) -> float:
        return float(self.final == self.example.answer)


def make_rows(seed: int = 0, train_size: int = 2000, val_size: int = 200) -> tuple[list[dict], list[dict]]:
    """Sums of three 3-digit numbers, shuffled with `seed`; no sum is in both splits."""
    import random

    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < train_size + val_size:
        terms = [rng.randint(100, 999) for _ in range(3)]
        prompt = "+".join(map(str, terms))
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "answer": str(sum(terms))})
    return rows[val_size:], rows[:val_size]


def make_transcripts(rows: list[dict], seed: int = 0, call_share: float = 0.25, tool: Callable = calculator,
                     call: Callable[[str], str] = call_text) -> list[dict]:
    """One warm-start game per row: `call_share` of them call `tool` (the turn `call(prompt)` writes) and copy its
    result, the others answer at once."""
    import random

    from rl_core.agents.tools import tool_schema

    rng = random.Random(seed)
    schema = tool_schema(tool)
    tools, name = [schema], schema["function"]["name"]
    out = []
    for row in rows:
        question = {"role": "user", "content": row["prompt"]}
        if rng.random() < call_share:
            messages = [question, {"role": "assistant", "content": call(row["prompt"])},
                        {"role": "tool", "name": name, "content": row["answer"]},
                        {"role": "assistant", "content": row["answer"]}]
        else:
            messages = [question, {"role": "assistant", "content": row["answer"]}]
        out.append({"messages": messages, "tools": tools})
    return out


def main(argv: list[str] | None = None, *, name: str = "tool-arithmetic",
         transcripts: Callable[[list[dict], int], list[dict]] = make_transcripts) -> None:
    """Write an example's rows, its warm-start games (`transcripts`) and the chat template to `--out`."""
    parser = argparse.ArgumentParser(description=f"write the {name} example's rows, warm-start games and chat "
                                                 "template")
    parser.add_argument("--out", default=f"data/{name}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, val = make_rows(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    splits = (("train", train), ("val", val), ("warm-train", transcripts(train, args.seed)),
              ("warm-val", transcripts(val, args.seed + 1)))
    for split, rows in splits:
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    print(f"wrote {len(train)} train and {len(val)} held-out rows, their warm-start games and the chat template "
          f"to {out}/")


if __name__ == "__main__":
    main()
