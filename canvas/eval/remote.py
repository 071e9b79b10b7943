"""`dcanvas eval --task clients|code`: the evaluations that run against servers (URLs) instead of a loaded model.

Owns `register_remote` (the flags these tasks add to `dcanvas eval`) and `run_remote` (the command: the servers,
the held-out text or the code tasks, the judge for `clients`, markdown or `--json`, `--out`). `--url` is the server
under test (ours: `dcanvas serve`; or any llama.cpp server for the FIM shapes and the code task), `--peer-url` one
more server run beside it in the same command (for `clients`, the FIM shapes only: llama.cpp has no websocket).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from canvas.env import TOKEN
from canvas.eval.client_shapes import SHAPES, Sender, Shape
from canvas.eval.samples import EvalError

TASKS = ("quality", "clients", "code")


def _shapes(value: str) -> tuple[Shape, ...]:
    out = tuple(v.strip() for v in value.split(",") if v.strip())
    if not out or any(v not in SHAPES for v in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated shapes of {', '.join(SHAPES)}, got {value!r}")
    return out  # type: ignore[return-value]  # checked against SHAPES just above


def register_remote(parser: argparse.ArgumentParser) -> None:
    from canvas.eval.code_tasks import DEFAULT_TASKS

    parser.add_argument("--task", choices=TASKS, default="quality",
                        help="quality: the model's infill and continuation (default); clients: the requests real "
                             "clients send, against --url; code: Python infill against --url (and --peer-url)")
    parser.add_argument("--url", default=None, help="clients/code: the server under test, e.g. http://127.0.0.1:8765")
    parser.add_argument("--peer-url", dest="peer_url", default=None,
                        help="clients/code: a second server beside it (e.g. llama.cpp's llama-server)")
    parser.add_argument("--token", default=None,
                        help="clients/code: the servers' bearer token (default: $DCANVAS_TOKEN)")
    parser.add_argument("--shapes", type=_shapes, default=None, help=f"clients: shapes to send ({','.join(SHAPES)})")
    parser.add_argument("--code-tasks", dest="code_tasks", type=Path, default=DEFAULT_TASKS,
                        help="code: the gap tasks (JSONL from `python -m canvas.eval.code_tasks`)")
    parser.add_argument("--code-limit", dest="code_limit", type=int, default=None,
                        help="code: the first N tasks of each kind (default all)")  # fmt: skip


def run_remote(args: argparse.Namespace) -> int:
    """Run `--task clients` or `--task code`; markdown, or with `--json` one JSON object as the last line."""
    import torch
    from rich.console import Console

    from canvas.eval.report import clients_markdown, code_markdown

    console = Console(stderr=True)

    def fail(message: str) -> int:
        console.print(f"[red]error:[/red] {message}")
        return 2

    if args.url is None:
        return fail(f"--task {args.task} needs --url (a running server)")
    token = args.token if args.token is not None else TOKEN.get()
    t0 = time.perf_counter()
    try:
        servers = {"url": Sender(args.url, token)}
        if args.peer_url is not None:
            servers["peer"] = Sender(args.peer_url, token)
    except EvalError as exc:
        return fail(str(exc))
    torch.set_num_threads(max(1, args.threads))
    with console.status(f"evaluating {args.task}") as status:

        def progress(what: str) -> None:
            status.update(f"evaluating {args.task}: {what}")

        try:
            result = _clients(args, servers, progress) if args.task == "clients" else _code(args, servers, progress)
        except EvalError as exc:
            return fail(str(exc))
    result["wall_s"] = time.perf_counter() - t0
    from canvas.bench.common import machine

    result["machine"] = machine()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    render = clients_markdown if args.task == "clients" else code_markdown
    sys.stdout.write(json.dumps(result, allow_nan=True) + "\n" if args.json else render(result))
    console.print(f"evaluated in {result['wall_s']:.0f} s")
    return 0


def _clients(args: argparse.Namespace, servers: dict[str, Sender], progress: Any) -> dict[str, Any]:
    from canvas.eval.clients import ClientsConfig, run_clients
    from canvas.eval.judge import JudgeError, load_judge
    from canvas.eval.samples import read_documents, read_texts

    cfg = ClientsConfig()
    changes: dict[str, Any] = {k: getattr(args, k) for k in ("samples", "seed", "examples")
                               if getattr(args, k) is not None}  # fmt: skip
    if args.shapes is not None:
        changes["shapes"] = args.shapes
    try:
        cfg = replace(cfg, **changes)
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    docs = read_texts(args.texts) if args.texts is not None else read_documents(args.data)
    try:
        judge = load_judge(args.judge)
    except JudgeError as exc:
        raise EvalError(str(exc)) from None
    result = run_clients(servers, judge, docs, cfg, progress)
    result["data"] = str(args.texts if args.texts is not None else args.data)
    return result


def _code(args: argparse.Namespace, servers: dict[str, Sender], progress: Any) -> dict[str, Any]:
    from canvas.eval.code import run_code
    from canvas.eval.code_tasks import read_tasks

    if args.code_limit is not None and args.code_limit < 1:
        raise EvalError(f"--code-limit must be >= 1, got {args.code_limit}")
    examples = args.examples if args.examples is not None else 3
    result = run_code(servers, read_tasks(args.code_tasks), limit=args.code_limit, examples=examples,
                      progress=progress)  # fmt: skip
    result["code_tasks"] = str(args.code_tasks)
    return result
