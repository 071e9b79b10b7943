"""`dcanvas eval --task clients`: its metrics on hand-made strings, the half-typed lines, the request bodies against
llama.vim's, and the whole run against a fake server whose replies are noise, an echo of the text after the cursor,
or the human text itself (the metrics must tell them apart), and against a real `dcanvas serve` on the tiny model.

The judge here is a unigram judge over the documents' words: a word the documents hold costs a few nats, any other
20 nats, so noise is noise to it as to SmolLM2 (a tiny random LM gives every token the same ~ln V nats).
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from canvas.eval.client_shapes import (
    FIM_FIELDS,
    LineSample,
    Sender,
    fim_body,
    inst_bodies,
    line_samples,
    openai_body,
    read_inst_stream,
    window_start,
)
from canvas.eval.clients import (
    ClientsConfig,
    echo,
    first_line,
    length_ratio,
    median,
    noise,
    one_word,
    percentile,
    run_clients,
    score_in_place,
    share,
    word_4grams,
)
from canvas.eval.report import clients_markdown
from canvas.eval.samples import EvalError

DOCS = [
    ("a", "The river ran past the mill and the miller watched the water turn the great wheel all day long.\n"
          "In the evening his daughter brought bread and cheese, and they sat together by the open door.\n"
          "Nobody in the village remembered a summer as dry as that one, when the river almost stopped."),
    ("b", "The old library stood at the corner of the square, and its windows were always full of light.\n"
          "Every morning the librarian unlocked the heavy door and swept the steps before the first reader came.\n"
          "The children liked the room with the maps best, because the maps showed places nobody had seen."),
]  # fmt: skip


class UnigramJudge:
    """NLL of a word: 2 nats if the documents hold it, else 20; spaces and punctuation 1 nat (tokens start where
    a word or a mark starts, as a tokenizer's offsets do)."""

    name = "unigram"

    def __init__(self, docs: list[tuple[str, str]]) -> None:
        self.vocab = {w for _, t in docs for w in t.lower().replace(",", " ").replace(".", " ").split()}

    def token_nlls(self, text: str, start: int, end: int) -> list[tuple[int, float]]:
        import re

        out = []
        for m in re.finditer(r"\w+|[^\w\s]", text):
            if start <= m.start() < end and m.start() > 0:
                out.append((m.start(), 2.0 if m.group().lower() in self.vocab or not m.group().isalnum() else 20.0))
        return out


# ---- metrics on strings -------------------------------------------------------------------------------------------
def test_echo_counts_word_4grams_found_after() -> None:
    after = "\nThe Cat sat on the mat, purring.\n"
    assert word_4grams("a b c d e") == [("a", "b", "c", "d"), ("b", "c", "d", "e")]
    assert echo("the cat sat on the mat", after) == (3, 3)  # every 4-gram is copied (case and commas aside)
    assert echo("a dog sat on the rug", after) == (0, 3)
    assert echo("the cat sat on a rug", after) == (1, 3)
    assert echo("too short", after) == (0, 0)


def test_one_word_suggestions_are_told_apart() -> None:
    assert one_word("a") and one_word(" be.") and one_word("API") and one_word(")")
    assert not one_word("") and not one_word("  ") and not one_word("the end.") and not one_word("foo(bar)")


def test_noise_share_and_pooling() -> None:
    assert noise([1.0, 12.5, 3.0, 30.0]) == (2, 4)
    assert noise([12.0]) == (0, 1)  # above the bound, not at it
    assert share([(2, 4), (0, 4)]) == 0.25 and math.isnan(share([(0, 0)]))


def test_length_first_line_median_percentile() -> None:
    assert first_line("one\ntwo") == "one" and first_line("\nx") == ""
    assert length_ratio("abcd", "ab") == 2.0 and math.isnan(length_ratio("x", ""))
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([1.0, 2.0]) == 1.5 and math.isnan(median([]))
    assert percentile([float(v) for v in range(1, 21)], 0.95) == 19.0 and percentile([5.0], 0.95) == 5.0


def test_score_in_place_counts_noise_and_the_first_line() -> None:
    judge = UnigramJudge(DOCS)
    good = score_in_place(judge, "The river ran", " past the mill")
    bad = score_in_place(judge, "The river ran", " xq zzv\nthe mill")
    assert good.noise == (0, 3) and good.first_tokens == 3 and good.first_nll == 6.0
    assert bad.noise == (2, 4) and bad.first_tokens == 2 and bad.first_nll == 40.0  # the first line is "xq zzv"


# ---- samples and bodies -------------------------------------------------------------------------------------------
def test_line_samples_cut_mid_line_at_a_word() -> None:
    samples = line_samples(DOCS, 4, seed=0)
    assert len(samples) == 4 and samples == line_samples(DOCS, 4, seed=0)
    for s in samples:
        text = dict(DOCS)[s.doc_id]
        line = s.typed + s.reference
        assert line in text.split("\n") and len(s.typed) >= 16 and 16 <= len(s.reference) <= 160
        assert s.typed.endswith(" ") and not s.reference.startswith(" ")
        assert s.before.endswith(s.typed) and s.reference not in s.before + s.input_suffix
    with pytest.raises(EvalError):
        line_samples([("x", "short line")], 4, seed=0)


SAMPLE = LineSample("d", ("import math", "", "def area(r):"), "    y = ", "math.pi * r * r", ("    return y",))


def test_bodies_are_llama_vims() -> None:
    """The FIM and instruction bodies of tests/canvas/server/http/test_llama_vim_e2e.py (written from llama.vim)."""
    from tests.canvas.server.http.test_llama_vim_e2e import FIM, INST, INST_WARM_UP, inst_messages

    assert fim_body(SAMPLE, 250) == {**FIM, "input_suffix": "\n    return y\n",
                                     "input_prefix": "import math\n\ndef area(r):\n", "input_extra": []}
    assert fim_body(SAMPLE, 1000)["t_max_predict_ms"] == 1000 and FIM["response_fields"] == FIM_FIELDS
    warm, edit = inst_bodies(SAMPLE)
    assert set(warm) == set(INST_WARM_UP) and set(edit) == set(INST)
    assert {k: v for k, v in edit.items() if k != "messages"} == {k: v for k, v in INST.items() if k != "messages"}
    assert inst_messages("x")[0]["content"].split("--- CONTEXT")[0] == edit["messages"][0]["content"].split(
        "--- CONTEXT")[0]
    assert "--- SELECTION   " + "-" * 40 + "\n    y = \n" in edit["messages"][0]["content"]
    assert openai_body(SAMPLE, "m") == {"model": "m", "prompt": "import math\n\ndef area(r):\n    y = ",
                                        "suffix": "\n    return y\n", "max_tokens": 128, "stream": False}


def test_read_inst_stream_reads_as_llama_vim() -> None:
    raw = ('data: {"choices":[{"delta":{"role":"assistant"}}]}\n\ndata: {"choices":[{"delta":{"content":"a "}}]}\n'
           'data: {"choices":[{"delta":{"content":"b"}}]}\n\ndata: [DONE]\n')
    assert read_inst_stream(raw) == "a b"
    assert read_inst_stream('{"choices":[{"message":{"content":"whole"}}]}') == "whole"


def test_window_start() -> None:
    text = "first line\n" + "word " * 100 + "end"
    assert window_start(text, 15, 64) == 11  # its line starts near
    at = len(text) - 3
    assert text[window_start(text, at, 64) - 1] == " " and at - window_start(text, at, 64) <= 64


# ---- the run against a fake server --------------------------------------------------------------------------------
def fake_app(mode: str) -> Starlette:
    """/infill, /v1/completions and /v1/chat/completions answering noise, an echo of what follows the cursor, or the
    human rest of the line (looked up in the documents)."""
    lines = [ln for _, t in DOCS for ln in t.split("\n")]

    def answer(before: str, suffix: str) -> str:
        if mode == "noise":
            return " zqx vvkj wrrp qqz xxv"
        if mode == "echo":
            return first_line(suffix.lstrip("\n"))
        typed = before.split("\n")[-1]
        return next(ln[len(typed) :] for ln in lines if typed and ln.startswith(typed))

    async def infill(request: Request) -> Response:
        body = await request.json()
        content = answer(body["input_prefix"] + body["prompt"], body["input_suffix"])
        return JSONResponse({k: (content if k == "content" else 0) for k in body["response_fields"]})

    async def completions(request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"choices": [{"text": answer(body["prompt"], body["suffix"])}]})

    async def chat(request: Request) -> Response:
        body = await request.json()
        if body.get("n_predict") == 0:
            return JSONResponse({"choices": [{"message": {"content": ""}}]})
        system = body["messages"][0]["content"]
        typed = system.split("--- SELECTION")[1].split("\n", 1)[1].split("\n--- SUFFIX")[0]
        suffix = system.split("--- SUFFIX")[1].split("\n", 1)[1]
        text = typed + answer(typed, "\n" + suffix) if mode == "human" else answer(typed, "\n" + suffix)
        chunks = [json.dumps({"choices": [{"delta": {"content": text[i : i + 5]}}]}) for i in range(0, len(text), 5)]
        return Response("".join(f"data: {c}\n\n" for c in chunks) + "data: [DONE]\n\n",
                        media_type="text/event-stream")  # fmt: skip

    return Starlette(routes=[Route("/infill", infill, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"])])  # fmt: skip


@pytest.fixture(scope="module")
def fake_servers() -> Iterator[dict[str, str]]:
    urls, servers, threads = {}, [], []
    for mode in ("noise", "echo", "human"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(fake_app(mode), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append(server)
        threads.append(thread)
        urls[mode] = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not all(s.started for s in servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield urls
    for s in servers:
        s.should_exit = True
    for t in threads:
        t.join(10)


HTTP_SHAPES = ("llama-vim-250", "llama-vim-inst", "openai-fim")


def rows(url: str, peer: str | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    servers = {"url": Sender(url), **({"peer": Sender(peer)} if peer else {})}
    cfg = ClientsConfig(samples=4, shapes=HTTP_SHAPES, peer_shapes=("llama-vim-250",), examples=1)
    result = run_clients(servers, UnigramJudge(DOCS), DOCS, cfg)
    assert "| url | llama-vim-250 |" in clients_markdown(result)
    json.dumps(result)  # JSON-ready
    return {(r["server"], r["shape"]): r for r in result["results"]}


def test_metrics_tell_noise_echo_and_human_apart(fake_servers: dict[str, str]) -> None:
    human = rows(fake_servers["human"], peer=fake_servers["noise"])
    for shape in HTTP_SHAPES:
        r = human[("url", shape)]
        assert r["errors"] == 0 and r["empty_share"] == 0.0, r
        assert r["noise_share"] == r["noise_share_human"] == 0.0
        assert r["first_line_ratio"] == pytest.approx(1.0) and r["length_ratio_median"] == pytest.approx(1.0)
        assert r["echo_share"] == r["echo_share_human"]
        assert r["one_word_share"] == r["one_word_share_human"]
        assert r["seconds_median"] > 0 and r["seconds_p95"] >= r["seconds_median"]
    peer = human[("peer", "llama-vim-250")]
    assert peer["noise_share"] == 1.0 and peer["first_line_ratio"] > 100  # the noise server, beside
    assert ("peer", "openai-fim") not in human  # a peer gets the peer shapes only
    echoing = rows(fake_servers["echo"])
    for shape in ("llama-vim-250", "openai-fim"):
        assert echoing[("url", shape)]["echo_share"] == 1.0 and echoing[("url", shape)]["echo_share_human"] < 0.5


def test_errors_are_counted_not_scored() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there
    result = run_clients({"url": Sender(f"http://127.0.0.1:{port}", timeout_s=5)}, UnigramJudge(DOCS), DOCS,
                         ClientsConfig(samples=2, shapes=("llama-vim-250",)))  # fmt: skip
    (row,) = result["results"]
    assert row["errors"] == 2 and math.isnan(row["noise_share"]) and row["error_examples"]
    with pytest.raises(EvalError):
        Sender("127.0.0.1:8080")


# ---- the run against a real server --------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_every_shape_against_dcanvas_serve(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The five shapes against `dcanvas serve` on the tiny random model: every request answered, the websocket
    gap's text read back between the untouched sides (its document deleted afterwards)."""
    from canvas.engine.backend import write_tiny_checkpoint
    from tests.canvas.server.http.test_openai_e2e import TOKEN, Server

    # A 128-slot canvas: `openai-fim` asks for llama.vim's 128 tokens, and an infill takes at most one canvas.
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"), canvas_length=128)
    (model / "generation_config.json").write_text(json.dumps({"max_denoising_steps": 4}))  # quick canvases
    server = Server(model, tmp_path_factory.mktemp("serve"))
    try:
        result = run_clients({"url": Sender(server.url, TOKEN)}, UnigramJudge(DOCS), DOCS,
                             ClientsConfig(samples=2, ws_gap_tokens=8))  # fmt: skip
    finally:
        server.stop()
    rows = {r["shape"]: r for r in result["results"]}
    assert set(rows) == {"llama-vim-250", "llama-vim-1000", "llama-vim-inst", "openai-fim", "ws-gap"}
    for shape, r in rows.items():
        assert r["errors"] == 0, (shape, r["error_examples"])
        assert r["requests"] == 2 and r["seconds_median"] > 0
    gaps = [e for e in result["examples"] if e["shape"] == "ws-gap"]
    assert gaps and all(isinstance(e["output"], str) for e in gaps)
