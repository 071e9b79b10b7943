"""The generation engine: many canvases refined together, joined and retired between steps.

Owns the running generations. A request (`GenRequest`) carries token ids only — the context before the canvas, the
canvas slots with their pins, the sampler settings — so the engine knows nothing of documents or text. Each `step()`
admits waiting requests, runs ONE batched decoder forward over every diffusion row (their caches stacked, right-padded
and masked, each row at its own step of its own temperature schedule; the canvas is cut to the longest prefix of slots
any row uses, so a short infill window costs a short forward), then samples, accepts and renoises per row with the
row's own random stream, so a request's tokens do not depend on what it was batched with (a row's own state, its
step's draw and the events it reports: `canvas.engine.rows.Row`). The vocabulary-sized work (LM head, sampler,
self-conditioning soft embeddings) runs only for the slots that read it: free slots, plus pinned ones while the
model's self-conditioning is live (their next signal). `<null>` (a gap's unused slot) is never sampled after the last
pinned slot, where no gap can close, nor in the head of a gap that the sampler's `gap_min_fill` reserves for text. A
gap denoiser trained with the shifted head (`Engine(logit_shift=True)`) has every diffusion slot read from the hidden
state before it, slot 0 from the context's last position (`canvas.engine.decoder_weights.denoise_logits`), for the
sampled slots and the self-conditioning alike. AR rows (`canvas.engine.ar`) walk their canvas left to right; every
drafting lane of every AR row (an infill's K drafts, several users' fills) advances one token per step in ONE batched
encoder forward, and a gap with text after it is filled by the draft and ending whose seam reads best. Rows stop
individually; cancellation is honoured between steps, and between the pieces of a long context's encode. A request's
context is restored from the engine's `PrefixCache` as far as an earlier context shares its tokens (the longest common
prefix: an editor's next keystroke re-encodes only what it changed), shared by every route into the engine, bounded in
bytes. An AR infill whose first gap drafts in the FIM frame defers its context (`lazy_context`): its drafts read only
the FIM prompt, so the context is encoded (through the same cache) only when the seam's scoring reads it, and never
when a client's deadline takes a draft first; meanwhile it reports as cached what the cache holds of it.

Requests wait for a row in a `canvas.engine.scheduling.FairQueue`: one lane per `owner`, rows handed out round-robin
across owners, and a cancelled request leaves the queue at once (its `Done` is sent by `cancel()` itself). `submit`
can refuse: its `admit` callback sees the request's `Placement` under the queue's lock, so what it checks is what
the request gets. The engine measures its step time, how many steps generations hold a row, their own first-frame
time (with the tokens run for it and whether it ran alone) and how far each running row has got (`load()`), from
which waits and the row cap are estimated.

Events go to the request's callback from the engine's thread: a `Frame` every `stream_every` steps (draft argmax
with pins forced, accepted mask, entropy; an AR row's frame also says which slots are written so far: the others
still hold noise) and exactly one `Done` (committed slot ids per canvas, stats); a request
cancelled while queued gets its `Done` on the cancelling thread.
Run it synchronously with `run_until_idle()` or in a background thread with `start()` / `stop()`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from canvas.convert.fim import FimTokens, Order, WordEdges
from canvas.engine.ar import DEFAULT_FIM_ORDER, ARBatch, ARWalk, LineTokens
from canvas.engine.decoder_weights import denoise_logits
from canvas.engine.prefix_cache import DEFAULT_CONTEXT_CACHE_MB, MB, PrefillCancelled, PrefixCache
from canvas.engine.rows import Row
from canvas.engine.scheduling import EngineLoad, FairQueue, LoadStats, Placement
from canvas.engine.types import Done, Event, Frame, GenHandle, GenRequest, Status
from canvas.model import DiffusionModel, KVCache
from canvas.model.cpu import release_openmp_pool
from canvas.sampling.modes import request_kind
from canvas.sampling.sampler import GumbelNoise, NoiseSource, SamplerConfig

# The request, event and handle types live in canvas.engine.types; importing them from here still works.
__all__ = ["Done", "Engine", "Event", "Frame", "GenHandle", "GenRequest", "Status"]

_BANNED_LOGIT = -1e4  # a processed logit that exp() turns into an exact 0 probability


class Engine:
    def __init__(self, model: DiffusionModel, *, max_batch: int = 8,
                 context_cache_mb: float = DEFAULT_CONTEXT_CACHE_MB, context_cache: PrefixCache | None = None,
                 noise_factory: Callable[[SamplerConfig], NoiseSource] | None = None,
                 clause_ends: frozenset[int] | None = None, fim: FimTokens | None = None,
                 word_edges: WordEdges | None = None, fim_order: Order = DEFAULT_FIM_ORDER,
                 lines: LineTokens | None = None, logit_shift: bool = False, lazy_context: bool = True) -> None:
        """`clause_ends`: token ids that end a clause or sentence (from the tokenizer: `canvas.engine.ar`'s drafts may
        end after them); None spaces an AR infill's candidate endings evenly instead. `fim`: the FIM ids when the
        model has the FIM format (`canvas.convert.fim.model_fim_tokens`): AR infills then prompt with it unless a
        request's `SamplerConfig.fim` is False; None refuses requests that require it. `word_edges`: which ids start
        and end with whitespace (`canvas.convert.fim.word_boundaries`), for the FIM prompt's token healing; None
        prompts with the left side as it is. `fim_order`: the FIM prompt's order ("psm" or "spm"). `lines`: the ids
        that break a line before writing on it and those that are only spaces (`canvas.engine.ar.line_tokens`): a
        request's `SamplerConfig.ar_first_newline` False bans the former while an AR draft is blank; None bans none.
        `logit_shift`: the decoder's head is shifted, as its gap denoiser was trained (`canvas.engine.decoder_weights`):
        a diffusion slot i reads hidden state i - 1, slot 0 the context's last position; AR rows are untouched.
        `context_cache_mb`: the bytes (MiB) the encoder caches of earlier
        contexts may hold (`canvas.engine.prefix_cache`; 0 keeps none); `context_cache`: one to share instead (an
        engine's `twin` shares its own). `lazy_context`: an AR infill whose first gap drafts in the FIM frame (its
        drafts read only the FIM prompt) encodes its plain context only when something reads it (the seam's scoring,
        an SMC resample; `canvas.engine.ar.ARWalk.plain`), not at admission: an editor whose deadline takes a draft
        before the seam is scored never pays for it. The same tokens either way; False encodes every context at
        admission."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model.eval()
        self.max_batch = max_batch
        self.L = model.config.canvas_length
        self._noise_factory = noise_factory or (lambda cfg: GumbelNoise(cfg.seed))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: FairQueue[GenHandle] = FairQueue()
        self._active = 0  # rows taken: running, or popped from the queue and being admitted (under the lock)
        self._row_cap = max_batch  # rows run side by side now; admission control may lower it (`set_row_cap`)
        self.stats = LoadStats()  # updated on the engine's thread under the lock
        self._progress: tuple[tuple[int, int], ...] = ()  # (steps run, most left) per row, after the last step
        self._rows: list[Row] = []
        self._stacked: tuple[tuple[tuple[int, int], ...], KVCache] | None = None
        if context_cache_mb < 0:
            raise ValueError(f"context_cache_mb must be >= 0, got {context_cache_mb}")
        self.contexts = context_cache or PrefixCache(model, int(context_cache_mb * MB))
        self._thread: threading.Thread | None = None
        self._running = False
        self.forward_s = 0.0  # time inside decoder forwards, for the step-overhead figure
        self.clause_ends = clause_ends
        self.fim = fim
        self.word_edges = word_edges
        self.fim_order = fim_order
        self.lines = lines
        self.logit_shift = logit_shift
        self.lazy_context = lazy_context
        self._ar = ARBatch(model)

    def twin(self, *, max_batch: int = 1, context_cache_mb: float | None = None) -> Engine:
        """A new engine on the same model with the same tokenizer facts (clause ends, FIM format, word edges): for a
        caller that runs requests on its own thread of control (an evaluation, a one-off generation). It shares this
        engine's context cache, or, given `context_cache_mb`, has one of its own of that size (0: none, so that
        every request encodes its whole context, as a measurement may want)."""
        own = context_cache_mb is not None
        return Engine(self.model, max_batch=max_batch, context_cache_mb=context_cache_mb or 0,
                      context_cache=None if own else self.contexts, clause_ends=self.clause_ends, fim=self.fim,
                      word_edges=self.word_edges, fim_order=self.fim_order, lines=self.lines,
                      logit_shift=self.logit_shift, lazy_context=self.lazy_context)

    # ---- public API ------------------------------------------------------------------------------------------
    def submit(self, req: GenRequest, on_event: Callable[[Event], None] | None = None, *, owner: Hashable = None,
               admit: Callable[[Placement], None] | None = None, replacing: GenHandle | None = None) -> GenHandle:
        """Queue `req` in `owner`'s lane (None: a lane of its own, which makes the queue FIFO). `admit` sees where it
        would wait and may raise to refuse it (nothing changes then). `replacing`: a request this one supersedes; if
        it is still queued, this one is placed as if it had gone, and it leaves (cancelled) only if this one enters."""
        req.validate(self.L, self.model.config.vocab_size)
        if req.config.fim and self.fim is None and req.config.mode == "ar" and request_kind(req.pinned) == "infill":
            raise ValueError("fim: this model has no fill-in-the-middle format (built without the FIM adapters); "
                             "leave fim unset or false")
        handle = GenHandle(next(self._ids), on_event, req, self._withdraw)
        lane = handle if owner is None else owner
        with self._wake:
            if admit is not None:
                gone = replacing if replacing is not None and replacing in self._pending else None
                # A running row whose generation was cancelled (its client already answered: a stop sequence, a
                # deadline) is retired at the next step, before anyone is admitted: its row counts as free now.
                taken = self._active - sum(1 for r in list(self._rows) if r.handle.cancelled)
                placement = Placement(self._pending.position(lane, without=gone), max(0, self._row_cap - taken),
                                      len(self._pending) - (gone is not None), self._pending.owners)
                admit(placement)
            replaced = replacing is not None and self._pending.remove(replacing)
            handle.position = self._pending.push(lane, handle)
            self._wake.notify()
        if replaced and replacing is not None:
            replacing.end_cancelled()
        return handle

    def load(self) -> EngineLoad:
        with self._lock:
            s = self.stats
            return EngineLoad(self.max_batch, self._active, len(self._pending), s.step_s.value, s.first_frame_s.value,
                              tuple(s.gen_steps), self._progress, self._row_cap,
                              s.alone_first_frame_s(), s.first_frames, s.slowdown.value)

    def set_row_cap(self, rows: int) -> None:
        """Run at most `rows` generations side by side (clamped to [1, max_batch]); rows above a lowered cap finish,
        and queued requests start only below it."""
        with self._lock:
            self._row_cap = max(1, min(self.max_batch, rows))

    def queue_order(self) -> list[GenHandle]:
        """The queued requests in the order they will get rows."""
        with self._lock:
            return self._pending.order()

    def _withdraw(self, handle: GenHandle) -> None:
        with self._lock:
            removed = self._pending.remove(handle)
        if removed:
            handle.end_cancelled()

    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending or self._rows)

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def start(self) -> None:
        """Step in a background thread until `stop()`. The calling thread's OpenMP pool (the one that loaded the
        model) is released first, so the engine's thread owns the only team and its barriers spin between a step's
        parallel regions, as a one-thread program's do (`canvas.model.cpu.release_openmp_pool`: a third of an AR
        step on 2 cores otherwise)."""
        if self._thread is not None:
            return
        release_openmp_pool()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="dcanvas-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._running and not (self._pending or self._rows):
                    self._wake.wait()
                if not self._running:
                    return
            self.step()

    # ---- one engine step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> bool:
        """Admit, run one batched step, retire. Returns whether any work remains."""
        t0 = time.perf_counter()
        for row in [r for r in self._rows if r.handle.cancelled]:  # first: their rows go to whoever waits
            self._finish(row, "cancelled")
        self._admit()
        for row in self._rows:  # what a first frame is measured against (`_first_frame`)
            row.count_step(alone=len(self._rows) == 1)
        diffusion = [r for r in self._rows if r.cfg.mode == "diffusion"]
        if diffusion:
            try:
                self._diffusion_step(diffusion)
            except Exception as e:  # a failed step fails its rows, never the engine
                for row in diffusion:
                    self._finish(row, "failed", error=f"{type(e).__name__}: {e}")
        ar = [r for r in self._rows if r.cfg.mode == "ar"]
        if ar:
            try:
                self._ar_step(ar)
            except Exception as e:
                self._ar.clear()
                for row in ar:
                    self._finish(row, "failed", error=f"{type(e).__name__}: {e}")
        elif self._ar.cache is not None:
            self._ar.clear()  # the last AR row left (cancelled): free its lanes' cache
        rows = tuple((r.steps, r.left(self.L)) for r in self._rows)
        with self._lock:
            if diffusion or self._rows:
                self.stats.step_s.add(time.perf_counter() - t0)
            self._progress = rows
            return bool(self._pending or self._rows)

    def _admit(self) -> None:
        while len(self._rows) < self._row_cap:
            with self._lock:
                handle = self._pending.pop()
                if handle is None:
                    return
                self._active += 1
            req = handle.request
            assert req is not None
            if handle.cancelled:  # cancelled while being popped: cancel() found it gone from the queue
                self._release()
                handle.end_cancelled()
                continue
            t0 = time.perf_counter()
            try:
                cache, last, cached = self._context(req, handle)
                prompt_s = time.perf_counter() - t0
                row = Row(handle, req, cache, last, self.L, self.model.config.vocab_size, self.model.device,
                           self._noise_factory(req.config))
            except PrefillCancelled:  # cancelled while its context was encoded (between two pieces)
                self._release()
                handle.end_cancelled()
                continue
            except Exception as e:
                self._release()
                handle.emit(Done(handle.id, "failed", (), 0, 0, 0, 0.0, error=f"{type(e).__name__}: {e}"))
                continue
            row.admitted, row.cached_tokens, row.prompt_s = t0, cached, prompt_s
            row.encoded = 0 if cache is None else len(req.context_ids) - cached
            self._rows.append(row)

    def _release(self, steps: int | None = None) -> None:
        with self._lock:
            self._active -= 1
            if steps:
                self.stats.gen_steps.append(steps)

    def _context(self, req: GenRequest, handle: GenHandle) -> tuple[KVCache | None, Tensor | None, int]:
        """Encoder cache for the request's context (private to its row: AR rows and continuations grow it), its
        next-token logits, and how many of its tokens came from the context cache (frames and `Done` report them
        as `cached_tokens`). The longest prefix an earlier context shares is restored and only the rest encoded
        (`PrefixCache`); a request cancelled meanwhile stops between two pieces (`PrefillCancelled`).
        A deferred context (`_defers_context`) gets no cache here (None, None): its walk encodes it when read, and
        until then it reports what the cache holds of it (`PrefixCache.held`: the tokens it will not encode)."""
        if self._defers_context(req):
            return None, None, self.contexts.held(req.context_ids)
        room = self.L * req.n_canvases if req.n_canvases > 1 or req.config.mode == "ar" else 0
        pf = self.contexts.prefill(req.context_ids, room, stop=lambda: handle.cancelled)
        return pf.cache, pf.last, pf.cached

    def _defers_context(self, req: GenRequest) -> bool:
        """Whether `req`'s context waits until read (`lazy_context`): one canvas in AR mode whose first gap has
        pinned text after it and is drafted in the FIM frame, from a prompt built of token ids alone. Nothing else
        reads the plain context before that gap's seam is scored."""
        cfg = req.config
        if not (self.lazy_context and cfg.mode == "ar" and req.n_canvases == 1 and cfg.seam_aware):
            return False
        if self.fim is None or cfg.fim is False:
            return False
        # the first run of free slots has a pin after it (`request_kind` "infill" asks this of any gap)
        first_free = next((i for i, p in enumerate(req.pinned) if not p), None)
        return first_free is not None and request_kind(req.pinned[first_free:]) == "infill"

    def _diffusion_step(self, rows: list[Row]) -> None:
        model, L = self.model, self.L
        caches = [r.context()[0] for r in rows]
        key = tuple((id(c), c.length) for c in caches)
        if len(rows) == 1:
            cache = caches[0]
        elif self._stacked is not None and self._stacked[0] == key:
            cache = self._stacked[1]
        else:
            cache = KVCache.stack(caches)
            self._stacked = (key, cache)
        # The forward covers only the slots some row uses: unused slots are hidden from attention, so cutting them
        # off changes no used slot's logits, and an infill of a short window costs a short forward.
        n = max(r.used for r in rows)
        canvas = torch.stack([r.canvas[:n] for r in rows])  # (B, n)
        # Self-conditioning feeds every used slot, pinned ones too, the soft embeddings of its own previous logits
        # (as training and the reference do). While the model's self-conditioning MLP is all zeros (a converted
        # checkpoint) that signal changes nothing: then neither it nor the pinned slots' logits are computed.
        live_sc = not model.self_conditioning.inert()
        soft = None
        if live_sc and any(r.soft is not None for r in rows):
            # A zero signal is exactly "no self-conditioning" (the gated MLP maps 0 to 0); a row's soft embeddings
            # beyond its own used slots are never read, so zeros pad them too.
            soft = torch.zeros(len(rows), n, model.config.hidden_size, device=model.device, dtype=model.dtype)
            for b, r in enumerate(rows):
                if r.soft is not None:
                    soft[b, : r.used] = r.soft
        mask = None if all(r.used == n for r in rows) else torch.stack([r.valid[:n] for r in rows])  # (B, n)
        # Logits only where a step reads them: each row's free slots (sampled), then, while self-conditioning is
        # live, its pinned used slots (their next signal). With a 32-slot gap in a 158-slot window that is 32 rows
        # of the vocabulary-sized head, sampler and soft embedding instead of 158.
        pins = [r.pinned_pos if live_sc else r.pinned_pos[:0] for r in rows]
        at = torch.cat([torch.cat([r.free_pos, p]) + b * n for b, (r, p) in enumerate(zip(rows, pins, strict=True))])
        t0 = time.perf_counter()
        last = torch.stack([r.context()[1] for r in rows]) if self.logit_shift else None  # (B, V): slot 0's head
        logits = denoise_logits(model, canvas, cache, at=at, shift=self.logit_shift, last=last, soft=soft,
                                mask=mask)  # (K, V)
        sizes = [(len(r.free_pos), len(p)) for r, p in zip(rows, pins, strict=True)]
        temps = torch.cat([r.cfg.temperature(r.remaining).expand(f + p) for r, (f, p) in zip(rows, sizes, strict=True)])
        processed = logits.div_(temps.to(model.device)[:, None])  # (K, V)
        null_id = model.config.null_token_id
        if null_id is not None:
            # Finite, not -inf: the entropy terms stay 0 * -1e4 = 0 instead of 0 * -inf = nan. Free slots only.
            banned = torch.cat([torch.cat([r.no_null[r.free_pos], torch.zeros_like(p, dtype=torch.bool)])
                                for r, p in zip(rows, pins, strict=True)])  # (K,)
            processed[:, null_id].masked_fill_(banned, _BANNED_LOGIT)
        new_soft = model.soft_embeddings(processed) if live_sc else None  # (K, M): next step's self-conditioning
        self.forward_s += time.perf_counter() - t0
        off = 0
        for row, (n_free, n_pin) in zip(rows, sizes, strict=True):  # each over its own slots, with its own noise
            soft_b = None if new_soft is None else new_soft[off : off + n_free + n_pin]
            stop, frame = row.diffusion_update(processed[off : off + n_free], soft_b, L)
            off += n_free + n_pin
            if frame is not None:
                self._first_frame(row)
                row.handle.emit(frame)
            if stop:
                self._commit(row)

    def _ar_step(self, rows: list[Row]) -> None:
        """Advance every AR row's walk; ONE batched encoder forward steps all their drafting lanes."""
        for row in rows:
            row.steps += 1
            row.step_in_canvas += 1
            if row in self._rows:
                try:
                    self._ar_advance(row)
                except PrefillCancelled:  # cancelled while its deferred context was encoded
                    self._finish(row, "cancelled")
        drafting = [r for r in rows if r in self._rows and r.ar is not None and r.ar.drafting]
        if not drafting:
            self._ar.clear()
            return
        walks = [r.ar for r in drafting if r.ar is not None]
        t0 = time.perf_counter()
        logits = self._ar.step(walks)  # per walk (its logit rows, V)
        self.forward_s += time.perf_counter() - t0
        batch = self._ar.cache
        assert batch is not None
        off = 0
        for row, walk, out in zip(drafting, walks, logits, strict=True):
            k = walk.rows
            rows_k = torch.arange(off, off + k, device=out.device)
            off += k
            row.forwards += 1
            try:
                walk.take(out, batch, rows_k)  # the gap's end reads the plain context: a deferred one is encoded now
                if walk.drafting:
                    self._ar_frame(row)
                else:
                    self._ar_advance(row, stepped=True)
            except PrefillCancelled:
                self._finish(row, "cancelled")

    def _ar_advance(self, row: Row, stepped: bool = False) -> None:
        """Start `row`'s walk if needed and walk it to its next gap; commit its canvas when the walk is over.
        `stepped`: its gap just ended in the batched forward (a frame shows the chosen fill)."""
        if row.ar is None:
            gen = row.noise.generator if isinstance(row.noise, GumbelNoise) else torch.Generator().manual_seed(
                row.cfg.seed or 0)
            row.ar = ARWalk(self.model, row.cfg, row.cache, row.last_logits, row.canvas, row.argmax, row.pinned,
                            row.used, gen, keep_context=row.req.n_canvases > 1, room=self.L * row.req.n_canvases,
                            clause_ends=self.clause_ends, avoid=row.req.avoid, context=row.req.context_ids,
                            fim=self.fim if row.cfg.fim is not False else None, word_edges=self.word_edges,
                            prefix=self.contexts, fim_order=self.fim_order, lines=self.lines,
                            stop=lambda: row.handle.cancelled)
        walk = row.ar
        before = walk.forwards
        if not walk.drafting:
            walk.advance()
        row.forwards += walk.forwards - before
        if walk.finished:
            row.generated += walk.generated
            row.seam_filled |= walk.seam_aware_gaps > 0
            row.cache, row.last_logits = walk.ctx, walk.last
            self._ar_frame(row, last=True)
            self._commit(row, encoded=True)
        elif stepped:
            self._ar_frame(row)

    def _ar_frame(self, row: Row, last: bool = False) -> None:
        row.read_context()
        if not (last or row.step_in_canvas % row.req.stream_every == 0):
            return
        self._first_frame(row)
        row.handle.emit(row.ar_frame(self.L))

    def _commit(self, row: Row, encoded: bool = False) -> None:
        committed = row.argmax.tolist()
        if row.cfg.mode == "diffusion":
            row.generated += int(row.free.sum())
        eos = set(self.model.config.eos_token_ids)
        is_continuation = row.req.n_canvases > 1
        hit_eos = is_continuation and any(t in eos for t in committed)
        if hit_eos:
            committed = committed[: next(i for i, t in enumerate(committed) if t in eos) + 1]
        row.canvases.append(tuple(committed))
        if hit_eos or len(row.canvases) >= row.req.n_canvases:
            self._finish(row, "completed")
            return
        if not encoded:
            model = self.model
            t0 = time.perf_counter()
            # A shifted head reads the next canvas's slot 0 from the logits after this one.
            out, _ = model.encode(row.argmax[None], cache=row.context()[0],
                                  logits="last" if self.logit_shift else "none")
            if out is not None:
                row.last_logits = out[0, -1]
            self.forward_s += time.perf_counter() - t0
        self._stacked = None
        # Later canvases continue the text: nothing pinned, every slot in use.
        row.pinned.zero_()
        row.used = self.L
        row.valid.fill_(True)
        row.new_canvas(self.L, self.model.device)

    def _first_frame(self, row: Row) -> None:
        if row.handle.frames == 0:
            took = time.perf_counter() - row.admitted
            size = row.encoded + row.slot_steps  # tokens run for it, as if alone
            with self._lock:  # first frames alone are the baseline `RowCap` compares with
                self.stats.add_first_frame(took, size, alone=row.alone)

    def _finish(self, row: Row, status: Status, error: str | None = None) -> None:
        if row in self._rows:
            self._rows.remove(row)
            self._release(row.steps)
        self._stacked = None
        row.handle.emit(row.done(status, error))
