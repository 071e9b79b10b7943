"""llama.vim's instruction mode served through the real routes (canvas.server.http.llama_rewrite), with llama.vim's
exact requests (`llama#inst` and `llama#inst_send` at commit a1c8e6e40cb45df59b78add5b65d575386832465: the same
fields, the system message of `llama#inst_build`) read back as `s:inst_on_response` reads them: first with a scripted
engine whose candidates are chosen here (the first copies the lines below the selection), then on the tiny random
model, whose actual answers must keep the same invariant: no line from outside the selection."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.engine.core import Done, Event, GenHandle, GenRequest
from canvas.engine.scheduling import Placement
from canvas.server.admission import Admitted
from canvas.server.app import create_app
from canvas.server.config import ServerConfig
from canvas.server.http import routes
from canvas.server.http.core import HttpApi
from canvas.server.http.llama_rewrite import CANDIDATES
from tests.canvas.server.http.test_llama_ext import vim_system
from tests.canvas.server.http.test_llama_vim_e2e import read_stream_as_llama_vim

pytestmark = pytest.mark.timeout(120)
PROSE = ["the meeting got moved to friday cause the boss was out sick all week.",
         "Everyone on the team was told to send their reports by thursday night.",
         "The slides for the quarterly review still need a few more charts."]  # fmt: skip
COPY_BELOW = "\n\nThe team was told to send their reports by thursday night.\n" + PROSE[2]  # the reported answer
REWRITE = "The meeting was moved to Friday because the boss was out sick all week."


def messages(instruction: str) -> list[dict[str, str]]:
    """`llama#inst_build` for line 1 of PROSE selected, the ring's extra context empty."""
    return [{"role": "system", "content": vim_system([], PROSE[:1], PROSE[1:])},
            {"role": "user", "content": f"INSTRUCTION: {instruction}" if instruction else ""}]  # fmt: skip


# llama#inst (the warm-up while the user types) and llama#inst_send (the edit), as llama.vim sends them.
WARM_UP = {"id_slot": 0, "messages": messages(""), "samplers": [], "n_predict": 0, "stream": False,
           "cache_prompt": True, "response_fields": [""], "model": ""}  # fmt: skip
INST = {"id_slot": 0, "messages": messages("Rewrite this sentence more formally"), "min_p": 0.1, "temperature": 0.1,
        "samplers": ["min_p", "temperature"], "stream": True, "cache_prompt": True, "model": ""}  # fmt: skip


def outside_lines(doc: list[str], selected: range) -> set[str]:
    """The substantial lines of the document outside the selection (whitespace normalised), less the selection's."""
    inside = {" ".join(doc[i].split()) for i in selected}
    lines = {" ".join(line.split()) for i, line in enumerate(doc) if i not in selected}
    return {s for s in lines - inside if len(s) >= 12 or len(s.split()) >= 3}


class ScriptedAdmission:
    """An engine stand-in: the k-th generation of a request writes `script[k]` into its gap (the rest null)."""

    def __init__(self, backend: Backend, script: list[str]) -> None:
        self.backend, self.script = backend, script
        self.requests: list[GenRequest] = []
        self._ids = itertools.count(1)

    async def submit_async(self, request: GenRequest, on_event: Callable[[Event], None] | None, *, owner: Hashable,
                           replacing: GenHandle | None = None, affinity: str | None = None) -> Admitted:
        k = len(self.requests) % len(self.script)
        self.requests.append(request)
        free = [i for i, pinned in enumerate(request.pinned) if not pinned]
        ids = list(self.backend.tokenizer.encode(self.script[k]).ids)
        assert len(ids) <= len(free), "the scripted text must fit the gap"
        null = self.backend.null_id
        assert null is not None
        canvas = list(request.slot_ids)
        for slot, token in itertools.zip_longest(free, ids):
            canvas[slot] = null if token is None else token
        handle = GenHandle(next(self._ids), on_event, request)
        if on_event is not None:
            on_event(Done(handle.id, "completed", (tuple(canvas),), 1, 1, len(ids), 0.01))
        return Admitted(handle, Placement(position=0, free_rows=1, queued=0, owners=1), None)

    async def stats_async(self) -> dict[str, Any]:
        return {}

    async def aclose(self) -> None:
        return None


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Backend:
    # A canvas of 128: a gap of up to 96 tokens, room for the scripted candidates.
    path = write_tiny_checkpoint(Path(tmp_path_factory.mktemp("tiny")), canvas_length=128)
    b = load_backend(path, max_batch=8)
    return dataclasses.replace(b, sampler_defaults=dataclasses.replace(b.sampler_defaults, max_steps=3))


