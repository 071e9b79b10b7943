"""`dcanvas bench typing`: a typing session replayed against a running server's `/infill`, as llama.vim sends it.

Owns the replay and its report. The document is long held-out text (by default the news texts of
`canvas/convert/probes.jsonl`, written for the probe set, joined into one document; `--text FILE` for another); the
"other buffers" whose chunks travel in `input_extra` are the probe set's dialogue and technical texts. The cursor sits
on the first line of at least `--min-line` characters after `--prefix-chars` characters of the document; the line is
cut at `--column` and its next `--keystrokes` characters are typed one at a time. Each keystroke sends one request
built field for field as llama.vim's FIM request (`autoload/llama.vim`, `s:fim_ctx_local` and `llama#fim`): the
`--n-prefix` lines before the cursor line (`input_prefix`, newline-terminated), the cursor line up to the cursor
(`prompt`), the rest of the line and the `--n-suffix` lines after it (`input_suffix`), `--chunks` chunks of
`--chunk-lines` lines (`input_extra`, oldest first, the same on every keystroke as llama.vim's ring is between its
updates), `n_predict`, `n_indent`, top-k 40, top-p 0.90, `cache_prompt`, `t_max_prompt_ms` 500, `t_max_predict_ms`
250 (llama.vim's value for a request without a previous completion) and its `response_fields`. Requests go one
after another: each keystroke's answer arrives before the next is typed, so each latency is the server's alone.

Reports each request's latency, `tokens_cached`, `timings/prompt_n` and `truncated`; then the first request's latency
and the median and p95 of the keystrokes after it, as a table and, last, one JSON line. Works against `dcanvas serve`
and llama.cpp's `llama-server` alike (the same request, the same fields read back).

    dcanvas bench typing --url http://127.0.0.1:8765 [--keystrokes 10] [--token T]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from canvas.bench.common import machine
from canvas.env import TOKEN

PROBES = Path(__file__).resolve().parents[1] / "convert" / "probes.jsonl"
RESPONSE_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                   "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                   "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]


class TypingError(Exception):
    """The replay cannot run (bad input, a server that does not answer 200)."""


@dataclass(frozen=True, slots=True)
class Session:
    lines: list[str]  # the document, one entry a line
    row: int  # the cursor line
    column: int  # where the typed text starts on it
    typed: str  # the characters typed, one request each
    extra: list[str]  # input_extra chunks, oldest first


def _probe_texts(kinds: tuple[str, ...]) -> list[str]:
    rows = [json.loads(line) for line in PROBES.read_text().splitlines() if line.strip()]
    return [r["text"] for r in rows if r.get("kind") in kinds]


def session(text: str | None, *, prefix_chars: int, min_line: int, column: int, keystrokes: int, chunks: int,
            chunk_lines: int) -> Session:
    """Where the cursor goes and what it types (see the module docstring)."""
    doc = text if text is not None else "\n\n".join(_probe_texts(("news",)))
    lines = doc.split("\n")
    at, row = 0, None
    for i, line in enumerate(lines):
        if at >= prefix_chars and len(line) >= max(min_line, column + keystrokes):
            row = i
            break
        at += len(line) + 1
    if row is None:
        raise TypingError(f"no line of {max(min_line, column + keystrokes)}+ characters after {prefix_chars} "
                          "characters of the text: give a longer text or smaller --prefix-chars/--column")
    others = "\n\n".join(_probe_texts(("dialogue", "technical"))).split("\n")
    extra = []
    for c in range(chunks):  # spread over the other buffers, as llama.vim picks chunks where the cursor has been
        s = (c * len(others)) // max(chunks, 1)
        extra.append("\n".join(others[s : s + chunk_lines]) + "\n")
    return Session(lines, row, column, lines[row][column : column + keystrokes], extra)


def request(s: Session, k: int, *, n_prefix: int, n_suffix: int, n_predict: int) -> dict[str, Any]:
    """llama.vim's FIM request after `k` typed characters (no previous completion shown)."""
    line = s.lines[s.row][: s.column] + s.typed[:k]  # the line being written: nothing after the cursor yet
    prefix_lines = s.lines[max(0, s.row - n_prefix) : s.row]
    suffix_lines = s.lines[s.row + 1 : s.row + 1 + n_suffix]
    indent = len(line) - len(line.lstrip(" \t")) if line.strip() else 0
    return {
        "id_slot": 0,
        "input_prefix": "\n".join(prefix_lines) + "\n",
        "input_suffix": "\n" + "\n".join(suffix_lines) + "\n",  # the cursor line's rest (none here), the lines
        "input_extra": [{"text": c, "time": [0, 0], "filename": f"buffer{i}.txt"} for i, c in enumerate(s.extra)],
        "prompt": line if line.strip() else "",
        "n_predict": n_predict,
        "stop": [],
        "n_indent": indent,
        "top_k": 40,
        "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"],
        "stream": False,
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 250,
        "response_fields": RESPONSE_FIELDS,
    }


