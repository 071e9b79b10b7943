"""What the canvas view shows: a generation as its frames arrive, and the proposal it ends with.

`LiveCanvas` folds `gen.progress` deltas into one draft per slot of the canvas window and lays the document out as
pieces: the context before and after the window, the pinned spans' text, and for each free slot its current
draft, styled by state and coloured by entropy. Slot states, from the protocol's per-slot fields:

- `pinned`: kept by the model (the text of a pinned span);
- `pending`: free, no frame has reached it yet (shown as `░`);
- `unwritten`: free, and the AR writer has not reached it yet (`written: false`, shown as `▁`): its token is the
  canvas's initial noise, never the model's guess, so its text is never shown. Diffusion rows never send it: their
  noise is the picture of the canvas converging;
- `noise`: free, not accepted at the latest step (it will be renoised; its draft is the model's current guess);
- `accepted`: accepted at the latest step;
- `converged`: accepted with the same token in two consecutive frames (a frame that leaves an accepted slot out
  of its delta did not change it, so it counts).

Slot `i` of a frame is the `i`-th slot of the window in span order (`DocState.spans`, each with its `slots`); a
gap or a masked span shows its slots' drafts in place of its text. `ProposalView` lays out a proposal as an inline
diff, numbers its hunks exactly as the server does (maximal runs of non-equal segments, from 0) and tracks which
hunk the cursor is on and which are marked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rich.style import Style

from canvas.protocol import DiffSegment, DocState, GenProgress, Proposal
from tui.render import Piece, entropy_color
from tui.textfile import display

STYLE_NAMES = (
    "context", "pinned", "pending", "unwritten", "noise", "accepted", "converged",
    "equal", "insert", "delete", "current", "marked",
)  # fmt: skip
Palette = Mapping[str, Style]
PENDING_GLYPH = "░"
UNWRITTEN_GLYPH = "▁"  # a blank to be filled in: not "·" (an empty token) nor "░" (no frame yet)


@dataclass(slots=True)
class SlotDraft:
    token: int
    text: str
    entropy: float | None
    accepted: bool
    converged: bool = False
    written: bool = True

    @property
    def state(self) -> str:
        if not self.written:
            return "unwritten"
        return "converged" if self.converged else "accepted" if self.accepted else "noise"

    @property
    def shown(self) -> str:
        """What the slot is drawn as: its text (terminal-safe; `·` when empty) once written, else a blank."""
        return (display(self.text) or "·") if self.written else UNWRITTEN_GLYPH


@dataclass
class LiveCanvas:
    """One generation's view of the document it runs on."""

    state: DocState
    gen: str
    max_steps: int | None  # the resolved params echo it; every frame carries it again
    slots: dict[int, SlotDraft] = field(default_factory=dict)
    step: int = 0
    seq: int = 0
    accepted: int = 0
    free: int = 0
    elapsed_s: float = 0.0
    frames: int = 0
    lost_frames: bool = False  # a `seq` gap: the picture may be incomplete

    def __post_init__(self) -> None:
        self.free = sum(s.slots for s in self.state.spans if s.kind == "free")

    def apply(self, p: GenProgress) -> None:
        """Fold one (possibly merged) frame in."""
        if p.seq != self.seq + 1:
            self.lost_frames = True
        self.seq = p.seq
        changed = {s.i for s in p.slots}
        for draft_i, draft in self.slots.items():
            if draft_i not in changed and draft.accepted:
                draft.converged = True  # left out of the delta: unchanged across a frame
        for s in p.slots:
            prev = self.slots.get(s.i)
            stable = prev is not None and prev.written and prev.accepted and prev.token == s.token
            written = s.written  # False only for AR rows' slots not reached yet; older servers omit it (True)
            text = s.text if written else ""  # an unwritten slot's token is noise: keep none of its text
            self.slots[s.i] = SlotDraft(s.token, text, s.entropy, s.accepted and written,
                                        converged=written and s.accepted and stable, written=written)  # fmt: skip
        self.step, self.max_steps = p.step, p.max_steps
        self.accepted, self.free, self.elapsed_s = p.accepted, p.free or self.free, p.elapsed_s
        self.frames += 1

    @property
    def settled(self) -> int:
        """Free slots accepted or converged in the latest frame."""
        return sum(1 for d in self.slots.values() if d.accepted)

    @property
    def tokens_per_forward(self) -> float:
        return self.settled / self.step if self.step else 0.0

    @property
    def tok_s(self) -> float:
        return self.settled / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def counts(self) -> dict[str, int]:
        out = {"pending": max(0, self.free - len(self.slots)), "unwritten": 0, "noise": 0, "accepted": 0,
               "converged": 0}  # fmt: skip
        for d in self.slots.values():
            out[d.state] += 1
        return out

    def slot_piece(self, i: int, palette: Palette) -> Piece:
        draft = self.slots.get(i)
        if draft is None:
            return Piece(PENDING_GLYPH, palette["pending"], i)
        if not draft.written:
            return Piece(UNWRITTEN_GLYPH, palette["unwritten"], i)  # no entropy colour: nothing was sampled
        color = entropy_color(draft.entropy)
        style = palette[draft.state] + (Style(color=color) if color is not None else Style())
        return Piece(draft.shown, style, i)

    def pieces(self, palette: Palette, lo: int = 0, hi: int | None = None) -> list[Piece]:
        """The document from offset `lo` to `hi` (default: all of it), the window live. Tags are slot indexes."""
        st = self.state
        text, w = st.text, st.window
        out = [Piece(display(text[lo : w.start]), palette["context"])]
        slot = 0
        for span in st.spans:
            if span.kind == "pinned":
                out.append(Piece(display(text[span.start : span.end]), palette["pinned"]))
            else:
                out.extend(self.slot_piece(k, palette) for k in range(slot, slot + span.slots))
            slot += span.slots
        out.extend(self.slot_piece(k, palette) for k in sorted(k for k in self.slots if k >= slot))
        out.append(Piece(display(text[w.end : hi]), palette["context"]))
        return out


