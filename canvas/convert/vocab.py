"""The trimmed vocabulary: Gemma 3's 262,144 tokens cut down to the ones users' text needs, so the LM head is cheap.

Owns the committed ranking (`gemma3_vocab_rank.txt`, made by `python -m canvas.convert.vocab`, how exactly is in its
header): token frequencies on a mixture (the corpus's training split, source code, package documentation) interleaved
with a general-English prior (Gemma's own merge order, which is a frequency order learned on a very large corpus,
restricted to ASCII tokens, dictionary words first), because the corpus alone is not what users write: ranked on it,
common words of news or code fell apart into pieces the model never saw. Also owns the choice of ids to keep
(`select_vocab`), the
trimmed `tokenizer.json` (`trim_tokenizer`), both at once (`trim_vocab` -> `TrimmedVocab`), and the HF tokenizer
directory (`save_trimmed`; `trim_for_model` is what `build` calls).

Invariants of a trimmed tokenizer (the tests check each one):
- Ids are dense and follow the sorted kept old ids, so the low specials keep their numbers (pad 0, eos 1, bos 2,
  unk 3, mask 4) and `embed_new = embed_old[old_ids]` slices the embedding.
- All 256 byte-fallback tokens stay, so every character still encodes: decode(encode(t)) == t for any text that
  the original round-trips, and no text ever needs `<unk>`.
- The kept set is closed under BPE ancestry: a kept merged token keeps the intermediate tokens that BPE builds it
  from when it runs on the token's own string. A text whose original tokens are all kept therefore tokenizes
  exactly as before (the same merges fire in the same order), and no kept row is unreachable.
- A merge survives only when both halves and the result are kept (`tokenizers` refuses a merge out of its vocabulary),
  in the original order, so surviving merges keep their relative priority.
- Every added token is also in the model vocabulary under the same id, so no id >= the new vocab size is emitted.
- `rename` renames kept added tokens only (Gemma's `<unused0>` becomes the editor's `<null>`), in the vocab and in
  `added_tokens`; merges through a renamed token are dropped (added tokens are matched before BPE, so they were dead).
"""

from __future__ import annotations

import argparse
import collections
import copy
import itertools
import json
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from canvas.convert.source import sha256_file

HERE = Path(__file__).resolve().parent
RANKING = HERE / "gemma3_vocab_rank.txt"
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))
# Kept whenever present: the ids the model config names, plus the chat-turn markers (cheap, and text may carry them).
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")
# Gemma matches newline and tab runs as added tokens before BPE. Our corpus has no single newline and no tab (its
# paragraphs are joined by blank lines), but an editor's text has both, and without these they would fall back to
# byte tokens the model barely knows; 62 ids keep every whitespace run tokenized as Gemma does.
WHITESPACE = tuple(c * n for c in "\n\t" for n in range(1, 32))
NULL_SOURCE = "<unused0>"  # an unused Gemma slot, reused as the null token so its id stays in the low specials
NULL = "<null>"  # the editor's gap filler: lets an infill come out shorter than its gap
# Fill-in-the-middle sentinels, reserved from Gemma's unused added tokens (special, never produced by text; the
# tokenizer, `dcanvas convert` and transformers keep working): prefix, suffix, middle, end of middle.
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FIM_END = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_end|>"
FIM_SOURCES = {"<unused1>": FIM_PREFIX, "<unused2>": FIM_SUFFIX, "<unused3>": FIM_MIDDLE, "<unused4>": FIM_END}


