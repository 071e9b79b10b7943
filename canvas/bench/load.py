"""`dcanvas bench load`: many concurrent dcanvas/1 sessions editing and generating against one server.

Starts `dcanvas serve` as a child process on a free loopback port (or targets `--url`), measures one generation's
own first-frame time on the idle server (a lone session, `--solo` generations), then runs `--sessions` clients
(canvas.protocol.client) for `--seconds`. Each session opens its own document and loops: mask a word, generate,
accept or reject the proposal, sometimes undo, with a short pause. A `gen.start` refused as `busy` is a refusal, not an
error: the session waits the `retry_after_s` the server gave (with jitter) and asks again. Reports refusals, errors
other than `busy` (goal 0), p50/p99 time from the admitted `gen.start` to its first progress frame (goal: p99 <= 3x the
solo first frame) and from the first attempt (retries included), time between frames, generations by status and
completed per minute, the server's queue figures (`/health`) and its RSS sampled every second (goal: bounded). With
`--ray --replicas N` the server runs its engine as N Ray Serve replicas (`canvas.cluster`) and the figures add the
generations each replica started; the RSS is then the ingress's only. The last line of stdout is one JSON document
with every figure.

`--warm-tiny` runs issue 47's case over HTTP instead: one trivially small `/infill` (empty prefix and suffix, a few
tokens), then rounds of N concurrent fills (`--fills 4,8,16`, each round once the last is answered), each a word of
one of the texts below with the text around it; a table gives per round how many got 200, how many 429 (and other
statuses), the latencies of the answered ones and the server's `row_cap` and `max_queue` after it. A server whose
baseline is that one tiny first frame cuts its rows and refuses most of each round.

    python -m canvas.bench.load --model DIR --sessions 50 --seconds 60
    python -m canvas.bench.load --model DIR --warm-tiny --fills 4,8,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from canvas.env import TOKEN
from canvas.protocol import ErrorCode, GenProgress, MaskOp, ProtocolError
from canvas.protocol.client import DcanvasClient, Generation
from canvas.soak.server import rss_mib

_TEXTS = [
    "The cat sat on the mat and watched the rain fall on the garden.",
    "Once upon a time there was a small house by a quiet river.",
    "She opened the window, looked at the hills, and began to write.",
    "We walked along the road until the sun went down behind the trees.",
]


@dataclass
class Figures:
    first_frame_s: list[float] = field(default_factory=list)  # from the admitted gen.start
    first_frame_retries_s: list[float] = field(default_factory=list)  # from the first attempt, refusals included
    first_frame_at_once_s: list[float] = field(default_factory=list)  # admitted with a free row (no wait estimated)
    between_frames_s: list[float] = field(default_factory=list)
    refusals: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    edits: int = 0
    accepts: int = 0
    frames: int = 0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0] * 1000, 1)
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] * 1000, 1)


async def _admitted(c: DcanvasClient, doc_id: str, v: int, deadline: float, fig: Figures,
                    rng: random.Random) -> tuple[Generation, float] | None:
    """A started generation and when its gen.start was sent, retrying `busy` as the server says; None at the end."""
    max_steps, seed = rng.choice([8, 16, 24]), rng.randrange(1000)
    while time.monotonic() < deadline:
        gen = c.generate(doc_id, v, max_steps=max_steps, seed=seed)
        t0 = time.monotonic()
        try:
            await gen
            return gen, t0
        except ProtocolError as e:
            if e.code is not ErrorCode.BUSY:
                raise
            fig.refusals += 1
            wait = (e.data or {}).get("retry_after_s") or 1.0
            await asyncio.sleep(min(5.0, float(wait)) * rng.uniform(0.8, 1.5))  # jitter: retries do not come in step
    return None


async def _session(url: str, token: str | None, deadline: float, fig: Figures, rng: random.Random) -> None:
    try:
        async with DcanvasClient.connect(url, token=token, client_name="loadbench", request_timeout=120) as c:
            doc = await c.open(text=rng.choice(_TEXTS), name="load")
            while time.monotonic() < deadline:
                try:
                    words = [(i, i + len(w)) for i, w in _word_spans(doc.text)]
                    start, end = rng.choice(words)
                    doc = await c.edit(doc.doc_id, doc.v, [MaskOp(start=start, end=end)])
                    fig.edits += 1
                    first_try = time.monotonic()
                    started = await _admitted(c, doc.doc_id, doc.v, deadline, fig, rng)
                    if started is None:
                        break
                    gen, t0 = started
                    last = None
                    async for ev in gen:
                        now = time.monotonic()
                        if isinstance(ev, GenProgress):
                            fig.frames += 1
                            if last is None:
                                fig.first_frame_s.append(now - t0)
                                fig.first_frame_retries_s.append(now - first_try)
                                assert gen.accepted is not None
                                if gen.accepted.est_wait_s == 0:
                                    fig.first_frame_at_once_s.append(now - t0)
                            else:
                                fig.between_frames_s.append(now - last)
                            last = now
                    assert gen.done is not None
                    fig.statuses[gen.done.status] += 1
                    if gen.done.status == "completed" and rng.random() < 0.7:
                        doc = await c.accept(gen.gen, doc.v)
                        fig.accepts += 1
                        if rng.random() < 0.3:
                            doc = await c.undo(doc.doc_id)
                    elif gen.done.status == "completed":
                        await c.reject(gen.gen)
                    # Text that was masked and not accepted stays free: unmask everything for the next round.
                    doc = await c.edit(doc.doc_id, doc.v, [{"op": "unmask", "start": 0, "end": len(doc.text)}])
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
                except ProtocolError as e:
                    fig.errors[e.code.value] += 1
                    doc = await c.open(doc.doc_id)
    except Exception as e:  # a dropped connection or a bug: counted, never hidden
        fig.errors[type(e).__name__] += 1


def _word_spans(text: str) -> list[tuple[int, str]]:
    out, i = [], 0
    for w in text.split(" "):
        if w:
            out.append((i, w))
        i += len(w) + 1
    return out or [(0, text)]


def _cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) the process has used so far; None where /proc cannot say."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


async def _solo(url: str, token: str | None, n: int) -> list[float]:
    """First-frame times of `n` generations, one at a time on the idle server: a generation's own first frame."""
    fig = Figures()
    if n > 0:
        async with DcanvasClient.connect(url, token=token, client_name="loadbench-solo", request_timeout=120) as c:
            rng = random.Random(-1)
            for _ in range(n):
                doc = await c.open(text=rng.choice(_TEXTS), name="solo")
                start, end = rng.choice([(i, i + len(w)) for i, w in _word_spans(doc.text)])
                doc = await c.edit(doc.doc_id, doc.v, [MaskOp(start=start, end=end)])
                started = await _admitted(c, doc.doc_id, doc.v, time.monotonic() + 60, fig, rng)
                assert started is not None
                gen, t0 = started
                async for ev in gen:
                    if isinstance(ev, GenProgress) and len(fig.first_frame_s) < n:
                        fig.first_frame_s.append(time.monotonic() - t0)
                        break
                await gen.client.cancel(gen.gen)
                async for _ in gen:  # until its gen.done
                    pass
    return fig.first_frame_s


