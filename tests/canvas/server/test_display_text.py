"""No special token's text reaches a client: an AR infill in the FIM frame whose drafts end at `<|fim_end|>` (and
write it again after, as an ended lane does) sends frames, drafts and a proposal without any sentinel's text.

The tiny random model gets a tokenizer with the FIM sentinels as special tokens of its own vocabulary, and an engine
with the FIM format; its encoder is tilted towards `<|fim_end|>` so that every lane ends early and the rest of the
gap becomes `<null>`. The special ids are read from the tokenizer, never written here as literals.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from canvas.convert.fim import SENTINELS, fim_tokens
from canvas.engine.backend import _TINY_TEXT, Backend, load_backend
from canvas.engine.core import Engine
from canvas.model import PRESETS, DiffusionModel, save_pretrained
from canvas.model.tokenizer import MIN_VOCAB, save_tokenizer, special_ids, train_tokenizer
from tests.canvas.wsconn import Conn, edit, generate, open_doc, served


def _fim_checkpoint(out: Path) -> Path:
    """A tiny random model whose tokenizer has the FIM sentinels as special tokens inside the model's vocabulary."""
    tok = train_tokenizer([_TINY_TEXT] * 4, vocab_size=MIN_VOCAB + 96, min_frequency=2)
    tok.add_special_tokens(list(SENTINELS))
    ids = special_ids(tok)
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=tok.get_vocab_size(), canvas_length=32,
                              pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_ids=(ids["eos"],),
                              null_token_id=ids["null"], name="tiny-fim")  # fmt: skip
    torch.manual_seed(0)
    save_pretrained(DiffusionModel(cfg), out)
    save_tokenizer(tok, out)
    return out


@pytest.fixture(scope="module")
def fim_backend(tmp_path_factory: pytest.TempPathFactory) -> Backend:
    from transformers import AutoTokenizer

    path = _fim_checkpoint(tmp_path_factory.mktemp("tiny-fim"))
    backend = load_backend(path, max_batch=4)
    fim = fim_tokens(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    backend.local_engine = Engine(backend.engine.model, max_batch=4, fim=fim)
    backend.sampler_defaults = dataclasses.replace(backend.sampler_defaults, ar_drafts=4, ar_seam_tokens=2,
                                                   ar_temperature=0.8, ar_min_fill=0.3, fim=True)
    return backend


def _strings(msg: Any) -> list[str]:
    """Every string a message carries, however deep."""
    if isinstance(msg, str):
        return [msg]
    if isinstance(msg, dict):
        return [s for v in msg.values() for s in _strings(v)]
    if isinstance(msg, list):
        return [s for v in msg for s in _strings(v)]
    return []


def test_no_special_token_text_reaches_frames_drafts_or_proposal(
    fim_backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = fim_backend.tokenizer
    fim = fim_backend.engine.fim
    assert fim is not None
    specials = sorted(fim_backend.special_ids)
    assert {*fim.sentinels, fim_backend.null_id, fim_backend.eos_id} <= set(specials)
    texts = [tok.decode([i]) for i in specials]  # what each looks like when decoded raw: "<|fim_end|>", "<null>", ...
    assert all(texts)
    real = DiffusionModel.encode

    def ending(self: DiffusionModel, ids: torch.Tensor, *a: Any, **kw: Any) -> Any:
        logits, cache = real(self, ids, *a, **kw)
        if logits is not None:  # every lane wants to end: it writes `<|fim_end|>` as soon as it may, then again
            logits[..., fim.end] += 100.0
        return logits, cache

    monkeypatch.setattr(DiffusionModel, "encode", ending)
    with served(fim_backend, tmp_path) as make, make().websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        state = open_doc(c, "The cat sat on the mat. It was a warm day.")
        state = edit(c, state, {"op": "insert_gap", "at": 24, "n_tokens": 12})
        _, frames, done = generate(c, state, mode="ar", seed=3)
    assert done["status"] == "completed", done
    drafts = [f["drafts"] for f in frames if f.get("drafts")]
    assert drafts, "no frame carried the drafts"
    ended = [d for d in drafts if d.get("chosen") is not None]
    assert ended and ended[-1]["tokens"] == 12, "the lanes did not run on past their ends"
    assert any(s.get("token") == fim_backend.null_id for f in frames for s in f["slots"]), "no slot became <null>"
    for msg in [*frames, done]:
        leaked = [t for s in _strings(msg) for t in texts if t in s]
        assert not leaked, f"{leaked} reached the client in {json.dumps(msg)[:400]}"


def test_a_proposal_drops_every_special_token_a_slot_holds(fim_backend: Backend) -> None:
    """A canvas whose free slots hold special tokens among the words (what a diffusion row may leave) reads back as
    the words alone: no sentinel, `<pad>` or `<mask>` text in the proposal."""
    from canvas.document import Document

    tok = fim_backend.tokenizer
    doc = Document(tok, "The cat sat. It was warm.", config=fim_backend.document_config())
    doc.insert_gap(12, 8)
    view = doc.canvas_view()
    (region,) = view.free_regions
    words = list(tok.encode(" A dog ran").ids)
    specials = sorted(fim_backend.special_ids - {fim_backend.eos_id})
    fill = [t for pair in zip(words, specials, strict=False) for t in pair] + words[len(specials) :]
    fill = (fill + specials)[: region.slots]
    assert set(fill) & set(specials) and len(fill) == region.slots
    canvas = list(view.slot_ids)
    canvas[region.slot_start : region.slot_end] = fill
    proposal = fim_backend.proposal(doc, tuple(canvas))
    kept = [t for t in fill if t not in specials]
    assert proposal.old_text == "" and proposal.new_text == tok.decode(kept) == " A dog ran"[: len(proposal.new_text)]
    assert not [i for i in specials if tok.decode([i]) in proposal.new_text], proposal.new_text
