"""Which generation mode a request runs in when it names none: the model's default per kind of request.

Owns `ModeDefaults` (the default mode for infills/rewrites and for continuations), `request_kind` (which kind a
canvas is) and `ModeDefaults.resolve`, the one rule every entry point uses (the websocket `gen.start`, the HTTP
dialects, `dcanvas generate`, and through the server the TUI and the web page): a named mode is always honoured;
no mode takes the model's default for the request's kind.

The defaults live in the model directory's `EXTRA_FILE`, beside the sampler settings
transformers has no key for, as `default_mode_infill` and `default_mode_continuation`; `dcanvas eval --write-defaults`
writes them from measured quality (`canvas.eval.choice`). A directory without them keeps diffusion for both, as
before they existed.

An infill's default may also depend on its gap's size (`ModeDefaults.infill_by_gap`): a table of gap sizes with the
mode measured best at each (`GAP_MODES_FILE`, written by `dcanvas eval --write-gap-modes` beside the decoder it
measured: a served gap denoiser's adapter directory, else the model directory; `read_gap_modes`). A gap takes the
row of the smallest measured size at or above it; a gap past the largest measured size runs AR, as does every size
the table does not say diffusion for: no measurement, no diffusion. A request that gives no canvas (only its kind)
has no gap size and gets the kind's default.

Also owns `Mode` (the generation modes) and `EXTRA_FILE` and `LABELS` / `mode_label`, the one table of
how a mode, or what wrote a text (`canvas.engine.types.Writer`), is named to a user: the TUI's status line and
settings, the web page (through `welcome.model.labels`) and `dcanvas generate`. This module imports nothing that
needs torch, so the TUI, a pure client, can read the labels.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

Mode = Literal["diffusion", "ar"]
# The model directory's file of our sampler settings transformers has no key for (`canvas.sampling.sampler` reads and
# writes the rest of it); defined here so this torch-free module needs nothing from the sampler.
EXTRA_FILE = "dcanvas_sampler.json"
Kind = Literal["infill", "continuation"]
KINDS: tuple[Kind, ...] = get_args(Kind)
MODES: tuple[Mode, ...] = get_args(Mode)
# The measured infill mode per gap size, beside the decoder it was measured with (`read_gap_modes`).
GAP_MODES_FILE = "gap_modes.json"
# The keys of EXTRA_FILE, per kind.
MODE_KEYS: dict[Kind, str] = {"infill": "default_mode_infill", "continuation": "default_mode_continuation"}

# What a user reads for a mode setting, the mode a request runs in, or what wrote a text (`Writer`, `stats.mode`).
# "diffusion" says what it is on the converted models: their decoder has had no denoising training.
LABELS: dict[str, str] = {
    "default": "model default",  # no mode named: the model's default for the request's kind
    "diffusion": "diffusion (untrained decoder)",
    "ar": "AR (left to right)",
    "ar-infill": "AR infill (K drafts, seam-scored)",
}


def mode_label(mode: str | None, kind: Kind | None = None) -> str:
    """The label of a mode setting (None: the model's default), of a `Writer` ("ar-infill" included), or, with the
    request's `kind`, of the mode it runs in: AR on an infill drafts K candidates and keeps the one whose seam reads
    best (a model whose settings turn the drafts off fills left to right: its `Done.mode` then says "ar")."""
    if mode is None:
        return LABELS["default"]
    if mode == "ar" and kind == "infill":
        mode = "ar-infill"
    return LABELS.get(mode, mode)


@dataclass(frozen=True, slots=True)
class ModeDefaults:
    infill: Mode = "diffusion"  # infills and rewrites: free slots with pinned text after them
    continuation: Mode = "diffusion"  # free slots with nothing pinned after them
    # Measured (gap size, mode) rows, ascending sizes: an infill whose gap size is known takes its row's mode
    # (`by_gap`); empty: `infill` for every size.
    infill_by_gap: tuple[tuple[int, Mode], ...] = ()

    def __post_init__(self) -> None:
        for kind in KINDS:
            if getattr(self, kind) not in MODES:
                raise ValueError(f"{MODE_KEYS[kind]} must be one of {MODES}, got {getattr(self, kind)!r}")
        sizes = [g for g, _ in self.infill_by_gap]
        if any(g < 1 for g in sizes) or sizes != sorted(set(sizes)):
            raise ValueError(f"infill_by_gap needs distinct ascending gap sizes >= 1, got {sizes}")
        if any(m not in MODES for _, m in self.infill_by_gap):
            raise ValueError(f"infill_by_gap modes must be of {MODES}, got {self.infill_by_gap}")

    def by_gap(self, gap: int) -> Mode:
        """The measured mode for an infill whose largest gap is `gap` slots: the row of the smallest measured size
        at or above it; AR past the largest one (no measurement says otherwise)."""
        for size, mode in self.infill_by_gap:
            if gap <= size:
                return mode
        return "ar"

    def resolve(self, mode: Mode | None, kind: Kind, gap: int | None = None) -> Mode:
        """The mode a request runs in: `mode` when it names one, else this model's default for `kind` (for an
        infill with a known largest `gap` and a measured table, that size's measured mode)."""
        if mode is not None:
            return mode
        if kind == "continuation":
            return self.continuation
        if gap is not None and self.infill_by_gap:
            return self.by_gap(gap)
        return self.infill

    @property
    def decodes(self) -> bool:
        """Whether a request that names no mode can decode left to right (some kind's default is AR, or some gap
        size's): what the served dtype is chosen for (`canvas.model.cpu.resolve_dtype`)."""
        # A measured table always has AR in it: a gap past its largest size runs AR.
        return "ar" in (self.infill, self.continuation) or bool(self.infill_by_gap)

    def to_extra(self) -> dict[str, str]:
        """The EXTRA_FILE keys of these defaults."""
        return {MODE_KEYS[k]: getattr(self, k) for k in KINDS}


def request_kind(pinned: Sequence[bool]) -> Kind:
    """"infill" when some free slot has a pinned one after it (the fill must lead into that text), else
    "continuation" (nothing pinned, or pins only before the free slots). An empty canvas is a continuation."""
    seen_free = False
    for p in pinned:
        if not p:
            seen_free = True
        elif seen_free:
            return "infill"
    return "continuation"


def largest_gap(pinned: Sequence[bool]) -> int:
    """The longest run of free slots with a pinned slot after it (0: none, a continuation)."""
    best = run = 0
    for p in pinned:
        if p:
            best, run = max(best, run), 0
        else:
            run += 1
    return best


def read_gap_modes(directory: str | Path) -> tuple[tuple[tuple[int, Mode], ...], str | None] | None:
    """The measured (gap size, mode) rows in `directory`'s GAP_MODES_FILE and the sha256 of the decoder adapters they
    were measured with (None: the model's own decoder); None when the file is absent. Raises ValueError naming the
    file when it is malformed."""
    path = Path(directory) / GAP_MODES_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict) or not isinstance(raw.get("sizes"), list):
            raise ValueError("not a JSON object with a 'sizes' list")
        rows = tuple(sorted((int(r["gap"]), r["mode"]) for r in raw["sizes"]))
        ModeDefaults(infill_by_gap=rows)  # validates
        decoder = raw.get("decoder_sha256")
        if decoder is not None and not isinstance(decoder, str):
            raise ValueError("decoder_sha256 must be a string or null")
        return rows, decoder
    except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {exc}") from None


def load_mode_defaults(model_dir: str | Path) -> ModeDefaults:
    """A model directory's default modes from its EXTRA_FILE (diffusion for whatever it leaves out).

    Raises ValueError naming the file when it is unreadable JSON or names a mode that does not exist."""
    path = Path(model_dir) / EXTRA_FILE
    if not path.is_file():
        return ModeDefaults()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        return ModeDefaults(**{k: raw[key] for k, key in MODE_KEYS.items() if key in raw})
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {exc}") from None


def write_extra(model_dir: str | Path, values: dict[str, Any]) -> Path:
    """Merge `values` into the model directory's EXTRA_FILE (its other keys are kept)."""
    path = Path(model_dir) / EXTRA_FILE
    raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    raw.update(values)
    path.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    return path
