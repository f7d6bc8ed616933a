"""Environments written with the `verifiers` library (its `SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv`, rubrics and
`EnvGroup`), run unchanged: verifiers runs each episode's rollout, its turn logic, tools and rubric, against the
policy behind posttrain's gateway, and posttrain records the ids the policy sampled as for any agent function.

    # mypackage/tasks.py
    from rl_core.agents.verifiers import verifiers_environment

    MathTask = verifiers_environment("my-math-env", env_args={"difficulty": 2})

`data.task=mypackage.tasks:MathTask`, and `data.train` the environment's own rows (`posttrain make-data verifiers`).
verifiers loads the environment as it always does (`vf.load_environment(env_id, **env_args)`: the module named by the
id, installed or on PYTHONPATH). An `EnvGroup` runs several environments in one run: each row's `info` names its
environment (`env_id`, as the group writes its rows), whose rubric scores it.

verifiers runs in a Python of its own (`python`, else $POSTTRAIN_VERIFIERS_PYTHON, else this interpreter): its
releases do not install beside posttrain's pins (`make verifiers-venv` builds one that does). One runner process per
process that hosts episodes (`runner.py serve`, started on first use, stopped with it) runs them all concurrently.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).with_name("runner.py")
PYTHON_VARIABLE = "POSTTRAIN_VERIFIERS_PYTHON"
NO_VERIFIERS = 3  # the runner's exit code when its Python cannot import verifiers
_RUNNERS: dict[tuple[str, ...], Runner] = {}
_LOCK = threading.Lock()


def verifiers_python(python: str | None = None) -> str:
    """The Python that runs verifiers: `python`, else $POSTTRAIN_VERIFIERS_PYTHON, else this interpreter."""
    return python or os.environ.get(PYTHON_VARIABLE) or sys.executable


def runner_env(pythonpath: Sequence[str]) -> dict[str, str]:
    """The runner's environment: this process's, with `pythonpath` and the working directory on PYTHONPATH
    (environments next to the recipe load as verifiers loads installed ones)."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, *path, os.getcwd()])}


def exit_reason(python: str, code: int | None) -> str:
    if code == NO_VERIFIERS:
        return (f"{python} cannot import verifiers: build its own environment with `make verifiers-venv` and set "
                f"{PYTHON_VARIABLE}=.venv-verifiers/bin/python (or pass python=)")
    return f"the verifiers runner ({python}) exited with code {code}; its stderr is in this process's log"


class Runner:
    """One `runner.py serve` process: requests go in as JSON lines, answers come back by id to the waiting caller."""

    def __init__(self, python: str, pythonpath: Sequence[str]) -> None:
        self.python = python
        self.proc = subprocess.Popen([python, str(RUNNER), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, encoding="utf-8", env=runner_env(pythonpath))
        self.pending: dict[int, Future] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, name="verifiers runner", daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            answer = json.loads(line)
            with self.lock:
                waiting = self.pending.pop(answer.pop("id"), None)
            if waiting is not None:
                waiting.set_result(answer)
        reason = exit_reason(self.python, self.proc.wait())
        with self.lock:
            waiting, self.pending = list(self.pending.values()), {}
        for future in waiting:
            future.set_exception(RuntimeError(reason))

    def run(self, request: dict) -> dict:
        """Send `request` and wait for its answer."""
        future: Future = Future()
        with self.lock:
            if not self.alive():
                raise RuntimeError(exit_reason(self.python, self.proc.poll()))
            key = next(self.ids)
            self.pending[key] = future
            try:
                self.proc.stdin.write(json.dumps({"id": key, **request}) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass  # the runner is exiting: its reader fails every request still pending, this one included
        return future.result()

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()  # the runner ends on end of input
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def runner(python: str, pythonpath: Sequence[str] = ()) -> Runner:
    """This process's runner for `python` and `pythonpath`, started on first use (and again if it died)."""
    key = (python, *map(str, pythonpath))
    with _LOCK:
        known = _RUNNERS.get(key)
        if known is None or not known.alive():
            known = _RUNNERS[key] = Runner(python, key[1:])
        return known


@atexit.register
def stop_runners() -> None:
    """Stop every runner this process started."""
    with _LOCK:
        for known in _RUNNERS.values():
            known.close()
        _RUNNERS.clear()


def verifiers_environment(env_id: str, *, env_args: dict[str, Any] | None = None, python: str | None = None,
                          pythonpath: Sequence[str] = ()) -> Callable[[Any, dict], float]:
    """The agent function (`data.task`) whose episodes are rollouts of the verifiers environment `env_id`, loaded
    with `env_args`; its reward is the environment's rubric score (the weighted sum of its reward functions).
    `pythonpath`: directories the runner imports environments from, beside those installed in its Python."""
    args, path = dict(env_args or {}), tuple(pythonpath)
    json.dumps(args)  # the arguments travel to the runner as JSON: refuse others here, at import

    def episode(client: Any, row: dict) -> float:
        answer = runner(verifiers_python(python), path).run({"env_id": env_id, "env_args": args, "row": row,
                                                       "base_url": str(client.base_url), "api_key": client.api_key})
        if "failure" in answer:
            raise RuntimeError(f"verifiers environment {env_id}: {answer['failure']}")
        return answer["reward"]

    def check() -> str | None:
        """What stops the environment from loading in verifiers' Python (`posttrain validate` asks), else None."""
        try:
            answer = runner(verifiers_python(python), path).run({"rows": "train", "n": 1, "env_id": env_id,
                                                                 "env_args": args})
        except RuntimeError as exc:
            return str(exc)
        return f"verifiers environment {env_id} does not load: {answer['failure']}" if "failure" in answer else None

    episode.check = check
    episode.__name__ = episode.__qualname__ = "verifiers_" + re.sub(r"\W", "_", env_id)
    return episode


def verifiers_rows(env_id: str, path: str | Path, *, split: str = "train", n: int = -1,
                   env_args: dict[str, Any] | None = None, python: str | None = None,
                   pythonpath: Sequence[str] = ()) -> int:
    """Write the rows of `env_id`'s dataset (`split` "train", or "eval" for its eval dataset; the first `n`, all with
    -1) to the JSONL file `path`, in the form `verifiers_environment`'s episodes read: `messages` (the environment's
    prompt, its system prompt and few-shot turns included), `answer`, `info` (JSON text), `example_id`, and `task` (JSON
    text) where the dataset has one.
    Returns how many."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: a verifiers environment has a 'train' and an 'eval' dataset")
    answer = runner(verifiers_python(python), pythonpath).run(
        {"rows": split, "n": n, "env_id": env_id, "env_args": dict(env_args or {})})
    if "failure" in answer:
        raise RuntimeError(f"the {split} rows of verifiers environment {env_id} could not be read: {answer['failure']}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in answer["rows"]), encoding="utf-8")
    return len(answer["rows"])
