"""The eval's join faults (`join_faults`): what a reader sees at an infill's edges."""

from __future__ import annotations

import pytest

from canvas.eval.metrics import join_faults


@pytest.mark.parametrize(
    ("before", "middle", "after", "faults", "joins"),
    [
        ("on Tuesday night.", " The storm passed.", " Officials said", 0, 2),
        ("on Tuesday night.", "The storm passed.", " Officials said", 1, 2),  # "night.The"
        ("on Tuesday night.", " and the storm passed", " Officials said", 1, 2),  # a sentence starting lowercase
        ("on Tuesday night. ", " The storm", " passed.", 1, 2),  # a doubled space
        ("He said", " that the storm.", " officials said", 1, 2),  # the right join too
        ("He said \u201cno.\u201d", " and left", ".", 1, 2),  # a closing quote after the full stop
        ("It cost 3", ".5 million", " dollars", 0, 2),  # a decimal point is followed by a digit, not a letter
        ("The U.S.", " officials", " said", 1, 2),  # an abbreviation reads as a sentence end: the human text pays too
        ("Tuesday night.", "", " Officials said", 0, 1),  # an empty fill: the sides' own join
        ("", "Once upon a time", " there", 0, 1),  # nothing before: that join is not counted
    ],
)
def test_join_faults(before: str, middle: str, after: str, faults: int, joins: int) -> None:
    assert join_faults(before, middle, after) == (faults, joins)
