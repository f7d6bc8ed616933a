"""One episode's session on the gateway: the requests its agent sends, waiting for the policy's turns.

The agent's HTTP request (a server thread) is `submit`ted: it waits on a future. The episode's environment (the
rollout's thread, `rl_core.agents.gateway.agent`) takes it with `next`, lets the policy sample the turn, and sets the
future's result: the server answers the request with it. When the agent function returns (or raises), `end` puts
the end in the queue, so `next` returns None. `close` ends the session for good: the request still waiting and
every later one are answered with an error (the episode reached a limit, or the rollout is over).

Sessions are registered on a `Sessions` table under an unguessable id (`secrets.token_urlsafe`, 192 bits); the
server serves only ids in the table, and only to requests that carry the table's secret as their API key.
"""

from __future__ import annotations

import hmac
import queue
import secrets
import threading
from concurrent.futures import Future

from rl_core.agents.gateway.messages import ApiError, Request

_END = object()


class Session:
    """The requests of one episode's agent (module docstring)."""

    def __init__(self, ident: str):
        self.id = ident
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed: str | None = None
        self._pending: list[Future] = []
        self.refused = 0  # requests answered with an error
        self.ended = 0  # of those, refused because the episode had ended (a limit, or the rollout's end)

    def submit(self, request: Request) -> Future:
        """Queue the agent's `request`; the future's result is the answer (or an ApiError)."""
        future: Future = Future()
        with self._lock:
            if self._closed is not None:
                self.refused += 1
                self.ended += 1
                raise ApiError(409, self._closed, code="episode_ended")
            self._pending.append(future)
        future.add_done_callback(self._done)
        self._queue.put((request, future))
        return future

    def _done(self, future: Future) -> None:
        with self._lock:
            if future in self._pending:
                self._pending.remove(future)

    def next(self, timeout: float | None = None) -> tuple[Request, Future] | None:
        """The next request (and the future that answers it), or None once the agent has ended; waits."""
        item = self._queue.get(timeout=timeout)
        return None if item is _END else item

    def refuse(self, future: Future, error: ApiError) -> None:
        """Answer a request with `error` (counted)."""
        with self._lock:
            self.refused += 1
        if not future.done():
            future.set_exception(error)

    def end(self) -> None:
        """The agent function has returned or raised: `next` returns None after the requests already queued."""
        self._queue.put(_END)

    def close(self, why: str) -> None:
        """Refuse the request waiting, if any, and every later one, saying `why`."""
        with self._lock:
            self._closed = why
            pending, self._pending = self._pending, []
            waiting = [f for f in pending if not f.done()]
            self.refused += len(waiting)
            self.ended += len(waiting)
        for future in waiting:
            future.set_exception(ApiError(409, why, code="episode_ended"))


class Sessions:
    """The live sessions of a gateway, and the secret a request must carry as its API key."""

    def __init__(self) -> None:
        self.secret = secrets.token_urlsafe(32)
        self._live: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self) -> Session:
        session = Session(secrets.token_urlsafe(24))
        with self._lock:
            self._live[session.id] = session
        return session

    def drop(self, session: Session) -> None:
        session.close("the episode has ended")
        with self._lock:
            self._live.pop(session.id, None)

    def find(self, ident: str, authorization: str | None) -> Session:
        """The session `ident` for a request whose Authorization header is `authorization`; ApiError otherwise
        (the same answer for a wrong key and an unknown session: neither tells which sessions exist)."""
        key = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(key.encode(), self.secret.encode()):
            raise ApiError(401, "invalid API key: use the key the agent function was given", kind="authentication_error",
                           code="invalid_api_key")
        with self._lock:
            session = self._live.get(ident)
        if session is None:
            raise ApiError(404, "unknown session: each episode's client has its own base_url, valid while the episode "
                                "runs", code="session_not_found")
        return session
