"""The server tests' shared fixtures: one tiny model per test module and a server factory over it per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from tests.canvas.wsconn import Factory, served


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Backend:
    return load_backend(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model")), max_batch=4)


@pytest.fixture
def serve(backend: Backend, tmp_path: Path) -> Iterator[Factory]:
    with served(backend, tmp_path) as make:
        yield make
