"""An asyncio client for dcanvas/1 over `websockets`, used by the TUI, the tests and the load benchmark.

Owns one websocket connection: a reader task parses every server frame (`canvas.protocol`) and routes it:
- a reply whose `re` matches a pending request completes that request (errors raise `ProtocolError`);
- `gen.progress` / `gen.done` go to the `Generation` they belong to (by `gen` id, registered on `gen.accepted`);
- every `doc.state` (replies and broadcasts) goes to the `on_state` callback; anything unsolicited (broadcasts,
  errors without `re`) also goes to the bounded `events` queue, oldest dropped when nobody reads it.

Usage::

    async with DcanvasClient.connect("ws://127.0.0.1:8765/ws", token=None) as c:
        doc = await c.open(text="Once upon a time")
        doc = await c.edit(doc.doc_id, doc.v, [MaskOp(start=5, end=9)])
        async for ev in c.generate(doc.doc_id, doc.v, max_steps=32):
            ...  # GenProgress frames, then exactly one GenDone (the last item)
        doc = await c.accept(ev.gen, doc.v)

Callbacks run on the reader task and must not block. If the connection drops, pending requests and open
generations raise `ConnectionLost`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Generator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Origin

from canvas import __version__
from canvas.protocol import (
    PROTOCOL,
    Ack,
    ClientInfo,
    ClientRequest,
    DocClose,
    DocDelete,
    DocDeleted,
    DocEdit,
    DocList,
    DocListing,
    DocOpen,
    DocState,
    DocSummary,
    EditOp,
    ErrorCode,
    ErrorReply,
    GenAccepted,
    GenCancel,
    GenDone,
    GenParams,
    GenProgress,
    GenStart,
    Hello,
    HistoryRedo,
    HistoryUndo,
    Ping,
    Pong,
    ProposalAccept,
    ProposalReject,
    ProtocolError,
    ServerReply,
    Welcome,
    describe_error,
    dump,
    parse_op,
    parse_server_message,
)

log = logging.getLogger(__name__)
R = TypeVar("R", bound=ServerReply)
_CLOSED = object()  # put into generation queues when the connection ends


class ConnectionLost(ConnectionError):
    """The websocket closed while a request or generation was waiting on it."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"connection closed (code {code}): {reason}" if reason else f"connection closed (code {code})")
        self.code, self.reason = code, reason


class Generation:
    """One generation: awaitable (sends `gen.start`, waits for `gen.accepted`) and async-iterable (progress frames,
    then the `GenDone`, then the iteration stops)."""

    def __init__(self, client: DcanvasClient, doc_id: str, base_v: int, params: GenParams) -> None:
        self.client, self.doc_id, self.base_v, self.params = client, doc_id, base_v, params
        self.accepted: GenAccepted | None = None
        self.done: GenDone | None = None
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._start_lock = asyncio.Lock()
        self._finished = False

    @property
    def gen(self) -> str:
        if self.accepted is None:
            raise RuntimeError("the generation has not been started (await it or iterate it)")
        return self.accepted.gen

    async def start(self) -> Generation:
        async with self._start_lock:
            if self.accepted is None:
                msg = GenStart(doc_id=self.doc_id, base_v=self.base_v, params=self.params)
                self.accepted = await self.client._request(msg, GenAccepted, on_reply=self._register)
        return self

    def _register(self, reply: ServerReply) -> None:
        # Runs on the reader task before the next frame is read, so no progress frame can arrive unrouted.
        if isinstance(reply, GenAccepted):
            self.client._gens[reply.gen] = self._queue

    def __await__(self) -> Generator[Any, None, Generation]:
        return self.start().__await__()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> GenProgress | GenDone:
        if self._finished:
            raise StopAsyncIteration
        await self.start()
        item = await self._queue.get()
        if item is _CLOSED:
            self._finished = True
            raise self.client._lost or ConnectionLost(None, "closed")
        assert isinstance(item, GenProgress | GenDone)
        if isinstance(item, GenDone):
            self.done, self._finished = item, True
            self.client._gens.pop(item.gen, None)
        return item

    async def result(self) -> GenDone:
        """Skip the remaining progress frames and return the `GenDone`."""
        async for _ in self:
            pass
        assert self.done is not None
        return self.done

    async def cancel(self) -> None:
        await self.client.cancel(self.gen)


