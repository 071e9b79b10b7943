"""`dcanvas bench http`'s pure parts: the prompt windows, the request, the reading of an answer, the alternation and
the figures; the server process waited for until it answers /health (a stand-in server); the end-to-end run against
both real servers is `slow`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from canvas.bench.http import (
    GGUF,
    LLAMA_BIN,
    Answer,
    HttpBenchError,
    Server,
    body,
    llama_command,
    order,
    ours_command,
    prose,
    read_answer,
    summary,
    windows,
)


def _offsets(text: str) -> list[tuple[int, int]]:
    """Offsets of a whitespace tokenizer: each word with its leading space, as SentencePiece pieces are."""
    out, start = [], 0
    for i in range(1, len(text) + 1):
        if i == len(text) or text[i] == " ":
            out.append((start, i))
            start = i
    return out


def test_windows_are_consecutive_and_exactly_the_asked_tokens() -> None:
    text = " ".join(f"w{i}" for i in range(10))
    offs = _offsets(text)
    got = windows(offs, text, 3, 4)
    assert got == ["w0 w1 w2", " w3 w4 w5", " w6 w7 w8", "w0 w1 w2"]  # 3 fit; the 4th comes round again
    assert all(len(_offsets(w)) == 3 for w in got)


def test_windows_refuse_a_text_shorter_than_one_prompt() -> None:
    with pytest.raises(HttpBenchError, match="fewer than one prompt"):
        windows(_offsets("a b"), "a b", 3, 1)
    with pytest.raises(HttpBenchError, match=">= 1"):
        windows(_offsets("a b"), "a b", 0, 1)


def test_the_default_prose_holds_many_prompts() -> None:
    text = prose()
    assert len(text) > 20_000 and "\n\n" in text


def test_the_request_is_greedy_and_the_same_for_both() -> None:
    b = body("Once upon", 64, 7)
    assert b == {"prompt": "Once upon", "max_tokens": 64, "temperature": 0.0, "seed": 7, "stream": False}


def test_an_answer_is_read_with_its_token_counts_and_llamas_timings() -> None:
    ours = {"choices": [{"index": 0, "text": " a b", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 257, "completion_tokens": 63, "total_tokens": 320}}
    a = read_answer(ours, 2.0)
    assert (a.tokens, a.prompt_tokens, a.text, a.server_prompt_ms) == (63, 257, " a b", None)
    assert a.tok_s == pytest.approx(31.5)
    llama = {**ours, "timings": {"prompt_ms": 38.5, "predicted_ms": 1200}}
    b = read_answer(llama, 1.0)
    assert (b.server_prompt_ms, b.server_predict_ms) == (38.5, 1200.0)


@pytest.mark.parametrize("bad", [{}, {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}},
                                 {"choices": [{"text": 3}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}},
                                 {"error": {"message": "no"}}])
def test_what_is_not_a_completion_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(HttpBenchError, match="not an OpenAI completion"):
        read_answer(bad, 1.0)


def test_the_servers_take_turns_going_first() -> None:
    assert [order(r) for r in range(3)] == [("ours", "llama"), ("llama", "ours"), ("ours", "llama")]


def _a(wall: float, tokens: int) -> Answer:
    return Answer(wall, tokens, 256, "x")


def test_the_figures_are_per_token_medians_and_short_answers_are_counted() -> None:
    answers = {"ours": [_a(1.0, 64), _a(2.0, 64), _a(1.5, 32)], "llama": [_a(2.0, 64), _a(2.0, 64), _a(4.0, 64)]}
    res = summary(answers, 64)
    assert res["ours"]["tok_s"] == pytest.approx(32.0)  # 64, 32, 21.3 tok/s
    assert res["llama"]["tok_s"] == pytest.approx(32.0)  # 32, 32, 16
    assert res["ours"]["short"] == 1 and res["llama"]["short"] == 0
    assert res["ours"]["wall_s"] == pytest.approx(1.5)
    assert res["ratio"] == pytest.approx(1.0)
    assert res["ratio_paired"] == pytest.approx(4 / 3)  # per run: 2, 1, 4/3
    assert res["ours"]["ms_per_token"] == pytest.approx(1e3 * 2.0 / 64)


def test_the_figures_need_one_answer_per_run_from_each() -> None:
    with pytest.raises(HttpBenchError, match="one answer per run"):
        summary({"ours": [_a(1.0, 64)], "llama": []}, 64)


def test_the_server_commands() -> None:
    ours = ours_command(Path("/m"), 8790, Path("/t/docs.db"), threads=2)
    assert ours[:4] == [sys.executable, "-m", "canvas.cli", "serve"]
    assert ours[ours.index("--threads") + 1] == "2" and ours[ours.index("--port") + 1] == "8790"
    assert ours[ours.index("--model") + 1] == "/m" and ours[ours.index("--db") + 1] == "/t/docs.db"
    assert "--token" not in ours
    plain = ours_command(Path("/m"), 8790, Path("/t/docs.db"), token="s3cret")
    assert "--threads" not in plain and plain[plain.index("--token") + 1] == "s3cret"
    llama = llama_command(Path("/b/llama-server"), Path("/g.gguf"), 8791, 2)
    assert llama == ["/b/llama-server", "-m", "/g.gguf", "-t", "2", "--host", "127.0.0.1", "--port", "8791"]


# A stand-in server: /health answers 503 twice (loading, as llama-server does), then 200 with a JSON body.
_LOADING_SERVER = """
import http.server, json, sys
calls = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global calls
        calls += 1
        code = 503 if calls <= 2 else 200
        body = json.dumps({"status": "ok", "calls": calls}).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_is_ready_once_health_answers_200_and_a_dead_one_says_why(tmp_path: Path) -> None:
    from canvas.soak.server import free_port

    port = free_port()
    server = Server("stand-in", [sys.executable, "-c", _LOADING_SERVER, str(port)], f"http://127.0.0.1:{port}/",
                    tmp_path / "ok.log")
    try:
        assert server.wait_ready(30) == {"status": "ok", "calls": 3}
    finally:
        server.close()
    assert server.proc.returncode is not None
    dead = Server("dead", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                  f"http://127.0.0.1:{free_port()}", tmp_path / "dead.log")
    with pytest.raises(HttpBenchError, match=r"dead exited 3 while starting: no model here"):
        dead.wait_ready(30)


@pytest.mark.slow
@pytest.mark.skipif(not (LLAMA_BIN.is_file() and GGUF.is_file()), reason="needs llama-server and the Gemma GGUF")
def test_both_servers_answer_the_same_requests(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "canvas.cli", "bench", "http", "--runs", "1", "--prompt", "32",
                           "--tokens", "8", "--threads", "2", "--port", "8794"], capture_output=True, text=True,
                          timeout=1800, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert res["bench"] == "http" and res["runs"] == 1 and res["ratio"] > 0
    for name in ("ours", "llama"):
        assert res[name]["prompt_tokens"][0] >= 32 and 1 <= res[name]["tokens"][0] <= 8
    assert "cpu_flags" in res["machine"]
