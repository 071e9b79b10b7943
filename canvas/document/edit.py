"""Local re-tokenisation of a plain text edit: which atoms an edit replaces, and with what.

Only the atoms the edit touches are re-encoded, together with as many pinned neighbours as it takes for the
re-encoding to reproduce the outermost neighbour unchanged (typing "lo" after "Hel" yields the token "Hello", not
"Hel" + "lo"). Neighbours never come from across a barrier: free atoms (masked text, gaps: their tokens are kept
for the model) and the window start (new text stays on the side of the window it was typed on). The document
trims atoms the re-encoding leaves identical off the splice, so untouched tokens keep their identity.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

from canvas.document.base import Atom
from canvas.document.tokenizer import TextTokenizer, atoms_from_text


def local_edit(
    tokenizer: TextTokenizer,
    atoms: Sequence[Atom],
    starts: Sequence[int],
    ends: Sequence[int],
    window: int,
    start: int,
    end: int,
    text: str,
    max_atoms: int,
) -> tuple[int, int, list[Atom], bool]:
    """Splice `(index, n_old, new atoms, in_window)` that replaces characters [start, end) with `text`;
    `in_window` says on which side of the window start the new atoms belong.

    `starts`/`ends` are the atoms' character offsets and `window` the atom index where the window starts. Gaps
    exactly at `start` or `end` stay where they are; an insertion at a boundary goes after any gaps there.
    """
    n = len(atoms)
    i = bisect_right(ends, start)  # first atom ending after `start`: the one containing it or starting there
    if start < end:
        j = bisect_left(starts, end)
    else:
        j = i + 1 if i < n and starts[i] < start else i  # an insertion inside a token re-encodes that token
    prefix = atoms[i].text[: start - starts[i]] if i < j else ""
    suffix = atoms[j - 1].text[end - starts[j - 1] :] if i < j else ""
    straddle = i < window < j  # the edit covers the window start, which will move to the new text
    in_window = j > window if i < j else i >= window

    def joinable(k: int) -> bool:
        return not atoms[k].free and (k >= window) == in_window

    reach = 1
    while True:
        lo, hi = i, j
        while lo > 0 and i - lo < reach and not straddle and joinable(lo - 1):
            lo -= 1
        while hi < n and hi - j < reach and joinable(hi):
            hi += 1
        left = "".join(a.text for a in atoms[lo:i])
        right = "".join(a.text for a in atoms[j:hi])
        new = atoms_from_text(tokenizer, left + prefix + text + suffix + right)
        # A side is settled when it could not extend as far as asked (a barrier) or its outermost atom survived.
        left_ok = i - lo < reach or new[:1] == [atoms[lo]]
        right_ok = hi - j < reach or new[-1:] == [atoms[hi - 1]]
        if (left_ok and right_ok) or reach >= max_atoms:
            break
        reach *= 2
    return lo, hi - lo, new, in_window