def hunk_ids(diff: list[DiffSegment]) -> list[int]:
    """For each segment its hunk number, or -1 for `equal` segments."""
    out: list[int] = []
    hunk, inside = -1, False
    for seg in diff:
        if seg.op == "equal":
            inside = False
            out.append(-1)
            continue
        if not inside:
            hunk, inside = hunk + 1, True
        out.append(hunk)
    return out


@dataclass
class ProposalView:
    """A finished generation's proposal against the document it will change."""

    state: DocState
    gen: str
    proposal: Proposal
    current: int = 0
    marked: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.ids = hunk_ids(self.proposal.diff)
        self.n_hunks = max(self.ids, default=-1) + 1

    def move(self, delta: int) -> None:
        if self.n_hunks:
            self.current = (self.current + delta) % self.n_hunks

    def toggle_mark(self) -> None:
        if self.n_hunks:
            self.marked ^= {self.current}

    def chosen(self) -> list[int]:
        """The hunks "under the cursor or selection": the marked ones, else the current one."""
        return sorted(self.marked) if self.marked else ([self.current] if self.n_hunks else [])

    def pieces(self, palette: Palette, lo: int = 0, hi: int | None = None) -> list[Piece]:
        """The document from `lo` to `hi` with the proposal inline. Tags are hunk numbers (-1 outside hunks)."""
        text, p = self.state.text, self.proposal
        out = [Piece(display(text[lo : p.start]), palette["context"])]
        for seg, hunk in zip(p.diff, self.ids, strict=True):
            style = palette[seg.op]
            if hunk >= 0 and hunk in self.marked:
                style = style + palette["marked"]
            if hunk >= 0 and hunk == self.current:
                style = style + palette["current"]
            shown = display(seg.text)
            if seg.op != "equal" and not shown.strip("\n"):
                shown = shown.replace("\n", "⏎\n") or "·"  # a hunk of bare newlines must still be visible
            out.append(Piece(shown, style, hunk))
        out.append(Piece(display(text[p.end : hi]), palette["context"]))
        return out

    def new_text(self, hunks: list[int] | None = None) -> str:
        """The region's text after accepting `hunks` (all when None)."""
        chosen = set(range(self.n_hunks)) if hunks is None else set(hunks)
        parts = []
        for seg, hunk in zip(self.proposal.diff, self.ids, strict=True):
            if seg.op == "equal" or (seg.op == "insert") == (hunk in chosen):
                parts.append(seg.text)
        return "".join(parts)
