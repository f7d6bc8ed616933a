"""`posttrain run`'s start-up order (flows/entry.py), without Ray or Prefect: the flow starts only once the imports
started ahead in a thread are done."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import FAST, recipe


def test_the_flow_starts_after_the_imports_ahead_even_when_nothing_else_waits(in_workdir, monkeypatch):
    """Joining a Ray cluster (RAY_ADDRESS) with an API URL given, `run_recipe` waits for no local Ray and no
    temporary API: the flow must still wait for the import thread, or it imports transformers while that thread
    does (transformers' lazy module then refuses names: "cannot import name 'AutoTokenizer'")."""
    from flows import entry
    from infra.cluster.placement import Placement
    from rl_core.config import load_config

    cfg = load_config(recipe("arithmetic"), FAST)
    imported = threading.Event()
    seen: dict[str, object] = {}

    def slow_imports() -> None:
        time.sleep(0.5)  # still importing when the main thread is ready to start the flow
        imported.set()

    class Flow:
        def with_options(self, **_):
            return self

        def __call__(self, recipe, overrides):
            seen["imports done"] = imported.is_set()
            seen["thread"] = threading.current_thread() is threading.main_thread()
            return {"ran": True}

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # a cluster to join: no local Ray is started ahead
    monkeypatch.setattr(entry, "load_checked", lambda *_, **__: cfg)
    monkeypatch.setattr(entry, "_start_temporary_api", lambda: None)  # PREFECT_API_URL given: none to wait for
    monkeypatch.setattr(entry, "_import_ahead", slow_imports)
    monkeypatch.setattr(entry, "flow_for", lambda objective: Flow())
    monkeypatch.setattr(Placement, "start_actors_early", lambda self: pytest.fail("no actors ahead on a cluster"))

    assert entry.run_recipe(recipe("arithmetic"), []) == {"ran": True}
    assert seen == {"imports done": True, "thread": True}