def post(url: str, token: str | None, body: dict[str, Any], timeout: float) -> tuple[dict[str, Any], float]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(f"{url.rstrip('/')}/infill", json.dumps(body).encode(), headers, method="POST")
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer: dict[str, Any] = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise TypingError(f"/infill answered {e.code}: {e.read()[:300]!r}") from None
    except OSError as e:
        raise TypingError(f"{url}: {e}") from None
    return answer, time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def run(args: argparse.Namespace) -> int:
    if args.keystrokes < 1:
        print("dcanvas bench typing: --keystrokes must be >= 1")
        return 2
    try:
        text = Path(args.text).read_text() if args.text else None
        s = session(text, prefix_chars=args.prefix_chars, min_line=args.min_line, column=args.column,
                    keystrokes=args.keystrokes, chunks=args.chunks, chunk_lines=args.chunk_lines)
        rows = []
        for k in range(args.keystrokes + 1):  # k = 0: the cursor arrives; then one request a typed character
            body = request(s, k, n_prefix=args.n_prefix, n_suffix=args.n_suffix, n_predict=args.n_predict)
            answer, took = post(args.url, args.token, body, args.timeout)
            rows.append({"typed": s.typed[:k], "latency_s": round(took, 3),
                         "tokens_cached": answer.get("tokens_cached"), "prompt_n": answer.get("timings/prompt_n"),
                         "truncated": answer.get("truncated"), "content": answer.get("content", "")})
    except (OSError, TypingError) as e:
        print(f"dcanvas bench typing: {e}")
        return 1
    sent = request(s, 0, n_prefix=args.n_prefix, n_suffix=args.n_suffix, n_predict=args.n_predict)
    chars = {"extra": sum(len(c) for c in s.extra), "prefix": len(sent["input_prefix"]),
             "suffix": len(sent["input_suffix"])}
    print(f"{'#':>3} {'typed':<14} {'latency s':>9} {'cached':>7} {'prompt_n':>8} {'trunc':>5}  content")
    for i, r in enumerate(rows):
        print(f"{i:>3} {r['typed'][-14:]!s:<14} {r['latency_s']:>9.3f} {r['tokens_cached']!s:>7} {r['prompt_n']!s:>8} "
              f"{r['truncated']!s:>5}  {json.dumps(r['content'][:40])}")
    keys = [r["latency_s"] for r in rows[1:]]
    summary = {"first_s": rows[0]["latency_s"], "keystroke_median_s": round(statistics.median(keys), 3),
               "keystroke_p95_s": round(_pct(keys, 95), 3), "keystrokes": len(keys),
               "tokens_cached": [r["tokens_cached"] for r in rows], "prompt_n": [r["prompt_n"] for r in rows]}
    print(f"first request {summary['first_s']:.3f} s; per keystroke median {summary['keystroke_median_s']:.3f} s, "
          f"p95 {summary['keystroke_p95_s']:.3f} s over {len(keys)}; characters sent {chars}")
    print(json.dumps({"bench": "typing", "url": args.url, **summary, "chars": chars, "requests": rows,
                      "machine": machine()}))
    return 0


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the server's HTTP base, e.g. http://127.0.0.1:8765 (dcanvas "
                        "serve or llama.cpp's llama-server)")
    parser.add_argument("--token", default=TOKEN.get(), help="bearer token, if the server asks")
    parser.add_argument("--text", default=None, help="the document (default: the probe set's news texts, joined)")
    parser.add_argument("--keystrokes", type=int, default=10, help="characters typed, one request each (default 10)")
    parser.add_argument("--prefix-chars", type=int, default=6000,
                        help="characters of the document before the cursor line, at least (default 6000)")
    parser.add_argument("--min-line", type=int, default=60, help="the cursor line's least length (default 60)")
    parser.add_argument("--column", type=int, default=24, help="where typing starts on the line (default 24)")
    parser.add_argument("--chunks", type=int, default=4, help="input_extra chunks (default 4)")
    parser.add_argument("--chunk-lines", type=int, default=64, help="lines a chunk (default 64)")
    parser.add_argument("--n-prefix", type=int, default=256, help="lines before the cursor (llama.vim: 256)")
    parser.add_argument("--n-suffix", type=int, default=64, help="lines after the cursor (llama.vim: 64)")
    parser.add_argument("--n-predict", type=int, default=128, help="n_predict (llama.vim: 128)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for one answer")
    parser.set_defaults(func=run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="dcanvas bench typing", description=__doc__.split("\n\n")[0])
    register(parser)
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
