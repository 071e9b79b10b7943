"""The trimmed vocabulary on a small Gemma-shaped tokenizer trained here, and (slow) on the real Gemma 3 one.

The small tokenizer copies Gemma's shapes: BPE with byte fallback, <0x00>..<0xFF> as plain vocabulary entries after
the specials, "▁" for spaces, newline/tab runs as non-special added tokens, a <bos> template, and merges listed the
way the SentencePiece conversion lists them (every split of a token into two tokens, grouped by the token's rank), so
most tokens have several merges that build them, as in Gemma.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from canvas.convert.build import BuildConfig
from canvas.convert.vocab import (
    BYTE_TOKENS,
    FIM_PREFIX,
    FIM_SOURCES,
    NULL,
    RANKING,
    TrimmedVocab,
    interleave,
    load_ranking,
    mixed_ranking,
    prior_ranking,
    rank_ids,
    save_ranking,
    save_trimmed,
    select_vocab,
    trim_for_model,
    trim_tokenizer,
    trim_vocab,
)

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<unused0>", "<unused1>", "<start_of_turn>", "<end_of_turn>"]
WHITESPACE = ["\n", "\n\n", "\t", "\t\t"]  # Gemma's newline/tab runs: added, not special
SENTENCES = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want of "
    "a wife.",
    "In the beginning, God created the heavens and the earth. The earth was formless and empty.",
    "The quick brown fox jumps over the lazy dog, and the dog does not mind the fox at all.",
    "def main(argv):\n\treturn sum(int(x) for x in argv if x.isdigit())",
    "You will be hungry again in one hour. A thrilling time is in your immediate future.",
    "She was the youngest of the two daughters of a most affectionate, indulgent father.",
    "for line in open('data.txt'):\n\n\tprint(line.strip())",
]
SIZES = (300, 340, 400)  # of 594; 269 must stay: 256 bytes, 8 specials (with <unused0>), 4 whitespace runs, "▁"
TRICKY = st.sampled_from(["é", "Ü", "ñ", "世界", "日本語", "🎉", "👩‍💻", "\t", "\n", "\n\n\n", "   ", "\r\n", "\x00",
                          "def f(x):\n    return x", "supercalifragilisticexpialidocious", "the", " the", "<b>",
                          "<null>", "<bos>", "<unused0>", "▁", "\u2028", "a" * 40])
TEXTS = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(SENTENCES), TRICKY), max_size=6).map("".join)
REAL = Path.home() / ".cache/dcanvas/gemma3/hf/tokenizer.json"


def _sentencepiece_merges(vocab: dict[str, int], names: list[str]) -> list[list[str]]:
    """Every split of each token into two vocabulary tokens, tokens in rank order (the HF SentencePiece layout)."""
    out = []
    for t in names:
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                out.append([t[:k], t[k:]])
    return out


@functools.cache
def gemma_like() -> str:
    base = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    base.normalizer = normalizers.Replace(" ", "▁")
    # Trained on words (SentencePiece splits there too), used like Gemma: one piece of text is one BPE word.
    base.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    base.train_from_iterator(SENTENCES, BpeTrainer(vocab_size=420, show_progress=False))
    base.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")  # never fires after the normalizer
    pieces = sorted(base.get_vocab().items(), key=lambda kv: kv[1])
    names = SPECIALS + WHITESPACE + list(BYTE_TOKENS) + [t for t, _ in pieces if t not in WHITESPACE]
    vocab = {t: i for i, t in enumerate(names)}
    base.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    base.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                        special_tokens=[("<bos>", vocab["<bos>"])])
    tj = json.loads(base.to_str())
    merged = [t for t, _ in pieces if len(t) > 1]
    tj["model"]["vocab"] = vocab
    tj["model"]["merges"] = _sentencepiece_merges(vocab, merged)
    tj["added_tokens"] = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": t in SPECIALS} for t in SPECIALS + WHITESPACE]
    return json.dumps(tj)


def tok_json() -> dict[str, Any]:
    return json.loads(gemma_like())


@functools.cache
def original() -> Tokenizer:
    return Tokenizer.from_str(gemma_like())


@functools.cache
def ranked() -> tuple[int, ...]:
    return tuple(rank_ids(original(), SENTENCES))


@functools.cache
def trimmed(size: int) -> tuple[TrimmedVocab, Tokenizer]:
    v = trim_vocab(tok_json(), ranked(), size)
    return v, v.tokenizer()


def roundtrips(tok: Tokenizer, text: str) -> bool:
    return bool(tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text)


# ---- ranking -------------------------------------------------------------------------------------------------------
def test_rank_ids_counts_the_encoded_tokens() -> None:
    ids = rank_ids(original(), SENTENCES)
    counts: dict[int, int] = {}
    for s in SENTENCES:
        for i in original().encode(s, add_special_tokens=False).ids:
            counts[i] = counts.get(i, 0) + 1
    assert set(ids) == set(counts) and original().token_to_id("<bos>") not in ids  # no specials added
    keys = [(-counts[i], i) for i in ids]
    assert keys == sorted(keys)  # most frequent first, ties by id
    assert rank_ids(original(), []) == []


def test_ranking_file_roundtrip_and_rejects_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "rank.txt"
    save_ranking([5, 3, 262_143, 0], path, header=["how it was made"])
    assert load_ranking(path) == [5, 3, 262_143, 0]
    assert path.read_text().startswith("# how it was made\n")
    with pytest.raises(ValueError, match="once"):
        save_ranking([1, 2, 1], path)


def test_committed_ranking_is_small_and_documented() -> None:
    ids = load_ranking(RANKING)
    header = [line for line in RANKING.read_text().splitlines() if line.startswith("#")]
    assert RANKING.stat().st_size < 1_000_000
    assert len(ids) == len(set(ids)) >= BuildConfig().vocab_size and all(0 <= i < 262_144 for i in ids)
    assert any("train.jsonl" in h for h in header) and any("sha256" in h for h in header)
    assert any("merge order" in h for h in header)
    if REAL.is_file():  # the words everyone writes come early, from both the mixture and the prior
        vocab = json.loads(REAL.read_text(encoding="utf-8"))["model"]["vocab"]
        top = set(ids[:2_000])
        assert {vocab[","], vocab["▁the"], vocab["▁and"]} <= top


# ---- the ranking's parts -------------------------------------------------------------------------------------------
def test_mixed_ranking_normalises_each_part() -> None:
    big = {1: 900, 2: 100}  # a large source...
    small = {3: 8, 2: 2}  # ...does not drown a small one: relative frequencies are mixed
    assert mixed_ranking([(big, 0.5), (small, 0.5)]) == [1, 3, 2]
    assert mixed_ranking([(big, 1.0), (small, 0.0)])[:2] == [1, 2]


def test_interleave_takes_in_turn_and_keeps_first_places() -> None:
    assert interleave([1, 2, 3], [2, 4, 5, 6], 1, 2) == [1, 2, 4, 3, 5, 6]
    assert interleave([], [7, 7, 8]) == [7, 8]


def test_prior_ranking_is_ascii_merge_order_with_words_first() -> None:
    tj = tok_json()
    names = {i: t for t, i in tj["model"]["vocab"].items()}
    prior = prior_ranking(tj, ["fox", "THE"])
    added = {t["id"] for t in tj["added_tokens"]}
    assert not set(prior) & added and all(ord(c) < 127 for i in prior for c in names[i].replace("▁", " "))
    words = [names[i] for i in prior if names[i].replace("▁", "").lower() in ("fox", "the")]
    assert [names[i] for i in prior[: len(words)]] == words  # dictionary words first, in id (merge) order
    rest = prior[len(words):]
    assert rest == sorted(rest)


def test_fim_sentinels_are_kept_and_renamed() -> None:
    v = trim_vocab(tok_json(), ranked(), 300, sentinels={"<unused1>": FIM_PREFIX})
    tok = v.tokenizer()
    assert tok.token_to_id(FIM_PREFIX) == 6 and tok.token_to_id("<unused1>") is None
    assert tok.encode(f"a{FIM_PREFIX}b", add_special_tokens=False).ids.count(6) == 1
    with pytest.raises(ValueError, match="reserved"):
        trim_vocab(tok_json(), ranked(), 300, sentinels={"<unused77>": FIM_PREFIX})


# ---- selection -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
def test_select_keeps_the_required_ids_sorted_and_within_size(size: int) -> None:
    tj = tok_json()
    vocab = tj["model"]["vocab"]
    keep = select_vocab(tj, ranked(), size)
    assert keep == sorted(set(keep)) and len(keep) == size  # the ranking plus the fill reach the size exactly
    must = [*BYTE_TOKENS, *SPECIALS[:5], "<unused0>", "<start_of_turn>", "<end_of_turn>", *WHITESPACE, "▁"]
    assert {vocab[t] for t in must} <= set(keep)
    assert vocab["<unused1>"] not in keep  # an added token nobody asked for


def test_select_without_fill_stops_with_the_ranking() -> None:
    tj = tok_json()
    names = {i: t for t, i in tj["model"]["vocab"].items()}
    required = set(select_vocab(tj, [], 400, fill=False))
    top = ranked()[:10]
    keep = set(select_vocab(tj, top, 400, fill=False))
    assert required | set(top) <= keep and len(keep) < 400
    for i in keep - required - set(top):  # the rest is ancestry: pieces of the ranked tokens
        assert any(names[i] in names[t] for t in top), names[i]


def test_select_rejects_sizes_below_the_required_and_foreign_rankings() -> None:
    n_required = len(select_vocab(tok_json(), [], 10_000, fill=False))
    assert n_required == 256 + len(SPECIALS) - 1 + len(WHITESPACE) + 1  # all specials but <unused1>, and "▁"
    assert len(select_vocab(tok_json(), ranked(), n_required)) == n_required
    with pytest.raises(ValueError, match="below"):
        select_vocab(tok_json(), ranked(), n_required - 1)
    with pytest.raises(ValueError, match="not in this vocabulary"):
        select_vocab(tok_json(), [10**6], 400)
    with pytest.raises(ValueError, match="null_source"):
        select_vocab(tok_json(), ranked(), 400, null_source="<unused99>")
    no_bytes = tok_json()
    del no_bytes["model"]["vocab"]["<0x41>"]
    with pytest.raises(ValueError, match="byte-fallback"):
        select_vocab(no_bytes, ranked(), 400)


# ---- the trimmed tokenizer -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
def test_specials_keep_their_ids_and_old_ids_slice(size: int) -> None:
    v, tok = trimmed(size)
    old = original()
    for t in SPECIALS[:5]:
        assert tok.token_to_id(t) == old.token_to_id(t) == SPECIALS.index(t)
    assert tok.get_vocab_size(with_added_tokens=True) == v.size == size
    for name, new in tok.get_vocab().items():
        assert old.token_to_id("<unused0>" if name == NULL else name) == int(v.old_ids[new])
    embed = torch.randn(old.get_vocab_size(), 3)
    assert torch.equal(embed[v.old_ids][tok.token_to_id("<eos>")], embed[old.token_to_id("<eos>")])
    assert v.config_ids == {"pad_token_id": 0, "bos_token_id": 2, "eos_token_ids": (1,), "null_token_id": 5}
    assert tok.encode("hi").ids[0] == 2  # the <bos> template follows


@pytest.mark.parametrize("size", SIZES)
def test_merges_are_closed_and_every_kept_token_is_reachable(size: int) -> None:
    v, tok = trimmed(size)
    vocab = v.tokenizer_json["model"]["vocab"]
    merges = v.tokenizer_json["model"]["merges"]
    added = {t["content"] for t in v.tokenizer_json["added_tokens"]}
    built = {a + b for a, b in merges}
    assert all(a in vocab and b in vocab and a + b in vocab for a, b in merges)
    original_merges = [m for m in tok_json()["model"]["merges"] if all(t in vocab for t in (*m, m[0] + m[1]))]
    assert merges == original_merges  # every merge that can survive does, in order
    for name, i in vocab.items():
        if name in added or name in BYTE_TOKENS or len(name) == 1:
            continue
        assert name in built, name
        assert [t.id for t in tok.model.tokenize(name)] == [i], name  # BPE on its own string builds it


def test_null_token_resolves_as_a_special_added_token() -> None:
    v, tok = trimmed(SIZES[0])
    null = tok.token_to_id(NULL)
    assert null == 5 and tok.token_to_id("<unused0>") is None
    assert [t["special"] for t in v.tokenizer_json["added_tokens"] if t["content"] == NULL] == [True]
    ids = tok.encode(f"ab{NULL}cd", add_special_tokens=False).ids
    assert null in ids and tok.decode(ids) == "abcd"


def test_trim_rejects_what_cannot_work() -> None:
    tj = tok_json()
    keep = select_vocab(tj, ranked(), 320)
    with pytest.raises(ValueError, match="only kept added tokens"):
        trim_tokenizer(tj, keep, rename={"<0x41>": NULL})
    with pytest.raises(ValueError, match="already a token"):
        trim_tokenizer(tj, keep, rename={"<unused0>": "<eos>"})
    with pytest.raises(ValueError, match="byte-fallback"):
        trim_tokenizer(tj, [i for i in keep if i != tj["model"]["vocab"]["<0x00>"]])
    with pytest.raises(ValueError, match="post-processor"):
        trim_tokenizer(tj, [i for i in keep if i != 2])
    with pytest.raises(ValueError, match="normalizer"):  # "▁" as bytes would decode to "▁", not to a space
        trim_tokenizer(tj, [i for i in keep if i != tj["model"]["vocab"]["▁"]])
    with pytest.raises(ValueError, match="twice"):
        trim_tokenizer(tj, [*keep, keep[-1]])


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, size=st.sampled_from(SIZES))
def test_roundtrip_ids_and_fidelity(text: str, size: int) -> None:
    v, tok = trimmed(size)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert all(0 <= i < v.size for i in ids)
    if roundtrips(original(), text):  # not a literal "▁", which the decoder turns into a space in both
        assert roundtrips(tok, text)
    old_ids = original().encode(text, add_special_tokens=False).ids
    kept = set(v.old_ids.tolist())
    if all(i in kept for i in old_ids) and NULL not in text and "<unused0>" not in text:
        assert [int(v.old_ids[i]) for i in ids] == old_ids  # fully kept text: tokenized exactly as before


def test_save_trimmed_loads_with_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer_config.json").write_text(json.dumps({
        "backend": "tokenizers", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "mask_token": "<mask>", "tokenizer_class": "GemmaTokenizer",
        "extra_special_tokens": ["<unused0>", "<unused1>"]}))
    v, tok = trimmed(SIZES[1])
    save_trimmed(v, src, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["extra_special_tokens"] == [NULL] and config["null_token"] == NULL
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id) == (0, 1, 2)
    assert hf.convert_tokens_to_ids(NULL) == hf.null_token_id == 5 and len(hf) == v.size
    for text in [*SENTENCES, "héllo 世界 🎉\n\n\tx  y", f"a{NULL}b"]:
        assert hf(text).input_ids == tok.encode(text).ids

    # The build's entry point: the untrimmed transformers tokenizer and a ranking file give the same vocabulary.
    save_ranking(ranked(), tmp_path / "rank.txt")
    (src / "tokenizer.json").write_text(gemma_like())
    again = trim_for_model(AutoTokenizer.from_pretrained(str(src)), v.size, tmp_path / "again",
                           ranking=tmp_path / "rank.txt", sentinels={})
    assert torch.equal(again.old_ids, v.old_ids) and again.config_ids == v.config_ids
    assert AutoTokenizer.from_pretrained(str(tmp_path / "again")).null_token_id == 5


# ---- the real Gemma 3 tokenizer ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not REAL.is_file(), reason=f"no Gemma 3 tokenizer at {REAL} (`dcanvas model build` makes it)")
def test_real_gemma_at_the_default_size(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tj = json.loads(REAL.read_text(encoding="utf-8"))
    v = trim_vocab(tj, load_ranking(), BuildConfig().vocab_size, sentinels=FIM_SOURCES)
    tok, old = v.tokenizer(), Tokenizer.from_file(str(REAL))
    assert v.size == tok.get_vocab_size(with_added_tokens=True) == BuildConfig().vocab_size
    assert [tok.token_to_id(t) for t in FIM_SOURCES.values()] == [6, 7, 8, 9]
    for t in ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]:
        assert tok.token_to_id(t) == old.token_to_id(t)
    assert tok.token_to_id(NULL) == 5 and tok.token_to_id("\n") is not None
    vocab, added = tok.get_vocab(), {t["content"] for t in v.tokenizer_json["added_tokens"]}
    assert all(a in vocab and b in vocab and a + b in vocab for a, b in v.tokenizer_json["model"]["merges"])
    for name, i in vocab.items():
        if name not in added and name not in BYTE_TOKENS:
            assert [t.id for t in tok.model.tokenize(name)] == [i], name
    passages = [json.loads(line)["text"] for line in
                (Path(__file__).parents[3] / "canvas/convert/calibration.jsonl").read_text().splitlines()]
    texts = [*passages, "héllo 世界 🎉\n\tdef f(x):\n\t\treturn x  # ok", "ǅ ﷺ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200d\x7f"]
    kept = set(v.old_ids.tolist())
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert max(ids) < v.size and roundtrips(tok, text) and roundtrips(old, text)
        before = old.encode(text, add_special_tokens=False).ids
        if all(i in kept for i in before):
            assert [int(v.old_ids[i]) for i in ids] == before
    save_trimmed(v, REAL.parent, tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id, hf.null_token_id) == (0, 1, 2, 5)
    assert all(hf(t).input_ids == tok.encode(t).ids for t in texts)
