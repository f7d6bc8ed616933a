"""What a flow run's logs may hold: no credential.

Prefect sends the records of its run loggers (`prefect.flow_runs`, `prefect.task_runs`, and every print of a flow
with `log_prints`) to its API, where they are stored as the run's log rows, and prints them, with every other
record that reaches the root logger, to stderr. `redact_run_logs` puts `rl_core.redact.RedactingFilter` on each of
those handlers, so a record is scrubbed (message, arguments, traceback) before either handler writes it: what user
code raised is redacted where it is described (`rl_core.user_code.user_error`), and this filter catches what
reaches a log any other way. Every flow calls it first (`flows.params.open_run`, the regression flow).
"""

from __future__ import annotations

import logging

from rl_core.redact import RedactingFilter


def redact_run_logs() -> list[logging.Handler]:
    """Put a `RedactingFilter` on every handler of the root logger and of Prefect's loggers (once each; again on a
    handler that Prefect's logging setup made anew). Returns the handlers that carry it."""
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()  # Prefect's handlers exist from here on (a flow run's process made them at import)
    # a snapshot first: another thread may create a logger meanwhile (list() copies the keys without a switch)
    known = list(logging.root.manager.loggerDict)
    names = ["", *sorted(n for n in known if n == "prefect" or n.startswith("prefect."))]
    handlers: list[logging.Handler] = []
    for name in names:
        logger = logging.getLogger(name)
        for handler in getattr(logger, "handlers", ()):
            if handler in handlers:
                continue
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())
            handlers.append(handler)
    return handlers
