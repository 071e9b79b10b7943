"""Token healing at a FIM prompt's left edge (`heal_split`): the prefix ends at a word boundary, as every prefix the
fine-tune saw did, with the partial word moved to the middle's start."""

from __future__ import annotations

import numpy as np
import pytest

from canvas.convert.fim import heal_split

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
