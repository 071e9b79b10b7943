"""What a generation is, seen from outside the engine: the request, its events and its handle.

Owns `GenRequest` (token ids and sampler settings only: the engine knows nothing of documents or text), the events
a request's callback receives (`Frame` every `stream_every` steps, exactly one `Done`), and `GenHandle` (cancel a
generation or wait for its `Done`). Everything here but the handle is a frozen, picklable value, so a request and its
events can cross a process boundary unchanged (an engine replica in another process sends them back as they are).

A frame of an AR row says which slots are written (`Frame.written`): the rest still hold noise, and whoever shows a
frame (text, slots) shows only written slots as text.

Invariants: a handle emits exactly one `Done`, after every `Frame`; `cancel()` is idempotent and may come from any
thread; a request cancelled while it waits in the engine's queue gets its `Done` from the cancelling thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from canvas.sampling.sampler import SamplerConfig

# "unavailable": the engine replica running it died (`canvas.cluster.remote`); a local engine never says it.
Status = Literal["completed", "cancelled", "failed", "unavailable"]
# What wrote a generation's text: the diffusion decoder, the plain left-to-right AR fill, or AR drafts chosen by how
# well they lead into the text after a gap ("ar-infill", at least one gap so filled).
Writer = Literal["diffusion", "ar", "ar-infill"]


@dataclass(frozen=True, slots=True)
class GenRequest:
    context_ids: tuple[int, ...]  # tokens before the canvas, at least one (a BOS for an empty document)
    # The canvas slots in use: pinned ones keep their token, the others are generated. With fewer than
    # canvas_length slots, the rest of the canvas is unused: hidden from attention and never accepted. An empty
    # tuple means a whole free canvas (continue the text).
    slot_ids: tuple[int, ...] = ()
    pinned: tuple[bool, ...] = ()  # one per slot_ids entry: keep this token
    config: SamplerConfig = field(default_factory=SamplerConfig)
    n_canvases: int = 1  # continuation: later canvases are all free and follow the committed one
    stream_every: int = 1
    # A rewrite: per gap (run of free slots, in order), the ids of the text it replaces; AR mode offers a fill equal
    # to it only when no other candidate exists. Empty: nothing to avoid.
    avoid: tuple[tuple[int, ...], ...] = ()

    def validate(self, canvas_length: int, vocab_size: int) -> None:
        if not self.context_ids:
            raise ValueError("context_ids must hold at least one token (prepend BOS for an empty document)")
        if len(self.slot_ids) > canvas_length:
            raise ValueError(f"{len(self.slot_ids)} slots exceed the canvas length {canvas_length}")
        if len(self.pinned) != len(self.slot_ids):
            raise ValueError(f"pinned has {len(self.pinned)} entries for {len(self.slot_ids)} slots")
        bad = [t for t in (*self.context_ids, *self.slot_ids) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if self.n_canvases < 1 or self.stream_every < 1:
            raise ValueError("n_canvases and stream_every must be >= 1")


@dataclass(frozen=True, slots=True)
class Drafts:
    """An AR infill's K drafts of one gap side by side (`canvas.engine.ar`): the gap being drafted, or, once it is
    scored, the last gap with the draft chosen. Whole state, not a delta: the newest frame's drafts stand."""

    start: int  # the gap's canvas slots [start, end)
    end: int
    tokens: tuple[tuple[int, ...], ...]  # (K, n) each draft's tokens so far (all drafts grow together)
    lead: int  # the draft the frame's canvas shows while they grow: the likeliest so far
    chosen: int | None = None  # once scored: the draft written into the gap...
    length: int = 0  # ...and how many of its tokens were kept (the rest of the gap became <null>)
    # (K, n) each draft token's log-probability in the drafting frame (temperature 1, before bans), for a client's
    # own choice among the drafts (`canvas.server.http.draft_ends.early_end`); None where not recorded.
    logp: tuple[tuple[float, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class Frame:
    gen_id: int
    canvas_index: int
    step: int
    max_steps: int
    draft: tuple[int, ...]  # (L,) argmax canvas, pins forced
    accepted: tuple[bool, ...]  # (L,) accepted by the sampler this step
    entropy: tuple[float, ...]  # (L,) nats; 0 for pinned slots
    elapsed_s: float
    drafts: Drafts | None = None  # AR infills with more than one draft: all of them (None otherwise)
    # (L,) AR rows: True where the slot holds a pin or a token the model wrote (the leading draft's tokens so far
    # count); a False slot still holds the canvas's initial noise and is no text. None: a diffusion row, whose every
    # slot shows its current sample.
    written: tuple[bool, ...] | None = None
    # Context tokens whose encoder cache the engine reused for this request; for a context deferred until read (a
    # FIM infill, `Engine(lazy_context=True)`) and not read yet, the tokens the cache holds of it (not to encode).
    cached_tokens: int = 0
    # Seconds the engine spent encoding the request's context: at admission, or, deferred, when it was first read.
    prompt_s: float = 0.0
    # An AR row's FIM prompts (`canvas.engine.ar`; every FIM gap's so far, summed): their tokens, how many of those
    # the engine's cache restored instead of encoding, and the seconds their prefills took. All 0 until a FIM gap
    # starts, and in a row that drafts none (diffusion, the plain AR fill).
    fim_prompt_tokens: int = 0
    fim_cached_tokens: int = 0
    fim_prompt_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Done:
    gen_id: int
    status: Status
    canvases: tuple[tuple[int, ...], ...]  # committed slot ids per canvas (continuations cut after EOS)
    steps: int
    forwards: int
    generated: int  # free slots filled
    wall_s: float
    error: str | None = None
    mode: Writer | None = None  # None: not run (cancelled while queued) or from an engine that predates the field
    cached_tokens: int = 0  # as `Frame.cached_tokens`
    prompt_s: float = 0.0  # as `Frame.prompt_s`
    fim_prompt_tokens: int = 0  # as `Frame.fim_prompt_tokens`, and the two after it
    fim_cached_tokens: int = 0
    fim_prompt_s: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.forwards if self.forwards else 0.0

    @property
    def tok_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0


Event = Frame | Done


def cancelled_done(handle: GenHandle) -> Done:
    """The `Done` of a request cancelled before it ran a step."""
    return Done(handle.id, "cancelled", (), 0, 0, 0, 0.0)


class GenHandle:
    """A submitted generation: cancel it, or wait for its `Done`. `position` is where it joined the queue."""

    def __init__(self, gen_id: int, on_event: Callable[[Event], None] | None, request: GenRequest | None = None,
                 withdraw: Callable[[GenHandle], None] | None = None) -> None:
        self.id = gen_id
        self.request = request
        self._on_event = on_event
        self._withdraw = withdraw  # takes it out of the engine's queue if it still waits there
        self._cancel = threading.Event()
        self._done = threading.Event()
        self.result: Done | None = None
        self.frames = 0
        self.position = 0

    def cancel(self) -> None:
        """Stop it: a queued request leaves the queue now (and gets its `Done`), a running one between steps."""
        self._cancel.set()
        if self._withdraw is not None:
            self._withdraw(self)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> Done:
        if not self._done.wait(timeout):
            raise TimeoutError(f"generation {self.id} did not finish within {timeout} s")
        assert self.result is not None
        return self.result

    def end_cancelled(self) -> None:
        """Mark it cancelled and send the `Done` of a request that never ran a step (`cancelled_done`): for whoever
        took it out of a queue without `cancel()` (an engine replacing it with its successor), or found it cancelled
        there (withdrawn, or cancelled while being admitted)."""
        self._cancel.set()
        self.emit(cancelled_done(self))

    def emit(self, event: Event) -> None:
        """Deliver `event` to the request's callback, on the thread of whoever runs the request (the engine's, or a
        cluster replica's stream pump): a `Frame` is counted in `frames`; the `Done`, sent exactly once, becomes
        `result` and wakes `wait`."""
        if isinstance(event, Done):
            self.result = event
        else:
            self.frames += 1
        if self._on_event is not None:
            self._on_event(event)
        if isinstance(event, Done):
            self._done.set()
