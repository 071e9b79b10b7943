"""`dcanvas bench http`: plain continuation through each server's HTTP API, ours against llama.cpp's `llama-server` on
the GGUF of the same weights, measured in one run.

Owns the prompts, the request, the reading of an answer, the alternation and the report. Both servers are started
here (or named by `--ours-url` / `--llama-url` when they already run) and both stay up, but only one is busy at a
time: each run sends one request to one server, waits for the answer, then sends the same request to the other, and
which server goes first alternates from run to run, so load from other processes falls on both alike. Every request
is OpenAI's `POST /v1/completions`, which both speak: a prompt of `--prompt` tokens of held-out prose, `max_tokens`
`--tokens`, temperature 0 (greedy) and one seed. A run's prompt is its own window of the prose (the probe set's news
and fiction texts, `canvas/convert/probes.jsonl`, or `--text FILE`), cut at exactly `--prompt` tokens of the model's
tokenizer, so neither server's prompt cache holds it when the run starts (unless `--runs` exceeds the windows the text
holds: then the windows come round again, for both servers alike).

What is timed is the whole request, as a client sees it: connection, prefill, decode and the answer's JSON. Each
answer's `usage.completion_tokens` says how many tokens it holds; a server that ended early at EOS is reported
(`short`), and the figures are per token (tokens / wall), so a shorter answer is not a faster one. The ratio is ours
over llama-server's tokens/s: both the ratio of the medians and the median of the per-run ratios (a run's two
requests are neighbours in time). The last line is one JSON object with the machine (`canvas.bench.common.machine`).

    dcanvas bench http [--prompt 256] [--tokens 64] [--runs 8] [--threads 2] [--llama-server BIN] [--gguf FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from canvas.bench.common import machine
from canvas.env import TOKEN

PROBES = Path(__file__).resolve().parents[1] / "convert" / "probes.jsonl"
PROSE = ("news", "fiction")  # held out: written for the probe set, never in the training data
LLAMA_BIN = Path.home() / ".cache" / "dcanvas" / "llama.cpp" / "build" / "bin" / "llama-server"
GGUF = Path.home() / ".cache" / "dcanvas" / "gemma3" / "gemma-3-270m-q4_k_m.gguf"
SERVERS = ("ours", "llama")


class HttpBenchError(Exception):
    """The bench cannot run (bad input, a server that does not start or does not answer 200)."""


@dataclass(frozen=True, slots=True)
class Answer:
    wall_s: float  # the whole request, as the client sees it
    tokens: int  # completion tokens the server says it generated
    prompt_tokens: int  # prompt tokens the server says it read
    text: str
    server_prompt_ms: float | None = None  # llama-server's own `timings`, when it sends them
    server_predict_ms: float | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


# ---- the requests ----------------------------------------------------------------------------------------------


def prose(path: Path | None = None) -> str:
    """The held-out prose the prompts are cut from: `path`'s text, or the probe set's news and fiction, joined."""
    if path is not None:
        return path.read_text()
    rows = [json.loads(line) for line in PROBES.read_text().splitlines() if line.strip()]
    return "\n\n".join(r["text"] for r in rows if r.get("kind") in PROSE)


def windows(offsets: Sequence[tuple[int, int]], text: str, tokens: int, count: int) -> list[str]:
    """`count` prompts of exactly `tokens` tokens each, consecutive windows of `text` whose tokens (as the tokenizer
    split the whole text) have character `offsets`; past the last whole window they come round again. A window
    starts and ends on a token boundary (the start of its first token, the end of its last)."""
    if tokens < 1 or count < 1:
        raise HttpBenchError(f"--prompt and --runs must be >= 1, got {tokens} and {count}")
    fit = len(offsets) // tokens
    if fit == 0:
        raise HttpBenchError(f"the text has {len(offsets)} tokens, fewer than one prompt of {tokens}: give a longer "
                             "--text or a smaller --prompt")
    out = []
    for i in range(count):
        w = i % fit
        first, last = offsets[w * tokens], offsets[(w + 1) * tokens - 1]
        out.append(text[first[0] : last[1]])
    return out


def prompts(tokenizer_file: Path, text: str, tokens: int, count: int) -> list[str]:
    """`windows` of `text` as the model's tokenizer (`tokenizer.json`) splits it, special tokens left out."""
    from tokenizers import Tokenizer

    enc = Tokenizer.from_file(str(tokenizer_file)).encode(text, add_special_tokens=False)
    return windows(enc.offsets, text, tokens, count)