def _http_base(url: str) -> str:
    return url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rsplit("/ws", 1)[0]


def _health(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{_http_base(url)}/health", timeout=5) as r:
            health: dict[str, Any] = json.loads(r.read())
            return health
    except OSError:
        return {}


async def _run(url: str, token: str | None, sessions: int, seconds: float, pid: int | None,
               solo: int = 5) -> dict[str, Any]:
    load_before = os.getloadavg()  # other processes' load too: on a shared machine the figures read high with it
    solo_s = await _solo(url, token, solo)
    fig = Figures()
    rss: list[tuple[float, float]] = []
    t0 = time.monotonic()
    deadline = t0 + seconds

    async def sample() -> None:
        while pid is not None:
            value = rss_mib(pid)
            if value is not None:
                rss.append((round(time.monotonic() - t0, 1), value))
            await asyncio.sleep(1.0)

    cpu_before = _cpu_s(pid)
    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(_session(url, token, deadline, fig, random.Random(i)) for i in range(sessions)))
    sampler.cancel()
    wall = time.monotonic() - t0
    cpu_after = _cpu_s(pid)
    await asyncio.sleep(1.5)  # replicas post their counters every second
    queue = _health(url).get("queue")
    solo_p50 = _pct(solo_s, 50)
    admitted_p99 = _pct(fig.first_frame_s, 99)
    return {
        "sessions": sessions,
        "seconds": round(wall, 1),
        "errors": sum(fig.errors.values()),
        "errors_by_kind": dict(fig.errors),
        "refusals": fig.refusals,
        "solo_first_frame_ms": {"p50": solo_p50, "max": round(max(solo_s) * 1000, 1) if solo_s else None},
        "admitted_p99_over_solo": round(admitted_p99 / solo_p50, 2) if admitted_p99 and solo_p50 else None,
        "first_frame_with_retries_ms": {"p50": _pct(fig.first_frame_retries_s, 50),
                                        "p99": _pct(fig.first_frame_retries_s, 99)},
        "first_frame_free_row_ms": {"n": len(fig.first_frame_at_once_s), "p50": _pct(fig.first_frame_at_once_s, 50),
                                    "p99": _pct(fig.first_frame_at_once_s, 99)},
        "server_queue": queue,
        "generations_per_min": round(fig.statuses.get("completed", 0) * 60 / wall, 1) if wall > 0 else None,
        # The server process's CPU over the sessions' run (with --ray: the ingress alone, not its replicas).
        "server_cpu_s": round(cpu_after - cpu_before, 2) if cpu_after is not None and cpu_before is not None
        else None,
        # With --ray: generations each engine replica started (its own count, on /health), the solo ones included.
        "generations_by_replica": (queue or {}).get("generations_by_replica"),
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
        "generations": dict(fig.statuses),
        "generations_completed": fig.statuses.get("completed", 0),
        "edits": fig.edits,
        "accepts": fig.accepts,
        "progress_frames": fig.frames,
        "first_frame_ms": {"p50": _pct(fig.first_frame_s, 50), "p99": _pct(fig.first_frame_s, 99)},
        "between_frames_ms": {"p50": _pct(fig.between_frames_s, 50), "p99": _pct(fig.between_frames_s, 99)},
        "server_rss_mib": {
            "first": rss[0][1] if rss else None,
            "max": max(v for _, v in rss) if rss else None,
            "last": rss[-1][1] if rss else None,
            "samples": rss,
        },
    }


