"""Scenes for tests that must not depend on timing: the editor with no server, fed the protocol messages a server
would send (`doc.state`, `gen.accepted`, `gen.progress`, `gen.done`), built with `canvas.protocol` and posted to
the screen through the same handlers the network path uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.pilot import Pilot

from canvas.protocol import (
    DiffSegment,
    DocState,
    GenAccepted,
    GenDone,
    GenParams,
    GenProgress,
    GenStats,
    Limits,
    ModelInfo,
    Proposal,
    ServerInfo,
    ServerLimits,
    SlotUpdate,
    Span,
    Welcome,
    Window,
)
from tests.tui.helpers import settings_file
from tui.app import DcanvasApp
from tui.messages import Connected, DocUpdated, GenFinished, GenFrame, GenStarted

TEXT = (
    "The cat sat on the mat and watched the rain.\n"
    "A dog ran past the open door, and the cat did not move.\n"
    "\n"
    "Once upon a time there was a small house by a river.\n"
)
# " watched the rain" (26..43) is masked: 3 slots; a gap of 4 slots at 94, before " move".
SPANS = [
    Span(kind="pinned", start=0, end=26, slots=6),
    Span(kind="free", start=26, end=43, slots=3),
    Span(kind="pinned", start=43, end=94, slots=14),
    Span(kind="free", start=94, end=94, slots=4),
    Span(kind="pinned", start=94, end=155, slots=5),
]
STATE = DocState(doc_id="d-snap", v=4, name="story.txt", text=TEXT, window=Window(start=0, end=155), spans=SPANS)
WELCOME = Welcome(
    session="s-snap",
    server=ServerInfo(name="dcanvas", version="0.1.0"),
    model=ModelInfo(name="tiny-random", canvas_length=32, modes=["diffusion", "ar"]),
    limits=Limits(**ServerLimits().to_wire().model_dump()),
)
PARAMS = GenParams(max_steps=16, seed=42)


def app_for(tmp_path: Path) -> DcanvasApp:
    path = tmp_path / "story.txt"
    path.write_text(TEXT, encoding="utf-8")
    return DcanvasApp(path, settings_path=settings_file(tmp_path), connect=False)


async def settle(pilot: Pilot[Any]) -> None:
    await pilot.pause(0.15)  # handlers, then at least one canvas flush (30 fps)
    await pilot.wait_for_scheduled_animations()


async def opened(pilot: Pilot[Any]) -> None:
    app = pilot.app
    assert isinstance(app, DcanvasApp)
    screen = app.main
    screen.editor.cursor_blink = False
    screen.post_message(Connected("ws://127.0.0.1:8765/ws", WELCOME))
    screen.sync.state = STATE
    screen.post_message(DocUpdated(STATE, sent=TEXT))
    await settle(pilot)


def frame(seq: int, step: int, slots: list[tuple[int, str, float, bool]]) -> GenProgress:
    ups = [SlotUpdate(i=i, token=100 + k, text=t, entropy=e, accepted=a) for k, (i, t, e, a) in enumerate(slots)]
    return GenProgress(gen="g-snap", seq=seq, step=step, max_steps=16, slots=ups, accepted=sum(s[3] for s in slots),
                       free=7, elapsed_s=0.05 * step)  # fmt: skip


async def generating(pilot: Pilot[Any]) -> None:
    await opened(pilot)
    app = pilot.app
    assert isinstance(app, DcanvasApp)
    screen = app.main
    screen.phase = "starting"
    screen.post_message(GenStarted(GenAccepted(gen="g-snap", doc_id="d-snap", base_v=4, params=PARAMS)))
    # Slots 6-8 rewrite " watched the rain", 23-26 fill the gap: a spread of entropies and states.
    screen.post_message(GenFrame(frame(1, 1, [(6, " looked", 3.9, False), (7, " at", 2.6, False),
                                               (8, " sky", 4.4, False), (23, " even", 1.7, False),
                                               (24, " an", 3.1, False), (25, " inch", 0.9, True)])))  # fmt: skip
    screen.post_message(GenFrame(frame(2, 3, [(6, " watched", 0.4, True), (7, " the", 0.05, True),
                                               (8, " snow", 2.2, False), (23, " once", 1.2, True)])))  # fmt: skip
    await settle(pilot)


# An AR infill mid-way: the writer has written the masked span's three slots and the gap's first; the gap's last
# three still hold the canvas's initial noise. The contract sends them as token -1 with no text; these carry the
# noise tokens' text all the same (as servers that predate `written` did), which the view must never show.
AR_NOISE = ("Sele", " Deliver", " Syrian", "sport']])", " Quarterly", "Vue")  # slots 7, 8, 23-26
AR_WRITTEN = (" looked", " out", " there", " even")


def ar_frame(seq: int, written: dict[int, tuple[str, float]], unwritten: dict[int, str]) -> GenProgress:
    ups = [SlotUpdate(i=i, token=200 + i, text=t, entropy=e, accepted=True) for i, (t, e) in written.items()]
    ups += [SlotUpdate(i=i, token=-1, text=t, accepted=False, written=False) for i, t in unwritten.items()]
    return GenProgress(gen="g-snap", seq=seq, step=seq, max_steps=16, slots=ups, accepted=len(written), free=7,
                       elapsed_s=0.05 * seq)  # fmt: skip


async def ar_midway(pilot: Pilot[Any]) -> None:
    await opened(pilot)
    app = pilot.app
    assert isinstance(app, DcanvasApp)
    screen = app.main
    screen.phase = "starting"
    params = GenParams(mode="ar", max_steps=16, seed=42)
    screen.post_message(GenStarted(GenAccepted(gen="g-snap", doc_id="d-snap", base_v=4, params=params)))
    # The first frame carries every free slot; each later one the slot it wrote (a delta).
    first = dict(zip((7, 8, 23, 24, 25, 26), AR_NOISE, strict=True))
    screen.post_message(GenFrame(ar_frame(1, {6: (AR_WRITTEN[0], 0.6)}, first)))
    screen.post_message(GenFrame(ar_frame(2, {7: (AR_WRITTEN[1], 1.4)}, {})))
    screen.post_message(GenFrame(ar_frame(3, {8: (AR_WRITTEN[2], 2.7)}, {})))
    screen.post_message(GenFrame(ar_frame(4, {23: (AR_WRITTEN[3], 0.3)}, {})))
    await settle(pilot)


async def proposal_shown(pilot: Pilot[Any]) -> None:
    await generating(pilot)
    app = pilot.app
    assert isinstance(app, DcanvasApp)
    diff = [
        DiffSegment(op="equal", text=" watched the "),
        DiffSegment(op="delete", text="rain"),
        DiffSegment(op="insert", text="snow"),
        DiffSegment(op="equal", text=".\nA dog ran past the open door, and the cat did not"),
        DiffSegment(op="insert", text=" once"),
    ]
    assert "".join(d.text for d in diff if d.op != "insert") == TEXT[26:94]
    proposal = Proposal(base_v=4, start=26, end=94, text="".join(d.text for d in diff if d.op != "delete"), diff=diff)
    stats = GenStats(steps=9, tokens_per_forward=0.78, tok_s=41.5, wall_s=0.17)
    done = GenDone(gen="g-snap", doc_id="d-snap", status="completed", proposal=proposal, stats=stats)
    app.main.post_message(GenFinished("g-snap", done))
    await settle(pilot)
