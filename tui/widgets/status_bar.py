"""`StatusBar`: two lines at the bottom: the document, then the connection and the generation's numbers.

Line 1: file name (with `*` when unsaved), server version, canvas window, masked spans and gaps, cursor.
Line 2: connection state and model, mode, and for the current or last generation: step / max steps, tokens per
forward, tokens per second and the seed. Widgets never compute these: the screen sets `doc` and `run` and the bar
renders them, cropped with an ellipsis so it works at 80 columns.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import RenderableType
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget


@dataclass(frozen=True, slots=True)
class DocInfo:
    name: str = "untitled"
    dirty: bool = False
    v: int | None = None
    window: tuple[int, int] | None = None
    masked: int = 0
    gaps: int = 0
    free_slots: int = 0
    row: int = 0
    col: int = 0


@dataclass(frozen=True, slots=True)
class RunInfo:
    connection: str = "starting"  # starting | connected | offline
    model: str = ""
    mode: str = "diffusion"
    phase: str = "idle"  # idle | generating | cancelling | proposal
    step: int | None = None
    max_steps: int | None = None
    tokens_per_forward: float | None = None
    tok_s: float | None = None
    seed: int | None = None


class StatusBar(Widget):
    doc: reactive[DocInfo] = reactive(DocInfo, layout=False)
    run: reactive[RunInfo] = reactive(RunInfo, layout=False)

    def render(self) -> RenderableType:
        d, r = self.doc, self.run
        top = Text(no_wrap=True, overflow="ellipsis")
        top.append(f" {d.name}{'*' if d.dirty else ''}", style="bold")
        if d.v is not None:
            top.append(f" │ v{d.v}")
        if d.window is not None:
            top.append(f" │ window {d.window[0]}–{d.window[1]}")
        marks = []
        if d.masked:
            marks.append(f"{d.masked} masked")
        if d.gaps:
            marks.append(f"{d.gaps} gap{'s' if d.gaps > 1 else ''}")
        if marks:
            top.append(" │ " + ", ".join(marks) + f" ({d.free_slots} tok)", style="bold magenta")
        top.append(f" │ Ln {d.row + 1}, Col {d.col + 1}")
        bottom = Text(no_wrap=True, overflow="ellipsis")
        dot = {"connected": ("●", "green"), "offline": ("●", "red")}.get(r.connection, ("◌", "yellow"))
        bottom.append(f" {dot[0]} ", style=dot[1])
        bottom.append(r.model or r.connection)
        bottom.append(f" │ {r.mode}")
        if r.phase != "idle":
            bottom.append(f" │ {r.phase}", style="bold")
        if r.step is not None and r.max_steps is not None:
            bottom.append(f" │ step {r.step}/{r.max_steps}")
        if r.tokens_per_forward is not None:
            bottom.append(f" │ {r.tokens_per_forward:.2f} tok/fwd")
        if r.tok_s is not None:
            bottom.append(f" │ {r.tok_s:.1f} tok/s")
        if r.seed is not None:
            bottom.append(f" │ seed {r.seed}")
        return Text("\n").join([top, bottom])
