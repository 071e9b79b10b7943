"""The Starlette application: `GET /` (the web client), `GET /health`, `GET /schema`, `WS /ws`, and the HTTP text
generation routes of `canvas.server.http.core` (OpenAI-compatible `/v1/...`, llama.cpp's `/infill`).

Owns the websocket endpoint: the checks made before `accept()` (Origin allow-list, session count: a refusal is an
HTTP 403), then per connection a reader (rate limit, parse, `Hub.handle`) and a sender (`Outbox.run`) running side
by side, so replies and progress flow while requests are read. A malformed frame gets an error and the connection
stays open; the socket is closed only for a bad handshake (4409, 1008), a client that cannot keep up (1008) or a
dead peer. Static files come from `ServerConfig.web_dir` through `StaticFiles`, which refuses paths that resolve
outside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from canvas import __version__
from canvas.engine.backend import Backend, load_backend
from canvas.protocol import PROTOCOL, ErrorCode, ProtocolError, json_schema, parse_client_message
from canvas.server.admission import Admission, Admits
from canvas.server.config import ServerConfig
from canvas.server.faults import from_env
from canvas.server.http import routes as http_routes
from canvas.server.http.core import HttpApi
from canvas.server.hub import Hub
from canvas.server.lag import LoopLag
from canvas.server.outbox import Outbox
from canvas.server.security import origin_allowed, subprotocol_tokens
from canvas.server.state import Session
from canvas.store import open_store
from canvas.store.base import DocStore

log = logging.getLogger("canvas.server")
SUBPROTOCOL = "dcanvas.v1"


def create_app(config: ServerConfig, backend: Backend | None = None, store: DocStore | None = None,
               admission: Admits | None = None) -> Starlette:
    """The app for `config`. Without `backend`, the model in `config.model_dir` is loaded (None: the one
    `canvas.convert.resolve` chooses, as every command does).
    `admission`: where generations go instead of the backend's engine (`canvas.cluster.remote.RemoteAdmission`:
    Ray Serve replicas); the backend then needs no engine, and the server starts none."""
    if backend is None:
        from canvas.convert.resolve import resolve_model

        model_dir = resolve_model(config.model_dir).path  # raises ModelUnavailable (a FileNotFoundError)
        # Loading takes seconds to minutes (weights, the dtype probe, a first build of the CPU kernels): say so first.
        print(f"dcanvas: loading the model in {model_dir}...", file=sys.stderr, flush=True)
        backend = load_backend(model_dir, max_batch=config.max_batch, threads=config.threads,
                               context_cache_mb=config.context_cache_mb)
    own_store = store is None
    # DCANVAS_STORE_FAULTS (soak tests only) wraps the store in one that fails on purpose (canvas.server.faults).
    the_store = from_env(open_store(config.db)) if store is None else store
    # One admission policy for the websocket and the HTTP routes: both wait in the engine's one queue.
    admits: Admits = Admission(backend.engine, config.admission) if admission is None else admission
    engine = backend.local_engine if admission is None else None  # a remote admission's engines run elsewhere
    hub = Hub(backend, the_store, config.limits, token=config.token, admission=admits)
    api = HttpApi(config, backend, admission=admits)  # the OpenAI-compatible routes and llama.cpp's /infill
    started = time.monotonic()
    schema = json_schema()
    lag = LoopLag()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if engine is not None:
            engine.start()
        hub.peers.follow()  # a store shared with other server processes: learn of their changes as they happen
        lag_task = asyncio.create_task(lag.run(), name="dcanvas-loop-lag")
        try:
            yield
        finally:
            lag_task.cancel()
            await hub.gens.shutdown()
            await admits.aclose()
            if engine is not None:
                engine.stop()
            if own_store:
                the_store.close()

    async def health(request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "protocol": PROTOCOL,
                "version": __version__,
                "model": backend.name,
                "sessions": len(hub.sessions),
                "documents_open": len(hub.docs),
                "generations_running": len(hub.gens.runs),
                "http_generations": api.stats(),
                "queue": await admits.stats_async(),
                "loop_lag_ms": lag.stats(),
                "uptime_s": round(time.monotonic() - started, 1),
            }
        )

    async def schema_route(request: Request) -> Response:
        return JSONResponse(schema)

    async def ws_route(websocket: WebSocket) -> None:
        await serve_websocket(websocket, hub, config)

    routes: list[BaseRoute] = [
        Route("/health", health),
        Route("/schema", schema_route),
        WebSocketRoute("/ws", ws_route),
        *http_routes(api),
    ]
    web = Path(config.web_dir)
    if web.is_dir():
        routes.append(Mount("/", app=StaticFiles(directory=web, html=True), name="web"))
    else:

        async def no_web(request: Request) -> Response:
            return PlainTextResponse(f"no web client here ({web} does not exist); the websocket is at /ws", 404)

        routes.append(Route("/", no_web))
    app = Starlette(
        routes=routes,
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=config.allowed_hosts)],
        lifespan=lifespan,
    )
    app.state.hub = hub
    app.state.config = config
    return app


async def serve_websocket(websocket: WebSocket, hub: Hub, config: ServerConfig) -> None:
    origin = websocket.headers.get("origin")
    if not origin_allowed(origin, config.allowed_origins):
        log.warning("refused a websocket from origin %r", origin)
        await websocket.close(code=1008)  # before accept(): the client sees HTTP 403
        return
    if len(hub.sessions) >= config.limits.max_sessions:
        log.warning("refused a websocket: %d sessions already", len(hub.sessions))
        await websocket.close(code=1013)
        return
    offered = websocket.scope.get("subprotocols") or []
    # Only dcanvas.v1 is ever selected: a token offered as a subprotocol must not be echoed (canvas.server.security).
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)

    killed = asyncio.Event()
    verdict: list[tuple[int, str]] = []

    def kill(code: int, reason: str) -> None:
        if not verdict:
            verdict.append((code, reason))
        killed.set()

    outbox = Outbox(websocket.send_text, max_fps=config.limits.max_fps)
    session = Session(outbox, config.limits, kill)
    session.offered_tokens = subprotocol_tokens(offered)
    hub.open_session(session)
    sender = asyncio.create_task(outbox.run(), name=f"dcanvas-send-{session.id}")
    reader = asyncio.create_task(_read(websocket, hub, session), name=f"dcanvas-read-{session.id}")
    stopper = asyncio.create_task(killed.wait())
    try:
        await asyncio.wait({sender, reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if reader.done() and not reader.cancelled() and reader.exception() is None:
            close = reader.result()
            if close is not None:
                verdict.append(close)
        clean = not sender.done()  # the socket still works: send what is queued, then close
        for task in (reader, stopper):
            task.cancel()
        outbox.close()
        if clean:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sender, 5)
        if verdict:
            code, reason = verdict[0]
            with contextlib.suppress(Exception):
                await websocket.close(code=code, reason=reason)
    finally:
        # First, synchronously: if this handler is being cancelled, any await below would be cancelled too.
        hub.close_session(session)
        for task in (sender, reader, stopper):
            task.cancel()
        await asyncio.gather(sender, reader, stopper, return_exceptions=True)


async def _read(websocket: WebSocket, hub: Hub, session: Session) -> tuple[int, str] | None:
    """Read and handle requests until the peer leaves (None) or the session must close (code, reason)."""
    limits = hub.limits
    while True:
        try:
            message = await websocket.receive()
        except WebSocketDisconnect:
            return None
        if message["type"] == "websocket.disconnect":
            return None
        raw = message.get("text")
        if raw is None:
            raw = message.get("bytes")
        if raw is None:
            continue
        if not session.bucket.take():
            session.send(ProtocolError(ErrorCode.RATE_LIMITED, "slow down: too many messages").to_message())
            continue
        try:
            msg = parse_client_message(raw, limits)
        except ProtocolError as e:
            session.send(e.to_message())
            continue
        await hub.handle(session, msg)
        if session.close_after is not None:
            return session.close_after
