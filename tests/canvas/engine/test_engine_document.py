"""Property test over the real pipeline: document -> canvas view -> engine (real tiny model) -> proposal -> apply.

Pinned text never changes, the document after accept equals the old text with only the masked or gapped regions
replaced, and undo restores the old text exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canvas.document import Document, DocumentConfig
from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.engine.core import GenRequest
from canvas.sampling.sampler import SamplerConfig

TEXT = "The cat sat on the mat. A dog ran past the open door, and the rain fell on the quiet garden."


@pytest.fixture(scope="module")
def backend(tmp_path_factory) -> Backend:
    return load_backend(write_tiny_checkpoint(Path(tmp_path_factory.mktemp("tiny")), canvas_length=48))


def generate(backend: Backend, doc: Document, seed: int) -> list[int]:
    view = doc.canvas_view()
    req = GenRequest(backend.context(view.context_ids), view.slot_ids, view.pinned,
                     SamplerConfig(max_steps=3, seed=seed))
    handle = backend.engine.submit(req)
    backend.engine.run_until_idle()
    done = handle.wait(0)
    assert done.status == "completed", done.error
    return list(done.canvases[0][: len(view.slot_ids)])


def check_one_generation(backend: Backend, data: st.DataObject) -> None:
    doc = Document(backend.tokenizer, TEXT, config=DocumentConfig(canvas_length=backend.canvas_length))
    n = len(TEXT)
    a = data.draw(st.integers(0, n - 1), label="start")
    b = data.draw(st.integers(a + 1, min(n, a + 20)), label="end")
    use_gap = data.draw(st.booleans(), label="gap")
    if use_gap:
        doc.insert_gap(a, data.draw(st.integers(1, 6), label="gap tokens"))
    else:
        doc.mask(a, b)
    before = doc.text
    spans = [s for s in doc.spans() if s.kind == "pinned"]
    pinned_text = [before[s.start : s.end] for s in spans]
    ids = generate(backend, doc, data.draw(st.integers(0, 2**31), label="seed"))
    proposal = doc.make_proposal(ids, backend.null_id, eos_id=backend.eos_id)
    v_before = doc.version
    doc.apply_proposal(proposal)
    after = doc.text
    # Only the changed span differs: prefix and suffix around it are untouched.
    assert after[: proposal.start] == before[: proposal.start]
    assert after[len(after) - (len(before) - proposal.end):] == before[proposal.end:]
    # Every pinned span's text survives, in order.
    pos = 0
    for piece in pinned_text:
        found = after.find(piece, pos)
        assert found >= 0, piece
        pos = found + len(piece)
    doc.undo()
    assert doc.text == before and doc.version > v_before


FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@settings(max_examples=6, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_generation_changes_only_free_regions(backend: Backend, data: st.DataObject) -> None:
    check_one_generation(backend, data)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_generation_changes_only_free_regions_many(backend: Backend, data: st.DataObject) -> None:
    check_one_generation(backend, data)
