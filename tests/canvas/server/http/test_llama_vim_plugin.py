"""The real llama.vim plugin, unmodified, in a headless vim under tmux against a `dcanvas serve` process on the
embedded `canvas-6m` model: its ghost text appears while the user types (FIM, `/infill`), and an instruction on a
selected line comes back ready and replaces the line when accepted (`/v1/chat/completions`).

The plugin is not in this repository and cannot be fetched during the tests: the test runs when `LLAMA_VIM_DIR`
names a checkout of https://github.com/ggml-org/llama.vim (tried at a1c8e6e40cb45df59b78add5b65d575386832465 with
Debian 12's vim 9.0, which the plugin warns is older than it wants and which works) and vim, tmux and curl are
installed; it is skipped otherwise. `tests/canvas/server/http/test_llama_vim_e2e.py` sends the same requests without
vim.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from canvas.engine.backend import default_model_dir
from tests.canvas.server.http.test_openai_e2e import TOKEN, Server
from tests.tui.test_smoke import Terminal

PLUGIN = os.environ.get("LLAMA_VIM_DIR")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not PLUGIN or not (Path(PLUGIN) / "autoload" / "llama.vim").is_file(),
                       reason="set LLAMA_VIM_DIR to a checkout of github.com/ggml-org/llama.vim"),
    pytest.mark.skipif(any(shutil.which(p) is None for p in ("vim", "tmux", "curl")),
                       reason="needs vim, tmux and curl (apt-get install vim-nox tmux curl)"),
]
LINES = ["import math", "", "", "def area(r):", "    y = math.pi * r * r", "    return y", "", "",
         "print(area(2.0))"]  # fmt: skip


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = default_model_dir()
    if model is None:
        pytest.skip("this installation has no embedded default model")
    s = Server(Path(model), tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    term = Terminal(f"dcanvas-llama-vim-{os.getpid()}")
    yield term
    term.close()


def test_llama_vim_fim_and_instruction_mode(server: Server, terminal: Terminal, tmp_path: Path) -> None:
    source = tmp_path / "area.py"
    source.write_text("\n".join(LINES) + "\n")
    vimrc = tmp_path / "vimrc"
    vimrc.write_text(
        "set nocompatible\n"
        f"set rtp+={PLUGIN}\n"
        f"let g:llama_config = {{'endpoint_fim': '{server.url}/infill', "
        f"'endpoint_inst': '{server.url}/v1/chat/completions', 'api_key': '{TOKEN}', 'n_predict': 32}}\n"
    )
    env = {"TERM": "xterm-256color", "HOME": str(tmp_path), "PATH": os.environ.get("PATH", "")}
    terminal.start(f"vim -u {vimrc} -i NONE {source}", env)
    screen = terminal.wait(lambda s: "def area(r):" in s or "Press ENTER" in s, "vim to open the file", timeout=30)
    if "Press ENTER" in screen:  # the plugin's warning on a vim older than 9.1
        terminal.keys("Enter")
        terminal.wait(lambda s: "def area(r):" in s, "vim to open the file", timeout=30)
    before = server.http()["completed"]

    # FIM: a new line after line 5, typed up to "    z = ": the ghost text follows it on the screen.
    terminal.keys(":5", "Enter")
    terminal.keys("o")
    terminal.keys("    z = ")
    screen = terminal.wait(lambda s: any(line.startswith("    z = ") and len(line.rstrip()) > len("    z = ")
                                         for line in s.splitlines()), "the ghost text")  # fmt: skip
    assert server.http()["completed"] > before, screen

    # Instruction mode: undo the new line, select line 5, give an instruction, accept the result with Tab.
    terminal.keys("Escape")
    terminal.keys("u")
    terminal.keys(":5", "Enter")
    terminal.keys("V")
    terminal.keys("\\lli")
    terminal.wait(lambda s: "Instruction:" in s, "the instruction prompt", timeout=30)
    terminal.keys("use r ** 2", "Enter")
    terminal.wait(lambda s: "Ready!" in s, "the instruction's result")
    terminal.keys(":5", "Enter")
    terminal.keys("Tab")
    out = tmp_path / "after.py"
    terminal.keys(f":w! {out}", "Enter")
    terminal.wait(lambda s: out.exists(), "the file to be written", timeout=30)
    lines = out.read_text().split("\n")
    # The selected line was replaced by the answer; the text around it is as it was.
    assert lines[:4] == LINES[:4] and lines[-len(LINES[5:]) - 1 : -1] == LINES[5:]
    assert lines[4:-len(LINES[5:]) - 1] != [LINES[4]]
    assert server.http()["failed"] == 0
