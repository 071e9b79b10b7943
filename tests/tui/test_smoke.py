"""`dcanvas tui` as a real terminal program in tmux: it starts its embedded server, generates once, accepts, saves
and quits cleanly. Keys go in with `send-keys`; the screen is read with `capture-pane`."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tui.settings import Settings, save_settings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)"),
]
TEXT = "The cat sat on the mat. It was a warm day.\n"


class Terminal:
    """One tmux session on a private server socket, 80x24."""

    def __init__(self, name: str) -> None:
        self.base = ["tmux", "-L", name]
        self.name = name

    def tmux(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], check=True, capture_output=True, text=True).stdout

    def start(self, command: str, env: dict[str, str]) -> None:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        self.tmux("new-session", "-d", "-s", self.name, "-x", "80", "-y", "24", f"env {exports} {command}")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.name)

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", self.name, *keys)

    def wait(self, cond: Callable[[str], bool], what: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            assert "Traceback" not in screen, screen
            if cond(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the screen:\n{screen}")
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True)


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    term = Terminal(f"dcanvas-smoke-{os.getpid()}")
    yield term
    term.close()


def test_tui_in_a_real_terminal(terminal: Terminal, tiny_model: Path, tmp_path: Path) -> None:
    story = tmp_path / "story.txt"
    story.write_text(TEXT)
    exit_file = tmp_path / "exit-code"
    save_settings(Settings(seed=7, max_steps=6), tmp_path / "config" / "dcanvas" / "tui.json")
    env = {
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TERM": "xterm-256color",
        "PATH": os.environ.get("PATH", ""),
    }
    args = [sys.executable, "-m", "canvas.cli", "tui", str(story), "--model", str(tiny_model)]
    cmd = " ".join(shlex.quote(a) for a in args) + f"; echo $? > {shlex.quote(str(exit_file))}"
    terminal.start(f"sh -c {shlex.quote(cmd)}", env)

    terminal.wait(lambda s: "tiny-random" in s and " v0 " in s, "the embedded server and the document")
    terminal.keys("Right", "Right", "Right", "Right", "S-Right", "S-Right", "S-Right", "C-g")  # rewrite " cat"
    terminal.wait(lambda s: "Proposal:" in s, "the proposal")
    terminal.keys("Enter")
    terminal.wait(lambda s: "story.txt*" in s, "the accepted proposal")
    terminal.keys("C-s")
    terminal.wait(lambda s: "Saved story.txt" in s, "the save")
    terminal.keys("C-q")
    deadline = time.monotonic() + 30
    while not exit_file.exists():
        assert time.monotonic() < deadline, terminal.screen()
        time.sleep(0.2)
    assert exit_file.read_text().strip() == "0"
    assert story.read_text() != TEXT and (tmp_path / "story.txt~").read_text() == TEXT
    log = tmp_path / "state" / "dcanvas" / "tui.log"
    assert not log.exists() or "Traceback" not in log.read_text()
