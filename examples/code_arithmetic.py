"""Code as a tool: the tool example's sums, answered by writing Python that runs in a sandbox (docs/agents.md,
"Sandboxes"; recipes/code_arithmetic.py trains with it).

Each row is a sum of three 3-digit numbers (`prompt`) and its `answer`, as in `examples/tool_arithmetic.py`. The
environment starts a `LocalSandbox` per episode and offers one tool, the built-in `python` (`python_tool`): a turn
with a call is answered with what the code printed (or its error), and the first turn without one is the answer,
rewarded 1.0 when it is exactly the sum. The sandbox stops when the episode ends (`close`).

The warm start (`make_transcripts`) teaches the format from two kinds of games: a quarter write
`print(123+456+789)` for the row's sum and copy what it printed as the answer, the rest answer at once (which a model
this small gets wrong). RL has to find that running code pays.

The DVC stages `code_arithmetic` (rows, games and the template) and `code_warm_start` build it:
`dvc repro pipelines/code_arithmetic/dvc.yaml`.
"""

from __future__ import annotations

import json

from examples import tool_arithmetic
from rl_core.agents import Environment, Reply, Turn
from rl_core.agents.sandbox import Limits, LocalSandbox, python_tool

LIMITS = Limits(seconds=5, memory_bytes=512 << 20, processes=8, disk_bytes=8 << 20, output_bytes=2048)


def call_text(prompt: str) -> str:
    """The assistant turn that runs code printing the sum, as the model writes it."""
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": f"print({prompt})"}}) + "</tool_call>"


class CodeArithmetic(Environment):
    """One sum: the row's prompt as the question, the sandboxed `python` tool, the row's answer as the reward's key."""

    def reset(self) -> list[dict]:
        self.final = None
        self.sandbox = LocalSandbox(LIMITS).start()
        self.tools = (python_tool(self.sandbox),)
        return super().reset()

    def respond(self, turn: Turn) -> Reply:
        if not turn.calls:
            self.final = turn.content.strip()
        return super().respond(turn)  # the code's output, or the end of the episode

    def reward(self) -> float:
        return float(self.final == self.example.answer)

    def close(self) -> None:
        sandbox = getattr(self, "sandbox", None)
        if sandbox is not None:
            sandbox.stop()


def make_transcripts(rows: list[dict], seed: int = 0, call_share: float = 0.25) -> list[dict]:
    """One warm-start game per row: `call_share` of them print the sum with code and copy the output, the others
    answer at once."""
    return tool_arithmetic.make_transcripts(rows, seed, call_share, tool=python_tool(None), call=call_text)


def main(argv: list[str] | None = None) -> None:
    tool_arithmetic.main(argv, name="code-arithmetic", transcripts=make_transcripts)


if __name__ == "__main__":
    main()
