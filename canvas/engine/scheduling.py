"""The engine's waiting room: the fair queue that requests wait in for a row, and the load the engine measures.

Owns `FairQueue`, one FIFO lane per owner (a websocket session, an HTTP client) with rows handed out round-robin
across lanes: each turn serves the lane at the head of the rotation and sends it to the back. An owner's second
request therefore waits behind every other owner's first, so a session that floods the queue or keeps re-issuing
generations delays itself, never the others. `Placement` is where a new request would land (its position counts
the requests that will be served before it), `LoadStats` what the engine measures of itself (step time, steps per
generation, a generation's own first-frame time, the first frames of generations that ran alone, each with its
size) and `EngineLoad` a snapshot of both, from which admission control (`canvas.server.admission`) estimates waits,
and `RowCap` the rows run side by side.

Invariants: an item is in at most one lane; a lane in the rotation is never empty; positions are exact for the
queue as it stands (a later owner's first request may still overtake an earlier owner's second: that is the
fairness). Nothing here is thread-safe: the engine guards its queue and stats with its lock.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request would wait: `position` requests are served before it; `free_rows` engine rows are free now
    (the first `free_rows` in line start at the next engine step); `queued` requests are waiting in all."""

    position: int
    free_rows: int
    queued: int
    owners: int  # lanes waiting, this owner's included when it has one

    @property
    def releases(self) -> int:
        """Rows that must free up before this request starts (0: it starts at the next engine step)."""
        return max(0, self.position - self.free_rows + 1)


class FairQueue(Generic[T]):
    """Per-owner FIFO lanes served round-robin (see the module docstring)."""

    def __init__(self) -> None:
        self._lanes: OrderedDict[Hashable, deque[T]] = OrderedDict()  # rotation order: the head is served next
        self._owner: dict[T, Hashable] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, item: object) -> bool:
        return item in self._owner

    @property
    def owners(self) -> int:
        return len(self._lanes)

    def position(self, owner: Hashable, without: T | None = None) -> int:
        """The position a new request of `owner` would get (0: served next), as if `without` had left the queue.

        With the owner's lane at rotation index r holding d requests, the new one is its lane's (d+1)-th: lanes
        before r are served d+1 times before it, lanes after r d times, and a new lane joins the rotation's end."""
        gone = self._owner.get(without) if without is not None else None
        lens = [(o, len(lane) - (o == gone)) for o, lane in self._lanes.items()]
        lens = [(o, n) for o, n in lens if n > 0]
        owners = [o for o, _ in lens]
        r = owners.index(owner) if owner in owners else len(owners)
        d = lens[r][1] if r < len(lens) else 0
        return d + sum(min(n, d + 1) for _, n in lens[:r]) + sum(min(n, d) for _, n in lens[r + 1 :])

    def push(self, owner: Hashable, item: T) -> int:
        """Queue `item` at the back of `owner`'s lane; returns its position."""
        if item in self._owner:
            raise ValueError("the item is already queued")
        pos = self.position(owner)
        self._lanes.setdefault(owner, deque()).append(item)
        self._owner[item] = owner
        return pos

    def pop(self) -> T | None:
        """The next item in round-robin order, or None when the queue is empty."""
        if not self._lanes:
            return None
        owner, lane = next(iter(self._lanes.items()))
        item = lane.popleft()
        del self._owner[item]
        if lane:
            self._lanes.move_to_end(owner)
        else:
            del self._lanes[owner]
        return item

    def remove(self, item: T) -> bool:
        """Take `item` out wherever it waits (a cancelled request leaves at once); False if it is not queued."""
        owner = self._owner.pop(item, None)
        if owner is None:
            return False
        lane = self._lanes[owner]
        lane.remove(item)
        if not lane:
            del self._lanes[owner]
        return True

    def order(self) -> list[T]:
        """Every queued item in the order `pop` would serve them (for tests and diagnostics)."""
        lanes = [(o, list(q)) for o, q in self._lanes.items()]
        out: list[T] = []
        while lanes:
            owner, lane = lanes.pop(0)
            out.append(lane.pop(0))
            if lane:
                lanes.append((owner, lane))
        return out


class _Ewma:
    """An exponentially weighted mean (None until the first sample): recent load counts most."""

    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


