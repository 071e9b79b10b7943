"""The soak's faults that are clients: one that drops its connection mid-generation, one that never reads its
socket, and a burst of clients starting generations at once, over the queue bound.

Each journals into one shared `ActorLog`: what it did, the refusals it met (typed, retryable: expected), anything
untyped (an `internal` error, a generation that `failed`, a connection dropped without a close code outside a
server kill), and what the server must have kept (the dropped client's document, unchanged).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import connect as ws_connect

from canvas.protocol import ErrorCode, GenProgress, MaskOp, ProtocolError
from canvas.protocol.client import ConnectionLost, DcanvasClient, Generation
from canvas.soak.writers import ANSWER_S

TEXT = "A long road ran past the old mill, over the bridge and up the hill to the farm."
LONG = {"max_steps": 256, "entropy_bound": 1e-6}  # accepts about one slot a step: a generation that runs long
# A drop waits this many refusals for a place: the writers keep the queue full (a real model on CPU admits one
# generation at a time), and with fewer tries most drops never got to drop anything.
DROP_TRIES = 60


@dataclass
class ActorLog:
    done: Counter[str] = field(default_factory=Counter)  # "drop", "stall", "burst" that ran to their end
    skipped: Counter[str] = field(default_factory=Counter)  # could not set up (e.g. the server was down)
    refusals: int = 0  # busy / rate_limited met by the actors (the burst's are the point)
    admitted: int = 0  # burst generations admitted
    unrefused_bursts: int = 0  # bursts whose every generation was admitted (a figure: see `burst`)
    statuses: Counter[str] = field(default_factory=Counter)  # gen.done statuses the actors saw
    lost: list[tuple[float, int | None, str]] = field(default_factory=list)  # unplanned: (t, close code, who)
    untyped: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    stall_closed: list[int | None] = field(default_factory=list)  # how each stalled connection ended (server side)


class Actors:
    def __init__(self, url: str, t0: float, seed: int) -> None:
        self.url, self.t0 = url, t0
        self.rng = random.Random(seed)
        self.log = ActorLog()

    def _now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    async def _doc(self, c: DcanvasClient, name: str) -> tuple[str, int]:
        """A new document with one word masked: (doc_id, version)."""
        s = await c.open(text=TEXT, name=name)
        start = self.rng.choice([i for i in range(1, len(TEXT) - 4) if TEXT[i - 1] == " " and TEXT[i].isalpha()])
        end = TEXT.find(" ", start)
        end = len(TEXT) - 1 if end < 0 else end  # the last word: up to the full stop
        s = await c.edit(s.doc_id, s.v, [MaskOp(start=start, end=end)])
        return s.doc_id, s.v

    async def _admitted(self, c: DcanvasClient, doc_id: str, v: int, tries: int, **params: Any) -> Generation | None:
        for _ in range(tries):
            gen = c.generate(doc_id, v, None, **params)
            try:
                return await gen
            except ProtocolError as e:
                if not (e.code is ErrorCode.BUSY and e.retryable):
                    self._error("gen.start", e)
                    return None
                self.log.refusals += 1
                await asyncio.sleep(min(3.0, float((e.data or {}).get("retry_after_s") or 0.5)))
        return None

    async def _connect(self, name: str) -> DcanvasClient:
        return await DcanvasClient.connect(self.url, client_name=name, request_timeout=120)

    def _error(self, what: str, e: ProtocolError) -> None:
        if e.code is ErrorCode.INTERNAL:
            self.log.untyped.append(f"{self._now()}: {what}: internal: {e.message}")

    # -- a client that drops mid-generation ----------------------------------------------------------------------

    async def drop(self) -> None:
        try:
            c = await DcanvasClient.connect(self.url, client_name="soak-drop", request_timeout=60)
        except Exception:  # noqa: BLE001 (the server is restarting: nothing to drop)
            self.log.skipped["drop"] += 1
            return
        try:
            doc_id, v = await self._doc(c, "drop")
            gen = await self._admitted(c, doc_id, v, DROP_TRIES, **LONG)
            if gen is None:
                self.log.skipped["drop"] += 1
                return
            while not isinstance(await asyncio.wait_for(gen.__anext__(), ANSWER_S), GenProgress):
                pass  # its first progress frame: the generation is running
            c.abort()  # gone without a close frame, as a laptop lid closes
        except (ConnectionLost, ProtocolError, TimeoutError, StopAsyncIteration) as e:
            self._lost_or_error("drop", e)
            return
        finally:
            await c.close()
        await asyncio.sleep(0.5)
        try:  # the document lost nothing: same version, still masked; its generation was cancelled
            async with DcanvasClient.connect(self.url, client_name="soak-drop-check", request_timeout=60) as c2:
                s = await c2.open(doc_id)
                if s.v != v or s.gen not in (None, gen.gen):
                    self.log.violations.append(f"drop: document {doc_id} at v{s.v} (gen {s.gen}) after the drop, "
                                               f"was v{v}")  # fmt: skip
                await self._delete(c2, doc_id)
        except (ConnectionLost, ProtocolError, OSError, TimeoutError) as e:
            self._lost_or_error("drop-check", e)
            return
        self.log.done["drop"] += 1

    # -- a client that never reads ---------------------------------------------------------------------------

    async def stall(self, seconds: float, doc_ids: list[str]) -> None:
        """Open a long generation and subscribe to the writers' documents, then stop reading for `seconds`:
        the websockets library stops reading the socket once one frame waits unread (max_queue=1), so the
        server's frames back up in the TCP buffers and then in the server's outbox for this session."""
        try:
            ws = await ws_connect(self.url, max_queue=1, open_timeout=10, ping_interval=None)
        except Exception:  # noqa: BLE001
            self.log.skipped["stall"] += 1
            return
        try:
            await ws.send(json.dumps({"type": "hello", "id": 1, "protocol": "dcanvas/1"}))
            await ws.send(json.dumps({"type": "doc.open", "id": 2, "text": TEXT, "name": "stall"}))
            doc: dict[str, object] = {}
            while doc.get("re") != 2:
                doc = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if doc.get("type") != "doc.state":
                self.log.skipped["stall"] += 1
                return
            await ws.send(json.dumps({"type": "doc.edit", "id": 3, "doc_id": doc["doc_id"], "base_v": doc["v"],
                                      "ops": [{"op": "mask", "start": 0, "end": len(TEXT) // 2}]}))  # fmt: skip
            await ws.send(json.dumps({"type": "gen.start", "id": 4, "doc_id": doc["doc_id"],
                                      "base_v": int(str(doc["v"])) + 1, "params": LONG}))  # fmt: skip
            for i, d in enumerate(doc_ids[:16]):
                await ws.send(json.dumps({"type": "doc.open", "id": 10 + i, "doc_id": d}))
            await asyncio.sleep(seconds)  # reads nothing
            self.log.stall_closed.append(ws.close_code)
            self.log.done["stall"] += 1
        except Exception as e:  # noqa: BLE001 (the server was killed meanwhile)
            self.log.lost.append((self._now(), getattr(e, "code", None), f"stall: {type(e).__name__}"))
        finally:
            ws.transport.abort()

    # -- a burst over the queue bound --------------------------------------------------------------------------

    async def burst(self, size: int) -> None:
        """`size` clients start a generation each at the same moment (the caller sizes it over the queue bound)."""
        clients: list[DcanvasClient] = []
        try:
            opened = await asyncio.gather(*(self._connect("soak-burst") for _ in range(size)), return_exceptions=True)
            clients = [c for c in opened if isinstance(c, DcanvasClient)]
            if len(clients) < len(opened):
                self.log.skipped["burst"] += 1
                return
            docs = await asyncio.gather(*(self._doc(c, "burst") for c in clients))
            # All at once, no retries: the ones over the bound must be refused with a typed, retryable busy, and
            # every one admitted answered. None refused is no violation: the sized bound (issue 47) admits what the
            # engines expect to start within a second, which short generations on fast replicas may be a whole burst
            # (it takes the replicas a while to admit each, and rows free up meanwhile). It is counted.
            results = await asyncio.gather(*(self._one(c, d, v) for c, (d, v) in zip(clients, docs, strict=True)))
            if not any(r == "refused" for r in results):
                self.log.unrefused_bursts += 1
            for c, (d, _) in zip(clients, docs, strict=True):
                await self._delete(c, d)
            self.log.done["burst"] += 1
        except (ConnectionLost, ProtocolError, TimeoutError) as e:
            self._lost_or_error("burst", e)
        finally:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

    async def _one(self, c: DcanvasClient, doc_id: str, v: int) -> str:
        gen = c.generate(doc_id, v, max_steps=8, seed=self.rng.randrange(1 << 30))
        try:
            await gen
        except ProtocolError as e:
            if e.code in (ErrorCode.BUSY, ErrorCode.RATE_LIMITED) and e.retryable:
                self.log.refusals += 1
                return "refused"
            self._error("burst gen.start", e)
            return "error"
        self.log.admitted += 1
        done = await asyncio.wait_for(gen.result(), ANSWER_S)
        self.log.statuses[done.status] += 1
        if done.status == "failed":
            self.log.untyped.append(f"{self._now()}: burst generation {done.gen} failed: {done.message}")
        return "admitted"

    async def _delete(self, c: DcanvasClient, doc_id: str) -> None:
        """The actors' documents go once used, so that an hour of them stays under the server's `max_docs`."""
        for _ in range(10):
            try:
                await c.delete(doc_id)
                return
            except ProtocolError as e:
                if not (e.code is ErrorCode.BUSY and e.retryable):  # busy: the store could not write; retry
                    self._error("doc.delete", e)
                    return
                self.log.refusals += 1
                await asyncio.sleep(min(3.0, float((e.data or {}).get("retry_after_s") or 0.5)))

    def _lost_or_error(self, who: str, e: Exception) -> None:
        self.log.skipped[who] += 1  # did not run to its end (the server was killed, or refused to set it up)
        if isinstance(e, ConnectionLost):
            self.log.lost.append((self._now(), e.code, who))
        elif isinstance(e, ProtocolError):
            self._error(who, e)
        elif isinstance(e, TimeoutError):  # a client left without an answer is a failure, whatever the server did
            self.log.untyped.append(f"{self._now()}: {who}: no answer within {ANSWER_S:.0f} s")
        elif isinstance(e, StopAsyncIteration):  # gen.done before any progress frame: nothing was dropped mid-way
            pass
        else:
            self.log.lost.append((self._now(), None, f"{who}: {type(e).__name__}"))
