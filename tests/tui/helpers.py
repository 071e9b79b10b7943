"""Helpers for the editor's tests: ports, settings files, waiting on a running app, building the app."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from textual.pilot import Pilot

from tui.app import DcanvasApp
from tui.settings import Settings, save_settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def settings_file(tmp_path: Path, **fields: object) -> Path:
    path = tmp_path / "settings.json"
    save_settings(Settings.model_validate({"seed": 7, "max_steps": 6, **fields}), path)
    return path


async def wait_until(pilot: Pilot[int], cond: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """Let the app run until `cond()` holds (the server answers on its own thread meanwhile)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.05)


def make_app(
    tmp_path: Path, text: str | None = "The cat sat on the mat. It was a warm day.\n", **kwargs: object
) -> DcanvasApp:
    path = tmp_path / "story.txt"
    if text is not None:
        path.write_text(text, encoding="utf-8", newline="")
    settings = kwargs.pop("settings", None) or settings_file(tmp_path)
    return DcanvasApp(path, settings_path=settings, **kwargs)  # type: ignore[arg-type]
