"""One running generation inside the engine (`Row`): its canvas, its bookkeeping, and the events it reports.

Owns a row's state between two engine steps: the canvas (pinned ids forced, the free slots noise until a step accepts
them), which slots are used, free and sampled, where `<null>` may not be sampled, its stopping state, its counters
(steps, forwards, generated slots), the figures its frames and `Done` report (context tokens the cache restored,
seconds spent encoding the context) and what its first frame is measured by (its slots run, whether it ran alone).
It applies one diffusion step's draw to itself (`diffusion_update`: sample, accept, renoise, keep the
self-conditioning signal), and it builds its own `Frame`s and its `Done`, so that what a row reports is written in
one place.

`canvas.engine.core.Engine` decides when: which rows run together, the batched forward and the logits it hands each
row, when a canvas commits, when a row finishes, and the AR walk's steps (`canvas.engine.ar`).

Invariants: everything here runs over the row's own slots with its own random stream (`noise`), so a request's tokens
do not depend on what it was batched with; the slots in use are always a prefix of the canvas; a context deferred
until read (`cache` None at admission, `Engine(lazy_context=True)`) reports what the prefix cache holds of it until
its walk has encoded it (`read_context`).
"""

from __future__ import annotations

import math
import time
from typing import TypedDict

import torch
from torch import Tensor

from canvas.engine.ar import ARWalk
from canvas.engine.types import Done, Frame, GenHandle, GenRequest, Status, Writer
from canvas.model import KVCache
from canvas.sampling.sampler import NoiseSource, StoppingState, select_accepted, step_stats_at

__all__ = ["Row"]


class FimPrompt(TypedDict):
    """The FIM prompt fields of a `Frame` or `Done` (`Frame.fim_prompt_tokens` and the two after it)."""

    fim_prompt_tokens: int
    fim_cached_tokens: int
    fim_prompt_s: float