def body(prompt: str, tokens: int, seed: int) -> dict[str, Any]:
    """The `/v1/completions` request both servers get: greedy, `tokens` long, one seed, not streamed."""
    return {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "seed": seed, "stream": False}


def read_answer(answer: Any, wall_s: float) -> Answer:
    """An OpenAI completion as an `Answer`; raises HttpBenchError when it is not one."""
    try:
        usage = answer["usage"]
        tokens, prompt_tokens = int(usage["completion_tokens"]), int(usage["prompt_tokens"])
        text = answer["choices"][0]["text"]
        if not isinstance(text, str):
            raise TypeError("text")
    except (KeyError, IndexError, TypeError, ValueError):
        raise HttpBenchError(f"not an OpenAI completion: {json.dumps(answer)[:300]}") from None
    timings = answer.get("timings") if isinstance(answer.get("timings"), dict) else {}
    assert isinstance(timings, dict)
    prompt_ms, predict_ms = timings.get("prompt_ms"), timings.get("predicted_ms")
    return Answer(wall_s, tokens, prompt_tokens, text,
                  float(prompt_ms) if isinstance(prompt_ms, int | float) else None,
                  float(predict_ms) if isinstance(predict_ms, int | float) else None)


def post(url: str, data: dict[str, Any], *, token: str | None = None, timeout: float = 600.0) -> Answer:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/completions", json.dumps(data).encode(), headers,
                                 method="POST")
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        wall = time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        raise HttpBenchError(f"{url}/v1/completions answered {e.code}: {e.read()[:300]!r}") from None
    except OSError as e:
        raise HttpBenchError(f"{url}: {e}") from None
    try:
        return read_answer(json.loads(raw), wall)
    except ValueError:
        raise HttpBenchError(f"{url}/v1/completions answered with no JSON: {raw[:300]!r}") from None


def order(run: int) -> tuple[str, str]:
    """Which server goes first in run `run`: ours in even runs, llama-server in odd ones."""
    return SERVERS if run % 2 == 0 else (SERVERS[1], SERVERS[0])


# ---- the figures -----------------------------------------------------------------------------------------------


def summary(answers: dict[str, list[Answer]], tokens: int) -> dict[str, Any]:
    """Medians per server and the ratios (ours over llama-server's tokens/s; > 1: ours is faster). Both lists hold
    one answer per run, in run order."""
    runs = len(answers["ours"])
    if runs == 0 or len(answers["llama"]) != runs:
        raise HttpBenchError(f"need one answer per run from each server, got {len(answers['ours'])} and "
                             f"{len(answers['llama'])}")
    out: dict[str, Any] = {}
    for name in SERVERS:
        xs = answers[name]
        row: dict[str, Any] = {
            "wall_s": statistics.median(a.wall_s for a in xs),
            "tok_s": statistics.median(a.tok_s for a in xs),
            "ms_per_token": statistics.median(1e3 * a.wall_s / max(1, a.tokens) for a in xs),
            "tokens": [a.tokens for a in xs], "prompt_tokens": [a.prompt_tokens for a in xs],
            "short": sum(a.tokens < tokens for a in xs),
        }
        for key, attr in (("server_prompt_ms", "server_prompt_ms"), ("server_predict_ms", "server_predict_ms")):
            got = [getattr(a, attr) for a in xs if getattr(a, attr) is not None]
            if got:
                row[key] = statistics.median(got)
        out[name] = row
    pair = [o.tok_s / m.tok_s for o, m in zip(answers["ours"], answers["llama"], strict=True) if m.tok_s > 0]
    out["ratio"] = out["ours"]["tok_s"] / out["llama"]["tok_s"] if out["llama"]["tok_s"] > 0 else None
    out["ratio_paired"] = statistics.median(pair) if pair else None
    out["runs"] = runs
    return out


