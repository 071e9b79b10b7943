"""canvas.protocol.client against a scripted websocket server on loopback: correlation, errors, generations, broadcasts,
connection loss. (The client against the real server is tested in tests/canvas/test_server*.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from canvas import protocol as p
from canvas.protocol import ErrorCode, ProtocolError
from canvas.protocol.client import ConnectionLost, DcanvasClient

Handler = Callable[[dict[str, Any], ServerConnection], Awaitable[None]]
pytestmark = pytest.mark.timeout(30)


def _welcome(re: Any) -> str:
    return p.dump(
        p.Welcome(
            re=re,
            session="s-test",
            server=p.ServerInfo(name="fake", version="0"),
            model=p.ModelInfo(name="none", canvas_length=16, modes=["diffusion"]),
            limits=p.ServerLimits().to_wire(),
        )
    )


def _state(re: Any = None, v: int = 0, text: str = "") -> str:
    return p.dump(p.DocState(re=re, doc_id="d1", v=v, text=text, window=p.Window(start=0, end=len(text))))


_STATS = p.GenStats(steps=3, tokens_per_forward=1.0, tok_s=10.0, wall_s=0.1)


class FakeServer:
    """Answers hello itself, hands every other request to the test's handler, records what it received."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.received: list[dict[str, Any]] = []
        self.url = ""

    async def _serve(self, ws: ServerConnection) -> None:
        async for raw in ws:
            msg = json.loads(raw)
            self.received.append(msg)
            if msg["type"] == "hello":
                if msg.get("token") == "bad":
                    err = ProtocolError(ErrorCode.UNAUTHORIZED, "wrong token", msg.get("id"))
                    await ws.send(p.dump(err.to_message()))
                    await ws.close(1008, "unauthorized")
                    return
                await ws.send(_welcome(msg.get("id")))
            else:
                await self.handler(msg, ws)


@pytest.fixture
async def fake() -> AsyncIterator[Callable[[Handler], Awaitable[FakeServer]]]:
    servers = []

    async def start(handler: Handler) -> FakeServer:
        fs = FakeServer(handler)
        server = await serve(fs._serve, "127.0.0.1", 0)
        servers.append(server)
        port = next(iter(server.sockets)).getsockname()[1]
        fs.url = f"ws://127.0.0.1:{port}/ws"
        return fs

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def _echo_state(msg: dict[str, Any], ws: ServerConnection) -> None:
    if msg["type"] == "doc.open":
        await ws.send(_state(msg["id"], 0, msg.get("text") or ""))
    elif msg["type"] == "ping":
        await ws.send(p.dump(p.Pong(re=msg["id"])))


async def test_handshake_sends_protocol_client_and_token(fake: Any) -> None:
    fs = await fake(_echo_state)
    async with DcanvasClient.connect(fs.url, token="s3cret", client_name="pytest") as c:
        assert c.welcome is not None and c.welcome.session == "s-test"
        assert await c.ping() > 0
    hello = fs.received[0]
    assert hello["type"] == "hello" and hello["protocol"] == "dcanvas/1" and hello["token"] == "s3cret"
    assert hello["client"]["name"] == "pytest"
    assert fs.received[1]["type"] == "ping" and fs.received[1]["id"] != hello["id"]


async def test_wrong_token_raises_unauthorized(fake: Any) -> None:
    fs = await fake(_echo_state)
    with pytest.raises(ProtocolError) as info:
        async with DcanvasClient.connect(fs.url, token="bad"):
            pass
    assert info.value.code is ErrorCode.UNAUTHORIZED and info.value.message == "wrong token"


async def test_replies_are_matched_by_re_even_out_of_order(fake: Any) -> None:
    held: list[dict[str, Any]] = []

    async def reverse(msg: dict[str, Any], ws: ServerConnection) -> None:
        held.append(msg)
        if len(held) == 2:
            for m in reversed(held):
                await ws.send(_state(m["id"], 0, m["text"]))

    fs = await fake(reverse)
    async with DcanvasClient.connect(fs.url) as c:
        a, b = await asyncio.gather(c.open(text="first"), c.open(text="second"))
    assert (a.text, b.text) == ("first", "second")


