"""`SamplerConfig.ar_first_newline` False: no AR draft breaks its line while its text is blank, even where the model's
likeliest tokens are a line break and a space (the tiny random model with two ids' logits raised, standing for them);
once the draft has written on its line a line break may come, and the default leaves every token alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from canvas.engine.ar import LineTokens, line_tokens
from canvas.engine.core import Engine
from canvas.model import DiffusionModel, ModelConfig
from tests.canvas.engine.test_ar import NULL, PLAIN, infill, run
from tests.canvas.engine.test_ar_fim import FIM

NEWLINE, SPACE = 77, 78  # the ids that stand for a newline and a space here
LINES = LineTokens(frozenset({NEWLINE}), frozenset({SPACE}))
# Far above any other logit of the random model: the newline is the greedy choice everywhere, then the space.
BIAS = {NEWLINE: 50.0, SPACE: 45.0}


@pytest.fixture(scope="module")
def model() -> Iterator[DiffusionModel]:
    torch.manual_seed(0)
    m = DiffusionModel(ModelConfig.from_name("tiny").replace(null_token_id=NULL)).eval()
    logits = m.logits

    def biased(h: torch.Tensor, quant: bool = False) -> torch.Tensor:
        out = logits(h, quant)
        for token, bias in BIAS.items():
            out[..., token] += bias
        return out

    m.logits = biased  # type: ignore[method-assign]
    yield m
    del m.logits


def test_line_tokens_are_read_from_the_token_texts() -> None:
    texts = ["a", "\n", "\u2581\n", "x\n", "<0x0A>", "\n\n", " \t\n", "", "\u2581a", "\r", " ", "\u2581\u2581", "\t"]
    assert line_tokens(texts) == LineTokens(frozenset({1, 2, 4, 5, 6, 9}), frozenset({10, 11, 12}))


def _blank_then_break(draft: list[int] | tuple[int, ...]) -> bool:
    """Whether `draft` breaks its line before writing a token other than a space."""
    for t in draft:
        if t == NEWLINE:
            return True
        if t != SPACE:
            return False
    return False


@pytest.mark.parametrize("cfg", [{"ar_drafts": 4, "ar_temperature": 0.0}, {"ar_drafts": 3, "ar_temperature": 1.0},
                                 {**PLAIN, "ar_temperature": 0.0}], ids=["scored-greedy", "scored-sampled", "plain"])
def test_no_draft_breaks_its_line_while_it_is_blank(model: DiffusionModel, cfg: dict[str, object]) -> None:
    engine = Engine(model, max_batch=2, lines=LINES)
    left, gap = 3, 8
    banned = infill((1, 2), left, gap, 3, seed=5, ar_first_newline=False, **cfg)  # type: ignore[arg-type]
    free = infill((1, 2), left, gap, 3, seed=5, **cfg)  # type: ignore[arg-type]
    (done_b, done_f), (frames_b, _) = run(engine, [banned, free])
    assert done_f.canvases[0][left] == NEWLINE  # the model's choice, left alone by default
    fill = done_b.canvases[0][left : left + gap]
    assert fill[0] != NEWLINE and not _blank_then_break(fill)
    drafts = [lane for frame in frames_b if frame.drafts is not None for lane in frame.drafts.tokens] or [fill]
    assert not any(_blank_then_break(lane) for lane in drafts)  # every draft, not only the one written
    assert any(NEWLINE in lane for lane in drafts)  # once a line has text, a line break may follow


def test_without_line_tokens_nothing_is_banned(model: DiffusionModel) -> None:
    engine = Engine(model, max_batch=1)  # a tokenizer with no line breaks: the setting changes nothing
    (done,), _ = run(engine, [infill((1, 2), 3, 4, 3, ar_first_newline=False, ar_drafts=2, ar_temperature=0.0)])
    assert done.canvases[0][3] == NEWLINE


def test_no_fim_draft_ends_while_it_is_blank(model: DiffusionModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the FIM frame with no minimum fill, where `<|fim_end|>` is the likeliest token, then the space: under
    `ar_first_newline` False no draft ends while it is only spaces (its first line would hold no text), which by
    default it does as soon as its first token is written."""
    monkeypatch.setitem(BIAS, FIM.end, 60.0)
    monkeypatch.setitem(BIAS, SPACE, 55.0)
    engine = Engine(model, max_batch=2, lines=LINES, fim=FIM)
    left, gap = 3, 6
    cfg = {"ar_drafts": 2, "ar_temperature": 0.0, "ar_seam_tokens": 2, "ar_min_fill": 0.0, "ar_endings": 1}
    banned = infill((1, 2), left, gap, 3, seed=5, ar_first_newline=False, **cfg)  # type: ignore[arg-type]
    free = infill((1, 2), left, gap, 3, seed=5, **cfg)  # type: ignore[arg-type]
    (done_b, done_f), (frames_b, _) = run(engine, [banned, free])
    assert done_f.canvases[0][left : left + gap] == (SPACE,) + (NULL,) * (gap - 1)  # ended after a space
    fill = [t for t in done_b.canvases[0][left : left + gap] if t != NULL]
    assert any(t != SPACE for t in fill)  # spaces, then text (the repeat ban ends the run of spaces)
    lanes = [lane for frame in frames_b if frame.drafts is not None for lane in frame.drafts.tokens]
    assert lanes and any(FIM.end in lane for lane in lanes)  # the drafts do end...
    for lane in lanes:  # ...never while blank
        assert FIM.end not in lane or any(t != SPACE for t in lane[: lane.index(FIM.end)]), lane
