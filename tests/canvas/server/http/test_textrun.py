"""`TextRun.events(drafts=False)`: no drafts, and no frame read as text where nothing can end early, with the same
deltas and finishes as a run that makes every draft."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.sampling.sampler import Mode
from canvas.server.http.textgen import TextReader, TextTask, plan
from canvas.server.http.textrun import Draft, Event, Finish, TextRun

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    b = load_backend(write_tiny_checkpoint(Path(tmp_path_factory.mktemp("tiny"))), max_batch=4)
    b.engine.start()
    try:
        yield b
    finally:
        b.engine.stop()


async def _events(backend: Backend, task: TextTask, drafts: bool) -> list[Event]:
    run = TextRun(backend, plan(backend, task, max_context=99), task)
    await run.start()
    return [ev async for ev in run.events(drafts)]


def _timeless(events: list[Event]) -> list[Event]:
    """The events less their timings (a finish's queue, wall and prompt seconds differ run to run)."""
    return [dataclasses.replace(ev, queued_s=0.0, wall_s=0.0, prompt_s=0.0, cached_tokens=0)
            if isinstance(ev, Finish) else ev for ev in events]


def _count_probes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an entry per `TextReader.probe` call from here on."""
    calls: list[int] = []
    probe = TextReader.probe

    def counted(self: TextReader, *args: Any, **kwargs: Any) -> TextReader:
        calls.append(1)
        return probe(self, *args, **kwargs)

    monkeypatch.setattr(TextReader, "probe", counted)
    return calls


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
@pytest.mark.parametrize("max_tokens", [12, 40])  # one canvas; several (the tiny model's canvas is 32)
async def test_without_drafts_the_text_is_the_same_and_no_frame_is_read(backend: Backend, mode: Mode,
                                                                        max_tokens: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    task = TextTask("The cat sat on the mat.", max_tokens=max_tokens, n=2, seed=5,
                    config=dataclasses.replace(backend.sampler_defaults, mode=mode, max_steps=6))
    full = await _events(backend, task, True)
    assert any(isinstance(ev, Draft) for ev in full)
    probes = _count_probes(monkeypatch)
    bare = await _events(backend, task, False)
    assert not probes  # no cut rule, no stop: nothing can end early, so no frame is decoded
    assert _timeless(bare) == _timeless([ev for ev in full if not isinstance(ev, Draft)])


async def test_with_a_stop_sequence_frames_are_still_read_for_an_early_end(backend: Backend,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    task = TextTask("The cat sat on the mat.", max_tokens=40, seed=3, stop=("e",),
                    config=dataclasses.replace(backend.sampler_defaults, mode="ar"))
    full = await _events(backend, task, True)
    probes = _count_probes(monkeypatch)
    bare = await _events(backend, task, False)
    assert probes and not any(isinstance(ev, Draft) for ev in bare)
    assert _timeless(bare) == _timeless([ev for ev in full if not isinstance(ev, Draft)])
