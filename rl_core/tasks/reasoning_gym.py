"""The reasoning-gym task: procedural reasoning problems from the `reasoning-gym` library, scored by its own scorers.

`data.task=reasoning_gym`; a split names its problems as `NAME[+NAME...]:SEED:SIZE`, e.g.
`data.train=leg_counting:0:2000` and `data.val=leg_counting:1:200`; several names make a composite of them in
equal shares (`leg_counting+chain_sum:0:2000`). The same name, seed and size give the same problems anywhere.
Each problem's `question` is the user prompt, under reasoning-gym's own system prompt (its answer goes between
`<answer>` and `</answer>`) unless `data.system_prompt` is set; the reward is the library's `score_answer` of the
text between the last answer tags (0 when there are none, or when the scorer raises on what the model wrote).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from rl_core.rewards import completion_text
from rl_core.tasks.base import Example, Task

SOURCE = re.compile(r"^(?P<names>[a-z0-9_]+(\+[a-z0-9_]+)*):(?P<seed>\d+):(?P<size>\d+)$")


def _library():
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError("data.task=reasoning_gym needs the reasoning-gym package: pip install 'reasoning-gym>=0.1.25'"
                          ) from exc
    return reasoning_gym


def parse_source(source: str) -> tuple[tuple[str, ...], int, int]:
    """`(names, seed, size)` of a split `NAME[+NAME...]:SEED:SIZE`; ValueError saying the form."""
    match = SOURCE.match(str(source))
    if match is None or int(match["size"]) == 0:
        raise ValueError(f"a reasoning_gym split is NAME[+NAME...]:SEED:SIZE (e.g. leg_counting:0:2000), got "
                         f"{source!r}")
    return tuple(match["names"].split("+")), int(match["seed"]), int(match["size"])


@functools.lru_cache(maxsize=16)
def dataset(source: str):
    """The reasoning-gym dataset a split names (one per process and source: a reward worker rebuilds it once)."""
    names, seed, size = parse_source(source)
    rg = _library()
    from reasoning_gym.factory import DATASETS

    unknown = [n for n in names if n not in DATASETS]
    if unknown:
        raise ValueError(f"reasoning_gym split {source!r}: no dataset {', '.join(unknown)} in reasoning-gym "
                         f"(it has {len(DATASETS)}: {', '.join(sorted(DATASETS)[:8])}, ...)")
    if len(names) == 1:
        return rg.create_dataset(names[0], seed=seed, size=size)
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(name=n, weight=1.0, config={}) for n in names]
    return rg.create_dataset("composite", seed=seed, size=size, datasets=specs)


def reasoning_gym_reward(prompts: list, completions: list, rg_source: list, rg_index: list, **_: Any) -> list[float]:
    """reasoning-gym's own score of each completion's answer (the text between its last `<answer>` tags, the
    library's `extract_answer`) against its problem."""
    from reasoning_gym.utils import extract_answer

    scores = []
    for completion, source, index in zip(completions, rg_source, rg_index, strict=True):
        data = dataset(source)
        try:
            answer = extract_answer(completion_text(completion), tag_name="answer")
            score = float(data.score_answer(answer, entry=data[int(index)]))
        except Exception:  # noqa: BLE001 - some scorers raise on what they cannot parse: the answer is wrong
            score = 0.0
        scores.append(score)
    return scores


class ReasoningGymTask(Task):
    name = "reasoning_gym"
    build_hint = None  # generated from its name, seed and size: nothing to build

    def load(self, source: str, data: Any) -> list[Example]:
        problems = dataset(str(source))
        out = []
        for index in range(len(problems)):
            entry = problems[index]
            answer = "" if entry["answer"] is None else str(entry["answer"])
            out.append(Example(entry["question"], answer, columns={"answer": answer, "rg_source": str(source),
                                                                   "rg_index": index},
                               row=f"{source} problem {index}"))
        return out

    def _system(self, data: Any) -> str:
        if data is not None and data.system_prompt:
            return data.system_prompt
        from reasoning_gym.utils import SYSTEM_PROMPTS

        return SYSTEM_PROMPTS["default"]

    def plain_text(self, example: Example, data: Any) -> str:
        parts = [self._system(data), example.prompt]
        if (extra := self.instruction(data)) is not None:
            parts.append(extra)
        return "\n".join(parts)

    def messages(self, example: Example, data: Any) -> list[dict]:
        messages = super().messages(example, data)
        if messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self._system(data)})
        return messages

    def default_rewards(self, data: Any) -> list[tuple[str, Any]]:
        return [("reasoning_gym", reasoning_gym_reward)]

    def supervised_target(self, example: Example) -> str:
        return f"<answer>{example.answer}</answer>"
