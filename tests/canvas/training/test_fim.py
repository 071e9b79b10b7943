"""The FIM format and its packed training rows: layout, sentinels from the tokenizer, word cuts, loss kinds,
determinism, and packing that no piece can see across."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from canvas.convert.fim import FimUnavailable, end_token_id, fim_prompt, fim_tokens, word_boundaries
from canvas.model import DiffusionModel
from canvas.training.fim import FIM, NONE, PLAIN, Corpus, FimDataConfig, Rows, sample_rows
from canvas.training.tokens import TokenArrays

DATA = FimDataConfig(seq_len=96, max_middle=24, max_prefix=20, max_suffix=16, min_fim_piece=12, gaps="spans")


def _tok(fim_base: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_file(str(fim_base["base"] / "tokenizer.json"))


def _corpus(fim_base: dict[str, Path], split: str = "train") -> Corpus:
    tok = _tok(fim_base)
    arr = TokenArrays.open(fim_base["tokens"], split)
    return Corpus(arr.tokens, arr.doc_starts, *word_boundaries(tok), fim_tokens(tok))


def _pieces(rows: Rows, r: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Row r's pieces as (ids, positions, kinds)."""
    out = []
    seg = rows.segment[r]
    for s in sorted(set(seg.tolist()) - {-1}):
        at = seg == s
        out.append((rows.ids[r][at].tolist(), rows.positions[r][at].tolist(), rows.kind[r][at].tolist()))
    return out


