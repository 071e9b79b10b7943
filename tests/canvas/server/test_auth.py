"""The token as a websocket subprotocol (what a browser can send): encoding, the rule at hello, and a real websocket
client against a real uvicorn server, which must select `dcanvas.v1` and never echo the token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.server.embedded import EmbeddedServer
from canvas.server.security import authorized, subprotocol_tokens, token_subprotocol

pytestmark = pytest.mark.timeout(120)
TOKEN = "correct-horse-battery-ünï/+="  # characters a subprotocol may not hold, hence base64url


def test_token_subprotocol_round_trip_and_junk() -> None:
    proto = token_subprotocol(TOKEN)
    assert proto.startswith("dcanvas.token.") and all(c.isalnum() or c in "._-" for c in proto)
    assert subprotocol_tokens(["dcanvas.v1", proto, "other"]) == (TOKEN,)
    # empty (a wrong token, not a missing one), bad characters, a bad length, bytes that are not UTF-8
    junk = ["dcanvas.token.", "dcanvas.token.!!", "dcanvas.token.Y", "dcanvas.token.__8"]
    assert subprotocol_tokens(junk) == ("", None, None, None)
    assert authorized([], None) and authorized(["anything"], None)  # a server without a token
    assert authorized([TOKEN], TOKEN) and authorized([TOKEN, TOKEN], TOKEN)
    assert not authorized([], TOKEN) and not authorized([None], TOKEN) and not authorized([TOKEN, "wrong"], TOKEN)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Backend:
    return load_backend(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model")), max_batch=4)


@pytest.fixture(scope="module")
def server(backend: Backend) -> Iterator[EmbeddedServer]:
    with EmbeddedServer(backend=backend, token=TOKEN) as s:
        yield s


async def _hello(url: str, protocols: list[str], **fields: Any) -> tuple[str | None, str | None, dict[str, Any], int]:
    """Connect offering `protocols`, send hello: (selected subprotocol, the response header, reply, close code)."""
    async with connect(url, subprotocols=protocols or None) as ws:  # type: ignore[arg-type]
        assert ws.response is not None
        header = ws.response.headers.get("Sec-WebSocket-Protocol")
        await ws.send(json.dumps({"type": "hello", "id": 1, "protocol": "dcanvas/1", **fields}))
        reply = json.loads(await ws.recv())
        code = 0
        if reply["type"] == "error":
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None
            code = closed.value.rcvd.code
        return ws.subprotocol, header, reply, code


def test_a_token_offered_as_a_subprotocol_authorizes_and_is_never_echoed(server: EmbeddedServer) -> None:
    good = token_subprotocol(TOKEN)

    async def scenario() -> None:
        selected, header, reply, _ = await _hello(server.url, ["dcanvas.v1", good])
        assert (selected, header, reply["type"]) == ("dcanvas.v1", "dcanvas.v1", "welcome")  # no token in it
        # The same token in hello as well is fine; a hello token alone still works (editors, the TUI).
        assert (await _hello(server.url, ["dcanvas.v1", good], token=TOKEN))[2]["type"] == "welcome"
        assert (await _hello(server.url, [], token=TOKEN))[2]["type"] == "welcome"
        refusals: list[tuple[list[str], dict[str, Any]]] = [
            (["dcanvas.v1", token_subprotocol("wrong-token-wrong-token")], {}),
            (["dcanvas.v1", "dcanvas.token.%%%"], {}),  # not base64url
            (["dcanvas.v1", good], {"token": "wrong-token-wrong-token"}),  # every token given must be right
            (["dcanvas.v1", good, token_subprotocol("wrong-token-wrong-token")], {}),
            (["dcanvas.v1"], {}),  # none at all
        ]
        for protocols, fields in refusals:
            selected, _, reply, code = await _hello(server.url, protocols, **fields)
            assert (selected, reply["code"], code) == ("dcanvas.v1", "unauthorized", 1008), protocols

    asyncio.run(scenario())


def test_docs_describe_the_subprotocol_token() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "protocol.md").read_text(encoding="utf-8")
    transport = doc.split("## Transport", 1)[1].split("\n## ", 1)[0]
    assert "dcanvas.token." in transport and "base64url" in transport and "dcanvas.v1" in transport
