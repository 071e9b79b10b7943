"""The `dcanvas` command line: one entry point, subcommands registered lazily.

Each subcommand lives with the module that owns it; this file only maps names to `module:function` so that
`dcanvas --help` stays fast (no torch import) and a missing optional piece fails with a clear message.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence

from canvas import __version__

# name -> (module, register function, one-line help). The register function adds its arguments to a
# subparser and sets `func` (called with the parsed namespace, returns an exit code).
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "bench": ("canvas.bench.cli", "register", "run a benchmark (model, engine, kernels, load)"),
    "generate": ("canvas.engine.generate_cli", "register", "generate text from a prompt"),
    "serve": ("canvas.server", "register", "run the dcanvas/1 websocket server"),
    "cluster": ("canvas.cluster.cli", "register", "manage the Ray Serve engine replicas of `serve --ray`"),
    "schema": ("canvas.protocol", "register", "print the JSON Schema of every dcanvas/1 message"),
    "tui": ("tui.app", "register", "open the Textual editor"),
    "data": ("canvas.training.data", "register", "build the training corpus and tokenizer"),
    "train": ("canvas.training.train_cli", "register", "train the default model"),
    "eval": ("canvas.eval.evaluate", "register", "evaluate a model (infill, continuation, AR)"),
    "convert": ("canvas.convert.cli", "register", "convert a Gemma 3 checkpoint into a DiffusionGemma model"),
    "model": ("canvas.convert.cli", "register_model", "build the default model (Gemma-3-270M, converted)"),
}


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcanvas", description="diffusion-canvas: non-linear text generation")
    parser.add_argument("--version", action="version", version=f"dcanvas {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = sys.argv[1] if len(sys.argv) > 1 else None
    for name, (module, register, help_text) in SUBCOMMANDS.items():
        try:
            present = _available(module)
        except ModuleNotFoundError:
            present = False
        if not present:
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Import only the module of the command being run; the others just show their help line.
        if name == wanted:
            fn: Callable[[argparse.ArgumentParser], None] = getattr(importlib.import_module(module), register)
            fn(p)
    return parser


# libgomp reads its spin count once, when torch loads it, so it is set here, before any subcommand imports torch.
# The engine's thread owns the process's only OpenMP team (`canvas.model.cpu.release_openmp_pool`), and an idle-alone
# team spins 300,000 times at each barrier before it sleeps: fast alone, a collapse when anything else is busy (a
# nice'd 1-thread job beside a 2-thread server: 25-59 s for a 48-token completion). 1,000 spins keeps the idle speed
# (0.70-0.86 s against 0.66-0.83 s) and the loaded one (1.1-2.5 s; passive waiting: 1.0-1.3 s idle, 1.1-2.0 s loaded).
# The EPYC avx512_bf16, 2 cores, `dcanvas serve --threads 2`, ~300-token prompts; a value set by the user wins.
GOMP_SPINCOUNT = "1000"


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:])
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0 if args.command is None else 2
    result = func(args)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
