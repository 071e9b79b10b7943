"""The HTTP side of text generation, shared by the OpenAI-compatible routes and llama.cpp's `/infill`: who may call
(the dcanvas/1 policy), how much they may send, and how a request's generation is tied to its connection.

Owns `ApiLimits`, `HttpApi` (what both dialects share for `create_app`, and the counters `/health` reports),
`Refusal` (a request refused with an HTTP status; each dialect renders it in its own error shape) and
`EventStream` (server-sent events whose producer is cancelled as soon as the client disconnects).

Security, as for the websocket: a browser page from an origin outside the allow-list is refused (403) whatever it
sends; when the server has a token (always, off loopback) every route wants `Authorization: Bearer <token>` (401
otherwise; compared in constant time); a body over `max_body_bytes` is refused (413) before it is parsed; at most
`max_running` engine generations come from HTTP at once (429 past that). Generations go through the engine's queue
and the server's admission control like everyone else's (`canvas.server.admission`: one lane per client address;
a full queue is a 429 with `Retry-After`), and a client that disconnects has its generation cancelled (taken out of
the queue at once, or stopped between engine steps), streaming or not (the stream watches the connection, it does
not wait for its next write to fail).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from canvas.engine.backend import Backend
from canvas.engine.core import Done, Frame, GenHandle, GenRequest
from canvas.server.admission import Admission, Admits, Busy
from canvas.server.config import ServerConfig
from canvas.server.http.textgen import Plan, TextTask
from canvas.server.http.textrun import Event, Finish, GenerationFailed, TextRun
from canvas.server.security import origin_allowed, token_ok

log = logging.getLogger("canvas.server")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ApiLimits:
    max_body_bytes: int = 1 << 20  # one request body: a few files of editor context fit many times over
    max_text_chars: int = 500_000  # prompt, suffix and extra context together
    max_context_tokens: int = 2048  # tokens before the canvas the encoder reads; older ones are dropped
    max_canvases: int = 16  # a continuation's budget is at most this many canvases
    max_n: int = 8  # choices per request
    max_running: int = 32  # engine generations from HTTP at once

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_text_chars", "max_context_tokens", "max_canvases", "max_n", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"ApiLimits.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def for_server(cls, config: ServerConfig) -> ApiLimits:
        """The websocket's limits carried over: a frame's size for a body, a document's for the text."""
        lim = config.limits
        return cls(max_body_bytes=lim.max_frame_bytes, max_text_chars=lim.max_doc_chars,
                   max_running=4 * config.max_batch)


