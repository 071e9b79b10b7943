"""More of the editor under Pilot: gaps, AR mode, the canvas window, another client's edits, settings, files,
quitting, and frame coalescing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from textual.widgets import Input

from canvas.protocol import ReplaceOp
from canvas.protocol.client import DcanvasClient
from tests.tui.helpers import make_app, settings_file, wait_until
from tests.tui.scenes import AR_NOISE, app_for, ar_frame, ar_midway, frame, generating
from tui.app import DcanvasApp
from tui.live import UNWRITTEN_GLYPH
from tui.messages import GenFrame
from tui.screens.prompt import PromptScreen
from tui.screens.settings import SettingsScreen
from tui.settings import mode_label
from tui.widgets.canvas_view import MAX_FPS
from tui.widgets.mode_line import ModeLine
from tui.widgets.status_bar import StatusBar

pytestmark = pytest.mark.timeout(120)
TEXT = "The cat sat on the mat. It was a warm day.\n"


async def test_gap_prompt_then_ar_generation(tmp_path: Path, server_url: str) -> None:
    app = make_app(tmp_path, TEXT, server=server_url, settings=settings_file(tmp_path, mode="ar"))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.main
        await wait_until(pilot, lambda: screen.sync.ready, "the document")
        await pilot.press(*["right"] * 7, "ctrl+n")  # after "The cat"
        await wait_until(pilot, lambda: isinstance(app.screen, PromptScreen), "the gap prompt")
        await pilot.press("backspace", "backspace", "3", "enter")
        await wait_until(pilot, lambda: any(k == "gap" for _, _, k in screen.editor.marks), "the gap")
        state = screen.sync.state
        assert state is not None
        assert [(s.start, s.slots) for s in state.spans if s.kind == "free"] == [(7, 3)]
        await pilot.press("ctrl+g")  # the gap is free: no new gap; AR mode drafts it, scored by the text after it
        await wait_until(pilot, lambda: screen.phase == "proposal", "the proposal")
        # The status line names what wrote the proposal (gen.done's stats.mode), not just "AR".
        assert screen.run_info.mode == mode_label("ar-infill") == "AR infill (K drafts, seam-scored)"
        assert "AR infill (K drafts, seam-scored)" in str(screen.query_one(StatusBar).render())
        assert screen.live is not None and screen.live.frames >= 1
        await pilot.press("escape")
        await wait_until(pilot, lambda: screen.phase == "idle", "reject")
        await pilot.press("ctrl+u")  # unmask at the cursor: the gap goes
        await wait_until(pilot, lambda: not screen.editor.marks, "the unmask")


async def test_window_moves_with_f4_and_with_a_mask_outside_it(tmp_path: Path, server_url: str) -> None:
    body = "".join(f"Line {k}: the cat sat on the mat.\n" for k in range(30))
    line20 = body.index("Line 20")
    app = make_app(tmp_path, body, server=server_url)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.main

        def window() -> tuple[int, int]:
            st = screen.sync.state
            return (-1, -1) if st is None else (st.window.start, st.window.end)

        await wait_until(pilot, lambda: screen.sync.ready, "the document")
        assert window()[0] == 0 and window()[1] < len(body)
        # The marks follow the first state in a later refresh than the one that sets `ready`.
        await wait_until(pilot, lambda: any(k == "outside" for _, _, k in screen.editor.marks), "the outside mark")
        await pilot.press(*["down"] * 20, "f4")
        await wait_until(pilot, lambda: window()[0] == line20, "F4")
        # Mask "the" on the first line, now outside the window: the window comes back with the mask.
        await pilot.press("ctrl+home", *["right"] * 8, *["shift+right"] * 3, "ctrl+r")
        await wait_until(pilot, lambda: window()[0] == 0, "the mask")
        state = screen.sync.state
        assert state is not None
        ((start, end),) = [(s.start, s.end) for s in state.spans if s.kind == "free"]
        assert 6 <= start <= 8 and 11 <= end <= 12  # "the", snapped outward to tokens
        await pilot.press("ctrl+z")  # one undo takes back the mask and the move
        await wait_until(pilot, lambda: window()[0] == line20, "undo")


async def test_another_clients_edit_shows_up(tmp_path: Path, server_url: str) -> None:
    app = make_app(tmp_path, TEXT, server=server_url)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.main
        await wait_until(pilot, lambda: screen.sync.ready, "the document")
        state = screen.sync.state
        assert state is not None
        async with DcanvasClient.connect(server_url) as other:
            doc = await other.open(state.doc_id)
            await other.edit(doc.doc_id, doc.v, [ReplaceOp(start=0, end=3, text="A")])
            await wait_until(pilot, lambda: screen.editor.doc_text == "A" + TEXT[3:], "the broadcast")
            # Typing here after that goes on top of the other edit, not over it.
            await pilot.press("ctrl+end", "z")
            await wait_until(pilot, lambda: (screen.sync.state or state).text == "A" + TEXT[3:] + "z", "the push")


async def test_settings_screen_validates_and_persists(tmp_path: Path) -> None:
    settings = settings_file(tmp_path)
    app = make_app(tmp_path, TEXT, settings=settings, connect=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings")
        await pilot.press("tab", *["backspace"] * 3, "0", "enter")  # max steps 0: refused
        assert isinstance(app.screen, SettingsScreen)
        assert "max_steps" in str(app.screen.query_one("#settings-error").render())
        await pilot.press("backspace", "1", "2", "ctrl+s")
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsScreen), "save")
        assert app.settings.max_steps == 12
        assert json.loads(settings.read_text())["max_steps"] == 12
        await pilot.press("f2", "escape")  # cancel keeps them
        assert app.settings.max_steps == 12


async def test_mode_defaults_to_the_model_and_f8_toggles_the_diffusion_decoder(tmp_path: Path) -> None:
    settings = settings_file(tmp_path)
    app = make_app(tmp_path, TEXT, settings=settings, connect=False)
    async with app.run_test(size=(80, 24)) as pilot:
        assert app.settings.mode is None and app.settings.gen_params().mode is None  # the server resolves it
        assert app.main.run_info.mode == mode_label(None)
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings")
        await pilot.press("ctrl+s")  # the form keeps "model default" as no mode
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsScreen), "save")
        assert app.settings.mode is None and json.loads(settings.read_text())["mode"] is None
        await pilot.press("f8")
        assert app.settings.mode == "diffusion" and json.loads(settings.read_text())["mode"] == "diffusion"
        assert app.main.run_info.mode == mode_label("diffusion") and "untrained" in mode_label("diffusion")
        await pilot.press("f8")
        assert app.settings.mode is None and app.main.run_info.mode == mode_label(None)
        app.settings = app.settings.model_copy(update={"mode": "ar"})
        await pilot.press("f8")  # from AR, one key to diffusion
        assert app.settings.mode == "diffusion"


async def test_open_save_as_and_quit_with_unsaved_changes(tmp_path: Path) -> None:
    other = tmp_path / "other.md"
    other.write_bytes(b"# Title\r\n\r\nSome text.\r\n")
    app = make_app(tmp_path, TEXT, connect=False)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.main
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, PromptScreen), "the open prompt")
        app.screen.query_one(Input).value = str(other)  # typing the path key by key is slow under Pilot
        await pilot.press("enter")
        await wait_until(pilot, lambda: screen.editor.doc_text == "# Title\n\nSome text.\n", "the file")
        assert app.textfile.newline == "\r\n" and app.textfile.name == "other.md"
        await pilot.press("ctrl+end", "!", "f3")
        await wait_until(pilot, lambda: isinstance(app.screen, PromptScreen), "the save-as prompt")
        copy = tmp_path / "copy.md"
        app.screen.query_one(Input).value = str(copy)
        await pilot.press("enter")
        await wait_until(pilot, lambda: copy.exists(), "save as")
        assert copy.read_bytes() == b"# Title\r\n\r\nSome text.\r\n!"
        await pilot.press("x", "ctrl+q")  # unsaved: the first Ctrl+Q only warns
        await pilot.pause()
        assert app.is_running
        await pilot.press("ctrl+q")
        await wait_until(pilot, lambda: not app.is_running, "quit")


async def test_frames_are_coalesced(tmp_path: Path) -> None:
    app = app_for(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await generating(pilot)
        screen = app.main
        view = screen.canvas
        before, t0 = view.layouts, time.monotonic()
        for seq in range(3, 303):  # 300 frames as fast as they can be posted
            entropy = 4.0 * (1 - seq / 303)
            screen.post_message(GenFrame(frame(seq, seq, [(6, f" w{seq}", entropy, seq % 2 == 0)])))
            if seq % 50 == 0:
                await pilot.pause()
        await wait_until(pilot, lambda: screen.live is not None and screen.live.seq == 302, "the frames")
        await pilot.pause(0.1)
        elapsed = time.monotonic() - t0
        layouts = view.layouts - before
        assert layouts <= MAX_FPS * elapsed + 3, (layouts, elapsed)
        assert " w302" in view.last_live_text


async def test_an_ar_infill_mid_way_shows_blanks_where_it_has_not_written(tmp_path: Path) -> None:
    """The slots an AR row has not reached are drawn as blanks, never as the noise tokens they hold; a slot shows
    its text once a frame writes it."""
    app = app_for(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ar_midway(pilot)
        screen = app.main
        view = screen.canvas
        shown = view.last_live_text
        assert not [t for t in AR_NOISE if t.strip() in shown], shown
        assert " watched the rain" not in shown and "and looked out there." in shown  # the masked span, written
        assert f"did not even{UNWRITTEN_GLYPH * 3} move." in shown  # the gap: one slot written, three to go
        mode_line = str(screen.query_one(ModeLine).render())
        assert f"{UNWRITTEN_GLYPH}3 to write" in mode_line
        screen.post_message(GenFrame(ar_frame(5, {24: (" budge", 0.4)}, {})))
        await wait_until(pilot, lambda: "even budge" in view.last_live_text, "the next slot written")
        assert f"did not even budge{UNWRITTEN_GLYPH * 2} move." in view.last_live_text
        assert f"{UNWRITTEN_GLYPH}2 to write" in str(screen.query_one(ModeLine).render())


async def test_an_unreadable_file_is_never_overwritten(tmp_path: Path) -> None:
    binary = tmp_path / "image.bin"
    binary.write_bytes(b"\x89PNG\x00\x01\x02")
    app = DcanvasApp(binary, settings_path=settings_file(tmp_path), connect=False)
    async with app.run_test(size=(80, 24)) as pilot:
        assert app.textfile.path is None and app.main.editor.doc_text == ""
        await pilot.press("a", "ctrl+s")
        await wait_until(pilot, lambda: isinstance(app.screen, PromptScreen), "save as, not save")
    assert binary.read_bytes() == b"\x89PNG\x00\x01\x02"
