"""What the server generates with: a model directory loaded into an `Engine` plus the tokenizer and special ids.

Owns `Backend` (one per server: one engine, shared by every session) and its loading. A model directory holds
`config.json` + `model.safetensors` (our DiffusionGemma layout, `canvas.model.io`) and an HF tokenizer
(`tokenizer.json`, ...). `write_tiny_checkpoint` makes a small random-weight directory of that layout, so tests,
the TUI's and the web page's tests can run a real server (model, engine, sampler) on a CPU in seconds.

The model's sampler defaults come from its `generation_config.json` (as transformers' `generate` reads them);
a request's explicit parameters override them. Its default mode per kind of request (`canvas.sampling.modes`) comes from
`dcanvas_sampler.json`; a request that names a mode gets it. The BOS token (when the tokenizer has one) is
prepended to every context, as the tokenizer itself does when it encodes a prompt; `<null>` (when present) lets an
infill come out shorter than its gap; EOS ends a region.

A gap denoiser (`dcanvas train --objective gap-denoise`, exported) is served from the model directory's
`DECODER_DIR` (`decoder_adapters/`: a subdirectory, which a build's file check does not count), from
`$DCANVAS_DECODER_ADAPTERS` (a directory, or `off`), or from the directory `load_backend` is given
(`resolve_decoder_adapters`); its adapters are read only in the decoder pass, so AR requests run exactly as without
it, and a set trained with the shifted head makes the engine read the canvas so. The per-gap-size infill modes
measured for the decoder served (`canvas.sampling.modes.GAP_MODES_FILE`, in the adapters' directory, else the
model's) are used only when they name that decoder's sha256; `Backend.mode_for` reads a request's largest gap
from its canvas.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from canvas.convert.fim import WordEdges
from canvas.document import CanvasView, Document, DocumentConfig, HFTokenizer, Proposal
from canvas.engine.ar import clause_end_ids, line_tokens
from canvas.engine.core import Engine, GenRequest
from canvas.engine.prefix_cache import DEFAULT_CONTEXT_CACHE_MB
from canvas.env import DECODER_ADAPTERS
from canvas.model.config import ModelConfig
from canvas.model.cpu import DtypeChoice
from canvas.sampling.modes import Kind, ModeDefaults, largest_gap, load_mode_defaults, read_gap_modes, request_kind
from canvas.sampling.sampler import Mode, SamplerConfig, load_sampler_defaults

DECODER_DIR = "decoder_adapters"  # a model directory's served gap denoiser (an exported adapter set)
AUTO = "auto"

# A few lines of plain English for the tiny tokenizer to learn merges from (written for this purpose).
_TINY_TEXT = """\
The cat sat on the mat and watched the rain. A dog ran past the open door, and the cat did not move.
Once upon a time there was a small house by a river. In the house lived a man who wrote letters every day.
She opened the window, looked at the garden, and began to write. The morning was cold and very quiet.
We walked along the road until the sun went down, then we sat by the fire and talked about the sea.
"""


@dataclass
class Backend:
    name: str
    # None: this server runs no model; its generations run elsewhere (`dcanvas serve --ray`: on Ray Serve replicas,
    # each with its own Backend that has one). `engine` then raises: reaching for it is a bug.
    local_engine: Engine | None
    tokenizer: HFTokenizer  # the document's view of the tokenizer
    canvas_length: int
    bos_id: int | None
    eos_id: int | None
    null_id: int | None
    modes: tuple[str, ...] = ("diffusion", "ar")
    sampler_defaults: SamplerConfig = field(default_factory=SamplerConfig)  # the model's generation_config.json
    mode_defaults: ModeDefaults = field(default_factory=ModeDefaults)  # its default mode per kind of request
    # The gap denoiser served (its adapters.json's main keys, with `path`), or None: the model's own decoder.
    decoder: dict[str, Any] | None = None
    # The tokenizer's special tokens (`<null>`, `<|fim_end|>`, ...): markup of the model's, never text a client shows.
    special_ids: frozenset[int] = frozenset()
    _decoded: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def engine(self) -> Engine:
        if self.local_engine is None:
            raise RuntimeError(f"{self.name}: this server runs no engine (its generations run on Ray Serve replicas)")
        return self.local_engine

    def token_text(self, token: int) -> str:
        """The text of one token for display (a lone byte of a multi-byte character shows as U+FFFD); a special
        token has none (a `<null>` slot, a draft's `<|fim_end|>` and the repeats after it show as nothing)."""
        cache = self._decoded
        text = cache.get(token)
        if text is None:
            text = cache[token] = "" if token in self.special_ids else self.tokenizer.decode([token])
        return text

    def mode_for(self, mode: Mode | None, kind: Kind | Sequence[bool], gap: int | None = None) -> Mode:
        """The mode a request runs in: `mode` when it names one, else the model's default for its kind (given, or
        read from the canvas's pinned flags, which also give the largest gap for a measured per-size table)."""
        if isinstance(kind, str):
            return self.mode_defaults.resolve(mode, kind, gap)
        return self.mode_defaults.resolve(mode, request_kind(kind), largest_gap(kind) if gap is None else gap)

    def document_config(self) -> DocumentConfig:
        return DocumentConfig(canvas_length=self.canvas_length, max_undo=200)

    def context(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        return ids if self.bos_id is None else (self.bos_id, *ids)

    def request(self, view: CanvasView, config: SamplerConfig, *, stream_every: int = 1) -> GenRequest:
        """The engine request that fills the free slots of a document's canvas view."""
        return GenRequest(self.context(view.context_ids), view.slot_ids, view.pinned, config, stream_every=stream_every,
                          avoid=view.replaced_ids)

    def proposal(self, doc: Document, canvas: tuple[int, ...]) -> Proposal:
        """A generated canvas read back into `doc` (the document the request's view came from): nulls dropped,
        a region cut at EOS. Any other special token (a FIM sentinel, `<pad>`, `<mask>`: what a diffusion row may
        leave in a slot) is no text either and is dropped like a null; a pinned slot never holds one (the document
        encodes typed special-token strings as plain text)."""
        drop = self.special_ids - {self.eos_id}
        if self.null_id is not None and drop:
            canvas = tuple(self.null_id if t in drop else t for t in canvas)
        return doc.make_proposal(canvas, self.null_id, eos_id=self.eos_id)


def _special_id(tok: Any, attr: str, token: str | None = None) -> int | None:
    value = getattr(tok, attr, None)
    if isinstance(value, int):
        return value
    if token is not None:
        found = tok.convert_tokens_to_ids(token)
        unk = getattr(tok, "unk_token_id", None)
        if isinstance(found, int) and found != unk:
            return found
    return None


def _special_ids(tok: Any, config: ModelConfig) -> tuple[int | None, int | None, int | None]:
    """(bos, eos, null): the tokenizer's, else the model config's."""
    null_id = _special_id(tok, "null_token_id", "<null>")
    if null_id is None:
        null_id = config.null_token_id
    eos_id = _special_id(tok, "eos_token_id")
    if eos_id is None and config.eos_token_ids:
        eos_id = config.eos_token_ids[0]
    return _special_id(tok, "bos_token_id"), eos_id, null_id


def _display_specials(tok: Any, *known: int | None) -> frozenset[int]:
    """The ids the tokenizer marks special (its added tokens flagged so, and the ones it names: bos, eos, pad, ...)
    and the `known` ones (bos, eos, null, which may come from the model's config instead)."""
    raw = getattr(tok, "backend_tokenizer", tok)
    ids = {int(i) for i, t in raw.get_added_tokens_decoder().items() if t.special}
    ids.update(int(i) for i in getattr(tok, "all_special_ids", ()))
    ids.update(i for i in known if i is not None)
    return frozenset(ids)


def load_frontend(model_dir: str | Path) -> Backend:
    """A `Backend` without the model (`engine` None): the tokenizer, canvas length, special ids and sampler
    defaults of `model_dir`, read from its config.json, generation_config.json and tokenizer files only (the
    weights need not be there). What an ingress needs whose generations run on Ray Serve replicas."""
    from transformers import AutoTokenizer

    from canvas.model.io import read_config

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json; is this a dcanvas model directory?")
    config = read_config(path)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    bos_id, eos_id, null_id = _special_ids(tok, config)
    adapters = resolve_decoder_adapters(path)
    decoder = _decoder_record(adapters) if adapters is not None else None
    return Backend(name=config.name or path.name, local_engine=None, tokenizer=HFTokenizer(tok),
                   canvas_length=config.canvas_length, bos_id=bos_id, eos_id=eos_id, null_id=null_id,
                   sampler_defaults=load_sampler_defaults(path), decoder=decoder,
                   mode_defaults=_with_gap_modes(load_mode_defaults(path), path, decoder),
                   special_ids=_display_specials(tok, bos_id, eos_id, null_id))


def load_backend(model_dir: str | Path, *, max_batch: int = 8, dtype: DtypeChoice = "auto",
                 threads: int | None = None, context_cache_mb: float = DEFAULT_CONTEXT_CACHE_MB,
                 decoder_adapters: str | Path | None = AUTO) -> Backend:
    """Load the model and tokenizer in `model_dir` and start nothing yet (the server starts the engine).

    `dtype` "auto" picks what this CPU computes fastest (`canvas.model.cpu`: bf16 on AMX / avx512_bf16 CPUs where a
    probe confirms it, fp32 elsewhere, for small models and for models that decode left to right by default;
    `DCANVAS_DTYPE` overrides). `threads` sets torch's
    intra-op threads, by default to the physical cores this process may use. The process's allocator keeps large
    freed blocks for reuse from here on (`canvas.model.cpu.configure_allocator`). An fp32 model of 50M parameters or
    more gets int8 weights for its AR decode steps (`canvas.model.int8.scheme_for`; `DCANVAS_DECODE_INT8=off|weight|
    dynamic` overrides); `DCANVAS_DECODE_COMPILE=on` compiles its decode step in the background
    (`canvas.model.decode`). `decoder_adapters`: the gap denoiser to serve (`resolve_decoder_adapters`: "auto" finds
    one, None serves the model's own decoder)."""
    from transformers import AutoTokenizer

    from canvas.convert.fim import model_fim_tokens, word_boundaries
    from canvas.engine.decoder_weights import load_decoder_adapters
    from canvas.model import load_pretrained
    from canvas.model.cpu import configure_allocator, configure_threads, parameter_count, resolve_dtype
    from canvas.model.decode import attach_compiler, compile_setting
    from canvas.model.int8 import quantize_decode, scheme_for
    from canvas.model.io import read_config

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json; is this a dcanvas model directory?")
    configure_threads(threads)  # before the probe in resolve_dtype, which times at this thread count
    configure_allocator()
    adapters = resolve_decoder_adapters(path, decoder_adapters)
    decoder = _decoder_record(adapters) if adapters is not None else None
    mode_defaults = _with_gap_modes(load_mode_defaults(path), path, decoder)
    model = load_pretrained(path, dtype=resolve_dtype(dtype, params=parameter_count(read_config(path)),
                                                      decodes=mode_defaults.decodes))
    if adapters is not None:  # before the int8 copies: they are taken of the (unchanged) shared weights
        load_decoder_adapters(model, adapters)
    scheme = scheme_for(model)  # DCANVAS_DECODE_INT8, else int8 "weight" for large fp32 models (canvas.model.int8)
    if scheme is not None:
        quantize_decode(model, scheme)
    if compile_setting():  # DCANVAS_DECODE_COMPILE=on: compile the decode step in the background from now
        attach_compiler(model)
    sampler_defaults = load_sampler_defaults(path)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    bos_id, eos_id, null_id = _special_ids(tok, model.config)
    # Where an AR infill's drafts may end (canvas.engine.ar): tokens that end a clause or a sentence.
    clause_ends = clause_end_ids(tok.convert_ids_to_tokens(list(range(model.config.vocab_size))))
    # What breaks a line before writing on it, and what is only spaces (an editor's suggestion may not open with an
    # empty line): each id's own text, which a byte-level vocabulary spells differently in its pieces ("Ċ").
    raw = tok.backend_tokenizer
    ids = [[i] for i in range(raw.get_vocab_size(with_added_tokens=True))]
    texts = raw.decode_batch(ids, skip_special_tokens=False)
    # Whether AR infills may prompt with the FIM format: the build applied FIM adapters (never the vocabulary alone).
    fim = model_fim_tokens(path, tok)
    edges = _padded(word_boundaries(tok), model.config.vocab_size) if fim is not None else None
    return Backend(
        name=model.config.name or path.name,
        local_engine=Engine(model, max_batch=max_batch, context_cache_mb=context_cache_mb, clause_ends=clause_ends,
                            fim=fim, word_edges=edges, lines=line_tokens(texts),
                            logit_shift=bool(decoder and decoder.get("logit_shift"))),
        tokenizer=HFTokenizer(tok),
        canvas_length=model.config.canvas_length,
        bos_id=bos_id,
        eos_id=eos_id,
        null_id=null_id,
        sampler_defaults=sampler_defaults,
        mode_defaults=mode_defaults,
        decoder=decoder,
        special_ids=_display_specials(tok, bos_id, eos_id, null_id),
    )


def resolve_decoder_adapters(model_dir: Path, choice: str | Path | None = AUTO) -> Path | None:
    """The gap denoiser's adapter directory to serve with `model_dir`: None or "off" for none; a directory as
    given; "auto": `$DCANVAS_DECODER_ADAPTERS` (a directory, or "off"), else `model_dir/DECODER_DIR` when it holds an
    adapter set, else none. A directory named explicitly (argument or variable) must hold one."""
    if choice is None or str(choice) == "off":
        return None
    if str(choice) != AUTO:
        given = Path(choice)
    else:
        env = DECODER_ADAPTERS.text()  # a directory to serve instead, or "off"
        if env == "off":
            return None
        if not env:
            own = model_dir / DECODER_DIR
            return own if (own / "adapters.json").is_file() else None
        given = Path(env)
    if not (given / "adapters.json").is_file():
        raise FileNotFoundError(f"{given}: no adapters.json; not an exported gap-denoise adapter set")
    return given


def _decoder_record(adapters: Path) -> dict[str, Any]:
    from canvas.engine.decoder_weights import read_decoder_meta

    meta = read_decoder_meta(adapters)
    keep = ("objective", "rank", "targets", "logit_shift", "step", "tokens_seen", "sha256")
    return {"path": str(adapters), **{k: meta.get(k) for k in keep}}


def _with_gap_modes(defaults: ModeDefaults, model_dir: Path, decoder: dict[str, Any] | None) -> ModeDefaults:
    """`defaults` with the per-gap-size infill modes measured for the decoder served, where there are any (see the
    module docstring); a table measured with another decoder is left out, with a line on stderr."""
    where = Path(decoder["path"]) if decoder is not None else model_dir
    found = read_gap_modes(where)
    if found is None:
        return defaults
    rows, measured = found
    served = decoder["sha256"] if decoder is not None else None
    if measured != served:
        print(f"dcanvas: {where}: the per-gap modes were measured with another decoder ({measured or 'the model'}'s, "
              f"not {served or 'the model'}'s); infills keep the default mode", file=sys.stderr)
        return defaults
    return dataclasses.replace(defaults, infill_by_gap=rows)


def default_model_dir() -> Path | None:
    """The embedded canvas-6m, when this installation has one (what a command serves by default is
    `canvas.convert.resolve.resolve_model`'s choice, not this)."""
    from canvas.convert.resolve import EMBEDDED

    return EMBEDDED if (EMBEDDED / "config.json").is_file() else None


def write_tiny_checkpoint(path: str | Path, *, seed: int = 0, canvas_length: int = 32) -> Path:
    """Write a random-weight `tiny` model with a small trained tokenizer to `path` (a directory)."""
    import torch

    from canvas.model import PRESETS, DiffusionModel, save_pretrained
    from canvas.model.tokenizer import MIN_VOCAB, save_tokenizer, special_ids, train_tokenizer

    out = Path(path)
    tok = train_tokenizer([_TINY_TEXT] * 4, vocab_size=MIN_VOCAB + 96, min_frequency=2)
    ids = special_ids(tok)
    cfg = dataclasses.replace(
        PRESETS["tiny"],
        vocab_size=tok.get_vocab_size(),
        canvas_length=canvas_length,
        pad_token_id=ids["pad"],
        bos_token_id=ids["bos"],
        eos_token_ids=(ids["eos"],),
        null_token_id=ids["null"],
        name="tiny-random",
    )
    torch.manual_seed(seed)
    save_pretrained(DiffusionModel(cfg), out)
    save_tokenizer(tok, out)
    return out


def _padded(edges: WordEdges, vocab: int) -> WordEdges:
    """The word edges of every id the model can write (ids past the tokenizer's, if the model pads its vocabulary,
    have no text: neither edge)."""
    starts, ends = (np.pad(e[:vocab], (0, max(0, vocab - e.size))) for e in edges)
    return starts, ends