def _infill(url: str, token: str | None, body: dict[str, Any]) -> tuple[int, float]:
    """POST /infill: its HTTP status and how long the answer took (s)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(f"{_http_base(url)}/infill", json.dumps(body).encode(), headers, method="POST")
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
            status = int(r.status)
    except urllib.error.HTTPError as e:
        status = e.code
    return status, time.monotonic() - t0


def _fill_body(i: int, n_predict: int) -> dict[str, Any]:
    """The i-th fill: one word of one of the texts to write again, the text before and after it around the gap."""
    words = _word_spans(_TEXTS[i % len(_TEXTS)])
    at, word = words[1 + i % (len(words) - 2)]
    text = _TEXTS[i % len(_TEXTS)]
    return {"input_prefix": text[:at], "input_suffix": text[at + len(word) :], "n_predict": n_predict, "seed": i}


def _warm_tiny(url: str, token: str | None, rounds: list[int], n_predict: int) -> dict[str, Any]:
    """One tiny /infill, then each round's fills all at once (see the module docstring)."""
    tiny_status, tiny_s = _infill(url, token, {"input_prefix": "", "input_suffix": "", "n_predict": 4, "seed": 0})
    after_tiny = _health(url).get("queue") or {}
    out: list[dict[str, Any]] = []
    for n in rounds:
        with ThreadPoolExecutor(max_workers=n) as pool:
            answers = list(pool.map(lambda i: _infill(url, token, _fill_body(i, n_predict)), range(n)))
        ok = [t for status, t in answers if status == 200]
        statuses = Counter(status for status, _ in answers)
        queue = _health(url).get("queue") or {}
        out.append({"fills": n, "ok": len(ok), "refused_429": statuses.get(429, 0),
                    "other": {str(k): v for k, v in statuses.items() if k not in (200, 429)},
                    "ok_ms": {"p50": _pct(ok, 50), "max": round(max(ok) * 1000, 1) if ok else None},
                    "row_cap": queue.get("row_cap"), "max_queue": queue.get("max_queue"),
                    "alone_first_frame_ms": _ms(queue.get("alone_first_frame_s")),
                    "slowdown": queue.get("first_frame_slowdown")})
    return {"scenario": "warm-tiny", "n_predict": n_predict,
            "tiny": {"status": tiny_status, "ms": round(tiny_s * 1000, 1), "row_cap": after_tiny.get("row_cap"),
                     "max_queue": after_tiny.get("max_queue"),
                     "alone_first_frame_ms": _ms(after_tiny.get("alone_first_frame_s"))},
            "rounds": out, "server_queue": _health(url).get("queue"),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def _ms(seconds: Any) -> float | None:
    return None if seconds is None else round(float(seconds) * 1000, 1)


def _print_warm_tiny(r: dict[str, Any]) -> None:
    t = r["tiny"]
    print(f"tiny /infill (empty prefix and suffix, 4 tokens): {t['status']} in {t['ms']} ms; then row_cap "
          f"{t['row_cap']}, max_queue {t['max_queue']}, alone first frame {t['alone_first_frame_ms']} ms")
    head = ("fills", "200", "429", "other", "p50 ms", "max ms", "row_cap", "max_queue", "alone ms", "slowdown")
    print(" | ".join(f"{h:>9}" for h in head))
    for x in r["rounds"]:
        cells = (x["fills"], x["ok"], x["refused_429"], sum(x["other"].values()), x["ok_ms"]["p50"],
                 x["ok_ms"]["max"], x["row_cap"], x["max_queue"], x["alone_first_frame_ms"], x["slowdown"])
        print(" | ".join(f"{'-' if c is None else c!s:>9}" for c in cells))
    print(json.dumps(r))


def _brief(queue: dict[str, Any] | None) -> dict[str, Any] | None:
    """The server's queue figures without the per-replica details (printed on their own line)."""
    return None if queue is None else {k: v for k, v in queue.items() if k != "replicas"}


def _wait_replicas(url: str, replicas: int, deadline: float) -> None:
    while (_health(url).get("queue") or {}).get("replicas_live", 0) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {replicas} engine replicas came up")
        time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> int:
    try:
        rounds = [int(n) for n in args.fills.split(",")]
        if not rounds or min(rounds) < 1:
            raise ValueError
    except ValueError:
        print(f"dcanvas bench load: --fills must be positive counts separated by commas, not {args.fills!r}",
              file=sys.stderr)
        return 2
    proc: subprocess.Popen[bytes] | None = None
    url = args.url
    if url is None:
        port = _free_port()
        db = Path(tempfile.mkdtemp(prefix="dcanvas-load-")) / "docs.db"
        cmd = [
            sys.executable,
            "-m",
            "canvas.cli",
            "serve",
            "--port",
            str(port),
            "--db",
            str(db),
            "--log-level",
            "warning",
            "--max-batch",
            str(args.max_batch),
            "--max-queue",
            str(args.max_queue),
        ]
        cmd += ["--model", args.model] if args.model else []  # fmt: skip
        cmd += ["--threads", str(args.threads)] if args.threads else []  # fmt: skip
        cmd += ["--first-frame-slo", args.first_frame_slo] if args.first_frame_slo else []  # fmt: skip
        cmd += ["--ray", "--replicas", str(args.replicas)] if args.ray else []  # fmt: skip
        cmd += ["--ray-address", args.ray_address] if args.ray and args.ray_address else []  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        url = f"ws://127.0.0.1:{port}/ws"
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    print("dcanvas bench load: the server did not start", file=sys.stderr)
                    return 1
                time.sleep(0.3)
    try:
        pid = proc.pid if proc is not None else args.pid
        if args.ray:  # the replicas come up after the ingress answers: wait until all of them post figures
            _wait_replicas(url, args.replicas, deadline=time.monotonic() + 300)
        if args.warm_tiny:
            warm = _warm_tiny(url, args.token, rounds, args.n_predict)
        else:
            result = asyncio.run(_run(url, args.token, args.sessions, args.seconds, pid, args.solo))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a loaded machine: the figures are in, the server must not outlive them
                proc.kill()
                proc.wait()
    if args.warm_tiny:
        _print_warm_tiny(warm)
        return 0 if all(not x["other"] for x in warm["rounds"]) and warm["tiny"]["status"] == 200 else 1
    r = result
    print(f"{r['sessions']} sessions for {r['seconds']} s: {r['errors']} errors {r['errors_by_kind']}, "
          f"{r['refusals']} refusals (busy)")
    print(f"generations {r['generations']}; edits {r['edits']}; accepts {r['accepts']}; frames {r['progress_frames']}")
    print(f"first frame ms: solo {r['solo_first_frame_ms']}; admitted {r['first_frame_ms']} "
          f"(p99 {r['admitted_p99_over_solo']}x solo); with retries {r['first_frame_with_retries_ms']}; "
          f"admitted to a free row {r['first_frame_free_row_ms']}")
    print(f"between frames ms {r['between_frames_ms']}; server queue {_brief(r['server_queue'])}")
    if r["generations_by_replica"] is not None:
        print(f"generations/min {r['generations_per_min']}; by replica {r['generations_by_replica']}")
    else:
        print(f"generations/min {r['generations_per_min']}")
    m = r["server_rss_mib"]
    print(f"server RSS MiB first {m['first']} max {m['max']} last {m['last']}; server CPU {r['server_cpu_s']} s")
    print(json.dumps(result))
    return 0 if result["errors"] == 0 else 1


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="an existing server's ws URL (default: start one)")
    parser.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, to sample its RSS")
    parser.add_argument("--model", default=None, help="model directory for the server that is started")
    parser.add_argument("--token", default=TOKEN.get())
    parser.add_argument("--max-batch", type=int, default=8, help="the started server's --max-batch")
    parser.add_argument("--threads", type=int, default=None, help="the started server's --threads")
    parser.add_argument("--first-frame-slo", default=None, help="the started server's --first-frame-slo")
    parser.add_argument("--max-queue", default="auto", help="the started server's --max-queue (default auto)")
    parser.add_argument("--ray", action="store_true", help="start the server with --ray (engine replicas on Ray)")
    parser.add_argument("--replicas", type=int, default=1, help="with --ray: the server's engine replicas")
    parser.add_argument("--ray-address", default=None, help="with --ray: a running Ray cluster (default: local)")
    parser.add_argument("--solo", type=int, default=5, help="generations timed alone on the idle server first")
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warm-tiny", action="store_true",
                        help="HTTP: one tiny /infill, then rounds of concurrent fills (issue 47), instead of sessions")
    parser.add_argument("--fills", default="4,8,16", help="with --warm-tiny: concurrent fills per round")
    parser.add_argument("--n-predict", type=int, default=16, help="with --warm-tiny: each fill's n_predict")
    parser.set_defaults(func=run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="dcanvas bench load", description=__doc__.split("\n\n")[0])
    register(parser)
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