class LoadStats:
    """What the engine measures of its own work, for wait estimates and the row cap.

    A first frame is measured with its generation's size (`add_first_frame`): the tokens the model ran for it before
    that frame, as if it had run alone (the context it encoded, 0 when cached, plus its own slots at each step; an AR
    row's drafting lanes and once its window). The first frames of generations that ran alone (no other row in the
    engine at any of their steps up to it) are kept with their sizes: `alone_estimate` is what a generation of a given
    size takes alone. `slowdown` follows how much longer than that the generations just measured took."""

    def __init__(self, keep: int = 128) -> None:
        self.step_s = _Ewma()  # wall time of an engine step that ran rows (admission and encoding included)
        self.first_frame_s = _Ewma()  # a generation's own first-frame time: from leaving the queue to its first frame
        self.alone: deque[tuple[float, float]] = deque(maxlen=keep // 2)  # (size, first frame s) of the last alone
        self.sizes: deque[float] = deque(maxlen=keep // 2)  # sizes of the last first frames (alone or not)
        self.slowdown = _Ewma()  # own first frame / `alone_estimate` of its size
        self.first_frames = 0  # first frames measured so far (a clock for `RowCap`)
        self.gen_steps: deque[int] = deque(maxlen=keep)  # steps of the last rows to leave (done, cancelled, failed)

    def add_first_frame(self, seconds: float, size: float, *, alone: bool) -> None:
        """A generation's own first frame took `seconds` for `size` tokens; `alone`: no other row ran beside it."""
        size = max(1.0, size)
        self.first_frame_s.add(seconds)
        self.first_frames += 1
        self.sizes.append(size)
        if alone:
            self.alone.append((size, seconds))
        expected = alone_estimate(self.alone, size)
        if expected is not None and expected > 0:
            self.slowdown.add(seconds / expected)

    def alone_first_frame_s(self) -> float | None:
        """What a generation of the recent median size takes alone (for /health); None until one ran alone."""
        if not self.sizes:
            return None
        return alone_estimate(self.alone, sorted(self.sizes)[len(self.sizes) // 2])


ALONE_NEAREST = 32  # alone samples, nearest in size (the newest among equals), that an estimate reads
ALONE_QUANTILE = 0.25  # of their seconds per token


def alone_estimate(samples: Iterable[tuple[float, float]], size: float, *, nearest: int = ALONE_NEAREST,
                   q: float = ALONE_QUANTILE) -> float | None:
    """The first frame a generation of `size` tokens is expected to have alone: `size` x the `q`-quantile of the
    seconds per token of the `nearest` samples (size, seconds) closest to it in size (by ratio); None without any.

    Why per token and nearest in size: a first frame grows with the context encoded and the slots stepped, and a
    step has a fixed cost too, so a tiny request (an empty prefix and suffix: a few ms) says nothing of what a
    fill of a 200-token window takes. Why a low quantile and not the minimum: one row alone can be slowed (the event
    loop busy with frames of rows that just finished, another process), rarely sped up, so the faster samples are
    the undisturbed ones; but the minimum is a single sample, and one lucky or odd request would set the baseline
    for every later one (issue 47: one 21 ms first frame made every fill read as over the SLO; the cap fell to 1)."""
    size = max(1.0, size)
    ranked = sorted(enumerate(samples), key=lambda s: (abs(math.log(max(1.0, s[1][0]) / size)), -s[0]))
    if not ranked:
        return None
    per_token = sorted(t / max(1.0, n) for _, (n, t) in ranked[:nearest])
    return size * per_token[int(q * (len(per_token) - 1))]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A snapshot of the engine's load: rows, queue, and what it has measured (None until measured)."""

    max_batch: int
    active: int  # rows taken (running, or leaving the queue right now)
    queued: int
    step_s: float | None
    first_frame_s: float | None
    recent_steps: tuple[int, ...] = ()  # steps of the last generations to leave their rows
    rows: tuple[tuple[int, int], ...] = ()  # per running row after the last step: (steps run, most steps left)
    row_cap: int | None = None  # rows the engine runs side by side now (None: max_batch; see `RowCap`)
    alone_first_frame_s: float | None = None  # `LoadStats.alone_first_frame_s`
    first_frames: int = 0
    slowdown: float | None = None  # recent own first frames / their alone estimates (an EWMA; `RowCap` reads it)

    @property
    def cap(self) -> int:
        return self.max_batch if self.row_cap is None else self.row_cap

    @property
    def gen_steps(self) -> float | None:
        """Mean steps a generation holds its row (the recent ones)."""
        return sum(self.recent_steps) / len(self.recent_steps) if self.recent_steps else None

    def steps_left(self, done: int, left: int) -> float:
        """Expected steps a row that has run `done` and may run `left` more still runs: the mean over the recent
        generations that ran past `done` (each cut at `done + left`), less `done`; at least one, at most `left`.
        Conditioning matters: a row that is already past the mean is a long one, not one about to stop."""
        longer = [min(t, done + left) for t in self.recent_steps if t > done]
        expected = sum(longer) / len(longer) - done if longer else float(left)
        return max(1.0, min(float(left), expected))

    def release_times(self, n: int) -> list[float] | None:
        """When the next `n` rows will free up, in seconds from now, earliest first (None until steps are measured).

        Each running row frees up after its expected steps left (`steps_left`); the generation that takes its row,
        like one taking a row that is free now, holds it for the mean. Rows join and leave together, so releases
        come in bursts: this schedule, not the mean interval `release_s`, is what a request in the queue waits."""
        if self.step_s is None or self.gen_steps is None:
            return None
        mean = max(1.0, self.gen_steps)
        firsts = [self.steps_left(done, left) for done, left in self.rows]
        firsts += [mean] * max(0, self.cap - len(firsts))  # free rows: taken now, released after the mean
        steps = sorted(first + k * mean for first in firsts for k in range(max(0, n)))[:n]
        return [t * self.step_s for t in steps]

    @property
    def release_s(self) -> float | None:
        """Mean time between two rows freeing up with every row busy: a row lasts gen_steps steps, and `cap` of them
        run side by side."""
        if self.step_s is None or self.gen_steps is None:
            return None
        return self.gen_steps * self.step_s / self.cap


class RowCap:
    """How many rows the engine may run side by side so that a generation's own first frame stays within `slo` times
    what a generation of its size takes alone (`EngineLoad.slowdown`, against `alone_estimate`).

    Why a cap below `max_batch`: on a few CPU cores a bigger batch buys throughput with latency. The engine's thread,
    the event loop that turns frames into messages and (in a bench) the clients share the cores, so each row more
    slows every step and every frame: bench load on 2 cores, 50 sessions, admitted p99 first frame 2.0x the idle one
    with 4 rows, 3.1x with 8, 6.2x with 16 (BENCHMARKS.md). On a GPU a bigger batch costs little and the cap stays at
    `max_batch`. The measure is the engine's own, so the cap follows whatever slows it (the model, the cores,
    another process).

    The rule, checked on each new request: when the measured slowdown (an EWMA) is above `slo`, one row less; when
    it is below `relax` x `slo`, one row more, up to `max_batch`. After a change the cap holds until `settle` more
    first frames are measured, so the EWMA has moved before it is read again (alpha 0.2: five samples move it two
    thirds of the way). Until a first frame alone has been measured it is `max_batch`. It recovers by itself: the
    fewer rows run together, the more first frames run alone, and those are the slowdown's own baseline (a window of
    recent ones, never one fastest sample), so a cap cut too far measures a slowdown near 1 and grows again.
    """

    def __init__(self, max_batch: int, slo: float, *, relax: float = 0.7, settle: int = 5) -> None:
        if max_batch < 1 or not slo > 1 or not 0 < relax < 1 or settle < 1:
            raise ValueError("RowCap needs max_batch >= 1, slo > 1, 0 < relax < 1 and settle >= 1")
        self.max_batch, self.slo, self.relax, self.settle = max_batch, slo, relax, settle
        self.cap = max_batch
        self._changed_at = 0  # `first_frames` when the cap last changed

    def update(self, load: EngineLoad) -> int:
        """The cap for `load`: changed by at most one row, and only once `settle` first frames followed the last
        change."""
        slowdown = load.slowdown
        if slowdown is None or load.first_frames < self._changed_at + self.settle:
            return self.cap
        if slowdown > self.slo and self.cap > 1:
            self.cap -= 1
        elif slowdown < self.relax * self.slo and self.cap < self.max_batch:
            self.cap += 1
        else:
            return self.cap
        self._changed_at = load.first_frames
        return self.cap
