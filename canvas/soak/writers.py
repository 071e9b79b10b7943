"""The soak's writers: each is the only writer of its own document, and journals everything it was told.

A writer loops until its deadline: insert a unique marker (`#w3e17#`) or delete one, pin a range, mask a word and
generate (sometimes cancelling mid-way), accept or reject the proposal, unmask, undo, redo. Being the only writer
makes what the server says checkable: every change it acknowledges moves the version by exactly one (a no-op by
none), and the text it returns is the whole truth about the document at that version.

Faults, as a writer meets them: a retryable refusal (`busy`: the queue is full, or the store could not write) is
retried as told, with the same request (same marker, same base version: nothing may have changed); a dropped
connection is journalled with its close code and what was in flight, then the writer reconnects (the server may be
restarting), re-reads its document and journals it (`reconcile`): the in-flight change may have been applied once,
or not at all. An accept whose answer was lost is retried: a second application would be a duplicate.

Slow answers: on a loaded machine with a real model a reply (or the next frame of a generation) can take many
seconds. A reply later than `LATE_S` is journalled as late (`WriterLog.late`, a figure, not a failure: it came, and
typed); only a request with no answer at all within `ANSWER_S` counts as unanswered (a violation), and then the
writer drops that connection, reconnects and reconciles as after a lost one.

Invariant: a writer has at most one request in flight, so at most one change can be unaccounted for.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from canvas.protocol import DocState, ErrorCode, GenDone, GenProgress, MaskOp, PinOp, ProtocolError, ReplaceOp
from canvas.protocol.client import ConnectionLost, DcanvasClient, Generation

# Closed at both ends: a generation that rewrites the text beside a marker cannot extend it into another one.
MARKER = re.compile(r"#w\d+e\d+#")
TEXTS = [
    "The cat sat on the mat and watched the rain fall on the garden.",
    "Once upon a time there was a small house by a quiet river.",
    "She opened the window, looked at the hills, and began to write.",
    "We walked along the road until the sun went down behind the trees.",
]
MAX_CHARS = 420  # past this a writer deletes markers instead of adding them: the document stays inside one window
LATE_S = 30.0  # a reply (or a generation's next frame) slower than this is journalled as late
ANSWER_S = 300.0  # no reply (or no next frame) within this: unanswered, a violation; the connection is dropped
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Known:
    """A document as the server described it in one `doc.state`."""

    v: int
    text: str
    can_undo: bool
    can_redo: bool

    @classmethod
    def of(cls, s: DocState) -> Known:
        return cls(s.v, s.text, s.can_undo, s.can_redo)


@dataclass(frozen=True, slots=True)
class Step:
    t: float  # seconds since the soak started
    how: str  # "open", "ack:<kind>" (the reply to a request), "reconcile" (re-read after a lost connection)
    state: Known
    inflight: str | None = None  # reconcile: the change whose answer was lost (it may have been applied once)


@dataclass
class WriterLog:
    """What one writer was told, for the checker."""

    name: str
    doc_id: str = ""
    steps: list[Step] = field(default_factory=list)
    lost: list[tuple[float, int | None, str | None]] = field(default_factory=list)  # (t, close code, in flight)
    errors: Counter[str] = field(default_factory=Counter)  # typed errors by code (refusals apart)
    # busy: "queue" (the queue is full), "store" / "store_full" (the store could not write); "rate": rate_limited
    refusals: Counter[str] = field(default_factory=Counter)
    untyped: list[str] = field(default_factory=list)  # internal errors, failed generations
    unanswered: list[str] = field(default_factory=list)  # requests without any answer within `ANSWER_S`
    late: list[tuple[float, str, float]] = field(default_factory=list)  # (t, what, seconds): answered after `LATE_S`
    gens: dict[str, str] = field(default_factory=dict)  # gen -> its gen.done status, or "lost" with the connection
    gen_times: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # gen -> (accepted, answered)
    told: dict[str, str] = field(default_factory=dict)  # gen -> the text of its proposal (completed)
    accepted: list[str] = field(default_factory=list)  # accepts acknowledged (or confirmed by `conflict: accepted`)
    rejected: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)  # an accept retried after a lost answer that applied again

    @property
    def last(self) -> Known | None:
        return self.steps[-1].state if self.steps else None


class Writer:
    def __init__(self, index: int, url: str, t0: float, deadline: float, *, seed: int, gen_steps: tuple[int, ...],
                 grace_s: float = 240.0, request_timeout: float = ANSWER_S) -> None:  # fmt: skip
        self.i, self.url, self.t0, self.deadline = index, url, t0, deadline
        self.hard_deadline = deadline + grace_s  # reconnecting (a restart) may run this long past the deadline
        self.rng = random.Random(seed)
        self.gen_steps = gen_steps
        self.request_timeout = request_timeout
        self.log = WriterLog(f"w{index}")
        self.client: DcanvasClient | None = None
        self.inflight: str | None = None
        self._marks = 0

    def _now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    @property
    def known(self) -> Known:
        last = self.log.last
        assert last is not None
        return last

    # -- the loop ----------------------------------------------------------------------------------------------

    async def run(self) -> WriterLog:
        try:
            while time.monotonic() < self.deadline:
                try:
                    if self.client is None:
                        if not await self._connect():
                            break
                    await self._act()
                except ConnectionLost as e:
                    self.log.lost.append((self._now(), e.code, self.inflight))
                    self.client = None
                except TimeoutError as e:  # a request without any answer: the connection cannot be trusted
                    self.log.unanswered.append(f"{self._now()}: {self.inflight or str(e) or 'a request'}")
                    await self._drop_client()  # the next loop reconnects and reconciles what was in flight
            # A connection lost in the last action: reconcile before stopping, so the journal ends on what is stored.
            if self.client is None and self.log.doc_id:
                await self._connect()
        finally:
            await self._drop_client()
        return self.log

    async def _drop_client(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            try:
                await client.close()
            except Exception:  # noqa: BLE001 (closing a broken connection: nothing to learn)
                pass

    async def _connect(self) -> bool:
        """Connect (retrying while the server restarts), then open or re-read the document. False past the grace."""
        delay = 0.2
        while time.monotonic() < self.hard_deadline:
            try:
                self.client = await DcanvasClient.connect(self.url, client_name=f"soak-{self.log.name}",
                                                          request_timeout=self.request_timeout)  # fmt: skip
                break
            except Exception:  # noqa: BLE001 (refused, reset, 1013 while full: the server is restarting)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 1.5)
        else:
            return False
        assert self.client is not None
        if not self.log.doc_id:
            s = await self._open(lambda c: c.open(text=self.rng.choice(TEXTS), name=self.log.name))
            if s is None:
                return True  # the next loop tries again
            self.log.doc_id = s.doc_id
            self.log.steps.append(Step(self._now(), "open", Known.of(s)))
            return True
        inflight, self.inflight = self.inflight, None
        s = await self._open(lambda c: c.open(self.log.doc_id))
        if s is None:
            self.inflight = inflight  # not re-read yet: the next connection reconciles
            await self._drop_client()
            return True
        before = self.known
        self.log.steps.append(Step(self._now(), "reconcile", Known.of(s), inflight))
        if inflight is not None and inflight.startswith("accept:"):
            await self._accept_again(inflight.split(":", 1)[1], applied=s.v == before.v + 1)
        return True

    async def _open(self, call: Callable[[DcanvasClient], Awaitable[DocState]]) -> DocState | None:
        assert self.client is not None
        for _ in range(20):
            try:
                return await self._ask("open", call(self.client))
            except ProtocolError as e:
                if not await self._refused(e):
                    self._error(e)
                    return None
        return None

    async def _act(self) -> None:
        k = self.known
        r = self.rng.random()
        if r < 0.35:
            await self._generate()
        elif r < 0.6:
            await self._marker()
        elif r < 0.7:
            a = self.rng.randrange(0, max(1, len(k.text) - 1))
            b = min(len(k.text), a + self.rng.randrange(1, 12))
            if a < b:
                await self._change("pin", lambda c: c.edit(self.log.doc_id, k.v, [PinOp(start=a, end=b)]))
        elif r < 0.85 and k.can_undo:
            await self._change("undo", lambda c: c.undo(self.log.doc_id))
        elif k.can_redo:
            await self._change("redo", lambda c: c.redo(self.log.doc_id))
        await asyncio.sleep(self.rng.uniform(0.02, 0.2))

    # -- requests ----------------------------------------------------------------------------------------------

    async def _ask(self, what: str, call: Awaitable[T]) -> T:
        """One request's reply (or a generation's next frame), journalled as late when it took over `LATE_S`. The
        client's own timeout (`ANSWER_S`) raises `TimeoutError`; `wait_s` bounds what has none (a stream)."""
        t = time.monotonic()
        try:
            return await call
        finally:
            took = time.monotonic() - t
            if took > LATE_S:
                self.log.late.append((self._now(), what, round(took, 1)))

    async def _next(self, gen: Generation) -> GenProgress | GenDone | None:
        """The generation's next frame; None after its `gen.done`. No frame within `ANSWER_S`: `TimeoutError`."""
        try:
            return await self._ask(f"gen:{gen.gen}", asyncio.wait_for(gen.__anext__(), self.request_timeout))
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise TimeoutError(f"generation {gen.gen}: no frame for {self.request_timeout:.0f} s") from None

    async def _refused(self, e: ProtocolError) -> bool:
        """A retryable refusal: counted, waited out as the server said. False for any other error."""
        if e.code is ErrorCode.BUSY:
            why = str((e.data or {}).get("unavailable") or "")
            self.log.refusals[("store_full" if "full" in why else "store") if why else "queue"] += 1
        elif e.code is ErrorCode.RATE_LIMITED:
            self.log.refusals["rate"] += 1
        else:
            return False
        wait = float((e.data or {}).get("retry_after_s") or 0.5)
        await asyncio.sleep(min(5.0, wait) * self.rng.uniform(0.8, 1.4))
        return True

    def _error(self, e: ProtocolError) -> None:
        self.log.errors[e.code.value] += 1
        if e.code is ErrorCode.INTERNAL:
            self.log.untyped.append(f"{self._now()}: {self.inflight or 'request'}: internal: {e.message}")

    async def _change(self, kind: str, call: Callable[[DcanvasClient], Awaitable[DocState]]) -> DocState | None:
        """A request that changes the document, retried while refused; its reply journalled."""
        for _ in range(30):
            if self.client is None:
                raise ConnectionLost(None, "not connected")
            self.inflight = kind
            try:
                s = await self._ask(kind, call(self.client))
            except ProtocolError as e:
                self.inflight = None
                if await self._refused(e):
                    continue
                self._error(e)
                if e.code is ErrorCode.STALE_VERSION:  # cannot happen to a lone writer: re-read all the same
                    await self._reread()
                return None
            self.inflight = None
            self.log.steps.append(Step(self._now(), f"ack:{kind.split(':')[0]}", Known.of(s)))
            return s
        return None

    async def _reread(self) -> None:
        s = await self._open(lambda c: c.open(self.log.doc_id))
        if s is not None:
            self.log.steps.append(Step(self._now(), "reconcile", Known.of(s)))

    async def _marker(self) -> None:
        k = self.known
        marks = [(m.start(), m.end()) for m in MARKER.finditer(k.text)]
        if len(k.text) > MAX_CHARS and marks:
            a, b = self.rng.choice(marks)
            a -= 1 if a > 0 and k.text[a - 1] == " " else 0
            op = ReplaceOp(start=a, end=b, text="")
        else:
            self._marks += 1
            at = self.rng.choice([0, len(k.text), *[i for i, ch in enumerate(k.text) if ch == " "]])
            op = ReplaceOp(start=at, end=at, text=f" #{self.log.name}e{self._marks}#")
        await self._change("replace", lambda c: c.edit(self.log.doc_id, k.v, [op]))

    async def _generate(self) -> None:
        k = self.known
        words = [(m.start(), m.end()) for m in re.finditer(r"[A-Za-z]{3,}", k.text[:300])]
        if not words:
            await self._marker()
            return
        a, b = self.rng.choice(words)
        masked = await self._change("mask", lambda c: c.edit(self.log.doc_id, k.v, [MaskOp(start=a, end=b)]))
        if masked is None:
            return
        gen = await self._start(masked.v)
        if gen is not None:
            await self._follow(gen)
        k = self.known
        # Text that was masked and not accepted stays free: unmask it all for the next round.
        await self._change("unmask", lambda c: c.edit(self.log.doc_id, k.v, [{"op": "unmask", "start": 0,
                                                                           "end": len(k.text)}]))  # fmt: skip

    async def _start(self, v: int) -> Generation | None:
        for _ in range(30):
            if time.monotonic() > self.deadline or self.client is None:
                return None
            gen = self.client.generate(self.log.doc_id, v, max_steps=self.rng.choice(self.gen_steps),
                                       seed=self.rng.randrange(1 << 30))  # fmt: skip
            try:
                await self._ask("gen.start", gen.start())
            except ProtocolError as e:
                if await self._refused(e):
                    continue
                self._error(e)
                return None
            self.log.gens[gen.gen] = "running"
            self.log.gen_times[gen.gen] = (self._now(), None)
            return gen
        return None

    async def _follow(self, gen: Generation) -> None:
        cancel_after = 2 if self.rng.random() < 0.1 else -1
        frames = 0
        try:
            while (ev := await self._next(gen)) is not None:
                if isinstance(ev, GenProgress):
                    frames += 1
                    if frames == cancel_after:
                        await gen.cancel()
        except ConnectionLost:
            self.log.gens[gen.gen] = "lost"
            self.log.gen_times[gen.gen] = (self.log.gen_times[gen.gen][0], self._now())
            raise
        done = gen.done
        assert done is not None
        self.log.gens[done.gen] = done.status
        self.log.gen_times[done.gen] = (self.log.gen_times[done.gen][0], self._now())
        if done.status == "failed":
            self.log.untyped.append(f"{self._now()}: generation {done.gen} failed: {done.message}")
        if done.status != "completed" or done.proposal is None:
            return
        self.log.told[done.gen] = done.proposal.text
        if self.rng.random() < 0.6:
            v = self.known.v
            if await self._change(f"accept:{done.gen}", lambda c: c.accept(done.gen, v)) is not None:
                self.log.accepted.append(done.gen)
        else:
            await self._reject(done.gen)

    async def _reject(self, gen: str) -> None:
        for _ in range(30):
            assert self.client is not None
            self.inflight = f"reject:{gen}"
            try:
                await self._ask(f"reject:{gen}", self.client.reject(gen))
            except ProtocolError as e:
                self.inflight = None
                if await self._refused(e):
                    continue
                self._error(e)
                return
            self.inflight = None
            self.log.rejected.append(gen)
            return

    async def _accept_again(self, gen: str, applied: bool) -> None:
        """An accept whose answer was lost, retried. Applied already (the version moved by one): the retry must be
        refused as `conflict ... accepted`; not applied: the retry applies it now, once."""
        for _ in range(30):
            assert self.client is not None
            v = self.known.v
            self.inflight = f"accept:{gen}"  # lost again: the next re-read allows for it once more
            try:
                s = await self._ask(f"accept:{gen}", self.client.accept(gen, v))
            except ProtocolError as e:
                self.inflight = None
                if await self._refused(e):
                    continue
                if e.code is ErrorCode.CONFLICT and "accepted" in e.message:
                    self.log.accepted.append(gen)
                else:
                    self._error(e)
                return
            self.inflight = None
            self.log.steps.append(Step(self._now(), "ack:accept", Known.of(s)))
            self.log.accepted.append(gen)
            if applied:
                self.log.duplicates.append(f"{gen}: accepted again after its first accept was applied")
            return
