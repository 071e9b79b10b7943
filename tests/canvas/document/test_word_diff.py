"""A proposal's diff replaces whole words: read without colour (a plain terminal, a log), a rewrite shows the old
words and then the new ones, never their letters interleaved (the character diff of "atch" -> "and he carried" read
"atnd he charried")."""

from __future__ import annotations

import re

import pytest

from canvas.document.proposal import word_diff

CASES = [
    ("atch", "and he carried"),
    ("watched the boats go by. In", "the summer he played in the river"),
    (" cat sat on the mat.", " dog sat on the mat. Then"),
    ("x\n\ny", "x\ny"),
    ("", "new text"),
    ("old text", ""),
    ("naïve café", "naive café"),
]


@pytest.mark.parametrize(("old", "new"), CASES)
def test_word_diff_joins_back_and_cuts_only_between_words(old: str, new: str) -> None:
    chunks = word_diff(old, new)
    assert "".join(c.text for c in chunks if c.op != "insert") == old
    assert "".join(c.text for c in chunks if c.op != "delete") == new
    assert all(c.text for c in chunks) and all(a.op != b.op for a, b in zip(chunks, chunks[1:], strict=False))
    for text, ops in ((old, ("equal", "delete")), (new, ("equal", "insert"))):
        cuts, at = set(), 0
        for c in chunks:
            if c.op in ops:
                at += len(c.text)
                cuts.add(at)
        inside = {m.start() + k for m in re.finditer(r"\w+", text) for k in range(1, len(m.group()))}
        assert not cuts & inside, f"a chunk ends inside a word of {text!r}: {chunks}"


def test_a_rewrite_reads_old_words_then_new_ones() -> None:
    plain = "".join(c.text for c in word_diff("atch", "and he carried"))
    assert plain == "atchand he carried"