class Row:
    """One running generation inside the engine."""

    def __init__(self, handle: GenHandle, req: GenRequest, cache: KVCache | None, last_logits: Tensor | None, L: int,
                 V: int, device: torch.device, noise: NoiseSource) -> None:
        # cache None: a FIM infill whose context is encoded only when read (its AR walk does it, `Engine.lazy_context`)
        self.handle, self.req, self.cfg, self.cache, self.V = handle, req, req.config, cache, V
        self.last_logits = last_logits  # (V,) AR next-token logits after the context (None with the cache)
        n = len(req.slot_ids)
        self.used = n or L  # slots in use: always a prefix of the canvas
        self.valid = torch.arange(L, device=device) < self.used
        self.pinned = torch.zeros(L, dtype=torch.bool, device=device)
        self.pinned[:n] = torch.tensor(req.pinned, dtype=torch.bool)
        self.pinned_ids = torch.zeros(L, dtype=torch.long, device=device)
        self.pinned_ids[:n] = torch.tensor(req.slot_ids, dtype=torch.long)
        self.noise = noise
        self.no_null = self.null_banned()  # (L,) pins never change, so neither does this
        self.canvases: list[tuple[int, ...]] = []
        self.steps = self.forwards = self.generated = 0
        self.t0 = self.admitted = time.perf_counter()  # admitted: when it left the queue (the engine sets it)
        self.cached_tokens = 0  # context tokens whose encoder cache was reused (the engine sets it)
        self.prompt_s = 0.0  # seconds spent encoding the context (the engine sets it)
        self.encoded = 0  # context tokens encoded at admission (a deferred context: none)
        self.deferred = cache is None  # until its walk has encoded the context and the row has taken its figures
        # Until its first frame (`LoadStats.add_first_frame`): its own slots per step (an AR row's lanes), summed,
        # and whether no other row ran beside it.
        self.slot_steps = 0
        self.alone = True
        self.new_canvas(L, device)

    def new_canvas(self, L: int, device: torch.device) -> None:
        noise = self.noise.uniform_tokens((1, L), self.V, device)[0]
        self.canvas = torch.where(self.pinned, self.pinned_ids, noise)
        self.argmax = self.canvas.clone()
        self.soft: Tensor | None = None  # (used, M) last step's soft embeddings, while self-conditioning is live
        self.free_pos = self.free.nonzero().squeeze(1)  # (k,) the slots sampled each step, ascending
        self.pinned_pos = (self.pinned & self.valid).nonzero().squeeze(1)  # (p,) used pinned slots
        self.remaining = self.cfg.max_steps
        self.step_in_canvas = 0
        self.stopping = StoppingState(self.cfg.stability_threshold, self.cfg.confidence_threshold, 1, self.used, device)
        self.ar: ARWalk | None = None  # AR mode: this canvas's walk (the engine starts it)
        self.seam_filled = False  # AR mode: some gap was filled by scored drafts

    @property
    def free(self) -> Tensor:
        return ~self.pinned & self.valid

    def context(self) -> tuple[KVCache, Tensor]:
        """The context's cache and the logits after it: every row but a deferred AR infill has them from admission."""
        assert self.cache is not None and self.last_logits is not None
        return self.cache, self.last_logits

    def null_banned(self) -> Tensor:
        """(L,) bool: free slots where `<null>` (a gap's unused slot) may not be sampled. After the last pin it has no
        meaning: no pinned text follows to close a gap, and training puts nulls only inside gaps. Inside a gap (a run
        of free slots with a pin after it) training puts the nulls after the infill, in at most `1 - gap_min_fill`
        of the gap, so the gap's head holds text."""
        after_last_pin = torch.cumsum(self.pinned.flip(0).long(), 0).flip(0) == 0  # no pin at or after the slot
        banned = self.free & after_last_pin
        if self.cfg.gap_min_fill > 0:
            free = self.free.tolist()
            start = None
            for i, f in enumerate(free + [False]):
                if f and start is None:
                    start = i
                elif not f and start is not None:
                    if i < self.used and bool(self.pinned[i]):  # a gap: closed by a pin
                        banned[start : start + math.ceil(self.cfg.gap_min_fill * (i - start))] = True
                    start = None
        return banned

    def left(self, L: int) -> int:
        """The most steps it may still run: its step budget (AR: a step a token), later canvases included."""
        later = self.req.n_canvases - len(self.canvases) - 1
        if self.cfg.mode == "ar":
            return self.used - (self.ar.pos if self.ar is not None else 0) + later * L
        return self.remaining + later * self.cfg.max_steps

    def count_step(self, alone: bool) -> None:
        """Before its first frame: what it runs in this step (its used slots, or an AR walk's lanes) counts toward
        the size its first-frame time is measured against; `alone`: no other row runs in the step."""
        if self.handle.frames == 0:
            self.slot_steps += self.used if self.cfg.mode == "diffusion" or self.ar is None else max(1, self.ar.rows)
            self.alone &= alone

    def diffusion_update(self, logits: Tensor, soft: Tensor | None, L: int) -> tuple[bool, Frame | None]:
        """Apply one diffusion step to the canvas: `logits` (free slots, V) are this row's processed logits, in
        `free_pos` order; `soft` (free then used pinned slots, M) the step's soft embeddings, None while the model's
        self-conditioning is inert. Samples, accepts by entropy, renoises the rest and updates the stopping state.
        Returns whether the canvas is done (settled, or out of steps) and the frame to send, when one is due."""
        m, device = self.used, self.canvas.device
        stats = step_stats_at(logits, self.free_pos, m, self.noise)  # (1, m)
        free = self.free[None, :m]
        pinned, pinned_ids = self.pinned[:m], self.pinned_ids[:m]
        accepted = select_accepted(stats.entropy, free, self.cfg.entropy_bound)[0]  # (m,)
        renoise = self.noise.uniform_tokens((1, m), self.V, device)[0]
        self.canvas[:m] = torch.where(pinned, pinned_ids, torch.where(accepted, stats.sample[0], renoise))
        self.argmax[:m] = torch.where(pinned, pinned_ids, stats.argmax[0])
        if soft is not None:
            self.soft = soft.new_empty(m, soft.shape[1])
            self.soft[torch.cat([self.free_pos, self.pinned_pos])] = soft
        self.remaining -= 1
        self.step_in_canvas += 1
        self.steps += 1
        self.forwards += 1
        stop = bool(self.stopping.update(self.argmax[None, :m], stats.entropy, free)[0]) or self.remaining == 0
        if not (stop or self.step_in_canvas % self.req.stream_every == 0):
            return stop, None
        entropy = torch.zeros(L, device=device)
        entropy[:m] = stats.entropy[0]  # 0 on pinned slots: never sampled
        accepted_all = torch.zeros(L, dtype=torch.bool, device=device)
        accepted_all[:m] = accepted
        return stop, Frame(self.handle.id, len(self.canvases), self.step_in_canvas, self.cfg.max_steps,
                           tuple(self.argmax.tolist()), tuple(accepted_all.tolist()), tuple(entropy.tolist()),
                           time.perf_counter() - self.t0, cached_tokens=self.cached_tokens, prompt_s=self.prompt_s)

    def read_context(self) -> None:
        """A deferred context its walk has encoded since: what it took replaces the admission's lookup in what
        frames and `Done` report (`cached_tokens`: the tokens the cache restored; `prompt_s` gains the encode)."""
        walk = self.ar
        if self.deferred and walk is not None and walk.context_cached is not None:
            self.deferred = False
            self.cached_tokens = walk.context_cached
            self.prompt_s += walk.context_s
            self.forwards += walk.context_forwards  # the pinned runs fed after it, as an eager walk counts them

    def ar_frame(self, L: int) -> Frame:
        """The frame of an AR row: the slots its walk touched count as accepted, and `written` says which hold text."""
        accepted = torch.zeros(L, dtype=torch.bool)
        if self.ar is not None:
            a, b = self.ar.touched
            accepted[a:b] = True
            written = self.ar.written()
        else:
            written = self.pinned & self.valid
        return Frame(self.handle.id, len(self.canvases), self.step_in_canvas, L, tuple(self.argmax.tolist()),
                     tuple(accepted.tolist()), (0.0,) * L, time.perf_counter() - self.t0,
                     None if self.ar is None else self.ar.drafts(), written=tuple(written.tolist()),
                     cached_tokens=self.cached_tokens, prompt_s=self.prompt_s, **self._fim_prompt())

    def done(self, status: Status, error: str | None = None) -> Done:
        """Its `Done`: the committed canvases and its figures (a deferred context's, once read, included)."""
        self.read_context()
        mode: Writer = self.cfg.mode if not self.seam_filled else "ar-infill"
        return Done(self.handle.id, status, tuple(self.canvases), self.steps, self.forwards, self.generated,
                    time.perf_counter() - self.t0, error, mode=mode, cached_tokens=self.cached_tokens,
                    prompt_s=self.prompt_s, **self._fim_prompt())

    def _fim_prompt(self) -> FimPrompt:
        """What its frames and `Done` report of its walk's FIM prompts (`ARWalk.fim_tokens`, `fim_cached`, `fim_s`)."""
        walk = self.ar
        if walk is None:
            return FimPrompt(fim_prompt_tokens=0, fim_cached_tokens=0, fim_prompt_s=0.0)
        return FimPrompt(fim_prompt_tokens=walk.fim_tokens, fim_cached_tokens=walk.fim_cached, fim_prompt_s=walk.fim_s)
