"""The soak's drop actor against a queue that stays full (the 5-minute dry run on the 96k model: the real model's
row cap is 1 and twenty writers keep it taken, so a drop that gave up after 10 refusals skipped 2 drops in 3, and
the fault class went mostly untested). It now waits through refusals as a writer does, up to `DROP_TRIES`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from canvas.protocol import ErrorCode, ProtocolError
from canvas.soak.actors import DROP_TRIES, LONG, Actors

pytestmark = pytest.mark.timeout(30)


class _FullQueue:
    """A client whose first `refusals` generations are refused as `busy` (retryable), then admitted."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.calls = refusals, 0

    def generate(self, doc_id: str, v: int, params: Any = None, **overrides: Any) -> Any:
        self.calls += 1
        refused = self.calls <= self.refusals

        async def start() -> str:
            if refused:
                raise ProtocolError(ErrorCode.BUSY, "the queue is full", data={"retry_after_s": 0.001}, retryable=True)
            return "admitted"

        return start()


def test_a_drop_waits_through_a_full_queue() -> None:
    actors = Actors("ws://127.0.0.1:9/ws", 0.0, seed=1)
    client = _FullQueue(refusals=20)  # what the dry run met: more than the 10 tries a drop had
    assert asyncio.run(actors._admitted(client, "d", 1, DROP_TRIES, **LONG)) == "admitted"  # type: ignore[arg-type]
    assert actors.log.refusals == 20 and client.calls == 21


def test_a_drop_gives_up_after_its_tries() -> None:
    actors = Actors("ws://127.0.0.1:9/ws", 0.0, seed=1)
    client = _FullQueue(refusals=10_000)
    assert asyncio.run(actors._admitted(client, "d", 1, DROP_TRIES, **LONG)) is None  # type: ignore[arg-type]
    assert client.calls == DROP_TRIES and actors.log.untyped == []
