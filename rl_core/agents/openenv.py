"""OpenEnv environments as posttrain environments, run as OpenEnv runs them: the environment's FastAPI app
(`openenv.core.env_server.create_app`) served by uvicorn on 127.0.0.1, one server per process that hosts episodes,
and one WebSocket session per episode (`openenv.core.GenericEnvClient`).

    # mypackage/guess_task.py
    from rl_core.agents.openenv import openenv_environment
    from mypackage.guess_env import GuessAction          # the OpenEnv Action the environment takes

    GuessTask = openenv_environment("mypackage.guess_env:app", GuessAction, tool="guess",
                                    description="Guess the secret number.", reset_columns=("seed",))

`data.task=mypackage.guess_task:GuessTask` then trains on the rows of `data.train`: an episode opens with the row's
prompt, the text of the observation `reset` returned appended to it; the model acts by calling the tool, whose
parameters are the Action's fields (their types and `Field` descriptions make its schema); each call is one `step`,
answered with the observation's text; the episode ends when an observation says `done`, or at a turn without a
call. Its `environment` reward is the sum of the steps' rewards. `reset_columns` names the row's columns passed to
the environment's `reset` (a seed, a level). A server that stops answering fails its calls like any environment's.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from rl_core.agents.environment import Environment, Reply, Turn

START_SECONDS = 60.0
HIDDEN = ("done", "reward", "metadata")  # an observation's fields that are not its text
_SERVERS: dict[str, tuple[subprocess.Popen, str]] = {}
_LOCK = threading.Lock()
# the server's own process: it serves `app` and exits when its parent's pipe closes (its parent died or stopped it)
_SERVE = """
import os, sys, threading, uvicorn
from importlib import import_module
module, _, name = sys.argv[1].partition(":")
app = getattr(import_module(module), name)
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


def server(app: str) -> str:
    """The base URL of this process's server of `app` (`package.module:app`), started on first use."""
    with _LOCK:
        known = _SERVERS.get(app)
        if known is not None and known[0].poll() is None:
            return known[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "ENABLE_WEB_INTERFACE": "false"}
        proc = subprocess.Popen([sys.executable, "-c", _SERVE, app, str(port)], stdin=subprocess.PIPE, env=env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):  # our own loopback server
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"the OpenEnv server of {app} did not start (exit code {proc.poll()}); run "
                                       f"`python -m uvicorn {app} --port 8000` to see why") from None
                time.sleep(0.1)
        _SERVERS[app] = (proc, url)
        return url


@atexit.register
def stop_servers() -> None:
    """Stop every OpenEnv server this process started."""
    with _LOCK:
        for proc, _ in _SERVERS.values():
            proc.kill()
            proc.wait()
        _SERVERS.clear()


def observation_text(observation: dict) -> str:
    """An observation as the model reads it: its one text field as it is, else its fields as JSON (`done`,
    `reward` and `metadata` left out)."""
    shown = {k: v for k, v in observation.items() if k not in HIDDEN}
    if len(shown) == 1 and isinstance(next(iter(shown.values())), str):
        return next(iter(shown.values()))
    return json.dumps(shown)


def action_tool(action: type, name: str, description: str, call: Callable[[dict], str]) -> Callable[..., str]:
    """A tool named `name` whose parameters are the fields of the pydantic `action` (all but `metadata`), which
    calls `call(fields)`; its docstring and annotations give the JSON schema."""
    fields = {k: f for k, f in action.model_fields.items() if k != "metadata"}
    missing = [k for k, f in fields.items() if not f.description]
    if missing:
        raise ValueError(f"{action.__name__}: give each field a description (Field(description=...)) for the "
                         f"model to read; {', '.join(missing)} has none")

    def tool(**arguments: Any) -> str:
        return call(arguments)

    parameters = []
    for k, f in fields.items():
        default = {} if f.is_required() else {"default": f.get_default(call_default_factory=True)}
        parameters.append(inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, annotation=f.annotation, **default))
    tool.__signature__ = inspect.Signature(parameters, return_annotation=str)
    tool.__annotations__ = {**{k: f.annotation for k, f in fields.items()}, "return": str}
    tool.__name__ = tool.__qualname__ = name
    args = "\n".join(f"    {k}: {f.description}" for k, f in fields.items())
    tool.__doc__ = f"{description}\n\nArgs:\n{args}\n"
    return tool


def openenv_environment(app: str, action: type, *, tool: str = "step", description: str | None = None,
                        reset_columns: Sequence[str] = (), render: Callable[[dict], str] = observation_text
                        ) -> type[Environment]:
    """A posttrain `Environment` class whose episodes are sessions of the OpenEnv environment served by `app`
    (see the module's docstring). `action` is the environment's Action class; `tool` names the tool the model
    calls with its fields, `description` says what the tool does (default: the Action's docstring); `render`
    turns an observation (a dict) into the text the model reads."""
    from openenv.core import GenericEnvClient

    text = description or inspect.cleandoc(action.__doc__ or "") or f"Act in the {tool} environment."
    action_tool(action, tool, text, lambda fields: "")  # a bad Action is refused when the task loads, not mid-run

    class OpenEnvEpisode(Environment):
        def reset(self) -> list[dict]:
            self.rewards: list[float] = []
            self.done = False
            self.client = GenericEnvClient(base_url=server(app)).connect()
            kwargs = {c: self.example.columns[c] for c in reset_columns}
            opened = self.client.reset(**kwargs)
            self.tools = (action_tool(action, tool, text, self._step),)
            messages = super().reset()
            shown = render(opened.observation)
            if shown:
                last = messages[-1]
                messages[-1] = {**last, "content": f"{last['content']}\n{shown}".strip()}
            return messages

        def _step(self, fields: dict) -> str:
            if self.done:
                return "error: the episode has ended"
            result = self.client.step(fields)
            self.rewards.append(float(result.reward or 0.0))
            self.done = bool(result.done)
            return render(result.observation)

        def respond(self, turn: Turn) -> Reply:
            reply = super().respond(turn)
            return Reply(reply.messages, done=True) if self.done else reply

        def reward(self) -> float:
            return sum(self.rewards)

        def close(self) -> None:
            client = getattr(self, "client", None)
            if client is not None:
                client.close()

    OpenEnvEpisode.__name__ = OpenEnvEpisode.__qualname__ = f"OpenEnv[{app}]"
    return OpenEnvEpisode
