"""Token healing at a FIM prompt's left edge (`heal_split`): the prefix ends at a word boundary, as every prefix the
fine-tune saw did, with the partial word moved to the middle's start."""

from __future__ import annotations

import numpy as np
import pytest

from canvas.convert.fim import LeadTokens, heal_split, lead_rest

# A made-up vocabulary: 0 " night" (starts a word), 1 "." , 2 "\n" (ends with whitespace), 3 " exer", 4 "cable",
# 5 " the", 6 "(" , 7 "x".
STARTS = np.array([True, False, True, True, False, True, False, False])
ENDS = np.array([False, False, True, False, False, False, False, False])


@pytest.mark.parametrize(
    ("left", "moved"),
    [
        ([5, 0, 1], 2),  # " the night." -> " night." opens the middle: a full stop is no word boundary by itself
        ([5, 0], 1),  # " the night": the last word may go on ("nightly") or end; the model decides, as text
        ([5, 3, 4], 2),  # " the" + " exer" "cable": mid-word, the word's tokens move together
        ([5, 0, 2], 0),  # ends with a line break: already a boundary
        ([], 0),
        ([3, 4], 0),  # the word is all of the left side: moving it would leave no prefix
        ([5] + [6, 7] * 5, 0),  # a run of 10 tokens without a boundary (code): longer than the limit, left as is
        ([2, 4, 1], 2),  # the boundary after a token that ends with whitespace
    ],
)
def test_heal_split(left: list[int], moved: int) -> None:
    assert heal_split(left, STARTS, ENDS) == moved


def test_limit_bounds_the_run() -> None:
    left = [5, 6, 7, 6, 7]
    assert heal_split(left, STARTS, ENDS, limit=4) == 0
    assert heal_split(left, STARTS, ENDS, limit=5) == 0  # the boundary would leave an empty prefix only at j=0
    assert heal_split([0, *left], STARTS, ENDS, limit=5) == 5


# Token healing by constraint (`LeadTokens`): a made-up vocabulary of decoded texts.
TEXTS = ["<pad>", " ", "  ", " a", " app", " applied", " applies", "lie", "lied", "d", " the", "  the", "the", " n",
         " never", "\n", " \n"]


def _texts(ids: np.ndarray) -> set[str]:
    return {TEXTS[int(i)] for i in ids}


def test_a_lead_allows_its_continuations_and_its_starts() -> None:
    lead = LeadTokens(TEXTS)
    assert _texts(lead.allowed(" applie")) == {" a", " app", " applied", " applies"}  # whole, or a start of it
    assert _texts(lead.allowed("lie")) == {"lie", "lied"}  # what is left after " app"
    assert _texts(lead.allowed(" n")) == {" n", " never"}  # " n" itself: the next token goes on from it
    assert lead.allowed("").size == 0 and lead.allowed(" zz").size == 0


def test_a_typed_space_allows_only_a_word_after_one_space() -> None:
    """Never the lone space (the word would follow without one), two spaces or a newline after it."""
    assert _texts(LeadTokens(TEXTS).allowed(" ")) == {" a", " app", " applied", " applies", " the", " n", " never"}


def test_lead_rest_follows_the_tokens_written() -> None:
    assert lead_rest(" applie", " app") == "lie" and lead_rest("lie", "lied") == "" and lead_rest(" n", " n") == ""
    assert lead_rest(" ", " the") == ""
