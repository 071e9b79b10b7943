"""The original Gemma 3 as the plain-text teacher: per-piece log-probabilities from one padded batch."""

from __future__ import annotations

import pytest
import torch

from canvas.training.fim import FIM, NONE, PLAIN, Rows
from canvas.training.fim_teacher import GemmaTeacher


def _tiny_gemma3(vocab: int = 40) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return Gemma3ForCausalLM(cfg).eval()


def _rows() -> Rows:
    # row 0: a plain piece of 5, a FIM piece of 4, a plain piece of 3 that runs to the row's end
    # row 1: a plain piece of 6, then padding
    ids = torch.tensor([[2, 11, 12, 13, 14, 2, 30, 31, 32, 2, 21, 22],
                        [2, 15, 16, 17, 18, 19, 0, 0, 0, 0, 0, 0]])
    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0]])
    kind = torch.tensor([[NONE, PLAIN, PLAIN, PLAIN, PLAIN, NONE, NONE, FIM, FIM, NONE, PLAIN, PLAIN],
                         [NONE, PLAIN, PLAIN, PLAIN, PLAIN, PLAIN, NONE, NONE, NONE, NONE, NONE, NONE]])
    return Rows(ids, pos, seg, kind)


def test_matches_each_piece_run_alone_and_renormalises_over_the_trimmed_ids() -> None:
    model = _tiny_gemma3()
    gemma_ids = torch.arange(40)
    gemma_ids[30:33] = -1  # trimmed ids Gemma lacks (sentinels): probability 0
    teacher = GemmaTeacher(model, gemma_ids)
    rows = _rows()
    got = teacher.plain_log_probs(rows)
    assert got.shape == (4 + 2 + 5, 40)
    want = []
    for b, s, e in ((0, 0, 5), (0, 9, 12), (1, 0, 6)):
        piece = rows.ids[b, s:e].clamp_max(29)  # the sentinels never sit in a plain piece
        with torch.no_grad():
            logits = model(input_ids=piece[None]).logits[0, :-1]  # (L-1, V)
        logits[:, 30:33] = -1e9
        want.append(torch.log_softmax(logits, -1))
    torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all() and (got[:, 30:33].exp() == 0).all()
    student = torch.log_softmax(torch.randn_like(got), -1)  # a KL against the teacher stays finite
    assert torch.isfinite(torch.nn.functional.kl_div(student, got, log_target=True, reduction="sum"))


def test_no_plain_targets_gives_an_empty_answer() -> None:
    rows = _rows()
    rows = Rows(rows.ids, rows.positions, rows.segment, torch.where(rows.kind == PLAIN, NONE, rows.kind))
    assert GemmaTeacher(_tiny_gemma3(), torch.arange(40)).plain_log_probs(rows).shape == (0, 40)


def test_load_says_what_is_missing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FileNotFoundError, match="dcanvas model build"):
        GemmaTeacher.load(tmp_path / "base", cache=tmp_path)
