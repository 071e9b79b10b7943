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


def test_a_burst_overflows_every_replica_s_bound_not_one() -> None:
    """With --ray the ingress's /health sums the replicas and has no `row_cap` of its own: a burst sized by the
    default (max_batch + 8) fitted in two replicas' queues, and the check that the burst meets a refusal failed
    (the 3-minute scale-out soak: "16 generations at once and none refused"). It is sized by every replica's bound."""
    from canvas.soak.run import burst_size

    one = {"row_cap": 3, "max_queue": 5}
    assert burst_size(one, max_batch=4) == 3 + 5 + 4
    ray = {"max_batch": 8, "replicas": [{"queue": {"row_cap": 3, "max_queue": 3}},
                                         {"queue": {"row_cap": 4, "max_queue": 12}}]}  # fmt: skip
    assert burst_size(ray, max_batch=4) == (3 + 3) + (4 + 12) + 4
    assert burst_size({}, max_batch=4) == 4 + 8 + 4  # no figures yet: the server's defaults
