"""A tiny "converted" base for the FIM tests: the tiny corpus's tokenizer with the four FIM sentinels added, a random
`tiny` model over it saved as a model directory, and the corpus tokenized with it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch

from canvas.convert.fim import SENTINELS
from canvas.model import DiffusionModel


def make_fim_base(tiny_data: dict[str, Path], root: Path) -> dict[str, Path]:
    from tokenizers import AddedToken, Tokenizer

    from canvas.model.tokenizer import save_tokenizer, special_ids
    from canvas.training.tokens import tokenize_corpus
    from canvas.training.train import model_config

    base = root / "base"
    tok = Tokenizer.from_file(str(tiny_data["tokenizer"] / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SENTINELS])
    save_tokenizer(tok, base)
    cfg = model_config("tiny", special_ids(tok), tok.get_vocab_size(with_added_tokens=True))
    torch.manual_seed(0)  # the same random base whichever test builds it first
    model = DiffusionModel(dataclasses.replace(cfg, name="tiny-fim-base"))
    with torch.no_grad():  # as in a converted model, the experts start at zero (so no routing flip changes logits)
        for layer in model.blocks:
            layer.experts_gate_up.zero_()
            layer.experts_down.zero_()
    model.save_pretrained(str(base))
    corpus = root / "corpus"
    shutil.copytree(tiny_data["corpus"], corpus)
    # A longer validation split, so the held-out rows hold FIM pieces of every size.
    lines = (corpus / "train.jsonl").read_text(encoding="utf-8").splitlines()[:12]
    (corpus / "valid.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenize_corpus(corpus, base, root / "tokens")
    assert json.loads((root / "tokens" / "meta.json").read_text())["vocab_size"] == cfg.vocab_size
    return {"base": base, "tokens": root / "tokens", "corpus": corpus}
