"""`ModeLine`: one line above the status bar while a generation runs or a proposal waits.

While generating it is the legend of the live view (slot states, the entropy ramp, counts per state); with a
proposal it says how many hunks there are, which one the cursor is on and which are marked.
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.style import Style
from rich.text import Text
from textual.widgets import Static

from tui.live import PENDING_GLYPH, UNWRITTEN_GLYPH, LiveCanvas, ProposalView
from tui.render import ramp_legend


class ModeLine(Static):
    def show_live(self, live: LiveCanvas, palette: Mapping[str, Style]) -> None:
        counts = live.counts()
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(" pinned", style=palette["pinned"])
        t.append(f"  {PENDING_GLYPH}{counts['pending']}", style=palette["pending"])
        if counts["unwritten"]:  # AR rows only: the slots the writer has still to reach
            t.append(f"  {UNWRITTEN_GLYPH}{counts['unwritten']} to write", style=palette["unwritten"])
        t.append(f"  noise {counts['noise']}", style=palette["noise"])
        t.append(f"  accepted {counts['accepted']}", style=palette["accepted"])
        t.append(f"  converged {counts['converged']}", style=palette["converged"])
        t.append("  entropy low ")
        for piece in ramp_legend(6):
            t.append(piece.text, style=piece.style)
        t.append(" high")
        if live.lost_frames:
            t.append("  (frames lost)", style="bold red")
        self.update(t)

    def show_proposal(self, view: ProposalView) -> None:
        t = Text(no_wrap=True, overflow="ellipsis")
        if view.n_hunks == 0:
            t.append(" The proposal changes nothing.", style="bold")
        else:
            t.append(f" Proposal: {view.n_hunks} hunk{'s' if view.n_hunks > 1 else ''}", style="bold")
            t.append(f" │ on hunk {view.current + 1}")
            if view.marked:
                t.append(f" │ marked {', '.join(str(h + 1) for h in sorted(view.marked))}")
        self.update(t)