# ---- ranking ---------------------------------------------------------------------------------------------------
def count_ids(tokenizer: Any, texts: Iterable[str], batch_size: int = 512) -> collections.Counter[int]:
    """How often each id occurs when encoding `texts` (no special tokens added).

    `tokenizer` is a `tokenizers.Tokenizer` or a transformers fast tokenizer (its backend is used)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    counts: collections.Counter[int] = collections.Counter()
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            counts.update(i for enc in backend.encode_batch(batch, add_special_tokens=False) for i in enc.ids)
            batch = []
    if batch:
        counts.update(i for enc in backend.encode_batch(batch, add_special_tokens=False) for i in enc.ids)
    return counts


def rank_ids(tokenizer: Any, texts: Iterable[str], batch_size: int = 512) -> list[int]:
    """Ids that occur when encoding `texts`, most frequent first, ties by id."""
    counts = count_ids(tokenizer, texts, batch_size)
    return sorted(counts, key=lambda i: (-counts[i], i))


def mixed_ranking(parts: Sequence[tuple[Mapping[int, int], float]]) -> list[int]:
    """Ids by a weighted mixture of relative frequencies: sum of weight * count / total over `(counts, weight)`
    parts, most frequent first, ties by id. Normalising each part first keeps a large source (code) from drowning
    a small one (prose) whatever their sizes."""
    score: dict[int, float] = collections.defaultdict(float)
    for counts, weight in parts:
        total = sum(counts.values())
        for i, c in counts.items():
            score[i] += weight * c / total
    return sorted(score, key=lambda i: (-score[i], i))


def prior_ranking(tok_json: Mapping[str, Any], lexicon: Iterable[str] = ()) -> list[int]:
    """A general-English prior from the tokenizer alone: its non-added tokens made only of printable ASCII (and
    newline, tab, "▁"), in id order, which for Gemma is merge priority (a frequency order from its very large, mostly
    multilingual training corpus); tokens whose text ("▁" dropped) is a word of `lexicon` (any case) come first, so
    whole English words (and names: a dictionary lists places and people) outrank fragments of other languages."""
    model = _bpe_model(tok_json)
    added = {int(t["id"]) for t in tok_json.get("added_tokens", [])}
    words = {w.lower() for w in lexicon}
    ascii_ids = []
    for name, i in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        text = name.replace("▁", " ")
        if i not in added and all(32 <= ord(c) < 127 or c in "\n\t" for c in text):
            ascii_ids.append((i, len(text.strip()) > 1 and text.strip().lower() in words))
    return [i for i, w in ascii_ids if w] + [i for i, w in ascii_ids if not w]


def interleave(a: Sequence[int], b: Sequence[int], take_a: int = 1, take_b: int = 1) -> list[int]:
    """`take_a` ids from `a`, then `take_b` from `b`, and so on, each id once (its first place wins)."""
    out: list[int] = []
    seen: set[int] = set()
    its = [(iter(a), take_a), (iter(b), take_b)]
    while True:
        moved = False
        for it, k in its:
            for _ in range(k):
                for i in it:
                    if i not in seen:
                        seen.add(i)
                        out.append(i)
                        moved = True
                        break
        if not moved:
            return out


def save_ranking(ids: Sequence[int], path: Path, header: Sequence[str] = ()) -> None:
    """One id a line (about 6 bytes an id, diffable), after `# `-comment header lines."""
    if len(set(ids)) != len(ids):
        raise ValueError("a ranking lists each id once")
    lines = [f"# {h}" for h in header] + [str(int(i)) for i in ids]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def load_ranking(path: Path = RANKING) -> list[int]:
    return [int(line) for line in path.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]


# ---- choosing the ids --------------------------------------------------------------------------------------------
def _merge_pairs(merges: Sequence[Any]) -> list[tuple[str, str]]:
    """Merges as pairs, from either serialisation (`[a, b]`, or the older `"a b"`)."""
    pairs = []
    for m in merges:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        pairs.append((a, b))
    return pairs


def _bpe_model(tok_json: Mapping[str, Any]) -> Mapping[str, Any]:
    model = tok_json["model"]
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise ValueError("expected a BPE tokenizer with byte_fallback (the round-trip guarantee rests on it)")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise ValueError("subword prefixes/suffixes are not supported (a merge's result would not be a + b)")
    missing = [t for t in BYTE_TOKENS if t not in model["vocab"]]
    if missing:
        raise ValueError(f"{len(missing)} byte-fallback tokens missing from the vocabulary (first {missing[0]})")
    return model


def _normalizer_tokens(norm: Mapping[str, Any] | None) -> list[str]:
    """What `Replace` normalizers write (Gemma's "▁" for a space). Each must stay a token: as byte-fallback bytes it
    would decode to "▁" itself, because the decoder's Replace("▁" -> " ") runs before ByteFallback."""
    if not norm:
        return []
    if norm.get("type") == "Sequence":
        return [t for sub in norm["normalizers"] for t in _normalizer_tokens(sub)]
    return [norm["content"]] if norm.get("type") == "Replace" and norm.get("content") else []


def _post_processor_tokens(pp: Mapping[str, Any] | None) -> list[str]:
    """Token names the post-processor inserts (they must stay)."""
    if not pp:
        return []
    if pp.get("type") == "Sequence":
        return [t for sub in pp["processors"] for t in _post_processor_tokens(sub)]
    if pp.get("type") == "TemplateProcessing":
        return [t for spec in pp["special_tokens"].values() for t in spec["tokens"]]
    if pp.get("type") == "ByteLevel":
        return []
    raise ValueError(f"unsupported post_processor {pp.get('type')!r} (TemplateProcessing, Sequence, ByteLevel)")


class _Ancestry:
    """For each merged token, the merge that builds it when BPE runs on the token's own string.

    BPE never merges across the boundary of a token it finally emits, and inside the span the merges fire in rank
    order whatever surrounds it, so a token's building merges in context are the ones it gets on its own. Keeping
    those intermediates (not just any pair that concatenates to the token: Gemma's merges list about two per token)
    makes kept tokens reachable and leaves fully-kept texts tokenized as before."""

    UNREACHABLE = ("", "")

    def __init__(self, model: Mapping[str, Any]) -> None:
        self.vocab: Mapping[str, int] = model["vocab"]
        self.ranks = {pair: r for r, pair in enumerate(_merge_pairs(model["merges"]))}
        self.parent: dict[str, tuple[str, str] | None] = {}

    def __call__(self, token: str) -> tuple[str, str] | None:
        """(a, b) with a + b == token; None for one character; UNREACHABLE when BPE cannot emit it."""
        if token not in self.parent:
            self._simulate(token)
        return self.parent[token]

    def _simulate(self, token: str) -> None:
        if len(token) == 1:
            self.parent[token] = None if token in self.vocab else self.UNREACHABLE
            return
        symbols = list(token)  # a character outside the vocabulary falls back to bytes, which never merge
        found: dict[str, tuple[str, str]] = {}
        while len(symbols) > 1:
            best, best_rank = -1, len(self.ranks)
            for i in range(len(symbols) - 1):
                r = self.ranks.get((symbols[i], symbols[i + 1]), best_rank)
                if r < best_rank:  # strict: the leftmost of equal pairs first, as tokenizers does
                    best, best_rank = i, r
            if best < 0:
                break
            a, b = symbols[best], symbols[best + 1]
            found[a + b] = (a, b)
            symbols[best : best + 2] = [a + b]
        if symbols != [token] or any(c not in self.vocab for c in token):
            self.parent[token] = self.UNREACHABLE
            return
        for merged, pair in found.items():  # every intermediate's own tree is its subtree here (same argument)
            self.parent.setdefault(merged, pair)


def select_vocab(tok_json: Mapping[str, Any], ranked: Sequence[int], size: int, *,
                 null_source: str | None = NULL_SOURCE, always: Iterable[str] = WHITESPACE,
                 reserved: Iterable[str] = (), fill: bool = True) -> list[int]:
    """The sorted old ids to keep: at most `size`, the required ones, then `ranked` in order with their ancestry.

    Required: the 256 byte-fallback tokens, `SPECIALS` that exist, the model's unk token, the normalizer's "▁",
    the post-processor's tokens, `null_source`, every token of `reserved` (the FIM sentinels' sources; each must
    exist) and the tokens of `always` that exist. A ranked token whose ancestry
    no longer fits is skipped (a later, shorter one may fit); a token BPE cannot emit at all is skipped too. When the
    ranking runs out first (our training split uses 52k of Gemma's ids), `fill` continues with the other non-added
    tokens by id, which for Gemma is its merge priority, so the result has exactly `size` ids."""
    model = _bpe_model(tok_json)
    vocab: Mapping[str, int] = model["vocab"]
    names = {i: t for t, i in vocab.items()}
    added = {int(t["id"]) for t in tok_json.get("added_tokens", [])}
    required_names = [*BYTE_TOKENS, *(t for t in SPECIALS if t in vocab), *(t for t in always if t in vocab),
                      *_normalizer_tokens(tok_json.get("normalizer")),
                      *_post_processor_tokens(tok_json.get("post_processor"))]
    if model.get("unk_token"):
        required_names.append(model["unk_token"])
    if null_source is not None:
        if null_source not in vocab:
            raise ValueError(f"null_source {null_source!r} is not in the vocabulary")
        required_names.append(null_source)
    for t in reserved:
        if t not in vocab:
            raise ValueError(f"reserved token {t!r} is not in the vocabulary")
        required_names.append(t)
    missing = [t for t in required_names if t not in vocab]
    if missing:
        raise ValueError(f"required tokens missing from the vocabulary: {missing}")
    keep = {vocab[t] for t in required_names}
    if size < len(keep):
        raise ValueError(f"size {size:,} is below the {len(keep)} ids that must be kept "
                         f"(256 byte-fallback tokens, the specials and the null token)")
    ancestry = _Ancestry(model)

    def closure(tid: int) -> set[int] | None:
        """`tid` and its not-yet-kept ancestors (`keep` is always closed, so a kept ancestor ends the walk)."""
        out: set[int] = set()
        stack = [tid]
        while stack:
            t = stack.pop()
            if t in keep or t in out:
                continue
            out.add(t)
            if t in added:  # matched before BPE runs: no ancestry
                continue
            pair = ancestry(names[t])
            if pair == _Ancestry.UNREACHABLE:
                return None
            if pair is not None:
                stack += [vocab[pair[0]], vocab[pair[1]]]
        return out

    bad = [t for t in ranked if t not in names]
    if bad:
        raise ValueError(f"ranked ids {bad[:5]} are not in this vocabulary of {len(names):,} (a ranking of another "
                         "tokenizer?)")
    candidates = itertools.chain(ranked, (t for t in sorted(names) if t not in added) if fill else ())
    for tid in candidates:
        if len(keep) >= size:
            break
        new = closure(tid)
        if new is not None and len(keep) + len(new) <= size:
            keep |= new
    return sorted(keep)


# ---- the trimmed tokenizer -------------------------------------------------------------------------------------------
def _remap_post_processor(pp: Any, new_id: Mapping[str, int], rename: Mapping[str, str]) -> Any:
    if not pp or pp.get("type") == "ByteLevel":
        return copy.deepcopy(pp)
    if pp.get("type") == "Sequence":
        return {**pp, "processors": [_remap_post_processor(p, new_id, rename) for p in pp["processors"]]}
    if pp.get("type") != "TemplateProcessing":
        raise ValueError(f"unsupported post_processor {pp.get('type')!r}")
    out = copy.deepcopy(pp)

    def piece(p: dict[str, Any]) -> dict[str, Any]:
        if "SpecialToken" in p:
            p["SpecialToken"]["id"] = rename.get(p["SpecialToken"]["id"], p["SpecialToken"]["id"])
        return p

    out["single"] = [piece(p) for p in out["single"]]
    out["pair"] = [piece(p) for p in out["pair"]]
    specials = {}
    for name, spec in out["special_tokens"].items():
        missing = [t for t in spec["tokens"] if t not in new_id]
        if missing:
            raise ValueError(f"the post-processor inserts {missing}, which are not kept")
        specials[rename.get(name, name)] = {"id": rename.get(spec["id"], spec["id"]),
                                            "ids": [new_id[t] for t in spec["tokens"]],
                                            "tokens": [rename.get(t, t) for t in spec["tokens"]]}
    out["special_tokens"] = specials
    return out


def trim_tokenizer(tok_json: Mapping[str, Any], keep: Sequence[int], *,
                   rename: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A new tokenizer.json dict over `keep` (new id = position in `keep`); everything else unchanged.

    Merges stay when a, b and a + b are all kept (in order), added tokens are dropped or renumbered, the
    post-processor's ids follow, `rename` renames kept added tokens (see the module docstring)."""
    model = _bpe_model(tok_json)
    rename = dict(rename or {})
    old_vocab: Mapping[str, int] = model["vocab"]
    names = {i: t for t, i in old_vocab.items()}
    if len(set(keep)) != len(keep):
        raise ValueError("keep lists an id twice")
    bad = [i for i in keep if i not in names]
    if bad:
        raise ValueError(f"keep has ids outside the vocabulary: {bad[:5]}")
    kept_names = [names[i] for i in keep]
    kept = set(kept_names)
    added = {t["content"]: t for t in tok_json.get("added_tokens", [])}
    for src, dst in rename.items():
        if src not in kept or src not in added:
            raise ValueError(f"rename {src!r}: only kept added tokens can be renamed")
        if dst in old_vocab and dst not in rename:
            raise ValueError(f"rename {src!r} -> {dst!r}: {dst!r} is already a token")
    if model.get("unk_token") and model["unk_token"] not in kept:
        raise ValueError(f"the unk token {model['unk_token']!r} must be kept")
    missing_bytes = [t for t in BYTE_TOKENS if t not in kept]
    if missing_bytes:
        raise ValueError(f"byte-fallback tokens must all be kept ({len(missing_bytes)} missing)")
    dropped = [t for t in _normalizer_tokens(tok_json.get("normalizer")) if t not in kept]
    if dropped:
        raise ValueError(f"the normalizer writes {dropped}, which must stay tokens (bytes would not decode back)")

    new_id = {t: i for i, t in enumerate(kept_names)}  # by original name
    vocab = {rename.get(t, t): i for i, t in enumerate(kept_names)}
    merges = [m for m, (a, b) in zip(model["merges"], _merge_pairs(model["merges"]), strict=True)
              if a in kept and b in kept and a + b in kept
              and a not in rename and b not in rename and a + b not in rename]
    new_added = []
    for content, tok in added.items():
        if content in kept:
            new_added.append({**tok, "id": new_id[content], "content": rename.get(content, content)})
    new_added.sort(key=lambda t: t["id"])

    out = {k: copy.deepcopy(v) for k, v in tok_json.items() if k not in ("model", "added_tokens", "post_processor")}
    new_model = {k: copy.deepcopy(v) for k, v in model.items() if k not in ("vocab", "merges")}
    if model.get("unk_token"):
        new_model["unk_token"] = rename.get(model["unk_token"], model["unk_token"])
    out["model"] = {**new_model, "vocab": vocab, "merges": merges}
    out["added_tokens"] = new_added
    out["post_processor"] = _remap_post_processor(tok_json.get("post_processor"), new_id, rename)
    padding = out.get("padding")
    if padding:
        pad = padding.get("pad_token")
        if pad not in vocab:
            raise ValueError(f"the padding token {pad!r} is not kept")
        padding["pad_id"] = vocab[pad]
    return out


@dataclass(frozen=True, eq=False)
class TrimmedVocab:
    """A sub-vocabulary of a tokenizer: `old_ids[new] = old` (int64) and the trimmed tokenizer.json dict."""

    old_ids: torch.Tensor  # (V_new,) int64, increasing: embed_new = embed_old[old_ids]
    tokenizer_json: dict[str, Any]
    rename: Mapping[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.old_ids.numel())

    def token_id(self, token: str) -> int | None:
        return self.tokenizer_json["model"]["vocab"].get(token)

    def tokenizer(self) -> Any:
        """The trimmed `tokenizers.Tokenizer`."""
        from tokenizers import Tokenizer

        return Tokenizer.from_str(json.dumps(self.tokenizer_json))

    @property
    def config_ids(self) -> dict[str, Any]:
        """Model-config fields for the trimmed vocabulary (Gemma's token names)."""
        eos = self.token_id("<eos>")
        return {"pad_token_id": self.token_id("<pad>"), "bos_token_id": self.token_id("<bos>"),
                "eos_token_ids": () if eos is None else (eos,), "null_token_id": self.token_id(NULL)}


def trim_vocab(tok_json: Mapping[str, Any], ranked: Sequence[int], size: int, *,
               null_source: str | None = NULL_SOURCE, null: str = NULL, always: Iterable[str] = WHITESPACE,
               sentinels: Mapping[str, str] | None = None, fill: bool = True) -> TrimmedVocab:
    """`select_vocab` then `trim_tokenizer`, renaming `null_source` to `null` and each of `sentinels`' keys to its
    value (`FIM_SOURCES` for the build)."""
    sentinels = dict(sentinels or {})
    keep = select_vocab(tok_json, ranked, size, null_source=null_source, always=always, reserved=sentinels,
                        fill=fill)
    rename = {null_source: null} if null_source is not None else {}
    rename.update(sentinels)
    trimmed = trim_tokenizer(tok_json, keep, rename=rename)
    return TrimmedVocab(torch.tensor(keep, dtype=torch.long), trimmed, rename)


def save_trimmed(vocab: TrimmedVocab, src_dir: Path, out_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json for `AutoTokenizer.from_pretrained(out_dir)`.

    The config is the source's (`src_dir/tokenizer_config.json`, when there) with renamed tokens followed, tokens
    that were dropped removed, and the null token named (`null_token`, so `tok.null_token_id` works)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    src = src_dir / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(src.read_text(encoding="utf-8")) if src.is_file() else {}
    vocab_ids = vocab.tokenizer_json["model"]["vocab"]

    def fix(tok: Any) -> Any:
        """The token's new name, or None when it was dropped; dict-shaped AddedTokens keep their shape."""
        if isinstance(tok, dict):
            content = fix(tok.get("content"))
            return None if content is None else {**tok, "content": content}
        if not isinstance(tok, str):
            return tok
        tok = vocab.rename.get(tok, tok)
        return tok if tok in vocab_ids else None

    for key in list(config):
        value = config[key]
        if key.endswith("_token") and value is not None:
            if fix(value) is None:
                del config[key]
            else:
                config[key] = fix(value)
        elif key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
            config[key] = [t for t in map(fix, value) if t is not None]
        elif key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, dict):
            config[key] = {k: fix(t) for k, t in value.items() if fix(t) is not None}
        elif key == "added_tokens_decoder":  # keyed by id: rebuilt from the trimmed added tokens
            config[key] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                           for t in vocab.tokenizer_json["added_tokens"]}
    for null in vocab.rename.values():
        if null == NULL:
            config["null_token"] = NULL
    # Compact: 1.8 MB at 32k tokens against 4.1 MB pretty-printed (each merge pair takes four lines there).
    (out_dir / "tokenizer.json").write_text(json.dumps(vocab.tokenizer_json, ensure_ascii=False) + "\n",
                                            encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")


def trim_for_model(tok: Any, size: int, out_dir: Path, ranking: Path = RANKING,
                   sentinels: Mapping[str, str] = FIM_SOURCES) -> TrimmedVocab:
    """The build's step: trim a transformers Gemma 3 tokenizer to `size` by the committed ranking, with the FIM
    sentinels reserved, write it to `out_dir`, return the ids to slice the model with."""
    tok_json = json.loads(tok.backend_tokenizer.to_str())
    vocab = trim_vocab(tok_json, load_ranking(ranking), size, sentinels=sentinels)
    with tempfile.TemporaryDirectory() as src:  # the source's tokenizer_config.json, as transformers writes it
        tok.save_pretrained(src)
        save_trimmed(vocab, Path(src), out_dir)
    return vocab


# ---- regenerating the committed ranking ------------------------------------------------------------------------
def _read_texts(paths: Iterable[Path], metadata: bool = False) -> list[str]:
    """File contents; for wheel METADATA files only the long description (after the first blank line)."""
    out = []
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append(text.split("\n\n", 1)[1] if metadata and "\n\n" in text else text)
    return out


def _paths(patterns: Sequence[str], exclude: Sequence[str]) -> list[Path]:
    import glob

    found = sorted({Path(p) for pat in patterns for p in glob.glob(pat, recursive=True)})
    return [p for p in found if p.is_file() and not any(x in str(p) for x in exclude)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m canvas.convert.vocab",
                                description="Rank the Gemma 3 token ids for trimming (the committed "
                                            "gemma3_vocab_rank.txt): a frequency mixture interleaved with a "
                                            "general-English prior.")
    p.add_argument("--tokenizer", type=Path, default=Path.home() / ".cache/dcanvas/gemma3/hf/tokenizer.json")
    p.add_argument("--corpus", type=Path, default=Path("data/corpus/train.jsonl"), help="JSON lines with 'text'")
    p.add_argument("--code", nargs="*", default=[f"{sys.base_prefix}/lib/python3.*/**/*.py",
                                                  "/usr/lib/node_modules/npm/**/*.js"],
                   help="globs of source files (default: this Python's standard library and npm's JavaScript; "
                        "never site-packages)")
    p.add_argument("--docs", nargs="*", default=[f"{sys.prefix}/lib/python3.*/site-packages/*.dist-info/METADATA"],
                   help="globs of wheel METADATA files (their READMEs: technical prose)")
    # The probe set's own sources stay out of the ranking, so its figures measure held-out text.
    p.add_argument("--exclude", nargs="*", default=["/test", "/textwrap.py", "/shlex.py", "lib/npm.js", "lib/cli.js",
                                                    "lib/base-cmd.js", "/starlette-", "/httpx-", "/uvicorn-",
                                                    "/textual-", "/rich-"], help="substrings of paths to skip")
    p.add_argument("--lexicon", nargs="*", type=Path, default=[Path("/usr/share/dict/american-english-large"),
                                                                Path("/usr/share/dict/british-english-large")],
                   help="word lists for the prior (Debian wamerican-large, wbritish-large)")
    p.add_argument("--weights", type=float, nargs=3, default=(0.5, 0.25, 0.25), metavar=("CORPUS", "CODE", "DOCS"))
    p.add_argument("--prior-every", type=int, default=2, help="prior ids taken after each mixture id")
    p.add_argument("--keep", type=int, default=98_304, help="ids written (the largest vocabulary it can serve)")
    p.add_argument("--out", type=Path, default=RANKING)
    args = p.parse_args(argv)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    tok_json = json.loads(args.tokenizer.read_text(encoding="utf-8"))
    corpus = [json.loads(line)["text"] for line in args.corpus.read_text(encoding="utf-8").splitlines() if line]
    code = _read_texts(_paths(args.code, [*args.exclude, "site-packages"]))
    docs = _read_texts(_paths(args.docs, args.exclude), metadata=True)
    missing = [f for f in args.lexicon if not f.is_file()]
    if missing or not (corpus and code and docs):
        print(f"missing inputs: lexicon {missing}, corpus {len(corpus)}, code {len(code)}, docs {len(docs)} texts "
              "(apt-get install wamerican-large wbritish-large; dcanvas data build)", file=sys.stderr)
        return 2
    lexicon = [w.strip() for f in args.lexicon for w in f.read_text(encoding="utf-8", errors="replace").splitlines()
               if w.strip() and "'" not in w]
    parts = [(count_ids(tokenizer, texts), w) for texts, w in zip((corpus, code, docs), args.weights, strict=True)]
    ids = interleave(mixed_ranking(parts), prior_ranking(tok_json, lexicon), 1, args.prior_every)[: args.keep]

    def chars(texts: list[str]) -> str:
        return f"{len(texts):,} texts, {sum(map(len, texts)):,} characters"

    header = [f"Gemma 3 token ids for trimming, best first: a frequency mixture (weights {args.weights}) of the "
              f"corpus's {args.corpus.name} ({chars(corpus)}), source code ({chars(code)}) and wheel READMEs "
              f"({chars(docs)}), each normalised to relative frequency,",
              f"interleaved 1:{args.prior_every} with Gemma's merge order over ASCII tokens, words of "
              f"{', '.join(f.name for f in args.lexicon)} ({len(lexicon):,} entries) first.",
              f"tokenizer.json sha256 {sha256_file(args.tokenizer)} ({tokenizer.get_vocab_size():,} tokens).",
              "Made by `python -m canvas.convert.vocab` (canvas/convert/vocab.py; defaults: this Python's stdlib "
              "minus tests, the venv's wheels, the probe set's sources excluded)."]
    save_ranking(ids, args.out, header)
    print(f"{len(ids):,} distinct ids -> {args.out} ({args.out.stat().st_size / 1e3:.0f} kB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
