"""`python -m tui.screenshot OUT.svg [--model DIR | --server URL]`: a real run of the editor, captured as SVG.

Runs the app headless at 80x24 on a short text, masks a phrase, opens a gap, generates with a fixed seed and saves
the screen after a few frames (the live view with its entropy colours) with `App.save_screenshot`. The README's
`docs/tui.svg` comes from here; run it again after the default model changes.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from textual.widgets.text_area import Selection

from tui.app import DcanvasApp
from tui.screens.prompt import PromptScreen
from tui.settings import Settings, save_settings

SAMPLE = (
    "The cat sat on the mat and watched the rain. A dog ran past the open door, and the cat did not move.\n"
    "\n"
    "Once upon a time there was a small house by a river. In the house lived a man who wrote letters every day.\n"
)
MASK = "watched the rain"
GAP_AFTER = "A dog"


async def capture(out: Path, *, model: str | None, server: str | None, frames: int, seed: int) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "story.txt"
        path.write_text(SAMPLE, encoding="utf-8")
        settings = save_settings(Settings(seed=seed, gap_tokens=6), Path(tmp) / "tui.json")
        app = DcanvasApp(path, server=server, model=model, settings_path=settings)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.main

            async def until(cond: Callable[[], object], what: str, timeout: float = 300.0) -> None:
                deadline = time.monotonic() + timeout
                while not cond():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"gave up waiting for {what}")
                    await pilot.pause(0.05)

            await until(lambda: screen.sync.ready, "the server")
            editor = screen.editor
            start = SAMPLE.index(MASK)
            editor.selection = Selection(editor.location_of(start), editor.location_of(start + len(MASK)))
            v = screen.sync.state.v if screen.sync.state else 0
            await pilot.press("ctrl+r")
            await until(lambda: screen.sync.state is not None and screen.sync.state.v > v, "the mask")
            at = SAMPLE.index(GAP_AFTER) + len(GAP_AFTER)
            editor.move_cursor(editor.location_of(at))
            await pilot.press("ctrl+n")
            await until(lambda: isinstance(app.screen, PromptScreen), "the gap prompt")
            await pilot.press("enter")
            await until(lambda: any(k == "gap" for _, _, k in editor.marks), "the gap")
            await pilot.press("end", "ctrl+g")
            await until(lambda: screen.live is not None and screen.live.frames >= frames, "frames")
            await pilot.pause(0.2)  # one more canvas flush
            out.parent.mkdir(parents=True, exist_ok=True)
            app.save_screenshot(filename=out.name, path=str(out.parent))
            await pilot.press("escape")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tui.screenshot", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="SVG file to write")
    parser.add_argument("--model", default=None, help="model directory for the embedded server")
    parser.add_argument("--server", default=None, help="use a running server instead")
    parser.add_argument("--frames", type=int, default=4, help="capture after this many frames (default 4)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    out = asyncio.run(capture(args.out, model=args.model, server=args.server, frames=args.frames, seed=args.seed))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
