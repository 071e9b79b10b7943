"""Property tests of canvas.document: random sequences of operations and simulated generations.

Properties: an operation either succeeds or raises a `DocumentError` and leaves the document exactly as it was;
state operations never change the text or any token; a plain edit changes exactly the characters it names and
keeps every masked token it does not touch; a generation (random ids in the free slots, proposal, apply) changes
only the free regions and never a pinned token; undo restores text and state exactly and redo re-applies; the
saved form round-trips. The tokenizer is a tiny byte-level BPE trained here on other paragraphs than the unit tests'.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from canvas.document import (
    Atom,
    Document,
    DocumentConfig,
    DocumentError,
    HFTokenizer,
    InsertGap,
    Mask,
    MoveWindow,
    Op,
    Pin,
    Replace,
    Unmask,
    Unpin,
)

CORPUS = [
    "A small boat drifted along the river while the children watched from the bridge.",
    "Nous avons mangé des crêpes au café, puis marché jusqu'à la forêt enneigée.",
    "春天来了，花开了，小鸟在树上唱歌。我们一起去看看吧。",
    "Party time 🎉🎂 with friends 😀 and a rocket 🚀 at midnight.",
    "def f(x):\n    return x * 2  # doubles the input\n",
]
WORDS = ["A", " small", " boat", " the", " river", ".", ",", " café", " crêpes", " 春天", "花", " 😀", "🦀", "\n", " "]
WORDS += ["é", "x"]  # single characters, so edits also land inside words
TEXTS = st.lists(st.sampled_from(WORDS), max_size=30).map("".join)
KINDS = ["pin", "unpin", "mask", "unmask", "gap", "move", "replace", "generate", "generate"]


@pytest.fixture(scope="session")
def tok() -> HFTokenizer:
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=480,
        special_tokens=["<pad>", "<eos>", "<null>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS * 3, trainer)
    return HFTokenizer(raw)


def snapshot(doc: Document) -> dict[str, Any]:
    d = doc.to_dict()
    return {"atoms": d["atoms"], "window": d["window"], "text": doc.text, "spans": doc.spans()}


def bounds(atoms: tuple[Atom, ...]) -> list[tuple[int, int]]:
    out, pos = [], 0
    for a in atoms:
        out.append((pos, pos + len(a.text)))
        pos += len(a.text)
    return out


def check_invariants(doc: Document, tok: HFTokenizer) -> None:
    atoms = doc.atoms()
    assert doc.text == "".join(a.text for a in atoms)
    for a in atoms:
        if not a.gap:
            assert tok.decode(a.ids) == a.text
    view = doc.canvas_view()
    size = doc.config.canvas_length
    assert len(view.slot_ids) == len(view.pinned) <= size
    start, end = doc.window()
    assert tok.decode(view.context_ids) == doc.text[:start]
    in_window = [a for a, (s, e) in zip(atoms, bounds(atoms), strict=True) if start <= s and e <= end]
    n_window_slots = sum(a.slots for a in in_window)
    assert sum(a.free for a in in_window) == sum(a.free for a in atoms)  # free atoms all inside the window
    # Pinned slots hold the window's tokens; free slots hold the placeholder.
    expected_slots = [t for a in in_window for t in ((view.placeholder_id,) * a.slots if a.free else a.ids)]
    assert list(view.slot_ids[:n_window_slots]) == expected_slots
    assert [p for a in in_window for p in [not a.free] * a.slots] == list(view.pinned[:n_window_slots])
    tail = [r for r in view.free_regions if r.tail]
    if tail:  # only on a document without masks or gaps, and it fills the canvas
        assert not any(a.free for a in atoms) and tail[0].slot_end == size == len(view.slot_ids)
    else:
        assert len(view.slot_ids) == n_window_slots
    for r in view.free_regions:
        assert not any(view.pinned[r.slot_start : r.slot_end]) and start <= r.char_start <= r.char_end <= end
    assert view.n_free == view.pinned.count(False)
    spans = doc.spans()
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:], strict=False))


def draw_op(data: st.DataObject, doc: Document, kind: str) -> Op:
    n = len(doc.text)
    lo, hi = doc.window()
    # Half the time inside the window, where state operations are valid; otherwise anywhere (errors included).
    a_max, b_min = (hi, lo) if data.draw(st.booleans()) else (n + 2, -1)
    s = data.draw(st.integers(max(b_min, -1), a_max))
    e = data.draw(st.integers(s - 1 if data.draw(st.integers(0, 9)) == 0 else s, a_max))
    free = [span for span in doc.spans() if span.kind == "free" and span.start < n]
    if kind in ("pin", "unmask", "replace") and free and data.draw(st.booleans()):  # aim at masked text and gaps
        span = data.draw(st.sampled_from(free))
        s = data.draw(st.integers(max(span.start - 1, 0), span.end))
        e = data.draw(st.integers(s, min(span.end + 1, n)))
    match kind:
        case "pin":
            return Pin(s, e)
        case "unpin":
            return Unpin(s, e)
        case "mask":
            return Mask(s, e)
        case "unmask":
            return Unmask(s, e)
        case "gap":
            return InsertGap(s, data.draw(st.integers(0, doc.config.canvas_length // 2)))
        case "move":
            return MoveWindow(data.draw(st.integers(-1, n + 1)))
        case _:
            return Replace(s, e, data.draw(TEXTS.map(lambda t: t[:12])))


def check_op(old: dict[str, Any], doc: Document, op: Op) -> None:
    old_atoms = tuple(Atom(tuple(x[0]), x[1], free=x[2] != "p", gap=x[2] == "g") for x in old["atoms"])
    atoms = doc.atoms()
    if isinstance(op, Replace):
        assert doc.text == old["text"][: op.start] + op.text + old["text"][op.end :]
        s, e = op.start, op.end

        def touched(span: tuple[int, int]) -> bool:
            if s == e:  # an insertion re-encodes the token it lands in; inserting nothing does nothing
                return bool(op.text) and span[0] < s < span[1]
            return span[1] > s and span[0] < e

        kept = [a for a, b in zip(old_atoms, bounds(old_atoms), strict=True) if a.free and not a.gap and not touched(b)]
        assert kept == [a for a in atoms if a.free and not a.gap]  # masked tokens away from the edit survive
    else:  # state operations change neither the text nor any token
        assert doc.text == old["text"]
        assert [(a.ids, a.text) for a in old_atoms if not a.gap] == [(a.ids, a.text) for a in atoms if not a.gap]
        if isinstance(op, Mask | Unpin):
            for a, (s, e) in zip(atoms, bounds(atoms), strict=True):
                if e > op.start and s < op.end:
                    assert a.free
        if isinstance(op, Pin | Unmask) and op.start < op.end:  # an empty range pins nothing (unmask: gaps there)
            for a, (s, e) in zip(atoms, bounds(atoms), strict=True):
                if e > op.start and s < op.end:
                    assert not a.free or (a.gap and isinstance(op, Pin))  # pin keeps gaps, unmask removes them


def generate(data: st.DataObject, doc: Document, tok: HFTokenizer) -> None:
    view = doc.canvas_view()
    if not view.free_regions:
        return
    null_id, eos_id = tok.token_id("<null>"), tok.token_id("<eos>")
    assert null_id is not None and eos_id is not None
    words = [t for w in WORDS for t in tok.encode(w).ids]
    token = st.one_of(st.sampled_from(words), st.integers(0, tok.vocab_size - 1), st.just(null_id))
    gen = list(view.slot_ids)
    for r in view.free_regions:
        gen[r.slot_start : r.slot_end] = data.draw(st.lists(token, min_size=r.slots, max_size=r.slots))
    old_atoms, old_text = doc.atoms(), doc.text
    proposal = doc.make_proposal(gen, null_id, eos_id=eos_id if data.draw(st.booleans()) else None)
    assert proposal.base_version == doc.version
    doc.apply_proposal(proposal)
    # The free runs of the old atoms, in order, each replaced by its region's atoms; everything else identical.
    expected: list[Atom] = []
    regions = iter(proposal.regions)
    for k, a in enumerate(old_atoms):
        if not a.free:
            expected.append(a)
        elif k == 0 or not old_atoms[k - 1].free:
            expected.extend(next(regions).atoms)
    expected.extend(r for region in regions for r in region.atoms)  # the tail, if any
    assert list(doc.atoms()) == expected
    text = old_text
    for region in reversed(proposal.regions):
        text = text[: region.char_start] + region.text + text[region.char_end :]
    assert doc.text == text == old_text[: proposal.start] + proposal.new_text + old_text[proposal.end :]
    assert all(not a.free for r in proposal.regions for a in r.atoms)


def run(data: st.DataObject, tok: HFTokenizer, text: str, canvas: int) -> None:
    doc = Document(tok, text, config=DocumentConfig(canvas_length=canvas, max_undo=50))
    doc.move_window(data.draw(st.integers(0, len(doc.text))))
    check_invariants(doc, tok)
    for _ in range(data.draw(st.integers(1, 10))):
        kind = data.draw(st.sampled_from(KINDS))
        old, version = snapshot(doc), doc.version
        try:
            if kind == "generate":
                op = None
                generate(data, doc, tok)
            else:
                op = draw_op(data, doc, kind)
                doc.apply([op])
        except DocumentError as err:
            event(f"{kind}: {type(err).__name__}")  # `--hypothesis-show-statistics` shows the mix
            assert snapshot(doc) == old and doc.version == version
            continue
        event(f"{kind}: ok" if doc.version != version else f"{kind}: no-op")
        check_invariants(doc, tok)
        if op is not None:
            check_op(old, doc, op)
        if doc.version == version:  # a no-op is not recorded
            assert snapshot(doc) == old
            continue
        new = snapshot(doc)
        doc.undo()
        assert snapshot(doc) == old
        doc.redo()
        assert snapshot(doc) == new
    copy = Document.from_dict(json.loads(json.dumps(doc.to_dict())), tok)
    assert copy.to_dict() == doc.to_dict() and copy.canvas_view() == doc.canvas_view()
    while doc.can_undo:  # the whole history unwinds to the starting text
        doc.undo()
    assert doc.text == text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), text=TEXTS, canvas=st.integers(4, 24))
def test_random_edits_and_generations(tok: HFTokenizer, data: st.DataObject, text: str, canvas: int) -> None:
    run(data, tok, text, canvas)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), text=TEXTS, canvas=st.integers(1, 40))
def test_random_edits_and_generations_long(tok: HFTokenizer, data: st.DataObject, text: str, canvas: int) -> None:
    run(data, tok, text, canvas)
