"""The gateway's HTTP server: OpenAI's Chat Completions API on 127.0.0.1, one per process that runs agent episodes.

    POST /sessions/<session>/v1/chat/completions   a turn of that session's episode (streamed or not)
    GET  /sessions/<session>/v1/models             the one model served, `policy`

Each episode's client gets `base_url=http://127.0.0.1:<port>/sessions/<session>/v1` and the server's secret as its
API key (`Sessions`). The server listens on loopback only, on a port the system picks, in a daemon thread of the
process that hosts the episodes' environments (an environment actor, or the driver with `data.env_workers=0`): the
agent function runs in the same process, so nothing outside the machine can reach it, whatever the cluster.

A body over `MAX_BODY_BYTES` is refused before it is read whole (413); every refusal is OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, Request  # at module level: FastAPI reads the handlers' annotations from here
from fastapi.responses import JSONResponse, StreamingResponse

from rl_core.agents.gateway.messages import MODEL, ApiError, chunks, completion, read_request
from rl_core.agents.gateway.session import Sessions

log = logging.getLogger("posttrain.gateway")
MAX_BODY_BYTES = 8 * 1024 * 1024
START_TIMEOUT_S = 30.0


def build_app(sessions: Sessions, sampling: dict[str, float | None]) -> Any:
    """The FastAPI app over `sessions`; `sampling`: the recipe's temperature and top_p that requests must match
    (read per request: the rollout sets them before its episodes start)."""
    app = FastAPI(title="posttrain gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def refused(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/sessions/{ident}/v1/models")
    async def models(ident: str, request: Request) -> dict:
        sessions.find(ident, request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "posttrain"}]}

    @app.post("/sessions/{ident}/v1/chat/completions")
    async def chat(ident: str, request: Request) -> Any:
        session = sessions.find(ident, request.headers.get("authorization"))
        try:
            raw = await _body(request)
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise ApiError(400, f"the request body is not JSON ({exc})") from None
            turn = read_request(body, temperature=sampling.get("temperature"), top_p=sampling.get("top_p"))
        except ApiError:
            session.refused += 1
            raise
        message, finish, usage = await asyncio.wrap_future(session.submit(turn))
        if not turn.stream:
            return completion(message, finish, usage)
        events = [f"data: {json.dumps(c)}\n\n" for c in chunks(message, finish, usage, turn.include_usage)]
        return StreamingResponse(iter([*events, "data: [DONE]\n\n"]), media_type="text/event-stream")

    return app


async def _body(request: Any) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body has {declared} bytes; at most {MAX_BODY_BYTES} are read",
                       code="request_too_large")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    return bytes(raw)


class Gateway:
    """The server and its sessions; `start` binds 127.0.0.1 on a free port and serves from a daemon thread."""

    def __init__(self) -> None:
        self.sessions = Sessions()
        self.sampling: dict[str, float | None] = {"temperature": None, "top_p": None}
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def base_url(self, session_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/sessions/{session_id}/v1"

    def start(self) -> Gateway:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.sessions, self.sampling), log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="posttrain-gateway")
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent gateway did not start on 127.0.0.1:{self.port}")
            time.sleep(0.01)
        log.info("agent gateway on http://127.0.0.1:%d", self.port)
        return self


_SHARED: Gateway | None = None
_SHARED_LOCK = threading.Lock()


def shared_gateway() -> Gateway:
    """This process's gateway, started on first use."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Gateway().start()
        return _SHARED
