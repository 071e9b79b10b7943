"""Styled text to terminal lines: pieces, soft wrapping, strips, and the entropy colour ramp.

A view is a list of `Piece`s (text, rich `Style`, a `tag`: the hunk a piece belongs to, or -1). `wrap` cuts them
into visual lines of at most `width` cells, breaking after a space where it can and at any character where it
cannot, and keeps every character: offsets can be mapped back from a click. A `Line` is a tuple of runs and is
hashable, so a widget can compare the lines of two frames and refresh only the ones that differ.

Text must already be terminal-safe (`tui.textfile.display`); `\\n` ends a line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from rich.cells import get_character_cell_size
from rich.color import Color
from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip


@dataclass(frozen=True, slots=True)
class Piece:
    text: str
    style: Style
    tag: int = -1


Run = tuple[str, Style, int]  # text, style, tag
Line = tuple[Run, ...]


def _char_width(ch: str) -> int:
    return 4 if ch == "\t" else get_character_cell_size(ch)


def line_starts(text: str, width: int) -> list[int]:
    """Offsets in `text` (one logical line, no newline) where visual lines start when wrapped to `width` cells."""
    width = max(1, width)
    starts = [0]
    col = 0
    space = -1  # last space on the current visual line
    widths = [_char_width(c) for c in text]
    for i, ch in enumerate(text):
        w = widths[i]
        while col + w > width and i > starts[-1]:
            # Break after the last space of this visual line when there is one, else at this character.
            start = space + 1 if ch != " " and space >= starts[-1] else i
            starts.append(start)
            col = sum(widths[start:i])
            space = text.rfind(" ", start, i)
        if ch == " ":
            space = i
        col += w
    return starts


def _split_runs(runs: list[Run], cuts: list[int]) -> list[Line]:
    """Cut a logical line's runs at character offsets `cuts` (ascending, starting with 0)."""
    lines: list[Line] = []
    bounds = [*cuts[1:], None]
    pos = 0  # character offset of the current run's start
    ri = 0
    current: list[Run] = []
    for end in bounds:
        current = []
        while ri < len(runs):
            text, style, tag = runs[ri]
            run_end = pos + len(text)
            if end is not None and run_end > end:
                take = end - pos
                if take > 0:
                    current.append((text[:take], style, tag))
                runs[ri] = (text[take:], style, tag)
                pos = end
                break
            current.append((text, style, tag))
            pos = run_end
            ri += 1
        lines.append(tuple(current))
    return lines


def wrap(pieces: Sequence[Piece], width: int) -> list[Line]:
    """Visual lines of `pieces` wrapped to `width` cells."""
    lines: list[Line] = []
    runs: list[Run] = []
    chars: list[str] = []

    def flush() -> None:
        logical = "".join(chars)
        lines.extend(_split_runs(runs, line_starts(logical, width)))
        runs.clear()
        chars.clear()

    for piece in pieces:
        parts = piece.text.split("\n")
        for k, part in enumerate(parts):
            if k:
                flush()
            if part:
                runs.append((part, piece.style, piece.tag))
                chars.append(part)
    flush()
    return lines


def line_cells(line: Line) -> int:
    return sum(_char_width(c) for text, _, _ in line for c in text)


def to_strip(line: Line, width: int, base: Style) -> Strip:
    segments = [Segment(text.replace("\t", "    "), base + style) for text, style, _ in line if text]
    return Strip(segments).extend_cell_length(width, base).crop(0, width)


def tag_at(line: Line, x: int) -> int:
    """The tag of the run under cell column `x` (-1 past the end)."""
    col = 0
    for text, _, tag in line:
        for c in text:
            col += _char_width(c)
            if x < col:
                return tag
    return -1


# -- entropy ramp -----------------------------------------------------------------------------------------------

# Low entropy (the model is sure) is green, high is red. 4 nats is a spread over ~55 tokens: past that a slot
# is noise whatever the exact value, so the ramp saturates there.
RAMP = (Color.parse("#5fd75f"), Color.parse("#d7d75f"), Color.parse("#ff8700"), Color.parse("#ff5f5f"))
RAMP_MAX_NATS = 4.0
RAMP_STEPS = 16  # quantised: a handful of distinct styles, so strips compare equal across frames


@lru_cache(maxsize=RAMP_STEPS + 1)
def _ramp_color(step: int) -> Color:
    x = step / RAMP_STEPS * (len(RAMP) - 1)
    lo = min(int(x), len(RAMP) - 2)
    a, b = RAMP[lo].get_truecolor(), RAMP[lo + 1].get_truecolor()
    t = x - lo
    return Color.from_rgb(
        a.red + (b.red - a.red) * t, a.green + (b.green - a.green) * t, a.blue + (b.blue - a.blue) * t
    )


def entropy_color(entropy: float | None) -> Color | None:
    """The ramp colour of an entropy in nats (None when unknown)."""
    if entropy is None:
        return None
    x = min(max(entropy, 0.0), RAMP_MAX_NATS) / RAMP_MAX_NATS
    return _ramp_color(round(x * RAMP_STEPS))


def ramp_legend(cells: int = 8) -> list[Piece]:
    """A small swatch of the ramp from low to high entropy."""
    return [Piece("█", Style(color=_ramp_color(round(k / max(1, cells - 1) * RAMP_STEPS)))) for k in range(cells)]
