"""The verifiers side of `rl_core.agents.verifiers`: a script run by a Python that has the `verifiers` package
(its own virtual environment, `make verifiers-venv`), never imported by posttrain. It imports only the standard
library and verifiers' own dependencies, so it runs in an environment where posttrain is not installed.

    python runner.py serve

Requests come in as JSON lines on stdin, and their answers go out as JSON lines, by id, to the file descriptor stdout
had at start; what verifiers or an environment prints goes to stderr, so it cannot corrupt the protocol. Every request
runs concurrently on one event loop, as verifiers runs its own rollouts; the runner ends when stdin closes (the process
that started it is gone).

An episode: {"id", "env_id", "env_args", "base_url", "api_key", "row"}; `row` is the dataset row as posttrain passes it
to an agent function (`prompt` the conversation, `answer`, `info`, `example_id`, a `task` payload if any). Its answer:
{"id", "reward"}, the rubric's score.
An environment's rows: {"id", "rows": "train" or "eval", "n", "env_id", "env_args"}; the answer {"id", "rows": [...]}.
A request that cannot be answered at all gets {"id", "failure": text}.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback

MODEL = "policy"  # the name posttrain's gateway serves the policy under
NO_VERIFIERS = 3  # the exit code when this Python cannot import verifiers


def load(env_id: str, env_args: dict, cache: dict):
    import verifiers as vf

    key = (env_id, json.dumps(env_args, sort_keys=True))
    if key not in cache:
        cache[key] = vf.load_environment(env_id, **env_args)
    return cache[key]


def rollout_input(row: dict) -> dict:
    """verifiers' RolloutInput of a row (`info` and a `task` payload travel as JSON text in posttrain's tables)."""
    info = row.get("info")
    out = {"prompt": row["prompt"], "example_id": int(row.get("example_id") or 0), "answer": row.get("answer") or "",
           "info": json.loads(info) if isinstance(info, str) and info else info or {}}
    if row.get("task"):
        out["task"] = row["task"]
    return out


async def episode(request: dict, cache: dict) -> dict:
    from openai import AsyncOpenAI
    from verifiers.clients import OpenAIChatCompletionsClient

    env = load(request["env_id"], request.get("env_args") or {}, cache)
    client = OpenAIChatCompletionsClient(AsyncOpenAI(base_url=request["base_url"], api_key=request["api_key"],
                                                     max_retries=0, timeout=None))
    try:  # a rollout verifiers stops early (a refused request, an empty turn) is scored as it stands, and logged
        output = await env.run_rollout(rollout_input(request["row"]), client, MODEL, {})
    finally:
        await client.close()
    return {"reward": float(output["reward"])}


async def serve(out) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    cache: dict = {}
    running: set[asyncio.Task] = set()

    async def answer(request: dict) -> None:
        try:
            result = {"rows": rows(request, cache)} if "rows" in request else await episode(request, cache)
        except Exception as exc:  # noqa: BLE001 - the episode's failure goes back to its caller, the others go on
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            result = {"failure": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps({"id": request["id"], **result}) + "\n")
        out.flush()

    while line := await reader.readline():
        task = asyncio.create_task(answer(json.loads(line)))
        running.add(task)
        task.add_done_callback(running.discard)
    for task in running:
        task.cancel()


def rows(request: dict, cache: dict) -> list[dict]:
    env = load(request["env_id"], request.get("env_args") or {}, cache)
    data = env.get_eval_dataset(n=request["n"]) if request["rows"] == "eval" else env.get_dataset(n=request["n"])
    out = []
    for i, row in enumerate(data):
        prompt = [{k: v for k, v in dict(m).items() if v is not None} for m in row["prompt"]]
        text = {k: v if isinstance(v, str) else json.dumps(v) for k in ("info", "task") if (v := row.get(k))}
        out.append({"messages": prompt, "answer": str(row.get("answer") or ""), "info": "{}", **text,
                    "example_id": int(row.get("example_id", i))})
    return out


def main() -> None:
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # prints of verifiers and of the environment land on stderr
    sys.stdout = sys.stderr
    try:
        import verifiers  # noqa: F401
    except ImportError as exc:
        print(f"{sys.executable}: {exc}", file=sys.stderr)
        sys.exit(NO_VERIFIERS)
    if sys.argv[1:] != ["serve"]:
        sys.exit(f"usage: {sys.argv[0]} serve")
    asyncio.run(serve(out))


if __name__ == "__main__":
    main()
