"""One connection's outgoing frames: ordered replies and events, with progress frames merged latest-wins.

Owns the only task that writes to a websocket. Producers (the session's reader, generation tasks, document
broadcasts) never wait on the socket: `put` and `progress` return at once, so a slow client cannot stall the
engine. Invariants:
- Replies and events are sent in the order they were put; none is dropped. A client that lets more than
  `max_queued` of them pile up is too slow to serve and gets `SlowConsumer` (the session then closes it).
- Progress of one generation occupies at most one place in the queue: a frame that arrives while an earlier one is
  still waiting is merged into it (per slot, the newest value wins; counters come from the newest frame, and
  `merged` counts the engine frames folded in). So deltas stay exact and the client never needs a resync.
- Progress goes out at most `max_fps` times a second per connection; frames that come faster are merged.
- A generation's `gen.done` is put after its last progress, so it is sent after that progress (queue order).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from canvas.protocol import GenDone, GenDrafts, GenProgress, ServerReply, SlotUpdate, dump


class SlowConsumer(Exception):
    """The client reads too slowly: too many frames are queued for it."""


@dataclass
class _Progress:
    re: str | int | None
    step: int
    max_steps: int
    accepted: int
    free: int
    elapsed_s: float
    slots: dict[int, SlotUpdate] = field(default_factory=dict)
    merged: int = 1
    drafts: GenDrafts | None = None


_STOP = object()


class Outbox:
    def __init__(
        self,
        send: Callable[[str], Awaitable[None]],
        *,
        max_fps: float = 30.0,
        max_queued: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self._interval = 1.0 / max_fps
        self._max_queued = max_queued
        self._clock = clock
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._pending: dict[str, _Progress] = {}  # gen -> merged progress waiting in the queue
        self._seq: dict[str, int] = {}  # gen -> progress frames sent
        self._last_progress = float("-inf")
        self._closed = False
        self.frames_sent = 0
        self.progress_sent = 0
        self.progress_merged = 0  # engine frames that were folded into another frame

    def put(self, msg: ServerReply) -> None:
        """Queue a reply or event. Raises `SlowConsumer` when the client has fallen too far behind."""
        if self._closed:
            return
        if self._queue.qsize() >= self._max_queued:
            raise SlowConsumer(f"{self._queue.qsize()} frames are waiting for this client")
        self._queue.put_nowait(msg)

    def progress(
        self,
        gen: str,
        *,
        re: str | int | None,
        step: int,
        max_steps: int,
        slots: Iterable[SlotUpdate],
        accepted: int,
        free: int,
        elapsed_s: float,
        drafts: GenDrafts | None = None,
    ) -> None:
        """Queue (or merge into the queued) progress of generation `gen`. `drafts` is whole state: the newest given
        stands (a frame without drafts keeps the queued frame's)."""
        if self._closed:
            return
        waiting = self._pending.get(gen)
        if waiting is None:
            waiting = self._pending[gen] = _Progress(re, step, max_steps, accepted, free, elapsed_s, merged=0)
            self._queue.put_nowait(("progress", gen))
        else:
            self.progress_merged += 1
        waiting.step, waiting.max_steps, waiting.accepted, waiting.free = step, max_steps, accepted, free
        waiting.elapsed_s = elapsed_s
        waiting.merged += 1
        if drafts is not None:
            waiting.drafts = drafts
        for s in slots:
            waiting.slots[s.i] = s

    def close(self) -> None:
        """Stop after the frames already queued (`run` then returns)."""
        if not self._closed:
            self._closed = True
            self._queue.put_nowait(_STOP)

    async def run(self) -> None:
        """Send until `close`. Exceptions from `send` (a dead socket) propagate to the caller."""
        while True:
            item = await self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, tuple):
                await self._send_progress(item[1])
            else:
                assert isinstance(item, ServerReply)
                if isinstance(item, GenDone):
                    self._seq.pop(item.gen, None)
                await self._send(dump(item))
                self.frames_sent += 1

    async def _send_progress(self, gen: str) -> None:
        wait = self._last_progress + self._interval - self._clock()
        if wait > 0:
            await asyncio.sleep(wait)  # frames arriving meanwhile merge into the waiting one
        p = self._pending.pop(gen)
        seq = self._seq.get(gen, 0) + 1
        self._seq[gen] = seq
        msg = GenProgress(
            re=p.re,
            gen=gen,
            seq=seq,
            step=p.step,
            max_steps=p.max_steps,
            slots=[p.slots[i] for i in sorted(p.slots)],
            accepted=p.accepted,
            free=p.free,
            merged=p.merged,
            elapsed_s=round(p.elapsed_s, 4),
            drafts=p.drafts,
        )
        self._last_progress = self._clock()
        await self._send(dump(msg))
        self.frames_sent += 1
        self.progress_sent += 1