# ---- the servers -----------------------------------------------------------------------------------------------


class Server:
    """A server process started here, its output in the file `log`: ready once `GET /health` answers 200
    (`wait_ready`), stopped by `close` (SIGTERM, SIGKILL after 20 s). The bench starts both of its servers so, and the
    end-to-end tests their `dcanvas serve` (tests/web, tests/canvas/server/http)."""

    def __init__(self, name: str, cmd: list[str], url: str, log: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name, self.cmd, self.url, self.log = name, cmd, url.rstrip("/"), log
        with log.open("wb") as out:  # the child keeps its own descriptor of the file
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Until `GET /health` answers 200 (llama-server answers 503 while it loads); returns its JSON object ({}
        where it sends none). Raises, the process stopped, if it ends or the time runs out."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self.close()
                raise HttpBenchError(f"{self.name} exited {self.proc.returncode} while starting: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        health = json.loads(r.read() or b"{}")
                        return health if isinstance(health, dict) else {}
            except (OSError, ValueError):  # not listening yet, 503 (an HTTPError), or a body that is not JSON
                pass
            time.sleep(0.2)
        self.close()
        raise HttpBenchError(f"{self.name} did not answer /health within {timeout:.0f} s: {self.tail()}")

    def tail(self, chars: int = 600) -> str:
        """The last `chars` characters of its output."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def ours_command(model: Path, port: int, db: Path, *, threads: int | None = None,
                 token: str | None = None) -> list[str]:
    """`dcanvas serve` of `model` on loopback `port` with its store in `db`, quiet but for warnings."""
    return [sys.executable, "-m", "canvas.cli", "serve", "--model", str(model), "--port", str(port), "--db", str(db),
            "--log-level", "warning", *(["--threads", str(threads)] if threads else []),
            *(["--token", token] if token is not None else [])]


def llama_command(binary: Path, gguf: Path, port: int, threads: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "-t", str(threads), "--host", "127.0.0.1", "--port", str(port)]


# ---- the command -----------------------------------------------------------------------------------------------


def _table(res: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"plain continuation over HTTP: {args.prompt}-token prompts, {args.tokens} tokens greedy, {res['runs']} "
          f"runs alternating, {args.threads} threads each")
    print(f"{'server':<14} {'wall s':>8} {'tok/s':>8} {'ms/token':>9} {'short':>6} {'server prompt/predict ms':>26}")
    for name, label in (("ours", "dcanvas serve"), ("llama", "llama-server")):
        r = res[name]
        split = (f"{r['server_prompt_ms']:.0f} / {r['server_predict_ms']:.0f}" if "server_prompt_ms" in r else "-")
        print(f"{label:<14} {r['wall_s']:>8.3f} {r['tok_s']:>8.1f} {r['ms_per_token']:>9.1f} {r['short']:>6} "
              f"{split:>26}")
    ratio, paired = res["ratio"], res["ratio_paired"]
    print(f"ours / llama-server tokens/s: {ratio:.3f} (median of medians), {paired:.3f} (median of per-run ratios)"
          if ratio is not None and paired is not None else "ours / llama-server tokens/s: n/a")
    for name in SERVERS:
        if res[name]["short"]:
            print(f"note: {name} ended {res[name]['short']} of {res['runs']} answers before {args.tokens} tokens "
                  "(EOS, or ours cutting back a word left open at the budget); the figures are per token")


def run(args: argparse.Namespace) -> int:
    if args.tokens < 1 or args.runs < 1 or args.threads < 1:
        print("dcanvas bench http: --tokens, --runs and --threads must be >= 1")
        return 2
    servers: list[Server] = []
    try:
        from canvas.convert.resolve import resolve_model

        model = resolve_model(args.model).path
        texts = prompts(model / "tokenizer.json", prose(args.text), args.prompt, args.runs + 1)
        with tempfile.TemporaryDirectory(prefix="dcanvas-bench-http-") as tmp:
            urls = {"ours": args.ours_url, "llama": args.llama_url}
            env = {k: v for k, v in os.environ.items() if k != TOKEN.name}  # our server on loopback, no token
            if urls["ours"] is None:
                urls["ours"] = url = f"http://127.0.0.1:{args.port}"
                servers.append(Server("dcanvas serve", ours_command(model, args.port, Path(tmp) / "docs.db",
                                                                   threads=args.threads), url,
                                      Path(tmp) / "ours.log", env))
            if urls["llama"] is None:
                if not args.llama_server.is_file():
                    raise HttpBenchError(f"{args.llama_server}: no llama-server binary (--llama-server)")
                if not args.gguf.is_file():
                    raise HttpBenchError(f"{args.gguf}: no such GGUF (--gguf)")
                urls["llama"] = url = f"http://127.0.0.1:{args.port + 1}"
                servers.append(Server("llama-server", llama_command(args.llama_server, args.gguf, args.port + 1,
                                                                    args.threads), url,
                                      Path(tmp) / "llama.log"))
            for s in servers:  # one after another: a model loading is not measured, but it slows the other's load
                s.wait_ready(args.start_timeout)
            tokens = {"ours": args.token if args.ours_url else None, "llama": None}
            for name in SERVERS:  # warm-up on a window no run uses: first-request costs (allocators, caches) off
                post(str(urls[name]), body(texts[-1], args.tokens, args.seed), token=tokens[name])
            answers: dict[str, list[Answer]] = {"ours": [], "llama": []}
            for r in range(args.runs):
                for name in order(r):
                    answers[name].append(post(str(urls[name]), body(texts[r], args.tokens, args.seed),
                                              token=tokens[name], timeout=args.timeout))
    except (OSError, HttpBenchError) as e:
        print(f"dcanvas bench http: {e}")
        return 1
    finally:
        for s in servers:
            s.close()
    res = summary(answers, args.tokens)
    _table(res, args)
    print(json.dumps({"bench": "http", "prompt_tokens": args.prompt, "tokens": args.tokens, "threads": args.threads,
                      "gguf": str(args.gguf), "model": str(model), **res, "machine": machine()}))
    return 0


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated, max_tokens (default 64)")
    parser.add_argument("--runs", type=int, default=8, help="requests to each server, alternating (default 8)")
    parser.add_argument("--threads", type=int, default=2, help="each server's threads (default 2)")
    parser.add_argument("--seed", type=int, default=1, help="the requests' seed (default 1)")
    parser.add_argument("--model", type=Path, default=None, help="our model directory (default: the one `dcanvas "
                        "serve` picks)")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_BIN, help=f"llama-server binary (default "
                        f"{LLAMA_BIN})")
    parser.add_argument("--gguf", type=Path, default=GGUF, help=f"its model, the same weights (default {GGUF})")
    parser.add_argument("--text", type=Path, default=None, help="prose to cut prompts from (default: the probe "
                        "set's news and fiction)")
    parser.add_argument("--port", type=int, default=8790, help="our server's port; llama-server's is the next one "
                        "(default 8790)")
    parser.add_argument("--ours-url", default=None, help="a running dcanvas server instead of starting one")
    parser.add_argument("--llama-url", default=None, help="a running llama-server instead of starting one")
    parser.add_argument("--token", default=TOKEN.get(), help="bearer token for --ours-url")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to load")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one answer")
    parser.set_defaults(func=run)