def scripted(backend: Backend, tmp_path: Path, script: list[str]) -> tuple[TestClient, ScriptedAdmission]:
    config = ServerConfig(db=":memory:", port=8765, hosts=("testserver",), web_dir=str(tmp_path))
    admission = ScriptedAdmission(backend, script)
    return TestClient(Starlette(routes=routes(HttpApi(config, backend, admission=admission)))), admission


def post(client: TestClient, body: dict[str, Any]) -> Any:
    """As llama.vim's curl posts it: compact JSON with a JSON content type."""
    data = json.dumps(body, separators=(",", ":")).encode()
    return client.post("/v1/chat/completions", content=data, headers={"Content-Type": "application/json"})


def final_meta(raw: str) -> dict[str, Any]:
    """The `dcanvas` field of a stream's choice 0, on its chunk with a finish_reason."""
    for block in raw.split("\n\n"):
        data = block.removeprefix("data: ")
        if block.startswith("data: ") and data != "[DONE]":
            choice = json.loads(data)["choices"][0]
            if choice.get("finish_reason"):
                return dict(choice["dcanvas"])
    raise AssertionError("no chunk with a finish_reason")


def test_a_candidate_that_copies_the_lines_below_gives_way_to_the_next(backend: Backend, tmp_path: Path) -> None:
    client, admission = scripted(backend, tmp_path, [COPY_BELOW, "\n" + REWRITE, "x", "The meeting moved."])
    warm = post(client, WARM_UP)
    assert warm.status_code == 200 and warm.json()["choices"][0]["message"]["content"] == ""
    assert admission.requests == []  # the warm-up generates nothing
    r = post(client, INST)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert len(admission.requests) == CANDIDATES
    result = read_stream_as_llama_vim(r.text)
    assert result == REWRITE  # candidate 1, its leading blank line dropped; not candidate 0
    assert not {" ".join(line.split()) for line in result.split("\n")} & outside_lines(PROSE, range(1))
    meta = final_meta(r.text)
    assert meta["instruction_tuned"] is False and meta["candidate"] == 1 and "fallback" not in meta
    assert [x["candidate"] for x in meta["refused"]] == [0] and "outside the selection" in meta["refused"][0]["reason"]


def test_when_every_candidate_copies_the_selection_comes_back_unchanged(backend: Backend, tmp_path: Path) -> None:
    client, _ = scripted(backend, tmp_path, [COPY_BELOW, PROSE[1], "  \n", PROSE[2] + " Yes."])
    streamed = post(client, INST)
    assert read_stream_as_llama_vim(streamed.text) == PROSE[0]
    meta = final_meta(streamed.text)
    assert meta["candidate"] is None and len(meta["refused"]) == CANDIDATES
    assert meta["fallback"] == "unchanged: every candidate copied text from outside the selection or was blank"
    plain = post(client, {**INST, "stream": False}).json()
    (choice,) = plain["choices"]
    assert choice["message"]["content"] == PROSE[0] and choice["finish_reason"] == "stop"
    assert choice["dcanvas"]["fallback"] == meta["fallback"] and plain["usage"]["completion_tokens"] == 0


def test_the_tiny_model_never_answers_a_line_from_outside_the_selection(backend: Backend, tmp_path: Path) -> None:
    # Lines long enough to count and short enough that the tiny model's 96-slot gap takes the selection as a gap.
    doc = ["import math", "def area(r):", "    y = math.pi * r * r", "    return y", "print(area(2.0))",
           "print(area(3.0) + area(4.0))"]  # fmt: skip
    selected = range(2, 3)
    config = ServerConfig(db=":memory:", port=8765, hosts=("testserver",), web_dir=str(tmp_path))
    body = {**INST, "messages": [{"role": "system", "content": vim_system(doc[:2], doc[2:3], doc[3:])},
                                 {"role": "user", "content": "INSTRUCTION: use r ** 2"}]}  # fmt: skip
    outside = outside_lines(doc, selected)
    with TestClient(create_app(config, backend=backend)) as client:
        for seed in range(3):
            r = post(client, {**body, "seed": seed})
            assert r.status_code == 200
            result = read_stream_as_llama_vim(r.text)
            assert result.strip()  # never blank: a candidate or the selection unchanged
            assert not {" ".join(line.split()) for line in result.split("\n")} & outside
            meta = final_meta(r.text)
            assert meta["instruction_tuned"] is False
            assert (result == doc[2]) if meta["candidate"] is None else (len(result.split("\n")) <= 2)
