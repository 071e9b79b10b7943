"""The committed default model: present, small, loads with ours and with transformers to the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from canvas.engine.backend import default_model_dir
from canvas.model import DiffusionModel
from canvas.model.tokenizer import load_tokenizer, special_ids

MODEL = default_model_dir()
pytestmark = pytest.mark.skipif(MODEL is None, reason="no default model installed under canvas/assets/")


def test_files_and_size() -> None:
    assert MODEL is not None
    names = {p.name for p in Path(MODEL).iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in Path(MODEL).iterdir()) <= 40 * 2**20


def test_ours_and_transformers_agree() -> None:
    from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

    assert MODEL is not None
    ours = DiffusionModel.from_pretrained(str(MODEL))
    theirs = DiffusionGemmaForBlockDiffusion.from_pretrained(str(MODEL)).eval()
    tok = load_tokenizer(MODEL)
    ids = torch.tensor([[special_ids(tok)["bos"], *tok.encode("It is a truth universally", add_special_tokens=False)]])
    L = ours.config.canvas_length
    canvas = torch.randint(0, ours.config.vocab_size, (1, L), generator=torch.Generator().manual_seed(0))
    enc, cache = ours.encode(ids)
    dec = ours.denoise(canvas, cache)
    with torch.no_grad():
        ref_cache = DynamicCache(config=theirs.config.get_text_config(decoder=True))
        h = theirs.model.encoder(input_ids=ids, past_key_values=ref_cache).last_hidden_state
        cap = theirs.config.get_text_config().final_logit_softcapping
        ref_enc = torch.tanh(theirs.lm_head(h).float() / cap) * cap
        ref_dec = theirs(decoder_input_ids=canvas, past_key_values=ref_cache).logits
    torch.testing.assert_close(enc, ref_enc, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dec, ref_dec, rtol=1e-4, atol=1e-4)
