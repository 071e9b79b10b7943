"""`TextRun`: the `n` engine generations of one HTTP request, as an async stream of per-choice text events.

Every choice is one `GenRequest` submitted to the server's engine through `submit` (the server's admission
control, so HTTP requests queue and batch with the websocket sessions' generations; a refusal raises out of `start`,
and the caller closes the run, which takes the choices already queued out of the queue). The engine's events cross
from its thread with `call_soon_threadsafe`; `events()` drains what has arrived, feeds each committed canvas to the
choice's `TextReader` and yields:
- `Delta`: text that has become final (a committed canvas, less what may still start a stop sequence or be a
  word that a later cut takes back);
- `Draft`: the choice's text if it were settled at the current canvas now (only the slots the model has written:
  an AR frame's unwritten slots still hold noise), with its step (latest wins: frames that arrive together give one
  draft), for clients that show the canvas converging;
- `Finish`: the choice is over (its reason, the whole text, token counts, timings).

A canvas is final when the engine commits it: a frame of a later canvas means the previous canvas is committed,
and it is the draft of that canvas's last frame (the engine always emits the frame of the step that stops a
canvas, and commits exactly that argmax); the last canvases come from `Done`. A choice ended early (a stop
sequence, `settle`, or an AR row whose drafts have all reached their end: `draft_ends.early_end`) has its engine
generation cancelled (`settle` takes, of an AR infill's side-by-side drafts, the best-scored whole one written so
far: `draft_ends.deadline_end`); `close()` cancels whatever is still running, which is what
a client that goes away triggers. However a choice ends, its text holds only what the model wrote (`TextReader`):
a settled draft is read up to its first unwritten slot and cut back to a word, and deltas never run ahead of what
a later cut could take back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from canvas.engine.backend import Backend
from canvas.engine.core import Done, Frame, GenHandle, GenRequest
from canvas.server.http.draft_ends import EarlyEnd, deadline_end, early_end, fim_end_id
from canvas.server.http.textgen import End, Plan, TextReader, TextTask


class GenerationFailed(Exception):
    """The engine failed a choice's generation (or stopped without being asked to). `retryable`: its engine went away
    (a Ray Serve replica died, status `unavailable`); the same request may succeed now on another."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable

    def refusal_status(self) -> int:
        """The HTTP status of a response that had not started: 503 (retry) or 500."""
        return 503 if self.retryable else 500


@dataclass(frozen=True, slots=True)
class Delta:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class Draft:
    index: int
    text: str
    step: int
    max_steps: int
    canvas: int
    ended: bool = False  # the text has reached where it ends (a cut rule or a stop string): settling takes it whole


@dataclass(frozen=True, slots=True)
class Finish:
    index: int
    reason: End
    text: str
    tokens: int  # generated tokens in `text`
    stop_word: str | None
    steps: int
    queued_s: float  # from submission to the row's start: the wait in the engine's queue and the context's encoding
    wall_s: float  # from the row's start to the end
    # The prompt's processing, alone. An AR infill drafted from FIM prompts (`fim_tokens` > 0): their prefills, as the
    # engine timed them (the plain context, deferred until the seam's scoring reads it, is part of choosing a draft).
    # Otherwise: the engine's encoding of the context (0-ish when its cache was reused) and, for an AR infill, the
    # time to its first frame (the pinned text before the gap prefilled, and the drafts' first step) and a deferred
    # context encoded after it.
    prompt_s: float = 0.0
    # The prompt's tokens the engine's cache restored instead of encoding (the newest report): of the FIM prompts
    # where there are any, else of the context.
    cached_tokens: int = 0
    prefill_s: float = 0.0  # the part of `wall_s` that `prompt_s` counts: `wall_s - prefill_s` is the drafting
    fim_tokens: int = 0  # the FIM prompts' tokens (`Frame.fim_prompt_tokens`); 0: none, the prompt is the context


Event = Delta | Draft | Finish
# How a run puts one choice's request in the engine's queue (the server's admission control; it may raise).
Submit = Callable[[GenRequest, Callable[[Frame | Done], None]], Awaitable[GenHandle]]


