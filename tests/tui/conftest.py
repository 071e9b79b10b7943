"""Fixtures for the editor's tests: a tiny random model, a real embedded server on it, and app helpers.

The server is the real `canvas.server` app on uvicorn in a thread (`canvas.server.embedded`), started once per session;
tests that kill a server start their own. Settings live in a temporary file, never in the user's config.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from canvas.server.backend import write_tiny_checkpoint
from canvas.server.embedded import EmbeddedServer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tui-model"))


@pytest.fixture(scope="session")
def server_url(tiny_model: Path) -> Iterator[str]:
    with EmbeddedServer(model_dir=str(tiny_model)) as server:
        yield server.url


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
