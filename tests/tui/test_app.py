"""The editor end to end under Textual's Pilot, against a real dcanvas/1 server running a tiny random model.

Keys are pressed as a user would; assertions read the app's state (the text area, the server state it mirrors,
the phase, the canvas view's counters) and the files on disk.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from textual.pilot import Pilot

from tests.tui.helpers import free_port, make_app, settings_file, wait_until
from tui.app import DcanvasApp
from tui.live import LiveCanvas, ProposalView
from tui.messages import GenFinished
from tui.widgets.banner import Banner
from tui.widgets.canvas_view import CanvasView

pytestmark = pytest.mark.timeout(120)
TEXT = "The cat sat on the mat. It was a warm day.\n"


def free_spans(app: DcanvasApp) -> list[tuple[int, int]]:
    state = app.main.sync.state
    assert state is not None
    return [(s.start, s.end) for s in state.spans if s.kind == "free" and s.end > s.start]


def version(app: DcanvasApp) -> int:
    state = app.main.sync.state
    return -1 if state is None else state.v


async def connected(pilot: Pilot[int], app: DcanvasApp) -> None:
    await wait_until(pilot, lambda: app.main.sync.ready, "the document to open on the server")


async def test_open_pin_mask_generate_accept_undo_save(tmp_path: Path, server_url: str) -> None:
    app = make_app(tmp_path, TEXT, server=server_url)
    story = tmp_path / "story.txt"
    original = story.read_bytes()
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.main
        await connected(pilot, app)
        assert screen.editor.doc_text == TEXT
        # Select "cat sat" with the keyboard and mask it, then pin "sat" back: only "cat" stays free.
        await pilot.press(*["right"] * 4, *["shift+right"] * 7, "ctrl+r")
        await wait_until(pilot, lambda: free_spans(app) != [], "the mask")
        assert free_spans(app) == [(3, 11)]  # snapped outward to tokens: " cat sat"
        await pilot.press("home", *["right"] * 8, *["shift+right"] * 3, "ctrl+p")
        await wait_until(pilot, lambda: free_spans(app) != [(3, 11)], "the pin")
        assert free_spans(app) == [(3, 7)]
        assert screen.editor.marks and screen.editor.marks[0][2] == "free"

        # Generate (no selection: the masked text): the live view gets frames, then the proposal diff.
        await pilot.press("end", "ctrl+g")
        await wait_until(pilot, lambda: screen.phase == "proposal", "the proposal")
        view = app.main.canvas
        live = screen.live
        assert isinstance(live, LiveCanvas) and live.frames >= 1
        assert view.live_frames_drawn >= 1  # a frame reached the screen, not just the model
        assert view.last_live_drafts and all(t in view.last_live_text for t in view.last_live_drafts)
        proposal = screen.proposal
        assert isinstance(proposal, ProposalView) and view.source is proposal
        p = proposal.proposal
        expected = TEXT[: p.start] + p.text + TEXT[p.end :]

        # Accept: the text changes as one undo unit; save writes it and keeps a backup of the original.
        v = version(app)
        await pilot.press("enter")
        await wait_until(pilot, lambda: version(app) > v and screen.editor.doc_text == expected, "accept")
        assert screen.phase == "idle"
        assert screen.sync.state is not None and screen.sync.state.text == expected
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: story.read_bytes() == expected.encode(), "the save")
        assert (tmp_path / "story.txt~").read_bytes() == original

        # Undo takes the whole proposal back; saving again restores the file byte for byte.
        v = version(app)
        await pilot.press("ctrl+z")
        await wait_until(pilot, lambda: version(app) > v and screen.editor.doc_text == TEXT, "undo")
        assert free_spans(app) == [(3, 7)]  # the mask is back too
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: story.read_bytes() == original, "the second save")


async def test_cancel_mid_generation(tmp_path: Path, server_url: str) -> None:
    # The random model never converges and steps are paced (conftest), so 256 steps last long enough to cancel.
    app = make_app(tmp_path, TEXT, server=server_url, settings=settings_file(tmp_path, max_steps=256))
    finished: list[GenFinished] = []
    async with app.run_test(
        size=(80, 24), message_hook=lambda m: finished.append(m) if isinstance(m, GenFinished) else None
    ) as pilot:
        screen = app.main
        await connected(pilot, app)
        await pilot.press(*["right"] * 4, *["shift+right"] * 3, "ctrl+g")  # generate on a selection masks it
        await wait_until(pilot, lambda: screen.live is not None and screen.live.frames >= 2, "frames")
        await pilot.press("escape")
        await wait_until(pilot, lambda: screen.phase == "idle", "the cancel")
        done = [m.done for m in finished if m.done is not None]
        assert [d.status for d in done] == ["cancelled"], done
        assert done[0].stats.steps < 256
        assert screen.editor.display and not screen.canvas.display
        assert screen.editor.doc_text == TEXT and free_spans(app) == [(3, 7)]


async def test_proposal_reject_regenerate_and_accept_part(tmp_path: Path, server_url: str) -> None:
    app = make_app(tmp_path, TEXT, server=server_url, settings=settings_file(tmp_path, max_steps=3))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.main
        await connected(pilot, app)
        await pilot.press(*["right"] * 4, *["shift+right"] * 3, "ctrl+g")
        await wait_until(pilot, lambda: screen.phase == "proposal", "the first proposal")
        first = screen.proposal
        assert first is not None
        await pilot.press("g")  # regenerate: the first proposal is dropped, a new seed runs
        await wait_until(pilot, lambda: screen.phase == "proposal" and screen.proposal is not first, "regenerate")
        assert screen.run_info.seed != 7
        second = screen.proposal
        assert second is not None and second.gen != first.gen
        await pilot.press("x")  # reject: nothing changes
        await wait_until(pilot, lambda: screen.phase == "idle", "reject")
        assert screen.editor.doc_text == TEXT
        await pilot.press("ctrl+g")  # the mask is still there: generate it again, accept only hunk 0
        await wait_until(pilot, lambda: screen.phase == "proposal", "the third proposal")
        third = screen.proposal
        assert third is not None
        part = TEXT[: third.proposal.start] + third.new_text([0]) + TEXT[third.proposal.end :]
        await pilot.press("y")
        await wait_until(pilot, lambda: screen.phase == "idle", "accept part")
        assert screen.editor.doc_text == part


async def test_server_loss_shows_error_and_reconnects(tmp_path: Path, tiny_model: Path) -> None:
    """The banner names the loss from the moment the connection drops until the editor is connected again: the
    reconnect (here in well under a second) replaces its plan ("Starting the embedded server…"), never its reason."""
    app = make_app(tmp_path, TEXT, model=tiny_model, settings=settings_file(tmp_path, max_steps=256))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.main
        await connected(pilot, app)
        banner = screen.query_one(Banner)
        assert not banner.display
        await pilot.press(*["right"] * 4, *["shift+right"] * 3, "ctrl+g")
        await wait_until(pilot, lambda: screen.phase == "generating", "the generation")
        assert app.embedded is not None
        await asyncio.to_thread(app.embedded.stop)  # the server goes away mid-generation
        await wait_until(pilot, lambda: banner.display and "Lost the connection" in str(banner.render()), "banner")
        await wait_until(pilot, lambda: screen.phase == "idle", "the run to end")
        assert screen.run_info.connection in ("offline", "starting")
        # The editor keeps working offline, then reconnects (the embedded server restarts) and re-opens the text.
        await pilot.press("end", "!")
        assert screen.editor.doc_text == TEXT[:-1] + "!\n"
        await wait_until(pilot, lambda: screen.sync.ready and not banner.display, "the reconnect", timeout=90)
        await wait_until(
            pilot, lambda: screen.sync.state is not None and screen.sync.state.text == TEXT[:-1] + "!\n", "sync"
        )


async def test_unreachable_server_keeps_the_editor_usable(tmp_path: Path) -> None:
    url = f"ws://127.0.0.1:{free_port()}/ws"
    app = make_app(tmp_path, TEXT, server=url)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.main
        banner = screen.query_one(Banner)
        await wait_until(pilot, lambda: banner.display and "Cannot reach" in str(banner.render()), "the banner")
        assert "Retrying" in str(banner.render())
        await pilot.press("ctrl+g")  # no crash, no generation: a message says why
        assert screen.phase == "idle"
        await pilot.press("end", "x", "ctrl+s")
        story = tmp_path / "story.txt"
        await wait_until(pilot, lambda: story.read_text() == "The cat sat on the mat. It was a warm day.x\n", "save")


async def test_view_shows_only_changed_lines(tmp_path: Path, server_url: str) -> None:
    # A long document: frames re-render the lines around the window, never the whole view.
    body = "".join(f"Line {k}: the cat sat on the mat.\n" for k in range(60))
    app = make_app(tmp_path, body, server=server_url)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.main
        await connected(pilot, app)
        await pilot.press("ctrl+g")  # nothing masked: a gap at the cursor
        await wait_until(pilot, lambda: screen.phase == "proposal", "the proposal")
        view: CanvasView = screen.canvas
        # Frame layouts only: showing a new source (the live canvas, then the proposal) draws the whole view once.
        counts = view.frame_refreshes
        assert counts, "no frame reached the view before the proposal"
        view_lines = len(body.splitlines()) + 1
        assert max(counts) < view_lines // 2, counts  # never the whole view
        assert sum(counts) / len(counts) < 20, counts
