"""`dcanvas bench typing`'s replay: the requests are llama.vim's FIM requests, one typed character apart."""

from __future__ import annotations

import pytest

from canvas.bench.typing import RESPONSE_FIELDS, TypingError, request, session


def test_each_keystroke_is_llama_vims_request_one_character_on() -> None:
    s = session(None, prefix_chars=6000, min_line=60, column=24, keystrokes=5, chunks=4, chunk_lines=64)
    assert len(s.typed) == 5 and len(s.extra) == 4
    bodies = [request(s, k, n_prefix=256, n_suffix=64, n_predict=128) for k in range(6)]
    first = bodies[0]
    assert first["input_prefix"].endswith("\n") and first["input_prefix"].count("\n") == min(256, s.row)
    assert first["input_suffix"].startswith("\n") and first["input_suffix"].count("\n") == 1 + min(64, len(
        s.lines) - s.row - 1)
    assert first["prompt"] == s.lines[s.row][:24]
    assert first["n_predict"] == 128 and first["cache_prompt"] is True and first["t_max_predict_ms"] == 250
    assert first["top_k"] == 40 and first["top_p"] == 0.90 and first["response_fields"] == RESPONSE_FIELDS
    assert sum(len(c["text"]) for c in first["input_extra"]) > 0
    for k, b in enumerate(bodies):
        assert b["prompt"] == s.lines[s.row][: 24 + k]  # the line as typed so far
        assert {f: b[f] for f in ("input_prefix", "input_suffix", "input_extra")} == {
            f: first[f] for f in ("input_prefix", "input_suffix", "input_extra")}


def test_a_text_without_a_long_enough_line_is_refused() -> None:
    with pytest.raises(TypingError, match="no line"):
        session("short\nlines\n", prefix_chars=0, min_line=60, column=0, keystrokes=3, chunks=1, chunk_lines=4)
