"""The fill-in-the-middle (FIM) format: the sentinels' ids, whether a model has the format, and the prompt.

Owns the token layout the FIM fine-tune teaches (`canvas.training.fim`) and the engine prompts with
(`canvas.engine.ar`), one definition for both:
- PSM: `<bos> <pre> prefix <suf> suffix <mid> middle <end>`;
- SPM (Bavarian et al. 2022's variant, `prefix` and `middle` contiguous): `<bos> <pre> <suf> suffix <mid> prefix
  middle <end>`.
The four sentinels are `canvas.convert.vocab`'s FIM tokens, their ids read from the tokenizer (`fim_tokens`), never
literals. A model has the format only when its build applied FIM adapters (`model_fim_tokens`): every vocabulary
since the sentinels were reserved has them, trained or not. `MAX_PREFIX` / `MAX_SUFFIX` are the side lengths the
fine-tune draws up to, so a prompt cut to them looks like what the adapters saw.

Word boundaries are part of the format: the fine-tune cuts its sides at them (a token whose text starts with
whitespace, or one after a token that ends with it; `word_boundaries`), so every prefix it saw ends where a word
ends and every middle starts with a new word. A gap in the editor starts wherever the writer put it, and a prompt
whose prefix ends in the middle of a word, or after a full stop the middle must follow with a space, is one the
adapters never saw: its first middle token is a guess at which of the two the writer meant ("night.The", "exer
cable"). `heal_split` moves the left side's last partial word out of the prefix and into the start of the middle
(token healing), where the model reads it as text and continues it as text. Where the caller knows where the
writer's word starts (an editor's cursor line: "would n", or "would " with the space typed), it takes that partial
word out of the prompt instead, so the prefix ends at a word end, and `LeadTokens` constrains the middle's first
tokens to write it again in the model's own tokens (" n" then "ounced" is a split the tokenizer never makes;
" never" is one token); the caller drops the lead from the answer.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from canvas.convert.vocab import FIM_END, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX

Order = Literal["psm", "spm"]
SENTINELS = (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FIM_END)
MAX_PREFIX, MAX_SUFFIX = 192, 128  # tokens of context on each side, at most
MAX_HEAL = 8  # tokens of a partial word `heal_split` moves at most (longer runs: code or a URL, left as they are)


class FimUnavailable(ValueError):
    """The tokenizer has no FIM sentinels (a model built before the vocabulary reserved them)."""


@dataclass(frozen=True, slots=True)
class FimTokens:
    """The ids the FIM format uses, read from one tokenizer."""

    prefix: int
    suffix: int
    middle: int
    end: int
    bos: int
    pad: int
    eos: int

    @property
    def sentinels(self) -> tuple[int, int, int, int]:
        return (self.prefix, self.suffix, self.middle, self.end)


def fim_tokens(tokenizer: Any) -> FimTokens:
    """The FIM ids of an HF tokenizer or a raw `tokenizers.Tokenizer`; raises `FimUnavailable` when any is missing."""
    from canvas.model.tokenizer import special_ids

    if isinstance(tokenizer, FimTokens):
        return tokenizer
    if hasattr(tokenizer, "token_to_id"):
        ids = [tokenizer.token_to_id(t) for t in SENTINELS]
    else:
        unk = getattr(tokenizer, "unk_token_id", None)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in SENTINELS]
        ids = [None if i == unk else i for i in ids]
    missing = [t for t, i in zip(SENTINELS, ids, strict=True) if i is None]
    if missing:
        raise FimUnavailable(f"the tokenizer has no FIM sentinels {missing}; rebuild the model (`dcanvas model build`)")
    special = special_ids(tokenizer)
    pre, suf, mid, end = (int(i) for i in ids if i is not None)
    return FimTokens(pre, suf, mid, end, bos=special["bos"], pad=special["pad"], eos=special["eos"])


def recorded_fim_adapters(model_dir: str | Path) -> str | None:
    """The hash of the FIM adapter set the build in `model_dir` merged, as its `build.json` records it; None when
    it merged none, or the directory has no readable record (converted or trained here: never FIM)."""
    record = Path(model_dir) / "build.json"
    try:
        meta = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else {}
    except ValueError:
        return None
    fingerprint = meta.get("fingerprint") if isinstance(meta, dict) else None
    found = fingerprint.get("fim_adapters") if isinstance(fingerprint, dict) else None
    return str(found) if found else None


def model_fim_tokens(model_dir: str | Path, tokenizer: Any) -> FimTokens | None:
    """The FIM ids when the model in `model_dir` has the FIM format: its build applied FIM adapters
    (`recorded_fim_adapters`) and its tokenizer has the sentinels; else None. The sentinels alone say nothing:
    every vocabulary since they were reserved has them, trained or not."""
    if recorded_fim_adapters(model_dir) is None:
        return None
    try:
        return fim_tokens(tokenizer)
    except FimUnavailable:
        return None


def end_token_id(tokenizer: Any) -> int:
    """The id that ends a generated middle (`<|fim_end|>`)."""
    return fim_tokens(tokenizer).end


def fim_prompt(tokenizer_or_ids: Any, left_ids: Sequence[int], right_ids: Sequence[int],
               order: Order = "psm") -> list[int]:
    """The prompt whose continuation is the middle between `left_ids` and `right_ids` (generate until
    `end_token_id`). A leading `<bos>` on `left_ids` is dropped: the prompt starts with its own."""
    t = fim_tokens(tokenizer_or_ids)
    left = list(left_ids)
    if left and left[0] == t.bos:
        left = left[1:]
    if order == "psm":
        return [t.bos, t.prefix, *left, t.suffix, *right_ids, t.middle]
    if order == "spm":
        return [t.bos, t.prefix, t.suffix, *right_ids, t.middle, *left]
    raise ValueError(f"order must be 'psm' or 'spm', got {order!r}")


WordEdges = tuple[np.ndarray, np.ndarray]  # per id: starts with whitespace, ends with whitespace (bool (V,) each)


def word_boundaries(tokenizer: Any) -> WordEdges:
    """Per vocabulary id: does its text start with whitespace, does it end with whitespace (bool (V,) each)."""
    raw = tokenizer if hasattr(tokenizer, "decode_batch") else tokenizer.backend_tokenizer
    n = raw.get_vocab_size(with_added_tokens=True)
    texts = raw.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    starts = np.fromiter((bool(s) and s[0].isspace() for s in texts), dtype=bool, count=n)
    ends = np.fromiter((bool(s) and s[-1].isspace() for s in texts), dtype=bool, count=n)
    return starts, ends


def heal_split(left: Sequence[int], starts_word: np.ndarray, ends_word: np.ndarray, limit: int = MAX_HEAL) -> int:
    """How many trailing tokens of `left` to move from a FIM prompt's prefix to the start of its middle, so that
    the prefix ends at a word boundary as every prefix the fine-tune saw did: the tokens after the last boundary
    that `left` itself shows (0 when its last token ends with whitespace, or when that run is longer than `limit`
    or is all of `left`). `starts_word` / `ends_word`: `word_boundaries`."""
    n = len(left)
    if n == 0 or ends_word[left[-1]]:
        return 0
    for j in range(n - 1, max(0, n - limit) - 1, -1):  # the boundary before left[j], nearest the end first
        if j > 0 and (starts_word[left[j]] or ends_word[left[j - 1]]):
            return n - j
    return 0


MAX_LEAD = 32  # characters of a writer's partial word a suggestion may be made to start with (`LeadTokens`)


class LeadTokens:
    """Token healing by constraint: the ids a text may start with when it must begin with `lead`, the writer's
    partial word (" applie") or the space typed before the next word (" "), taken out of the prompt so that the
    prompt ends where a word ends, as every prefix the fine-tune saw did, and written again by the model in its own
    tokens (" applied", one token, where the prompt would otherwise hold " app" "lie" and ask for "d").

    `allowed(rest)`: the ids whose text starts with `rest` and goes on past it (never into more whitespace after a
    typed space: " " then "  the" would double it), or equals a `rest` that is not only whitespace, or is a shorter
    start of `rest` that is not only whitespace (" app" of " applie": the next token continues from "lie"). A lone
    space is never allowed for a typed space: the word after it would then start without one, a split the tokenizer
    never makes. Built once per tokenizer from each id's text (`texts[id]`, the id decoded alone)."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = tuple(texts)
        self._cache: dict[str, np.ndarray] = {}  # rest -> allowed ids: a writer types the same leads again
        order = sorted(range(len(texts)), key=lambda i: texts[i])
        self._sorted = [texts[i] for i in order]
        self._ids = np.asarray(order, dtype=np.int64)
        self._exact: dict[str, list[int]] = {}
        for i, t in enumerate(texts):
            if t:
                self._exact.setdefault(t, []).append(i)
        self.allowed(" ")  # the most common lead (a space typed after a word) and the widest: read once, here

    def allowed(self, rest: str) -> np.ndarray:
        """The ids (sorted int64) a text that must start with `rest` may start with; empty for an empty `rest`."""
        if not rest:
            return np.zeros(0, dtype=np.int64)
        if (hit := self._cache.get(rest)) is not None:
            return hit
        if len(self._cache) >= 256:
            self._cache.pop(next(iter(self._cache)))
        found = self._cache[rest] = self._allowed(rest)
        return found

    def _allowed(self, rest: str) -> np.ndarray:
        lo = bisect.bisect_left(self._sorted, rest)
        hi = bisect.bisect_left(self._sorted, rest + "\U0010ffff", lo)  # every text that starts with `rest`
        n, spaced, blank = len(rest), rest[-1].isspace(), rest.isspace()
        keep = [not blank if len(t) == n else not (spaced and t[n].isspace()) for t in self._sorted[lo:hi]]
        out = [self._ids[lo:hi][np.asarray(keep, dtype=bool)]] if keep else []
        heads = [i for k in range(1, n) if not rest[:k].isspace() for i in self._exact.get(rest[:k], ())]
        out.append(np.asarray(heads, dtype=np.int64))
        return np.unique(np.concatenate(out))


def lead_rest(rest: str, token_text: str) -> str:
    """What of `rest` (the part of a lead not yet written) is left after a token whose text is `token_text` (one
    `LeadTokens.allowed` gave): "" once the token covers it."""
    return rest[len(token_text) :] if rest.startswith(token_text) and len(token_text) < len(rest) else ""