async def test_error_replies_raise_protocol_error_with_code_and_data(fake: Any) -> None:
    async def stale(msg: dict[str, Any], ws: ServerConnection) -> None:
        err = ProtocolError(ErrorCode.STALE_VERSION, "moved on", msg["id"], data={"current_v": 9})
        await ws.send(p.dump(err.to_message()))

    fs = await fake(stale)
    async with DcanvasClient.connect(fs.url) as c:
        with pytest.raises(ProtocolError) as info:
            await c.edit("d1", 3, [p.PinOp(start=0, end=1)])
    assert (info.value.code, info.value.data, info.value.retryable) == (ErrorCode.STALE_VERSION, {"current_v": 9}, True)
    edit = fs.received[-1]
    assert edit["ops"] == [{"op": "pin", "start": 0, "end": 1}] and edit["base_v"] == 3


async def test_bad_ops_and_params_fail_locally_without_sending(fake: Any) -> None:
    fs = await fake(_echo_state)
    async with DcanvasClient.connect(fs.url) as c:
        with pytest.raises(ProtocolError, match="start") as info:
            await c.edit("d1", 0, [{"op": "mask", "start": 4, "end": 1}])
        assert info.value.code is ErrorCode.INVALID_PARAMS
        with pytest.raises(ProtocolError, match="max_steps"):
            c.generate("d1", 0, max_steps=0)
    assert [m["type"] for m in fs.received] == ["hello"]


async def test_generation_streams_progress_then_done_and_routes_broadcasts(fake: Any) -> None:
    async def gen(msg: dict[str, Any], ws: ServerConnection) -> None:
        if msg["type"] != "gen.start":
            return
        rid = msg["id"]
        await ws.send(p.dump(p.GenAccepted(re=rid, gen="g7", doc_id="d1", base_v=0, params=p.GenParams(seed=1))))
        for seq in (1, 2, 3):
            slot = p.SlotUpdate(i=seq, token=seq, text=f"t{seq}", entropy=0.5, accepted=seq == 3)
            await ws.send(p.dump(p.GenProgress(re=rid, gen="g7", seq=seq, step=seq, max_steps=8, slots=[slot])))
            if seq == 2:
                await ws.send(_state(None, 5, "someone else edited"))  # a broadcast in the middle
        await ws.send(p.dump(p.GenDone(re=rid, gen="g7", doc_id="d1", status="completed", stats=_STATS)))

    fs = await fake(gen)
    seen: list[p.DocState] = []
    async with DcanvasClient.connect(fs.url, on_state=seen.append) as c:
        g = c.generate("d1", 0, max_steps=8, seed=1)
        events = [ev async for ev in g]
        assert [type(e).__name__ for e in events] == ["GenProgress"] * 3 + ["GenDone"]
        assert [e.seq for e in events[:3]] == [1, 2, 3]  # type: ignore[union-attr]
        assert g.gen == "g7" and g.done is events[-1] and g.done.status == "completed"
        assert [ev async for ev in g] == []  # finished: iterating again yields nothing
        assert [s.text for s in seen] == ["someone else edited"]
        broadcast = c.events.get_nowait()
        assert isinstance(broadcast, p.DocState) and broadcast.v == 5
    start = fs.received[1]
    assert start["params"]["max_steps"] == 8 and start["params"]["seed"] == 1 and start["doc_id"] == "d1"


async def test_cancel_acks_and_the_generation_still_ends_with_done(fake: Any) -> None:
    running: dict[str, Any] = {}

    async def gen(msg: dict[str, Any], ws: ServerConnection) -> None:
        if msg["type"] == "gen.start":
            running["re"] = msg["id"]
            await ws.send(p.dump(p.GenAccepted(re=msg["id"], gen="g1", doc_id="d1", base_v=0, params=p.GenParams())))
            await ws.send(p.dump(p.GenProgress(re=msg["id"], gen="g1", seq=1, step=0, max_steps=48, slots=[])))
        elif msg["type"] == "gen.cancel":
            assert msg["gen"] == "g1"
            await ws.send(p.dump(p.Ack(re=msg["id"])))
            done = p.GenDone(re=running["re"], gen="g1", doc_id="d1", status="cancelled", stats=_STATS)
            await ws.send(p.dump(done))

    fs = await fake(gen)
    async with DcanvasClient.connect(fs.url) as c:
        g = await c.generate("d1", 0)
        first = await g.__anext__()
        assert isinstance(first, p.GenProgress)
        await g.cancel()
        done = await g.result()
        assert done.status == "cancelled"