def test_prompt_layouts_use_the_tokenizers_sentinels(fim_base: dict[str, Path]) -> None:
    tok = _tok(fim_base)
    t = fim_tokens(tok)
    ids = [tok.token_to_id(s) for s in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_end|>")]
    assert list(t.sentinels) == ids and end_token_id(tok) == ids[3]
    assert len(set(ids)) == 4 and t.bos == tok.token_to_id("<bos>")
    left, right = [t.bos, 40, 41], [50]
    assert fim_prompt(tok, left, right) == [t.bos, t.prefix, 40, 41, t.suffix, 50, t.middle]
    assert fim_prompt(t, left, right, order="spm") == [t.bos, t.prefix, t.suffix, 50, t.middle, 40, 41]
    with pytest.raises(ValueError, match="order"):
        fim_prompt(t, left, right, order="mps")  # type: ignore[arg-type]


def test_a_tokenizer_without_sentinels_is_refused(tiny_data: dict[str, Path]) -> None:
    with pytest.raises(FimUnavailable, match="fim_prefix"):
        fim_tokens(Tokenizer.from_file(str(tiny_data["tokenizer"] / "tokenizer.json")))


def test_rows_are_deterministic_in_seed_and_step(fim_base: dict[str, Path]) -> None:
    c = _corpus(fim_base)
    a, b = sample_rows(c, DATA, 3, seed=1, step=7), sample_rows(c, DATA, 3, seed=1, step=7)
    for f in ("ids", "positions", "segment", "kind"):
        assert torch.equal(getattr(a, f), getattr(b, f))
    assert not torch.equal(a.ids, sample_rows(c, DATA, 3, seed=1, step=8).ids)
    assert not torch.equal(a.ids, sample_rows(c, DATA, 3, seed=2, step=7).ids)


def test_pieces_are_whole_documents_slices_with_loss_only_where_it_teaches(fim_base: dict[str, Path]) -> None:
    c = _corpus(fim_base)
    t = c.ids
    flat = c.tokens.astype(np.int64).tolist()
    text = " ".join(map(str, flat))

    def in_corpus(ids: list[int]) -> bool:
        return not ids or f" {' '.join(map(str, ids))} " in f" {text} "

    seen = {"psm": 0, "spm": 0, "plain": 0}
    for step in range(12):
        rows = sample_rows(c, DATA, 2, seed=0, step=step)
        assert rows.ids.shape == (2, DATA.seq_len)
        for r in range(2):
            for ids, pos, kind in _pieces(rows, r):
                assert ids[0] == t.bos and pos == list(range(len(ids))) and kind[0] == NONE
                if t.middle not in ids:  # plain: every token after <bos> is a target, no sentinel appears
                    assert set(kind[1:]) == {PLAIN} and not set(ids) & set(t.sentinels)
                    assert in_corpus(ids[1:])
                    seen["plain"] += 1
                    continue
                assert [i for i in ids if i in t.sentinels] == [t.prefix, t.suffix, t.middle, t.end]
                m = ids.index(t.middle)
                assert ids[-1] == t.end
                # Loss on the middle and <end> only: nothing before them (prefix, suffix, sentinels) is a target.
                first = kind.index(FIM)
                assert first > m and kind[:first] == [NONE] * first and kind[first:] == [FIM] * (len(ids) - first)
                if ids[2] == t.suffix:  # SPM: <bos> <pre> <suf> suffix <mid> prefix middle <end>
                    suffix, prefix, middle = ids[3:m], ids[m + 1 : first], ids[first:-1]
                    seen["spm"] += 1
                    assert middle and in_corpus(prefix + middle + suffix)
                else:  # PSM: <bos> <pre> prefix <suf> suffix <mid> middle <end>
                    s = ids.index(t.suffix)
                    prefix, suffix, middle = ids[2:s], ids[s + 1 : m], ids[m + 1 : -1]
                    assert first == m + 1
                    seen["psm"] += 1
                    assert middle and in_corpus(prefix + middle + suffix)
                    # Word cuts: the middle starts a word (or follows whitespace) and ends one (or the window).
                    # Mid-word only where no boundary was left after the prefix (a short window inside one word).
                    after = middle + suffix
                    none_left = not any(c.starts_word[i] for i in after[1:]) and not any(c.ends_word[i] for i in after)
                    assert c.starts_word[middle[0]] or (prefix and c.ends_word[prefix[-1]]) or none_left
                    assert not suffix or c.starts_word[suffix[0]] or c.ends_word[middle[-1]]
    assert all(n > 0 for n in seen.values()), seen


def test_fim_rate_zero_and_one(fim_base: dict[str, Path]) -> None:
    c = _corpus(fim_base)
    plain = sample_rows(c, FimDataConfig(**{**_fields(DATA), "fim_rate": 0.0}), 2, seed=0, step=0)
    assert FIM not in plain.kind.tolist()[0] + plain.kind.tolist()[1]
    fim = sample_rows(c, FimDataConfig(**{**_fields(DATA), "fim_rate": 1.0}), 2, seed=0, step=0)
    assert (fim.kind == FIM).sum() > 0


def _fields(cfg: FimDataConfig) -> dict[str, object]:
    return {f: getattr(cfg, f) for f in cfg.__slots__}  # type: ignore[attr-defined]


def test_packing_matches_each_piece_alone(fim_base: dict[str, Path]) -> None:
    """Attention stays inside a piece (sliding window included): a piece's losses are the same packed or alone."""
    from canvas.training.fim_train import attach_fim_adapters, packed_losses

    c = _corpus(fim_base)
    model = DiffusionModel.from_pretrained(str(fim_base["base"]))
    rows = attach_fim_adapters(model, 2, 4.0, ("attn.qkv",), c.ids.sentinels)
    batch = sample_rows(c, DATA, 1, seed=3, step=0)
    pieces = _pieces(batch, 0)
    assert len(pieces) >= 2 and max(len(p[0]) for p in pieces) > model.config.sliding_window
    with torch.no_grad():
        packed, _ = packed_losses(model, rows, batch)
        alone = []
        for ids, pos, kind in pieces:
            one = Rows(torch.tensor([ids]), torch.tensor([pos]), torch.zeros(1, len(ids), dtype=torch.long),
                       torch.tensor([kind]))
            alone.append(packed_losses(model, rows, one)[0])
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_a_model_has_the_fim_format_only_when_its_build_applied_fim_adapters(
    fim_base: dict[str, Path], tiny_data: dict[str, Path], tmp_path: Path
) -> None:
    """`model_fim_tokens`: the ids when build.json records FIM adapters and the tokenizer has the sentinels; a
    vocabulary with the sentinels but no adapters, adapters without sentinels, or a damaged record: None."""
    import json

    from canvas.convert.fim import model_fim_tokens

    tok, plain = _tok(fim_base), Tokenizer.from_file(str(tiny_data["tokenizer"] / "tokenizer.json"))
    assert model_fim_tokens(tmp_path, tok) is None  # no build.json: converted or trained here, never FIM
    (tmp_path / "build.json").write_text(json.dumps({"fingerprint": {"adapters": None}}))
    assert model_fim_tokens(tmp_path, tok) is None  # the sentinels alone say nothing
    (tmp_path / "build.json").write_text(json.dumps({"fingerprint": {"fim_adapters": "ab12"}}))
    assert model_fim_tokens(tmp_path, tok) == fim_tokens(tok)
    assert model_fim_tokens(tmp_path, plain) is None
    (tmp_path / "build.json").write_text("{not json")
    assert model_fim_tokens(tmp_path, tok) is None
