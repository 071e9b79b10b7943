"""The tokenizer contract of the document, an adapter for Hugging Face tokenizers, and atom building.

`TextTokenizer` is all the document needs: `encode` (text -> ids with character offsets, no special tokens
added), `decode` (ids -> text, special tokens rendered, not skipped) and `placeholder_id` (the id free slots carry
in a `CanvasView`). `encode` must be concatenation-safe: encoding a piece of text in isolation must not add a
prefix (a dummy space, a BOS), because the document re-encodes small pieces around each edit.

`atoms_from_text` groups an encoding into atoms using its offsets: a cut between tokens is valid only where
every token before it ends at or before every token after it starts, so the tokens of one multi-byte character
(same offsets) stay together. `atoms_from_ids` does the same for generated ids, which have no offsets, by
incremental decoding: an atom ends where the decoded text stops ending in U+FFFD (an incomplete UTF-8 sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from canvas.document.base import Atom
from canvas.document.errors import TokenizationError

INCOMPLETE = "\ufffd"  # what a byte-level decoder emits for bytes that do not form a whole character yet
_CONTEXT_ATOMS = 3  # atoms of left context used to decode generated ids (SentencePiece decoders strip a lead space)


@dataclass(frozen=True, slots=True)
class Encoded:
    """Token ids of a text and, for each, the character span `[start, end)` it covers in that text."""

    ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]


class TextTokenizer(Protocol):
    """The minimal tokenizer the document depends on."""

    @property
    def placeholder_id(self) -> int: ...

    def encode(self, text: str) -> Encoded: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """`TextTokenizer` over a `tokenizers.Tokenizer` or a transformers fast tokenizer (`backend_tokenizer`).

    It encodes with a private copy of the backend so the caller's tokenizer is never mutated: the copy has no
    post-processor (no special tokens added, offsets not trimmed of whitespace, so tokens tile the text), no
    truncation or padding, and by default encodes special-token strings typed by a user (`"<eos>"`) as plain
    text. It refuses a tokenizer that prefixes every encoding (see `TextTokenizer`). `placeholder_id` is the given
    id, else the tokenizer's pad, unk, eos or bos token, else its padding id, else its lowest special added token.
    """

    def __init__(self, tokenizer: Any, *, placeholder_id: int | None = None, literal_special_tokens: bool = True):
        from tokenizers import Tokenizer

        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not isinstance(backend, Tokenizer):
            raise TypeError(f"expected a tokenizers.Tokenizer or a fast tokenizer, got {type(tokenizer).__name__}")
        enc = Tokenizer.from_str(backend.to_str())
        enc.post_processor = None
        enc.no_truncation()
        enc.no_padding()
        enc.encode_special_tokens = literal_special_tokens
        self._tok = enc
        # The document re-encodes small pieces of text around each edit: an encoder that prefixes every call (a
        # dummy space, `prepend_scheme="first"`, `add_prefix_space=True`) would put that prefix into the middle of
        # the token stream.
        if self.decode(self.encode("a").ids + self.encode("b").ids) != self.decode(self.encode("ab").ids):
            raise ValueError(
                "the tokenizer prefixes every encoding (a dummy space or prefix space); the document needs an "
                "encoder that is safe to call on pieces of text (e.g. Metaspace prepend_scheme='never')"
            )
        self._placeholder = _find_placeholder(tokenizer, backend) if placeholder_id is None else placeholder_id
        if not 0 <= self._placeholder < enc.get_vocab_size(with_added_tokens=True):
            raise ValueError(f"placeholder_id {self._placeholder} is outside the vocabulary")

    @property
    def placeholder_id(self) -> int:
        return self._placeholder

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int | None:
        """Id of a token string (e.g. a special token such as a null/gap token), or None if the vocab lacks it."""
        i = self._tok.token_to_id(token)
        return None if i is None else int(i)

    def encode(self, text: str) -> Encoded:
        e = self._tok.encode(text, add_special_tokens=False)
        return Encoded(tuple(e.ids), tuple((int(a), int(b)) for a, b in e.offsets))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


def _find_placeholder(wrapper: Any, backend: Any) -> int:
    for name in ("pad_token_id", "unk_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(wrapper, name, None)
        if isinstance(value, int):
            return value
    padding = backend.padding
    if padding is not None and isinstance(padding.get("pad_id"), int):
        return int(padding["pad_id"])
    special = sorted(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    if special:
        return int(special[0])
    raise ValueError("the tokenizer has no pad/unk/eos/bos or special token to use as placeholder; pass placeholder_id")


def atoms_from_text(tokenizer: TextTokenizer, text: str) -> list[Atom]:
    """Encode `text` and group its tokens into pinned atoms whose texts concatenate to exactly `text`."""
    if not text:
        return []
    enc = tokenizer.encode(text)
    n, size = len(enc.ids), len(text)
    if n == 0:
        raise TokenizationError(f"the tokenizer returned no tokens for {text[:40]!r} ({size} characters)")
    if len(enc.offsets) != n:
        raise TokenizationError(f"the tokenizer returned {n} ids but {len(enc.offsets)} offsets")
    # Clamp so a sloppy tokenizer cannot cut outside the text; a cut must also advance (no empty atoms).
    starts = [min(max(a, 0), size) for a, _ in enc.offsets]
    ends = [min(max(b, 0), size) for _, b in enc.offsets]
    suffix_min_start = [size] * (n + 1)
    for k in range(n - 1, -1, -1):
        suffix_min_start[k] = min(starts[k], suffix_min_start[k + 1])
    atoms: list[Atom] = []
    cut, first, reach = 0, 0, 0
    for k in range(n):
        reach = max(reach, ends[k])
        if k == n - 1:
            new_cut = size
        elif reach <= suffix_min_start[k + 1] and reach > cut:
            new_cut = reach
        else:
            continue
        ids = tuple(enc.ids[first : k + 1])
        if new_cut > cut:
            atoms.append(Atom(ids, text[cut:new_cut]))
        else:  # trailing zero-width tokens: they belong to the last atom
            atoms[-1] = Atom(atoms[-1].ids + ids, atoms[-1].text)
        cut, first = new_cut, k + 1
    return atoms


def atoms_from_ids(tokenizer: TextTokenizer, ids: Sequence[int], left: Sequence[Atom] = ()) -> list[Atom]:
    """Group generated `ids` into pinned atoms by incremental decoding after the atoms `left` of them.

    Decoding after a little left context (then cutting it off) keeps decoders that treat the first token specially
    (SentencePiece drops its leading space) from changing the text of a region in the middle of a document. Ids
    that never complete a character (the model emitted a broken byte sequence) end up in the last atom, with the
    replacement characters the decoder gives them. Ids that decode to nothing join the atom after them
    (the one before them at the end).
    """
    context = [a.ids for a in left[-_CONTEXT_ATOMS:]]
    atoms: list[Atom] = []
    pending: list[int] = []
    piece = ""
    flat = [t for a in context for t in a]
    base = tokenizer.decode(flat)
    for token in ids:
        pending.append(int(token))
        alone = tokenizer.decode(pending)
        full = tokenizer.decode(flat + pending)
        in_context = full[len(base) :] if full.startswith(base) else alone
        # Prefer the text decoded in context only where it extends the text decoded alone (a lead space a
        # SentencePiece decoder strips from a first token); where bytes of a broken sequence merge across the
        # boundary, the text decoded alone keeps every atom's text equal to the decoding of its own ids.
        piece = in_context if in_context.endswith(alone) else alone
        if piece and not piece.endswith(INCOMPLETE):
            atoms.append(Atom(tuple(pending), piece))
            context = (context + [tuple(pending)])[-_CONTEXT_ATOMS:]
            flat = [t for a in context for t in a]
            base = tokenizer.decode(flat)
            pending, piece = [], ""
    if pending:
        if piece:
            atoms.append(Atom(tuple(pending), piece))
        elif atoms:
            atoms[-1] = Atom(atoms[-1].ids + tuple(pending), atoms[-1].text)
        # else: ids that decode to no text and have nothing to attach to carry no content; they are dropped.
    return atoms