async def test_other_requests_send_the_right_messages(fake: Any) -> None:
    async def reply(msg: dict[str, Any], ws: ServerConnection) -> None:
        kind, rid = msg["type"], msg["id"]
        if kind in ("proposal.accept", "history.undo", "history.redo"):
            await ws.send(_state(rid, 4, kind))
        elif kind in ("proposal.reject", "doc.close"):
            await ws.send(p.dump(p.Ack(re=rid)))
        elif kind == "doc.list":
            docs = [p.DocSummary(doc_id="d1", name="n", v=4, chars=3, updated=1.0)]
            await ws.send(p.dump(p.DocListing(re=rid, docs=docs)))

    fs = await fake(reply)
    async with DcanvasClient.connect(fs.url) as c:
        assert (await c.accept("g1", 3, hunks=[0])).text == "proposal.accept"
        await c.reject("g2")
        assert (await c.undo("d1")).text == "history.undo"
        assert (await c.redo("d1")).text == "history.redo"
        await c.close_doc("d1")
        assert [d.doc_id for d in await c.list_docs()] == ["d1"]
    sent = [{k: v for k, v in m.items() if k != "id"} for m in fs.received[1:]]
    assert sent == [
        {"type": "proposal.accept", "gen": "g1", "base_v": 3, "hunks": [0]},
        {"type": "proposal.reject", "gen": "g2"},
        {"type": "history.undo", "doc_id": "d1"},
        {"type": "history.redo", "doc_id": "d1"},
        {"type": "doc.close", "doc_id": "d1"},
        {"type": "doc.list"},
    ]


async def test_wrong_reply_type_and_malformed_frames(fake: Any) -> None:
    async def confused(msg: dict[str, Any], ws: ServerConnection) -> None:
        await ws.send("this is not json")
        await ws.send('{"type": "gen.progress", "gen": "x"}')  # missing fields: ignored with a warning
        await ws.send(p.dump(p.Pong(re=msg["id"])))  # a pong for a doc.open

    fs = await fake(confused)
    async with DcanvasClient.connect(fs.url) as c:
        with pytest.raises(ProtocolError, match="expected DocState, got 'pong'"):
            await c.open(text="x")
        assert await c.ping() > 0  # still usable after junk: the connection stays open


async def test_connection_loss_fails_pending_requests_and_generations(fake: Any) -> None:
    async def drop(msg: dict[str, Any], ws: ServerConnection) -> None:
        if msg["type"] == "gen.start":
            await ws.send(p.dump(p.GenAccepted(re=msg["id"], gen="g1", doc_id="d1", base_v=0, params=p.GenParams())))
        else:
            await ws.close(1011, "boom")

    fs = await fake(drop)
    async with DcanvasClient.connect(fs.url) as c:
        g = await c.generate("d1", 0)
        with pytest.raises(ConnectionLost) as info:
            await c.open(text="x")
        assert info.value.code == 1011 and "boom" in str(info.value)
        with pytest.raises(ConnectionLost):
            await g.__anext__()
        assert c.closed
        with pytest.raises(ConnectionLost):
            await c.ping()


async def test_abort_cuts_the_connection_without_a_close_frame(fake: Any) -> None:
    """`abort` is a network dropping, not a goodbye: the server's side ends abnormally (1006: no close frame came),
    and the client's open generation and later requests fail with `ConnectionLost`."""
    seen: list[ServerConnection] = []

    async def accept(msg: dict[str, Any], ws: ServerConnection) -> None:
        seen.append(ws)
        if msg["type"] == "gen.start":
            await ws.send(p.dump(p.GenAccepted(re=msg["id"], gen="g1", doc_id="d1", base_v=0, params=p.GenParams())))

    fs = await fake(accept)
    c = await DcanvasClient.connect(fs.url)
    try:
        g = await c.generate("d1", 0)
        c.abort()
        with pytest.raises(ConnectionLost):
            await g.__anext__()
        await asyncio.wait_for(seen[0].wait_closed(), 5)
        assert seen[0].close_code == 1006  # a polite `close` would have sent 1000
        assert c.closed
        with pytest.raises(ConnectionLost):
            await c.ping()
    finally:
        await c.close()


async def test_request_timeout_and_bounded_event_queue(fake: Any) -> None:
    async def silent_then_flood(msg: dict[str, Any], ws: ServerConnection) -> None:
        if msg["type"] == "doc.list":
            for v in range(10):
                await ws.send(_state(None, v, "flood"))
            await ws.send(p.dump(p.DocListing(re=msg["id"], docs=[])))

    fs = await fake(silent_then_flood)
    client = await DcanvasClient.connect(fs.url, request_timeout=0.2)
    try:
        with pytest.raises(TimeoutError):
            await client.ping()
        client.events = asyncio.Queue(maxsize=3)
        assert await client.list_docs() == []
        kept = [client.events.get_nowait().v for _ in range(3)]  # type: ignore[attr-defined]
        assert kept == [7, 8, 9]  # oldest dropped, latest kept
    finally:
        await client.close()
