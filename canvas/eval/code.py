"""`dcanvas eval --task code`: single- and multi-line infill on held-out Python, against running servers.

Owns `code_body` (the request), `normalise`, `cut_lines`, `CodeRecord`, `pool_code` and `run_code`. Each task of
`canvas.eval.code_tasks` goes to every server (ours, and with `--peer-url` any llama.cpp server, which applies its
model's FIM format itself, Qwen2.5-Coder's included) as llama.cpp's `/infill` at an emptied line: `input_prefix`
the program before the gap, `input_suffix` the newline after it and the rest, `prompt` "", greedy (`temperature` 0,
`seed` 0), `n_predict` 64 tokens for one line and 128 for several. The suggestion is cut to the gap's number of
lines (an editor accepting the first k lines), then:
- exact match: the suggestion equals the human lines, whitespace normalised at the ends (of the whole and of each
  line: indentation inside a multi-line gap still counts);
- test passed: the program with the suggestion in the gap passes the function's doctests in the sandbox
  (`canvas.eval.sandbox`); every task's doctests fail with the gap left empty, so passing means the lines work;
- seconds: the request's wall time (median, 95th percentile).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from canvas.eval.client_shapes import Sender
from canvas.eval.clients import median, percentile
from canvas.eval.code_tasks import KINDS, CodeTask
from canvas.eval.samples import EvalError
from canvas.eval.sandbox import run_doctests


def code_body(task: CodeTask) -> dict[str, Any]:
    return {"input_prefix": task.prefix, "input_suffix": task.suffix, "input_extra": [], "prompt": "",
            "n_predict": 64 if task.kind == "line" else 128, "temperature": 0.0, "seed": 0, "stream": False,
            "cache_prompt": True}  # fmt: skip


def normalise(text: str) -> str:
    """Whitespace at the ends removed: of the whole text and of each line's end (not a line's indentation)."""
    return "\n".join(line.rstrip() for line in text.strip().split("\n"))


def cut_lines(text: str, n: int) -> str:
    """The first `n` lines of `text` (without the newline that ends the last)."""
    return "\n".join(text.split("\n")[:n])


@dataclass(frozen=True, slots=True)
class CodeRecord:
    server: str
    task: str
    kind: str
    seconds: float
    error: str  # the request's error ("" when it was answered)
    exact: bool
    passed: bool
    test_error: str  # why the test did not run to the end (a syntax error, a timeout)
    text: str = field(repr=False)


def infill(sender: Sender, task: CodeTask) -> tuple[str, float, str]:
    """(suggestion, seconds, error) of one `/infill` request."""
    t0 = time.perf_counter()
    try:
        body = json.loads(sender.post("/infill", code_body(task)))
        content = body["content"]
        if not isinstance(content, str):
            raise TypeError("content is not a string")
    except (EvalError, OSError, ValueError, KeyError, TypeError) as e:
        return "", time.perf_counter() - t0, str(e) or type(e).__name__
    return content, time.perf_counter() - t0, ""


def score_task(server: str, task: CodeTask, text: str, seconds: float, error: str, *,
               timeout_s: float = 20.0) -> CodeRecord:  # fmt: skip
    if error:
        return CodeRecord(server, task.id, task.kind, seconds, error, False, False, "", text)
    fill = cut_lines(text, task.lines)
    result = run_doctests(task, task.filled(fill), timeout_s=timeout_s)
    return CodeRecord(server, task.id, task.kind, seconds, "", normalise(fill) == normalise(task.middle),
                      result.passed, result.error, fill)  # fmt: skip


def pool_code(records: Sequence[CodeRecord]) -> dict[str, Any]:
    if not records:
        raise EvalError("no records to pool")
    ok = [r for r in records if not r.error]
    n = len(records)
    seconds = [r.seconds for r in ok]
    return {
        "server": records[0].server, "kind": records[0].kind, "tasks": n, "errors": n - len(ok),
        "exact_match": sum(r.exact for r in records) / n, "tests_passed": sum(r.passed for r in records) / n,
        "empty_share": sum(not r.text.strip() for r in ok) / len(ok) if ok else math.nan,
        "seconds_median": median(seconds), "seconds_p95": percentile(seconds, 0.95),
        "error_examples": sorted({r.error for r in records if r.error})[:3],
    }  # fmt: skip


def run_code(servers: dict[str, Sender], tasks: Sequence[CodeTask], *, limit: int | None = None,
             timeout_s: float = 20.0, examples: int = 3,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Every task (the first `limit` of each kind) on every server; the JSON-ready result (`results`: one row per
    server and kind, `examples`, `records`)."""
    chosen = [t for k in KINDS for t in [t for t in tasks if t.kind == k][:limit]]
    if not chosen:
        raise EvalError("no code tasks to run")
    records: list[CodeRecord] = []
    for server, sender in servers.items():
        for i, task in enumerate(chosen):
            if progress is not None:
                progress(f"{server} {task.kind} #{i}")
            text, seconds, error = infill(sender, task)
            records.append(score_task(server, task, text, seconds, error, timeout_s=timeout_s))
    groups: dict[tuple[str, str], list[CodeRecord]] = {}
    for r in records:
        groups.setdefault((r.server, r.kind), []).append(r)
    by_id = {t.id: t for t in chosen}
    shown = {t.id for k in KINDS for t in [t for t in chosen if t.kind == k][:examples]}
    out_examples = [{"server": r.server, "task": r.task, "before": by_id[r.task].prefix[-200:],
                     "human": by_id[r.task].middle, "output": r.text, "exact": r.exact, "passed": r.passed,
                     "error": r.error or r.test_error} for r in records if r.task in shown]  # fmt: skip
    return {
        "task": "code", "servers": {k: v.url for k, v in servers.items()}, "tasks": len(chosen),
        "sources": sorted({t.source for t in chosen}), "results": [pool_code(g) for g in groups.values()],
        "examples": out_examples,
        "records": [{k: v for k, v in asdict(r).items() if k != "text"} for r in records],
    }  # fmt: skip
