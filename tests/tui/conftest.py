"""Fixtures for the editor's tests: a tiny random model, a real embedded server on it, and app helpers.

The server is the real `canvas.server` app on uvicorn in a thread (`canvas.server.embedded`), started once per session;
tests that kill a server start their own. Settings live in a temporary file, never in the user's config.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from canvas.engine.backend import write_tiny_checkpoint
from canvas.model import DiffusionModel
from canvas.server.embedded import EmbeddedServer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tui-model"))


@pytest.fixture(scope="session")
def server_url(tiny_model: Path) -> Iterator[str]:
    with EmbeddedServer(model_dir=str(tiny_model)) as server:
        yield server.url


STEP_FLOOR_S = 0.02


@pytest.fixture(autouse=True)
def _paced_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every denoising step of the in-process servers takes at least 20 ms. The tiny model alone runs 256 steps
    in under a second on a fast CPU, faster than a test can see the live phase, a frame or a cancel land; with
    the floor a 6-step generation shows a few frames and a 256-step one lasts over 5 s, on any machine."""
    denoise = DiffusionModel.denoise

    def paced(self: DiffusionModel, *args: Any, **kwargs: Any) -> Any:
        time.sleep(STEP_FLOOR_S)
        return denoise(self, *args, **kwargs)

    monkeypatch.setattr(DiffusionModel, "denoise", paced)


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