class Refusal(Exception):
    """A request refused with an HTTP status; `kind` and `param` feed the OpenAI error object. `retry_after`
    (seconds) becomes a `Retry-After` header."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after = retry_after

    def headers(self) -> dict[str, str] | None:
        # Retry-After takes whole seconds (RFC 9110 §10.2.3): round up, so a client never comes back too early.
        return None if self.retry_after is None else {"retry-after": str(max(1, math.ceil(self.retry_after)))}


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def until_disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStream(Response):
    """`text/event-stream` from an async iterator of events. The iterator runs as a task beside a watcher of the
    connection: a disconnect cancels it at once (its `finally` blocks cancel the generation), where a plain
    streaming response would notice only when its next write fails."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        self.events, self.on_close = events, on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        producer = asyncio.create_task(produce())
        watcher = asyncio.create_task(until_disconnected(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, watcher):
                task.cancel()
            results = await asyncio.gather(producer, watcher, return_exceptions=True)
            self.on_close()  # also when the events never started (a client gone before the first byte)
        error = results[0]
        if isinstance(error, BaseException) and not isinstance(error, asyncio.CancelledError | OSError):
            raise error


class HttpApi:
    """The state the HTTP dialects share: the backend, the limits, the token, and the counters."""

    def __init__(self, config: ServerConfig, backend: Backend, limits: ApiLimits | None = None,
                 admission: Admits | None = None) -> None:
        self.config, self.backend = config, backend
        self.limits = limits if limits is not None else ApiLimits.for_server(config)
        self.admission = admission if admission is not None else Admission(backend.engine, config.admission)
        self.running = 0  # engine generations from HTTP now
        self.outcomes: Counter[str] = Counter()  # requests by how they ended

    def stats(self) -> dict[str, int]:
        return {"running": self.running, **{k: self.outcomes[k] for k in ("completed", "cancelled", "failed")}}

    # -- a request's way in --------------------------------------------------------------------------------------

    def check_caller(self, request: Request) -> None:
        origin = request.headers.get("origin")
        if not origin_allowed(origin, self.config.allowed_origins):
            log.warning("refused an HTTP request from origin %r", origin)
            raise Refusal(403, f"requests from the origin {origin!r} are not allowed", kind="permission_error")
        if self.config.token is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token_ok(given.strip(), self.config.token):
                raise Refusal(401, "missing or wrong API key: send 'Authorization: Bearer <token>'",
                              kind="authentication_error", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The caller checked, then the body as a JSON object (at most `max_body_bytes`)."""
        self.check_caller(request)
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise Refusal(413, f"the request body has {declared} bytes, more than the limit of {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise Refusal(413, f"the request body is larger than the limit of {limit} bytes")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise Refusal(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise Refusal(400, "the body must be a JSON object")
        return data

    def check_text(self, *texts: str | None) -> None:
        total = sum(len(t) for t in texts if t)
        if total > self.limits.max_text_chars:
            raise Refusal(413, f"the request has {total} characters of text, more than the limit of "
                               f"{self.limits.max_text_chars}")

    def acquire(self, n: int) -> None:
        """Room for `n` engine generations (give it back with `release`); 429 when HTTP already has its share."""
        if self.running + n > self.limits.max_running:
            raise Refusal(429, f"{self.running} generations are running for HTTP clients; try again shortly",
                          kind="rate_limit_error", code="rate_limit_exceeded")
        self.running += n

    def release(self, n: int, outcome: str) -> None:
        """Give back what `acquire(n)` took, counting how the request ended (completed, cancelled, failed)."""
        self.running -= n
        self.outcomes[outcome] += 1

    # -- a request's generation, tied to its connection ----------------------------------------------------------

    async def unless_gone(self, request: Request, work: Awaitable[T]) -> T:
        """`work`'s result, or ClientGone (with `work` cancelled) when the client disconnects first."""
        job = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(until_disconnected(request.receive))
        try:
            await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not job.done():
                job.cancel()
            await asyncio.gather(job, watcher, return_exceptions=True)
        if job.cancelled():
            raise ClientGone()
        return job.result()

    @staticmethod
    def owner(request: Request) -> Hashable:
        """The admission lane of a request: its client's address (one editor's requests share a lane)."""
        return ("http", request.client.host if request.client is not None else None)

    async def start(self, plan: Plan, task: TextTask, owner: Hashable = ("http", None)) -> TextRun:
        """The task's generations queued in the engine in `owner`'s lane, with room reserved for them: 429 when HTTP
        has its share running, or when admission refuses one of them (`Retry-After` then says when to retry)."""
        self.acquire(task.n)

        async def submit(request: GenRequest, deliver: Callable[[Frame | Done], None]) -> GenHandle:
            return (await self.admission.submit_async(request, deliver, owner=owner)).handle

        run = TextRun(self.backend, plan, task, submit)
        try:
            await run.start()
        except Busy as e:
            run.close()  # choices already queued leave the queue
            self.release(task.n, "refused")
            raise Refusal(429, str(e), kind="rate_limit_error", code="server_busy",
                          retry_after=e.retry_after_s) from None
        except BaseException:
            run.close()
            self.release(task.n, "failed")
            raise
        return run

    async def collect(self, request: Request, run: TextRun, watch: Callable[[Event], None] | None = None, *,
                      drafts: bool = True) -> list[Finish]:
        """Every choice's `Finish`, in order (a non-streaming response). `watch` sees each event as it comes;
        `drafts=False`: it reads no `Draft` (none is made: `TextRun.events`).
        Raises ClientGone when the client disconnects first (the generation is cancelled) or GenerationFailed."""

        async def work() -> list[Finish]:
            finishes: dict[int, Finish] = {}
            async for ev in run.events(drafts):
                if watch is not None:
                    watch(ev)
                if isinstance(ev, Finish):
                    finishes[ev.index] = ev
            return [finishes[i] for i in sorted(finishes)]

        outcome = "failed"
        try:
            result = await self.unless_gone(request, work())
            outcome = "completed"
            return result
        except ClientGone:
            outcome = "cancelled"
            raise
        finally:
            run.close()
            self.release(run.task.n, outcome)

    def stream(self, run: TextRun, render: Callable[[Event], list[str]], end: Callable[[], list[str]],
               failed: Callable[[str], list[str]], head: list[str] | None = None, *,
               drafts: bool = True) -> EventStream:
        """A streaming response: `head` goes out at once, `render` turns each event into SSE chunks, `end` writes
        the tail once every choice has finished, `failed` the chunks that report an engine failure. `drafts=False`:
        `render` reads no `Draft` (none is made: `TextRun.events`)."""
        outcome = ["cancelled"]  # until the stream ends by itself

        async def events() -> AsyncIterator[str]:
            for chunk in head or ():
                yield chunk
            try:
                async for ev in run.events(drafts):
                    for chunk in render(ev):
                        yield chunk
                for chunk in end():
                    yield chunk
                outcome[0] = "completed"
            except GenerationFailed as e:
                log.warning("an HTTP generation failed: %s", e)
                outcome[0] = "failed"
                for chunk in failed(str(e)):
                    yield chunk
            except Exception:
                outcome[0] = "failed"
                raise

        def close() -> None:
            run.close()
            self.release(run.task.n, outcome[0])

        return EventStream(events(), close)

