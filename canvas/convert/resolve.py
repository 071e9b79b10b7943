"""Which model a command serves: one rule for `dcanvas serve` (and the server's own default), `generate`, `tui`, `eval`.

The first that applies wins:
1. an explicit `--model DIR`;
2. `$DCANVAS_MODEL`: `embedded` (the committed canvas-6m, quietly: the test suite sets it so that it stays hermetic on
   a machine whose cache holds the real model) or a model directory;
3. the built default model in the cache (`canvas.convert.build`: `cache_root()/models/<BuildConfig().name>`), when
   its `build.json` says it was built from today's inputs (`cached_problem`);
4. build it now, when its inputs (the `model` extra: the GGUF wheels, `gguf`, `accelerate`) are installed: one line
   with the expected time, then `dcanvas model build`'s own stage lines;
5. the embedded canvas-6m, with one line on stderr saying why and how to get the real one.

The start-up check is light: `dcanvas model build` hashes every file (seconds, for hundreds of MB), here only the
input fingerprint, the file names and the modification times are compared (milliseconds); the full sha256 check runs
only when a file is newer than `build.json`. What that leaves unseen (a file damaged in place with its mtime kept) is
not something a build produced or a user's edit does, and a truncated safetensors file still fails to load;
`dcanvas model build` re-checks everything. A machine without the model extra and no cache (CI) falls back at
once: no hashing, no build attempt.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from canvas.env import MODEL

EMBEDDED = Path(__file__).resolve().parents[1] / "assets" / "default-model"
HOW_TO_GET = "to serve the converted Gemma-3-270M: pip install -e '.[model]' && dcanvas model build"
# What `dcanvas model build` tells the user to expect, from the GGUF wheels (False) or with the HF copy of Gemma
# already cached (True); the measured times are in BENCHMARKS.md, "The converted Gemma-3-270M".
BUILD_TIME = {False: "about 2 to 3 minutes", True: "under a minute"}

Origin = Literal["explicit", "env", "cached", "built", "embedded"]


class ModelUnavailable(FileNotFoundError):
    """No model can be served: nothing named, none cached or buildable, and no embedded model in this install."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: Path  # the model directory to load
    origin: Origin  # which branch of the rule chose it
    note: str | None = None  # the line said about it (why the fallback, or that a build runs), if any


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def default_name() -> str:
    """The built default model's name (its cache directory), from the build's own config: it changes with it."""
    from canvas.convert.build import BuildConfig

    return BuildConfig().name


def inputs_installed() -> bool:
    """The `model` extra is importable: the GGUF wheels and the packages that read them (a probe, no import)."""
    from canvas.convert.source import GGUF_PACKAGE

    return all(importlib.util.find_spec(m) is not None for m in (GGUF_PACKAGE, "gguf", "accelerate"))


def _installed_gguf_sha() -> str | None:
    from canvas.convert.source import GGUF_PACKAGE

    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        return None
    return str(importlib.import_module(GGUF_PACKAGE).EXPECTED_SHA256)


def cached_problem(out: Path) -> str | None:
    """Why the built model at `out` may not be served (None: it may). Its inputs' fingerprint must be today's (with
    the GGUF's sha256 the installed wheels list; without them, the one it was built from), its files those that
    `build.json` lists, and none newer than `build.json`, or else each still of its recorded sha256."""
    from canvas.convert.build import BuildConfig, fingerprint, is_built

    record = out / "build.json"
    if not record.is_file():
        return f"no built model in {out}"
    try:
        meta = json.loads(record.read_text(encoding="utf-8"))
        recorded: dict[str, Any] = meta["fingerprint"]
        files: dict[str, str] = meta["files"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        return f"{record} is unreadable"
    fp = fingerprint(BuildConfig(), _installed_gguf_sha() or str(recorded.get("gguf_sha256")))
    changed = sorted(k for k in fp.keys() | recorded.keys() if fp.get(k) != recorded.get(k))
    if changed:
        return f"{out} was built from other inputs ({', '.join(changed)} changed)"
    present = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file() and p.name != "build.json"}
    if set(present) != set(files):
        return f"the files in {out} are not those its build.json lists"
    if max(present.values(), default=0) > record.stat().st_mtime_ns and not is_built(out, fp):
        return f"a file in {out} changed after the build (its sha256 differs from build.json)"
    return None


def build_default(cache: Path) -> Path:
    """`dcanvas model build` with the default config into `cache` (its stage lines on stderr)."""
    from canvas.convert.build import BuildConfig, build

    return build(BuildConfig(), cache=cache)


def embedded_name() -> str:
    try:
        return str(json.loads((EMBEDDED / "config.json").read_text(encoding="utf-8")).get("name") or EMBEDDED.name)
    except (OSError, json.JSONDecodeError):
        return EMBEDDED.name


def resolve_model(explicit: str | Path | None = None, *, cache: Path | None = None,
                  say: Callable[[str], None] = _stderr) -> ResolvedModel:
    """The model directory to serve, by the rule in the module docstring. `say` gets the one line of a fallback or
    a build (stderr by default). Raises `ModelUnavailable` when even the embedded model is missing."""
    if explicit is not None:
        return ResolvedModel(Path(explicit), "explicit")
    env = MODEL.text()  # `embedded` or a model directory
    if env == "embedded":
        return _embedded(None, say)
    if env:
        return ResolvedModel(Path(env), "env")
    from canvas.convert.build import cache_root

    cache = cache or cache_root()
    name = default_name()
    out = cache / "models" / name
    why = cached_problem(out) if (out / "build.json").is_file() else f"no {name} has been built in {cache}"
    if why is None:
        return ResolvedModel(out, "cached")
    if not inputs_installed():
        return _embedded(f"{why}, and the model extra is not installed", say)
    hf_cached = (cache / "gemma3" / "hf" / "model.safetensors").is_file()
    note = f"dcanvas: building the default model into {out} ({why}): {BUILD_TIME[hf_cached]}, once"
    say(note)
    try:
        built = build_default(cache)
    except Exception as e:  # any failure of the build (a missing wheel part, disk, memory) falls back, saying which
        return _embedded(f"building {name} failed: {e}", say)
    return ResolvedModel(built, "built", note)


def _embedded(why: str | None, say: Callable[[str], None]) -> ResolvedModel:
    """The committed canvas-6m; with a reason (not chosen by `$DCANVAS_MODEL`), one line saying it."""
    if not (EMBEDDED / "config.json").is_file():
        raise ModelUnavailable(f"no model to serve: {why or 'DCANVAS_MODEL=embedded'}, and this install has no "
                               f"embedded model at {EMBEDDED}; pass --model DIR ({HOW_TO_GET})")
    if why is None:
        return ResolvedModel(EMBEDDED, "embedded")
    note = f"dcanvas: serving the embedded {embedded_name()}: {why}; {HOW_TO_GET}"
    say(note)
    return ResolvedModel(EMBEDDED, "embedded", note)