class _Choice:
    def __init__(self, index: int, reader: TextReader, submitted: float) -> None:
        self.index, self.reader, self.submitted = index, reader, submitted
        self.handle: GenHandle | None = None
        self.last: Frame | None = None  # the newest frame of the current canvas
        self.fresh = False  # a frame arrived since the last draft
        self.first_frame: float | None = None
        self.prompt_s = 0.0  # from the engine's events: the newest (a deferred context's encode adds to it)
        self.cached_tokens = 0
        self.encoded_s = 0.0  # `prompt_s` as the first frame reported it: encoded before the row started
        self.lead_s = 0.0  # an AR infill: from the row's start to its first frame (its prompt's prefill)
        self.fim: tuple[int, int, float] = (0, 0, 0.0)  # the FIM prompts' tokens, cached tokens, prefill seconds
        self.sent = 0  # characters of text yielded as deltas
        self.steps = 0
        self.finished = False


class TextRun:
    def __init__(self, backend: Backend, plan: Plan, task: TextTask, submit: Submit | None = None) -> None:
        self.backend, self.plan, self.task = backend, plan, task
        self._submit: Submit = submit if submit is not None else self._on_engine
        self.queue: asyncio.Queue[tuple[int, Frame | Done]] = asyncio.Queue()
        self.choices: list[_Choice] = []
        self._settle: set[int] = set()
        self._fim_end = fim_end_id(backend.tokenizer.token_id)  # what ends an AR infill's draft on its own

    async def _on_engine(self, request: GenRequest, deliver: Callable[[Frame | Done], None]) -> GenHandle:
        return self.backend.engine.submit(request, deliver)  # no admission control: straight into the engine

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        for i in range(self.task.n):
            seed = self.task.seed + i if self.task.seed is not None else secrets.randbits(63)
            choice = _Choice(i, TextReader(self.backend, self.plan, self.task), now)
            self.choices.append(choice)
            request = dataclasses.replace(self.plan.request, config=dataclasses.replace(self.plan.request.config,
                                                                                        seed=seed))

            def deliver(ev: Frame | Done, i: int = i) -> None:  # on the engine's thread (or ours: a queued cancel)
                try:
                    loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))
                except RuntimeError:  # the event loop is gone (shutting down): nobody is listening
                    pass

            choice.handle = await self._submit(request, deliver)

    def close(self) -> None:
        """Cancel every generation still running (idempotent)."""
        for c in self.choices:
            if c.handle is not None and not c.finished:
                c.handle.cancel()

    def settle(self, index: int) -> None:
        """End choice `index` at its current draft (a time limit ran out): what the model has written of it is taken
        as committed, cut back to a word boundary where the text goes on (`TextReader.feed`)."""
        self._settle.add(index)

    @property
    def running(self) -> bool:
        return any(not c.finished for c in self.choices)

    async def events(self, drafts: bool = True) -> AsyncGenerator[Event, None]:
        """Every choice's events until all have finished; raises GenerationFailed. `drafts=False`: the caller reads
        no `Draft`, so none is made; where no early end can come of them either (the task has no cut rule and no
        stop sequence: `draft_ends.early_end` ends nothing then), frames are not read as text at all until their canvas
        is committed (a probe decodes the whole canvas's written text again, once a frame). The deltas and the
        finish are the same either way: a probe reads a copy of the reader."""
        probe_frames = drafts or self.task.cut is not None or bool(self.task.stop)
        try:
            while self.running:
                if not self._settle:
                    item = await self.queue.get()
                    batch = [item]
                else:
                    batch = []
                while not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                for i, ev in batch:
                    for out in self._on_event(self.choices[i], ev):
                        yield out
                for i in sorted(self._settle):
                    for out in self._settle_now(self.choices[i]):
                        yield out
                self._settle.clear()
                for c in self.choices if probe_frames else ():
                    if c.fresh and not c.finished and c.last is not None:
                        c.fresh = False
                        probe = c.reader.probe(c.last.draft, c.last.written)
                        end = self._early_end(c, probe)
                        if end is not None:  # every draft has reached its end: the rest would be cut anyway
                            for out in self._commit(c, end[0], last=True, settled=end[2], written=end[1]):
                                yield out
                            continue
                        if drafts:
                            yield Draft(c.index, probe.text, c.last.step, c.last.max_steps, c.last.canvas_index,
                                        probe.reason in ("rule", "word"))
        finally:
            self.close()

    # -- one engine event ----------------------------------------------------------------------------------------

    def _on_event(self, c: _Choice, ev: Frame | Done) -> list[Event]:
        if c.finished:
            return []
        out: list[Event] = []
        if isinstance(ev, Frame):
            if c.first_frame is None:
                c.first_frame = time.perf_counter() - ev.elapsed_s
                c.encoded_s = ev.prompt_s
                # An AR row's first frame comes after its prompt's prefill (the pinned text before the gap, or the
                # FIM prompt, which the engine encodes as the walk starts) and one drafting step.
                c.lead_s = ev.elapsed_s if ev.written is not None and self.plan.infill else 0.0
            c.prompt_s, c.cached_tokens = ev.prompt_s, ev.cached_tokens  # a deferred context, once read, adds
            c.fim = (ev.fim_prompt_tokens, ev.fim_cached_tokens, ev.fim_prompt_s)
            if c.last is not None and ev.canvas_index > c.last.canvas_index:  # the previous canvas's stopping frame
                out += self._commit(c, c.last.draft, last=False, written=c.last.written)
            c.last, c.fresh = ev, True
            c.steps += 1
            return out
        if ev.status != "completed":
            c.finished = True
            raise GenerationFailed(ev.error or f"the generation was {ev.status}", retryable=ev.status == "unavailable")
        c.steps = ev.steps
        if c.first_frame is None:
            c.encoded_s = ev.prompt_s
        c.prompt_s, c.cached_tokens = ev.prompt_s, ev.cached_tokens
        c.fim = (ev.fim_prompt_tokens, ev.fim_cached_tokens, ev.fim_prompt_s)
        fed = c.reader.canvases
        for k in range(fed, len(ev.canvases)):
            out += self._commit(c, ev.canvases[k], last=k == len(ev.canvases) - 1)
        if not c.finished:  # the engine ended with nothing more to read (e.g. every canvas already fed)
            c.reader.feed((), last=True)
            out += self._emit(c)
        return out

    def _early_end(self, c: _Choice, probe: TextReader) -> EarlyEnd | None:
        """`draft_ends.early_end` of the choice's newest frame, when it draws the canvas the reader reads next."""
        frame = c.last
        if frame is None or frame.written is None or frame.canvas_index != c.reader.canvases:
            return None
        return early_end(c.reader, self.task, frame, probe, fim_end=self._fim_end, null_id=self.backend.null_id,
                         token_text=self.backend.token_text)

    def _settle_now(self, c: _Choice) -> list[Event]:
        """Settle a choice (a time limit): where its frame shows an AR infill's drafts side by side, with the
        best-scored whole draft written so far (`draft_ends.deadline_end`), else with its current draft as drawn."""
        if c.finished:
            return []
        frame = c.last if c.last is not None and c.last.canvas_index == c.reader.canvases else None
        if frame is None:
            return self._commit(c, (), last=True, settled=True)
        end = deadline_end(c.reader, self.task, frame, fim_end=self._fim_end, null_id=self.backend.null_id,
                           token_text=self.backend.token_text)
        if end is not None:
            return self._commit(c, end[0], last=True, settled=end[2], written=end[1])
        return self._commit(c, frame.draft, last=True, settled=True, written=frame.written)

    def _commit(self, c: _Choice, canvas: tuple[int, ...] | list[int], *, last: bool, settled: bool = False,
                written: tuple[bool, ...] | None = None) -> list[Event]:
        c.reader.feed(canvas, last=last, settled=settled, written=written)
        return self._emit(c)

    def _emit(self, c: _Choice) -> list[Event]:
        r = c.reader
        out: list[Event] = []
        safe = r.safe
        if safe > c.sent:
            out.append(Delta(c.index, r.text[c.sent : safe]))
            c.sent = safe
        if r.done:
            c.finished = True
            if c.handle is not None:
                c.handle.cancel()  # ended early (a stop sequence, a settled draft): free its engine row
            now = time.perf_counter()
            first = c.first_frame if c.first_frame is not None else now
            assert r.reason is not None
            wall = max(0.0, now - first)
            fim_n, fim_cached, fim_s = c.fim
            if fim_n:  # the FIM prompts are what the drafts read: their prefill is the prompt's time, exactly
                prompt, prefill, cached = fim_s, min(wall, fim_s), fim_cached
            else:  # what the engine encoded after the row started (a deferred context) lies in `wall` as well
                prefill = min(wall, c.lead_s + max(0.0, c.prompt_s - c.encoded_s))
                prompt, cached = c.encoded_s + prefill, c.cached_tokens
            out.append(Finish(c.index, r.reason, r.text, r.tokens, r.stop_word, c.steps,
                              max(0.0, first - c.submitted), wall, prompt, cached, prefill, fim_n))
        return out
