"""A test hook that makes named sites fail on purpose, to exercise retries and the gate for real.

`POSTTRAIN_INJECT_FAULTS="rollout=1,reward=2,reward_nan=1"`: the first N calls at each site in this
process fail — `rollout` and `reward` raise `InjectedFault`, `reward_nan` makes one reward NaN,
`weight_load` makes a rollout engine load one weight wrong (`corrupt_one`: the sync's check must see it).
Unset (the normal case), every site is a no-op.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

ENV = "POSTTRAIN_INJECT_FAULTS"
_seen: Counter[str] = Counter()


class InjectedFault(RuntimeError):
    """Raised by an injected fault (never in a normal run)."""


def _budget(site: str) -> int:
    spec = os.environ.get(ENV, "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, count = item.partition("=")
        if name.strip() == site:
            return int(count or 1)
    return 0


def should_fail(site: str) -> bool:
    """True for the first N calls at `site` (N from the environment), counting this call."""
    if not os.environ.get(ENV):
        return False
    _seen[site] += 1
    return _seen[site] <= _budget(site)


def maybe_fail(site: str) -> None:
    if should_fail(site):
        raise InjectedFault(f"injected fault at {site!r} (call {_seen[site]}, {ENV}={os.environ[ENV]!r})")


def reset() -> None:
    _seen.clear()


def corrupt_one(state: dict, site: str = "weight_load") -> dict:
    """At `site`'s failing calls, `state` (name -> tensor) with its last tensor by name (the largest) changed by +1 in its first
    element (a copy of that tensor: the caller's is untouched); otherwise `state` itself."""
    if not should_fail(site):
        return state
    name = max(state)
    bad = state[name].detach().clone()
    bad.view(-1)[0] += 1
    return {**state, name: bad}


def corrupt_stream(pairs: Iterable[tuple[str, Any]], names: Iterable[str],
                   site: str = "weight_load") -> Iterable[tuple[str, Any]]:
    """`corrupt_one` for a stream of `(name, tensor)` pairs: at `site`'s failing calls the tensor named `max(names)`
    arrives changed by +1 in its first element (a copy); otherwise `pairs` itself."""
    if not should_fail(site):
        return pairs
    target = max(names)

    def corrupted() -> Iterator[tuple[str, Any]]:
        for name, value in pairs:
            if name == target:
                value = value.detach().clone()
                value.view(-1)[0] += 1
            yield name, value

    return corrupted()
