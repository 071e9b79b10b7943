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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from canvas.convert.vocab import FIM_END, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX

Order = Literal["psm", "spm"]
SENTINELS = (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FIM_END)
MAX_PREFIX, MAX_SUFFIX = 192, 128  # tokens of context on each side, at most


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


def model_fim_tokens(model_dir: str | Path, tokenizer: Any) -> FimTokens | None:
    """The FIM ids when the model in `model_dir` has the FIM format: its build applied FIM adapters (`build.json`
    records them as `fim_adapters`) and its tokenizer has the sentinels; else None. The sentinels alone say
    nothing: every vocabulary since they were reserved has them, trained or not."""
    record = Path(model_dir) / "build.json"
    try:
        meta = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else {}
    except ValueError:
        return None
    fingerprint = meta.get("fingerprint") if isinstance(meta, dict) else None
    if not isinstance(fingerprint, dict) or not fingerprint.get("fim_adapters"):
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
