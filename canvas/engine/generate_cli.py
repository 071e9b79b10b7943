"""`dcanvas generate`: continue a prompt with the engine, one canvas (or more) at a time, or rewrite the spans of
it marked `[[...]]` between the text around them (an infill, as the editor's mask does).

    dcanvas generate --prompt "It is a truth universally" [--model DIR] [--mode diffusion|ar]
                     [--max-new-tokens N] [--max-steps S] [--entropy-bound B] [--seed S] [--json]
    dcanvas generate --prompt "...that a single man [[in possession of a good fortune]], must be in want of a wife."

Human-readable by default, with a live view of the draft on a terminal; `--json` prints one JSON object with
`tokens`, `text`, `tokens_per_forward`, `steps`, `forwards`, `wall_s`, `model` (and for an infill `fills`, with
`text` then the whole rewritten text, and `written_by`: `diffusion`, `ar` or `ar-infill`), and the `mode` it ran in:
the one `--mode` names, else the model's default mode for an infill (text after a span) or a continuation
(`canvas.sampling.modes`). Without `--model`, the model is `canvas.convert.resolve`'s choice, as for every command.
Owns nothing but the command: the work is `canvas.engine.core`, and for an infill `canvas.document.Document` lays
out the canvas and reads it back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Any


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="text to continue, or with [[...]] around spans to rewrite")
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: $DCANVAS_MODEL, else the "
                        "built Gemma-3-270M conversion, building it if its packages are installed, else canvas-6m)")
    parser.add_argument("--mode", choices=("diffusion", "ar"), default=None,
                        help="default: the model's default mode for an infill ([[...]]) or a continuation")
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
    from canvas.model.tokenizer import load_tokenizer, special_ids

    model = DiffusionModel.from_pretrained(str(model_dir))
    tok = load_tokenizer(model_dir)
    return model, tok, special_ids(tok)


_MASK = re.compile(r"\[\[(.*?)\]\]", re.DOTALL)


def parse_masks(prompt: str) -> tuple[str, list[tuple[int, int]]]:
    """The prompt without its `[[` `]]` marks, and the character spans they enclosed (to be rewritten)."""
    parts, spans, pos, length = [], [], 0, 0
    for m in _MASK.finditer(prompt):
        outside, inner = prompt[pos : m.start()], m.group(1)
        if "[[" in outside or "]]" in outside or "[[" in inner:
            raise ValueError("unbalanced [[ ]] in --prompt")
        if not inner.strip():
            raise ValueError("[[...]] must enclose the text to rewrite; it is empty")
        length += len(outside)
        spans.append((length, length + len(inner)))
        length += len(inner)
        parts += [outside, inner]
        pos = m.end()
    rest = prompt[pos:]
    if "[[" in rest or "]]" in rest:
        raise ValueError("unbalanced [[ ]] in --prompt")
    return "".join([*parts, rest]), spans


def _live(args: argparse.Namespace) -> Any:
    """A transient live line for the draft on a terminal; None with --json or when stdout is not a terminal."""
    if args.json or not sys.stdout.isatty():
        return None
    from rich.live import Live

    live = Live("", refresh_per_second=20, transient=True)
    live.start()
    return live


def run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from canvas.convert.resolve import ModelUnavailable, resolve_model
    from canvas.engine.core import Engine, Frame, GenRequest
    from canvas.sampling.modes import load_mode_defaults
    from canvas.sampling.sampler import load_sampler_defaults

    try:
        model_dir = resolve_model(args.model).path
    except ModelUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        given = {"max_steps": args.max_steps, "entropy_bound": args.entropy_bound, "t_max": args.t_max,
                 "t_min": args.t_min}
        text, spans = parse_masks(args.prompt)
        config = dataclasses.replace(load_sampler_defaults(model_dir), seed=args.seed,
                                     **{k: v for k, v in given.items() if v is not None})
        if spans and args.max_new_tokens is not None:
            raise ValueError("--max-new-tokens is for a continuation; an infill fills the [[...]] spans")
        if args.max_new_tokens is not None and args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        if spans:
            return _infill(model_dir, text, spans, config, args)
        args.mode = load_mode_defaults(model_dir).resolve(args.mode, "continuation")
        config = dataclasses.replace(config, mode=args.mode)
        model, tok, ids = load(model_dir)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    L = model.config.canvas_length
    budget = args.max_new_tokens
    context = (ids["bos"], *tok.encode(args.prompt, add_special_tokens=False))
    if budget is not None and budget <= L:
        # One canvas of exactly `budget` free slots (the rest unused), as the HTTP API lays out a continuation: AR
        # stops at the budget and diffusion denoises only those slots, instead of a whole canvas cut afterwards.
        # Free slots' ids are never read (the engine replaces them with noise): any valid id does.
        slots, pins, n_canvases = (ids["pad"],) * budget, (False,) * budget, 1
    else:  # whole free canvases, each following the committed one; the last is cut to the budget afterwards
        slots, pins, n_canvases = (), (), max(1, math.ceil((budget or L) / L))
    engine = Engine(model)
    live = _live(args)

    def on_event(event: object) -> None:
        if live is not None and isinstance(event, Frame):
            draft = tok.decode([t for t in event.draft if t != ids["null"]], skip_special_tokens=True)
            live.update(Text(f"step {event.step}/{event.max_steps}  {draft}"))

    handle = engine.submit(GenRequest(tuple(context), slots, pins, config=config, n_canvases=n_canvases), on_event)
    engine.run_until_idle()
    done = handle.wait(0)
    if live is not None:
        live.stop()
    # A budget-sized canvas uses only its first `len(slots)` slots: the rest were never generated.
    canvases = [c[: len(slots)] if slots else c for c in done.canvases]
    tokens = [t for canvas in canvases for t in canvas if t != ids["null"]]
    if args.max_new_tokens is not None:
        tokens = tokens[: args.max_new_tokens]
    text = tok.decode(tokens, skip_special_tokens=True)
    if done.status != "completed":
        print(f"error: generation {done.status}: {done.error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"tokens": tokens, "text": text, "tokens_per_forward": round(done.tokens_per_forward, 3),
                          "steps": done.steps, "forwards": done.forwards, "wall_s": round(done.wall_s, 4),
                          "mode": args.mode, "model": model.config.name or model_dir.name}))
    else:
        print(args.prompt + text)
        print(f"[{model.config.name or model_dir.name}: {done.steps} steps, {done.tokens_per_forward:.2f} "
              f"tokens/forward, {done.tok_s:.0f} tok/s, {done.wall_s:.2f} s]", file=sys.stderr)
    return 0


def _infill(model_dir: Path, text: str, spans: list[tuple[int, int]], config: Any, args: argparse.Namespace) -> int:
    """Rewrite `spans` of `text` between the pinned text around them: one canvas window holding every span."""
    from rich.text import Text

    from canvas.document import Document, DocumentError
    from canvas.engine.backend import load_backend
    from canvas.engine.core import Frame
    from canvas.sampling.modes import mode_label

    backend = load_backend(model_dir, max_batch=1)
    doc = None
    # The window starts at the text's start when the spans fit there, else at the first span (all before it is
    # context for the encoder).
    for start in dict.fromkeys((0, spans[0][0])):
        try:
            doc = Document(backend.tokenizer, text, config=backend.document_config(), window_start=start)
            for s, e in spans:
                doc.mask(s, e)
            break
        except DocumentError:
            doc = None
    if doc is None:
        print(f"error: the [[...]] spans and the text between them must fit one canvas of {backend.canvas_length} "
              "tokens", file=sys.stderr)  # fmt: skip
        return 2
    view = doc.canvas_view()
    args.mode = backend.mode_for(args.mode, view.pinned)  # a span at the very end is a continuation
    config = dataclasses.replace(config, mode=args.mode)
    live = _live(args)

    def on_event(event: object) -> None:
        if live is not None and isinstance(event, Frame):
            draft = [t for t in event.draft[: len(view.slot_ids)] if t != backend.null_id]
            live.update(Text(f"step {event.step}/{event.max_steps}  {backend.tokenizer.decode(draft)}"))

    engine = backend.engine.twin(max_batch=1)
    handle = engine.submit(backend.request(view, config), on_event)
    engine.run_until_idle()
    done = handle.wait(0)
    if live is not None:
        live.stop()
    if done.status != "completed":
        print(f"error: generation {done.status}: {done.error}", file=sys.stderr)
        return 1
    proposal = backend.proposal(doc, done.canvases[0])
    new_text = text[: proposal.start] + proposal.new_text + text[proposal.end :]
    fills = [r.text for r in proposal.regions]
    replaced = [text[r.char_start : r.char_end] for r in proposal.regions]  # each span grown to whole tokens
    if args.json:
        print(json.dumps({"tokens": [t for r in proposal.regions for t in r.ids], "text": new_text, "fills": fills,
                          "replaced": replaced, "tokens_per_forward": round(done.tokens_per_forward, 3),
                          "steps": done.steps, "forwards": done.forwards, "wall_s": round(done.wall_s, 4),
                          "mode": args.mode, "written_by": done.mode, "model": backend.name}))  # fmt: skip
    else:
        print(new_text)
        print(f"[{backend.name}, {mode_label(done.mode)}: {done.steps} steps, {done.tokens_per_forward:.2f} "
              f"tokens/forward, {done.wall_s:.2f} s]", file=sys.stderr)
    return 0
