"""Faults the tests inject from their own code, to exercise retries, the gate and the weight sync's check for real.

Driver-side faults replace a method or a task in the test's own process (the flows run in it): `fail_first` makes
the first calls of a function raise `InjectedFault`, `faulty_reward_task` is the reward task with failed calls or a
NaN reward. An engine's faulty load is installed inside its Ray actor with `__ray_call__`
(`load_one_weight_wrong`). `one_weight_wrong` is the wrong load itself, on a state dict. S3 faults go into a real
boto3 client through botocore's own event system (`before-send`), so botocore's retries and checksum checks meet
them as they would meet S3's: `s3_error_answers` answers requests with an S3 error, `s3_corrupted_bodies` flips a
byte of what S3 sends back.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import torch


class InjectedFault(RuntimeError):
    """Raised by an injected fault."""


def fail_first(function: Callable, calls: int, site: str) -> Callable:
    """`function`, whose first `calls` calls raise InjectedFault naming `site` (then it runs as before)."""
    seen = [0]

    @functools.wraps(function)
    def failing(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        if seen[0] <= calls:
            raise InjectedFault(f"injected fault at {site!r} (call {seen[0]})")
        return function(*args, **kwargs)

    return failing


def faulty_reward_task(fail: int = 0, nan: int = 0):
    """The reward task (`tasks.reward.reward_task`, same name) whose first `fail` calls raise InjectedFault and whose
    next `nan` calls return a NaN reward for completion 0."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    from tasks.reward import reward_task

    seen = {"calls": 0, "nan": 0}

    @task(name="reward", task_run_name="reward step {step}", cache_policy=NO_CACHE)
    def reward(rewards: Any, examples: list, texts: list[str], episodes: list[dict] | None = None, *,
               step: int) -> Any:
        seen["calls"] += 1
        if seen["calls"] <= fail:
            raise InjectedFault(f"injected fault at 'reward' (call {seen['calls']})")
        scores = reward_task.fn(rewards, examples, texts, episodes, step=step)
        seen["nan"] += 1
        if seen["nan"] <= nan:
            scores.rewards[0] = math.nan
        return scores

    return reward


def _off_by_one(value: torch.Tensor) -> torch.Tensor:
    bad = value.detach().clone()
    bad.view(-1)[0] += 1
    return bad


def one_weight_wrong(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with its last tensor by name changed by +1 in its first element (a copy of that tensor: the caller's
    is untouched)."""
    name = max(state)
    return {**state, name: _off_by_one(state[name])}


def _corrupted(pairs: Iterable[tuple[str, Any]], target: str) -> Iterator[tuple[str, Any]]:
    for name, value in pairs:
        yield name, (_off_by_one(value) if name == target else value)


def load_one_weight_wrong(worker: Any) -> str:
    """Run inside a separate engine's actor (`actor.__ray_call__.remote(load_one_weight_wrong)`): its next weight
    load ends with one tensor wrong although the bytes arrived intact — the tensor with the largest name, +1 in its
    first element. Returns that tensor's name. The load after it is right again."""
    engine = worker.engine
    hf_model = getattr(engine, "model", None)
    if hf_model is not None:  # HF: the stream is received straight into the engine's parameters
        from infra.workers import distributed

        receive_into = distributed.receive_into

        def receive_then_corrupt(stream: Any, targets: dict[str, torch.Tensor]) -> None:
            distributed.receive_into = receive_into
            receive_into(stream, targets)
            name = max(targets)
            with torch.no_grad():
                targets[name].copy_(_off_by_one(targets[name]))

        distributed.receive_into = receive_then_corrupt
        return max(hf_model.state_dict())
    target = max(spec.name for spec in worker.layout)  # vLLM: the stream it loads from

    def update_then_restore(weights: Any, version: int) -> Any:
        del engine.update_weights  # the class's method again
        return engine.update_weights(_corrupted(weights, target), version)

    engine.update_weights = update_then_restore
    return target


# ------------------------------------------------------------------------------ S3, through botocore's events

class _Body(io.BytesIO):
    """A response body as botocore reads one from urllib3 (`read(amt)`, `stream()`)."""

    def stream(self, amt: int = 65536, decode_content: bool | None = None) -> Iterator[bytes]:
        while chunk := self.read(amt):
            yield chunk


def s3_error_answers(client: Any, operation: str, count: int, code: str = "SlowDown", status: int = 503) -> dict:
    """The first `count` requests of `operation` (e.g. "PutObject") on `client` are not sent: S3's error `code` with
    HTTP `status` comes back instead. Returns live counts: {"requests": every request of `operation`, "failed": those
    answered with the error}."""
    from botocore.awsrequest import AWSResponse

    seen = {"requests": 0, "failed": 0}
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected {code}</Message>'
            f"<RequestId>injected</RequestId></Error>").encode()

    def answer(request: Any, **_: Any) -> Any:
        seen["requests"] += 1
        if seen["failed"] >= count:
            return None  # sent to the server
        seen["failed"] += 1
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Body(body))

    client.meta.events.register(f"before-send.s3.{operation}", answer)
    return seen


def s3_corrupted_bodies(client: Any, key_suffix: str) -> list[str]:
    """Every GetObject on `client` of a key ending in `key_suffix` is sent to the server for real, and its body comes
    back with the last byte flipped under S3's own headers (its checksum of the true bytes): what a network that
    corrupts data delivers. Returns the URLs corrupted so far."""
    from botocore.awsrequest import AWSResponse
    from botocore.httpsession import URLLib3Session

    session, corrupted = URLLib3Session(), []

    def corrupt(request: Any, **_: Any) -> Any:
        if not urlsplit(request.url).path.endswith(key_suffix):
            return None
        response = session.send(request)
        body = bytearray(response.content)
        body[-1] ^= 0xFF
        corrupted.append(request.url)
        return AWSResponse(request.url, response.status_code, response.headers, _Body(bytes(body)))

    client.meta.events.register("before-send.s3.GetObject", corrupt)
    return corrupted