class DcanvasClient:
    """A dcanvas/1 session. Create it with `DcanvasClient.connect(url)`, used as `async with` or awaited."""

    def __init__(
        self,
        ws: ClientConnection,
        *,
        on_state: Callable[[DocState], None] | None = None,
        on_event: Callable[[ServerReply], None] | None = None,
        request_timeout: float = 30.0,
        events_maxsize: int = 1024,
    ) -> None:
        self._ws = ws
        self.on_state = on_state
        self.on_event = on_event
        self.request_timeout = request_timeout
        self.events: asyncio.Queue[ServerReply] = asyncio.Queue(maxsize=events_maxsize)
        self.welcome: Welcome | None = None
        self._ids = itertools.count(1)
        self._pending: dict[str | int, tuple[asyncio.Future[ServerReply], Callable[[ServerReply], None] | None]] = {}
        self._gens: dict[str, asyncio.Queue[object]] = {}
        self._lost: ConnectionLost | None = None
        self._reader = asyncio.create_task(self._read(), name="dcanvas-client-reader")

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        token: str | None = None,
        hello: bool = True,
        client_name: str = "canvas.protocol.client",
        origin: str | None = None,
        on_state: Callable[[DocState], None] | None = None,
        on_event: Callable[[ServerReply], None] | None = None,
        request_timeout: float = 30.0,
        open_timeout: float = 10.0,
        max_size: int = 1 << 24,
    ) -> _Connector:
        """Open a websocket to `url` and (unless `hello=False`) complete the handshake with `token`."""

        async def open_client() -> DcanvasClient:
            ws = await ws_connect(
                url,
                origin=None if origin is None else Origin(origin),
                open_timeout=open_timeout,
                max_size=max_size,
                ping_interval=20,
                ping_timeout=20,
            )
            client = cls(ws, on_state=on_state, on_event=on_event, request_timeout=request_timeout)
            if hello:
                try:
                    await client.hello(token, client_name=client_name)
                except BaseException:
                    await client.close()
                    raise
            return client

        return _Connector(open_client)

    # -- plumbing --------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._lost is not None

    async def _read(self) -> None:
        code: int | None = None
        reason = ""
        try:
            async for raw in self._ws:
                try:
                    msg = parse_server_message(raw)
                except ProtocolError as e:
                    log.warning("ignoring a malformed server frame: %s", e)
                    continue
                self._dispatch(msg)
        except ConnectionClosed:
            pass
        except Exception:  # a bug in a callback must not leave requests hanging forever
            log.exception("dcanvas client reader failed")
        finally:
            if self._ws.close_code is not None:
                code, reason = self._ws.close_code, self._ws.close_reason or ""
            self._lost = ConnectionLost(code, reason)
            for fut, _ in self._pending.values():
                if not fut.done():
                    fut.set_exception(self._lost)
            for queue in self._gens.values():
                queue.put_nowait(_CLOSED)

    def _dispatch(self, msg: ServerReply) -> None:
        if isinstance(msg, GenProgress | GenDone):
            queue = self._gens.get(msg.gen)
            if queue is not None:
                queue.put_nowait(msg)
                return
        if isinstance(msg, DocState) and self.on_state is not None:
            self.on_state(msg)
        pending = self._pending.get(msg.re) if msg.re is not None else None
        if pending is not None and not pending[0].done():
            fut, on_reply = pending
            if on_reply is not None:
                on_reply(msg)
            fut.set_result(msg)
            return
        if self.on_event is not None:
            self.on_event(msg)
        if self.events.full():
            self.events.get_nowait()  # latest wins: a client that never reads the queue must not grow without bound
        self.events.put_nowait(msg)

    async def _request(
        self, msg: ClientRequest, expect: type[R], on_reply: Callable[[ServerReply], None] | None = None
    ) -> R:
        if self._lost is not None:
            raise self._lost
        rid = next(self._ids)
        fut: asyncio.Future[ServerReply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, on_reply)
        try:
            await self._ws.send(dump(msg.model_copy(update={"id": rid})))
            reply = await asyncio.wait_for(fut, self.request_timeout)
        except ConnectionClosed:
            raise self._lost or ConnectionLost(self._ws.close_code, self._ws.close_reason or "") from None
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, ErrorReply):
            raise ProtocolError.from_message(reply)
        if not isinstance(reply, expect):
            kind = getattr(reply, "type", "?")
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"expected {expect.__name__}, got {kind!r}", rid)
        return reply

    async def send_raw(self, frame: str | bytes) -> None:
        """Send a frame as is (for tests and debugging); replies arrive on `events` unless they match a request."""
        await self._ws.send(frame)

    def abort(self) -> None:
        """Cut the TCP connection now, with no close frame, as a laptop lid closing or a network dropping does: the
        server sees the socket end, not a goodbye. For fault injection (the soak's `drop`); `close` is the polite
        way, and it still ends the reader after an abort."""
        self._ws.transport.abort()

    async def close(self) -> None:
        await self._ws.close()
        try:
            await asyncio.wait_for(self._reader, 5)
        except (TimeoutError, asyncio.CancelledError):
            self._reader.cancel()

    # -- requests --------------------------------------------------------------------------------------------

    async def hello(self, token: str | None = None, *, client_name: str = "canvas.protocol.client") -> Welcome:
        msg = Hello(protocol=PROTOCOL, client=ClientInfo(name=client_name, version=__version__), token=token)
        self.welcome = await self._request(msg, Welcome)
        return self.welcome

    async def open(self, doc_id: str | None = None, *, text: str | None = None, name: str | None = None) -> DocState:
        """Open document `doc_id`, or create a new one from `text` (empty when neither is given)."""
        return await self._request(DocOpen(doc_id=doc_id, text=text, name=name), DocState)

    async def close_doc(self, doc_id: str) -> None:
        await self._request(DocClose(doc_id=doc_id), Ack)

    async def delete(self, doc_id: str, base_v: int | None = None) -> None:
        """Delete a document (with `base_v`: only if it is still at that version)."""
        await self._request(DocDelete(doc_id=doc_id, base_v=base_v), DocDeleted)

    async def edit(self, doc_id: str, base_v: int, ops: Sequence[EditOp | Mapping[str, Any]]) -> DocState:
        """Apply `ops` (op models, or dicts validated here) to the document at version `base_v`."""
        parsed = [parse_op(dict(op)) if isinstance(op, Mapping) else op for op in ops]
        return await self._request(DocEdit(doc_id=doc_id, base_v=base_v, ops=parsed), DocState)

    def generate(self, doc_id: str, base_v: int, params: GenParams | None = None, **overrides: Any) -> Generation:
        """A generation of the document's free slots: `await` it to start it, or iterate it (starts on first use)."""
        base = params or GenParams()
        if overrides:
            try:
                base = GenParams.model_validate({**base.model_dump(), **overrides}, strict=False)
            except ValidationError as e:
                raise ProtocolError(ErrorCode.INVALID_PARAMS, f"params: {describe_error(e)}") from None
        return Generation(self, doc_id, base_v, base)

    async def cancel(self, gen: str) -> None:
        await self._request(GenCancel(gen=gen), Ack)

    async def accept(self, gen: str, base_v: int, hunks: Sequence[int] | None = None) -> DocState:
        msg = ProposalAccept(gen=gen, base_v=base_v, hunks=None if hunks is None else list(hunks))
        return await self._request(msg, DocState)

    async def reject(self, gen: str) -> None:
        await self._request(ProposalReject(gen=gen), Ack)

    async def undo(self, doc_id: str) -> DocState:
        return await self._request(HistoryUndo(doc_id=doc_id), DocState)

    async def redo(self, doc_id: str) -> DocState:
        return await self._request(HistoryRedo(doc_id=doc_id), DocState)

    async def list_docs(self) -> list[DocSummary]:
        return (await self._request(DocList(), DocListing)).docs

    async def ping(self) -> float:
        """Round-trip time in seconds."""
        t0 = time.perf_counter()
        await self._request(Ping(), Pong)
        return time.perf_counter() - t0


class _Connector:
    """What `DcanvasClient.connect` returns: use it with `async with`, or `await` it for a client you close."""

    def __init__(self, opener: Callable[[], Coroutine[Any, Any, DcanvasClient]]) -> None:
        self._opener = opener
        self._client: DcanvasClient | None = None

    def __await__(self) -> Generator[Any, None, DcanvasClient]:
        return self._opener().__await__()

    async def __aenter__(self) -> DcanvasClient:
        self._client = await self._opener()
        return self._client

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._client is not None:
            await self._client.close()
