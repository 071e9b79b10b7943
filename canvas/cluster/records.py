"""What an engine replica's `generate` stream says before its events: the generation was taken, or why not.

A replica's stream yields exactly one of these first, then (after `Accepted` only) the generation's `Frame`s and one
`Done` (`canvas.engine.types`), in tuples (`coalesce`). Frozen, picklable values and no Ray import, so the ingress side
(`canvas.cluster.remote`) and its unit tests read them without Ray installed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from canvas.engine.scheduling import Placement
from canvas.engine.types import Event, Frame, GenRequest


@dataclass(frozen=True, slots=True)
class Accepted:
    """Queued in the replica's engine: `gen_id` is the engine's id of it, unique on that replica."""

    replica: str
    gen_id: int
    placement: Placement
    est_wait_s: float | None


@dataclass(frozen=True, slots=True)
class Refused:
    """The replica's admission refused it (`canvas.server.admission.Busy`, field for field)."""

    replica: str
    placement: Placement
    max_queue: int
    est_wait_s: float | None
    retry_after_s: float
    message: str


@dataclass(frozen=True, slots=True)
class Invalid:
    """The request itself is wrong (`GenRequest.validate`): it fails on every replica alike."""

    message: str


@dataclass(frozen=True, slots=True)
class EngineRef:
    """A generation on a replica, for `replacing`: only that replica can take it out of its queue."""

    replica: str
    gen_id: int


First = Accepted | Refused | Invalid


def coalesce(batch: list[Event]) -> tuple[Event, ...]:
    """The events that arrived together, as one stream item (each item costs a Ray round of serialisation): a frame
    followed by a newer frame of the same canvas is dropped, as the ingress's outbox would merge it anyway; the last
    frame of each canvas stays (`canvas.server.http.textrun` reads a canvas's committed draft from it)."""
    kept = [ev for ev, nxt in zip(batch, batch[1:], strict=False)
            if not (isinstance(ev, Frame) and isinstance(nxt, Frame) and nxt.canvas_index == ev.canvas_index)]
    return (*kept, batch[-1])


def fingerprint(request: GenRequest) -> str:
    """What version of its document a generation serves, as far as an engine can tell: a short hash of the text
    around the canvas and the canvas's pinned slots. Two generations of one document with different fingerprints
    were started on different versions of it (`dcanvas bench soak` checks no two replicas serve those at once)."""
    key = repr((request.context_ids, request.slot_ids, request.pinned)).encode()
    return hashlib.blake2b(key, digest_size=6).hexdigest()
