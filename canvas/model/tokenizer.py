"""The byte-level BPE tokenizer of the embedded model: training, saving in HF layout, and special token ids.

Special tokens: `<pad>`, `<bos>`, `<eos>` and `<null>`, the gap filler: when an infill is shorter than the gap a
user opened, the model writes `<null>` into the unused slots and the editor drops them. The ids are whatever the
trainer assigns; code reads them with `special_ids(tokenizer)`, never as literals.

The saved directory (`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`) loads with
`transformers.AutoTokenizer.from_pretrained(dir)`, which then exposes `pad/bos/eos_token_id` and the named extra
special token `null_token` / `null_token_id`. Like Gemma's tokenizer it prepends `<bos>` when called with
`add_special_tokens=True` (the default); pass `add_special_tokens=False` to encode a fragment of a canvas.
Normalisation is NFC, so text differing only in unicode composition encodes identically; decoding is exact for
NFC text (byte-level BPE has no unknown token).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

PAD, BOS, EOS, NULL = "<pad>", "<bos>", "<eos>", "<null>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, NULL)
# Role -> token string. The strings are the contract with the saved files; ids are looked up.
SPECIAL_ROLES: dict[str, str] = {"pad": PAD, "bos": BOS, "eos": EOS, "null": NULL}
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet must fit


class TokenizerError(ValueError):
    """A tokenizer is unusable here (wrong vocabulary, missing special token)."""


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts` (deterministic for a given input order)."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} (256 bytes + special tokens), got {vocab_size}")
    if vocab_size > 65_535:
        raise ValueError(f"vocab_size must fit uint16 token arrays (<= 65535), got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path | str, *, model_max_length: int = 4096) -> Path:
    """Write `tok` in the HF layout that `AutoTokenizer.from_pretrained(out_dir)` loads."""
    from transformers import PreTrainedTokenizerFast

    for token in SPECIAL_TOKENS:
        if tok.token_to_id(token) is None:
            raise TokenizerError(f"tokenizer lacks the special token {token!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens={"null_token": NULL},
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    ids = special_ids(tok)
    # transformers 5 no longer writes special_tokens_map.json; older readers (and people) look for it. The ids are
    # recorded next to the strings so a reader without `tokenizers` can find the gap token.
    special_map = {f"{role}_token": token for role, token in SPECIAL_ROLES.items()}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["special_token_ids"] = {f"{role}_token_id": ids[role] for role in SPECIAL_ROLES}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def load_tokenizer(path: Path | str) -> Any:
    """Load a saved tokenizer directory with `AutoTokenizer` (offline) and check its special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    special_ids(tok)  # raises if something is missing
    return tok


class _HasTokenToId(Protocol):
    def token_to_id(self, token: str) -> int | None: ...


def special_ids(tokenizer: Any) -> dict[str, int]:
    """`{"pad", "bos", "eos", "null"} -> id`, read from an HF tokenizer or a raw `tokenizers.Tokenizer`."""
    ids: dict[str, int | None] = {}
    if hasattr(tokenizer, "token_to_id"):  # tokenizers.Tokenizer
        raw: _HasTokenToId = tokenizer
        ids = {role: raw.token_to_id(token) for role, token in SPECIAL_ROLES.items()}
    else:
        null_token = getattr(tokenizer, "null_token", None) or NULL
        ids = {
            "pad": tokenizer.pad_token_id,
            "bos": tokenizer.bos_token_id,
            "eos": tokenizer.eos_token_id,
            "null": tokenizer.convert_tokens_to_ids(null_token),
        }
        unk = getattr(tokenizer, "unk_token_id", None)
        if ids["null"] is not None and unk is not None and ids["null"] == unk:
            ids["null"] = None
    missing = sorted(role for role, value in ids.items() if value is None)
    if missing:
        raise TokenizerError(f"tokenizer has no id for the special token(s) {missing}")
    out = {role: int(value) for role, value in ids.items() if value is not None}
    if len(set(out.values())) != len(out):
        raise TokenizerError(f"special tokens share ids: {out}")
    return out


def iter_texts(paths: Iterable[Path]) -> Iterator[str]:
    """The `text` field of every line of the given JSONL files, in order."""
    for path in paths:
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                yield json.loads(line)["text"]
