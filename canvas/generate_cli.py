"""`dcanvas generate`: continue a prompt with the engine, one canvas (or more) at a time.

    dcanvas generate --prompt "It is a truth universally" [--model DIR] [--mode diffusion|ar]
                     [--max-new-tokens N] [--max-steps S] [--entropy-bound B] [--seed S] [--json]

Human-readable by default, with a live view of the draft on a terminal; `--json` prints one JSON object with
`tokens`, `text`, `tokens_per_forward`, `steps`, `forwards`, `wall_s`. Loads the embedded default model when no
`--model` is given. Owns nothing but the command: the work is `canvas.engine`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--mode", choices=("diffusion", "ar"), default="diffusion")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: one canvas")
    model_default = "default: the model's generation_config.json"
    parser.add_argument("--max-steps", type=int, default=None, help=model_default)
    parser.add_argument("--entropy-bound", type=float, default=None, help=model_default)
    parser.add_argument("--t-max", type=float, default=None, help=model_default)
    parser.add_argument("--t-min", type=float, default=None, help=model_default)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(func=run)


def load(model_dir: Path) -> tuple[Any, Any, dict[str, int]]:
    """(model, tokenizer, special ids) from a model directory holding weights and tokenizer files."""
    from canvas.model import DiffusionModel
    from canvas.training.tokenizer import load_tokenizer, special_ids

    model = DiffusionModel.from_pretrained(str(model_dir))
    tok = load_tokenizer(model_dir)
    return model, tok, special_ids(tok)


def run(args: argparse.Namespace) -> int:
    from canvas.engine import Engine, Frame, GenRequest
    from canvas.sampler import load_sampler_defaults
    from canvas.server.backend import default_model_dir

    model_dir = args.model or default_model_dir()
    if model_dir is None:
        print("error: no --model given and no embedded default model is installed", file=sys.stderr)
        return 2
    try:
        given = {"max_steps": args.max_steps, "entropy_bound": args.entropy_bound, "t_max": args.t_max,
                 "t_min": args.t_min}
        config = dataclasses.replace(load_sampler_defaults(model_dir), seed=args.seed, mode=args.mode,
                                     **{k: v for k, v in given.items() if v is not None})
        model, tok, ids = load(model_dir)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    L = model.config.canvas_length
    n_canvases = max(1, math.ceil((args.max_new_tokens or L) / L))
    context = (ids["bos"], *tok.encode(args.prompt, add_special_tokens=False))
    engine = Engine(model)
    live = None
    if not args.json and sys.stdout.isatty():
        from rich.live import Live
        from rich.text import Text

        live = Live(Text(""), refresh_per_second=20, transient=True)
        live.start()

    def on_event(event: object) -> None:
        if live is not None and isinstance(event, Frame):
            draft = tok.decode([t for t in event.draft if t != ids["null"]], skip_special_tokens=True)
            live.update(Text(f"step {event.step}/{event.max_steps}  {draft}"))

    handle = engine.submit(GenRequest(tuple(context), config=config, n_canvases=n_canvases), on_event)
    engine.run_until_idle()
    done = handle.wait(0)
    if live is not None:
        live.stop()
    tokens = [t for canvas in done.canvases for t in canvas if t != ids["null"]]
    if args.max_new_tokens is not None:
        tokens = tokens[: args.max_new_tokens]
    text = tok.decode(tokens, skip_special_tokens=True)
    if done.status != "completed":
        print(f"error: generation {done.status}: {done.error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"tokens": tokens, "text": text, "tokens_per_forward": round(done.tokens_per_forward, 3),
                          "steps": done.steps, "forwards": done.forwards, "wall_s": round(done.wall_s, 4),
                          "mode": args.mode, "model": model.config.name}))
    else:
        print(args.prompt + text)
        print(f"[{done.steps} steps, {done.tokens_per_forward:.2f} tokens/forward, {done.tok_s:.0f} tok/s, "
              f"{done.wall_s:.2f} s]", file=sys.stderr)
    return 0
