"""Admission control: which generations the engine's queue takes, and what a refused client is told.

Owns `AdmissionConfig` (the bound), `Admission` (the one policy object of a server, shared by the websocket's
`gen.start` and the HTTP routes, so both wait in the same engine queue under the same bound), `Busy` (a
refusal, rendered as the retryable `busy` error on the websocket and as HTTP 429 with `Retry-After`) and `Admits`
(what the handlers call, `submit_async`: this module's `Admission`, or `canvas.cluster.remote.RemoteAdmission`
when the engine runs as Ray Serve replicas, each with its own `Admission`).

The rule: a request that would wait for more than `max_queue` engine rows to free up before it starts is refused, with
the queue's length, the wait it would have had and when to retry. The queue is `canvas.engine.scheduling.FairQueue`, one
lane per owner (a session, an HTTP client) served round-robin, so a position counts each other owner's next request
before an owner's own second one: when the queue is full, a session's extra requests are the ones refused, never another
session's first. Waits come from what the engine measures (`EngineLoad.release_times`): its step time, how long
generations hold a row, and how far each running row has got. `max_queue` None (the default) sizes the bound from the
same measurements against the wait a request may have (`max_wait_s`, 1 s): it is the number of rows expected to free
up within that wait, so a burst of writers (eight editors asking at once on an eight-row server that is busy) waits
its turn instead of being refused, and only a request that would wait longer is told to come back. Why a second and
not a fraction of a first frame (the bound before issue 47): a client refused has to come back, and the refused ones
measured 2.3 s p50 to their first frame with retries (bench load, 50 sessions), worse than the wait they were spared;
and an estimate near zero refused the ninth of nine writers on a fresh server, and every queued request once the row
cap had fallen. A row whose generation was cancelled counts as free (the engine retires it at its next step, before it
admits anyone): an HTTP response cut early (a stop sequence, a deadline) is answered a step before its row leaves, and
its client's next request must not be refused for that row. The bound follows the load: when steps slow down (a
bigger batch, another process on the cores) it shrinks.

The rows themselves are capped too (`AdmissionConfig.first_frame_slo`, `canvas.engine.scheduling.RowCap`): each request
first lets the cap follow the engine's measured slowdown, a generation's own first frame against what a generation of
its size took alone (`canvas.engine.scheduling.alone_estimate`: per token, from the recent alone first frames nearest
in size, at their 25th percentile; never the single fastest one, which a request with an empty prefix and suffix set
for every later one before issue 47), a row more or less, so that on a few CPU cores a full batch does not slow every
admitted generation's start (bench load, 2 cores: 3.1x the idle first frame at p99 with 8 rows, 2.0x with 4). On a
GPU, where rows cost little, it stays at `max_batch`. The cap recovers by itself: fewer rows side by side run more
first frames alone, which are the baseline. A request that finds no free row under the cap waits or is refused as above.

`retry_after_s` spreads the refused clients out and brings them back in the order they were first refused: the
owners refused lately and not admitted since wait outside in that order, and the k-th of them is told to come back
after about k row releases (at least the releases its own request was short of). Clients told to retry after one
release would come back all at once, the quickest would win every time, and the refusals would spend the cores the
engine needs (a 2-core machine measured ~700 refusals a second that way).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from canvas.engine.scheduling import EngineLoad, Placement, RowCap
from canvas.protocol import ErrorCode, ProtocolError

if TYPE_CHECKING:  # the engine imports torch; ServerConfig imports this module and must stay light
    from canvas.engine.core import Engine, Event, GenHandle, GenRequest


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_queue: int | None = None  # engine rows a request may wait for; None: sized from the measured load
    # The sized bound: rows expected to free up within this wait (seconds; see above). A burst waits its turn.
    max_wait_s: float = 1.0
    cold_queue: int = 8  # the sized bound before the engine has measured anything (a fresh server)
    max_sized_queue: int = 256  # the sized bound never exceeds this, however fast the steps
    contention_s: float = 5.0  # a refused owner keeps its place outside for this long after its last refusal
    max_retry_s: float = 30.0  # the longest retry_after_s given
    # Rows run side by side are capped so a generation's own first frame stays within this many times what one of
    # its size takes alone (`canvas.engine.scheduling.RowCap`); None: always max_batch rows.
    first_frame_slo: float | None = 2.5

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0 or None, got {self.max_queue}")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}")
        if self.cold_queue < 0 or self.max_sized_queue < 1:
            raise ValueError("cold_queue must be >= 0 and max_sized_queue >= 1")
        if not (self.contention_s > 0 and self.max_retry_s > 0):
            raise ValueError("contention_s and max_retry_s must be > 0")
        if self.first_frame_slo is not None and not self.first_frame_slo > 1:
            raise ValueError(f"first_frame_slo must be > 1 or None, got {self.first_frame_slo}")


class Busy(Exception):
    """A request refused because the queue is full: what it would have waited for, and when to try again."""

    def __init__(self, placement: Placement, max_queue: int, est_wait_s: float | None, retry_after_s: float) -> None:
        self.placement, self.max_queue = placement, max_queue
        self.est_wait_s, self.retry_after_s = est_wait_s, retry_after_s
        super().__init__(
            f"the server is busy: {placement.queued} generations are waiting and this one would wait for "
            f"{placement.releases} to finish (at most {max_queue}); retry in {retry_after_s:.1f} s"
        )

    def data(self) -> dict[str, Any]:
        p = self.placement
        return {"queue_length": p.queued, "position": p.position, "max_queue": self.max_queue,
                "est_wait_s": self.est_wait_s, "retry_after_s": self.retry_after_s}

    def protocol_error(self) -> ProtocolError:
        return ProtocolError(ErrorCode.BUSY, str(self), data=self.data())


@dataclass(frozen=True, slots=True)
class Admitted:
    handle: GenHandle
    placement: Placement
    est_wait_s: float | None  # None until the engine has measured its steps


class Admits(Protocol):
    """What the server's handlers use of admission: the local `Admission`, or `canvas.cluster.remote.RemoteAdmission`
    (generations on Ray Serve replicas). `affinity` names what a generation's engine should have cached (the
    document it edits): a remote admission keeps those together on one replica; the local one has one engine."""

    async def submit_async(self, request: GenRequest, on_event: Callable[[Event], None] | None, *, owner: Hashable,
                           replacing: GenHandle | None = None, affinity: str | None = None) -> Admitted: ...

    async def stats_async(self) -> dict[str, Any]:
        """For /health (a remote admission asks its replicas)."""
        ...

    async def aclose(self) -> None:
        """At server shutdown, after every generation was stopped."""


class Admission:
    """The admission policy of one server: `submit` queues a generation or raises `Busy`. Runs on the event loop."""

    def __init__(self, engine: Engine, config: AdmissionConfig | None = None) -> None:
        self.engine = engine
        self.config = config if config is not None else AdmissionConfig()
        self.counts: Counter[str] = Counter()  # admitted, refused
        # Owners refused and not admitted since, in the order of their first refusal -> when last refused.
        self._outside: OrderedDict[Hashable, float] = OrderedDict()
        slo = self.config.first_frame_slo
        self._row_cap = None if slo is None else RowCap(engine.max_batch, slo)

    def bound(self, load: EngineLoad) -> int:
        """The queue's bound now: the configured one, or how many rows are expected to free up within the wait a
        request may have (`max_wait_s`); 0 when none is (every row held by a generation longer than that)."""
        c = self.config
        if c.max_queue is not None:
            return c.max_queue
        times = load.release_times(c.max_sized_queue)
        if times is None:
            return c.cold_queue
        return sum(1 for t in times if t <= c.max_wait_s)

    @staticmethod
    def wait_s(placement: Placement, load: EngineLoad) -> float | None:
        """The estimated wait before the request's first step: until the row it waits for frees up."""
        return _nth_release(load, placement.releases)

    def submit(self, request: GenRequest, on_event: Callable[[Event], None] | None, *, owner: Hashable,
               replacing: GenHandle | None = None) -> Admitted:
        """Queue `request` in `owner`'s lane, or raise `Busy` (and nothing changes)."""
        if self._row_cap is not None:  # first follow the latency the engine measures (a row more or less)
            self.engine.set_row_cap(self._row_cap.update(self.engine.load()))
        load = self.engine.load()  # the measured means; the placement itself is taken under the queue's lock
        bound = self.bound(load)
        seen: list[Placement] = []

        def admit(p: Placement) -> None:
            if p.releases > bound:
                self.counts["refused"] += 1
                rank = self._refused(owner)
                retry = _nth_release(load, min(_MAX_RETRY_RANK, max(p.releases - bound, rank)))
                retry = 1.0 if retry is None else min(self.config.max_retry_s, max(retry, _MIN_RETRY_S))
                raise Busy(p, bound, self.wait_s(p, load), retry)
            seen.append(p)

        handle = self.engine.submit(request, on_event, owner=owner, admit=admit, replacing=replacing)
        self.counts["admitted"] += 1
        self._outside.pop(owner, None)
        return Admitted(handle, seen[0], self.wait_s(seen[0], load))

    async def submit_async(self, request: GenRequest, on_event: Callable[[Event], None] | None, *, owner: Hashable,
                           replacing: GenHandle | None = None, affinity: str | None = None) -> Admitted:
        """`submit`, as `Admits` has it: one engine here, so `affinity` changes nothing."""
        return self.submit(request, on_event, owner=owner, replacing=replacing)

    async def stats_async(self) -> dict[str, Any]:
        return self.stats()

    async def aclose(self) -> None:
        """Nothing to close: the server stops the engine itself."""

    def _refused(self, owner: Hashable) -> int:
        """Note `owner`'s refusal; returns its place among the owners waiting outside (1: refused first)."""
        self._outside[owner] = time.monotonic()  # a new owner joins the end; one refused before keeps its place
        self._forget_gone()
        return list(self._outside).index(owner) + 1

    def _forget_gone(self) -> None:
        """Owners not refused for `contention_s` have stopped trying (or got in through another route)."""
        since = time.monotonic() - self.config.contention_s
        for gone in [o for o, last in self._outside.items() if last < since]:
            del self._outside[gone]

    def stats(self) -> dict[str, Any]:
        """For /health: the queue now, its bound and what admission has decided so far."""
        load = self.engine.load()
        self._forget_gone()
        return {"queued": load.queued, "active": load.active, "max_batch": load.max_batch, "row_cap": load.cap,
                "max_queue": self.bound(load), "step_s": _r4(load.step_s), "gen_steps": _round(load.gen_steps),
                "first_frame_s": _r4(load.first_frame_s), "alone_first_frame_s": _r4(load.alone_first_frame_s),
                "first_frame_slowdown": _round(load.slowdown),
                "admitted": self.counts["admitted"],
                "refused": self.counts["refused"], "refused_waiting": len(self._outside)}


_MAX_RETRY_RANK = 512  # the retry hint of the 600th owner outside is that of the 512th: beyond, it is a guess anyway
_MIN_RETRY_S = 0.01  # a release due within this is as good as now; a 0 s hint would invite a busy loop


def _nth_release(load: EngineLoad, n: int) -> float | None:
    """When the n-th row from now frees up (0: now), in seconds rounded to the millisecond; None until measured."""
    times = load.release_times(n)
    if times is None:
        return None
    return round(times[n - 1], 3) if n > 0 else 0.0


def _r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)
