"""User code the tests plug in by import path (`data.rewards`, `data.task`) and wrong user code they must refuse, as a
user's would be: outside the package. The example objective the tests train is `examples/custom_objective.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rl_core.agents import Environment
from rl_core.agents.verifiers import verifiers_environment

# environments written with verifiers (tests/fixtures/verifiers_envs), run by the Python `make verifiers-venv` builds
VERIFIERS_ENVS = Path(__file__).parent / "fixtures" / "verifiers_envs"
VERIFIERS_PYTHON = (os.environ.get("POSTTRAIN_VERIFIERS_PYTHON")
                    or str(Path(__file__).parents[1] / ".venv-verifiers" / "bin" / "python"))
vf_guess = verifiers_environment("vf_guess", python=VERIFIERS_PYTHON, pythonpath=[VERIFIERS_ENVS])


def answer_length_reward(completions, answer, **_):
    """A reward a test can recompute from the data to within 1e-3: the answer's length / 10, plus 1e-3 for a
    completion of odd length (so a group's rewards differ and its advantages are not all 0)."""
    return [len(a) / 10 + 1e-3 * (len(c) % 2) for c, a in zip(completions, answer)]


def length_reward(completions, **_):
    """len(text) / 10 of each completion (text, or the assistant message of a chat completion)."""
    return [len(c if isinstance(c, str) else c[-1]["content"]) / 10 for c in completions]


def unit_reward(completions, unit, **_):
    """1.0 when the completion names the row's `unit` column, 0.0 when not, None for a row without a unit."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [None if u is None else float(u in t) for t, u in zip(texts, unit)]


def sleepy_reward(completions, **_):
    """Never returns in time: the pool's timeout must name it."""
    import time

    time.sleep(3600)
    return [0.0] * len(completions)


def leaky_reward(completions, **_):
    """Raises quoting an API key, as a reward calling an API might: no log or error may repeat it."""
    raise PermissionError("the judge API refused key sk-" + "judge0123456789abcdefXYZ")


def exiting_reward(completions, **_):
    """Ends its own process, as a reward that crashes would: a reward error, never a lost trainer."""
    import os

    os._exit(3)


# ------------------------------------------------------------------------------------------ wrong ones

def objective_with_one_argument(rl):
    raise AssertionError("never called: the signature check refuses it")


def reward_without_completions(prompts, answer):
    raise AssertionError("never called: the signature check refuses it")


def not_an_objective(rl, context):
    return torch.zeros(())


NOT_A_FUNCTION = 3


# ---- an environment whose tool can hang, raise or crash its process (tests/infra/workers/test_environment_pool.py)
def wait(seconds: float) -> str:
    """Wait, then say so.

    Args:
        seconds: how long to wait; -1 ends the process at once (a crash)
    """
    import os
    import time

    if seconds < 0:
        os._exit(3)
    time.sleep(seconds)
    return f"waited {seconds:g} s"


class WaitingRoom(Environment):
    """One tool, `wait`; the episode ends at the first turn without a call; reward: the calls that returned."""

    tools = (wait,)

    def reward(self) -> float:
        if self.example.prompt == "bad reward":
            raise ValueError("no score for this row")
        return float(sum(not r.error for r in self.tool_results))


def compacting_agent(client, row):
    """Two turns, the second asked in a conversation that does not extend the first (the opening and a note of the
    policy's answer in its place), so every episode whose first turn is answered starts a new sample; 1.0 when the
    last answer has an even length (a reward that varies within a group)."""
    opening = {"role": "user", "content": row["prompt"]}
    first = client.chat.completions.create(model="policy", messages=[opening]).choices[0].message
    note = {"role": "user", "content": "You said " + (first.content or "")[:20] + ". Once more:"}
    second = client.chat.completions.create(model="policy", messages=[opening, note]).choices[0].message
    return float(len(second.content or "") % 2 == 0)
