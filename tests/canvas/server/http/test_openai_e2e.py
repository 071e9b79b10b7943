"""End to end: a real `dcanvas serve` process (tiny random model, a token on loopback), driven by the official
`openai` package over its OpenAI-compatible routes and by llama.vim's own request body over `/infill`.

The tiny model writes garbage; these tests check the mechanics: shapes, infill, streaming (text arrives while the
generation still runs, `[DONE]` last), `n`, `stop`, refusals, auth, and a disconnect mid-stream cancelling the
generation (the server's counters in /health).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from canvas.bench.http import Server as Process
from canvas.bench.http import ours_command
from canvas.engine.backend import write_tiny_checkpoint
from canvas.server.http.llama_infill import indent_rule
from canvas.soak.server import free_port

pytestmark = pytest.mark.timeout(180)
TOKEN = "e2e-token-0123456789abcdef"
SLOW = {"max_steps": 1024, "entropy_bound": 1e-9}  # a random model never settles: 1024 steps a canvas
PROMPT = "The cat sat on the mat and watched the rain."
# The body llama.vim's FIM request sends (autoload/llama.vim, `s:fim`), for a cursor after "    y = " in a small
# Python file, with one chunk of extra context gathered from another buffer.
LLAMA_VIM_FIM = {
    "id_slot": 0,
    "input_prefix": "import math\n\n\ndef area(r):\n",
    "input_suffix": "\n    return y\n\n\nprint(area(2.0))\n",
    "input_extra": [{"text": "def perimeter(r):\n    return 2 * math.pi * r\n", "time": 1718000000.5,
                     "filename": "shapes.py"}],
    "prompt": "    y = ",
    "n_predict": 128,
    "stop": [],
    "n_indent": 4,
    "top_k": 40,
    "top_p": 0.90,
    "samplers": ["top_k", "top_p", "infill"],
    "stream": False,
    "cache_prompt": True,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 1000,
    "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                        "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                        "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                        "tokens_cached"],
}  # fmt: skip


class Server:
    """`dcanvas serve` with the token, on a free loopback port (`canvas.bench.http.Server` starts it)."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        self.proc = Process("dcanvas serve", ours_command(model, self.port, tmp / "docs.db", token=TOKEN), self.url,
                            tmp / "server.log", env)
        self.proc.wait_ready(120)

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
            return json.loads(r.read())

    def http(self) -> dict[str, int]:
        return self.health()["http_generations"]

    def stop(self) -> None:
        self.proc.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))
    (model / "generation_config.json").write_text(json.dumps({"max_denoising_steps": 4}))  # quick canvases
    s = Server(model, tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0, timeout=60)


def test_models_and_a_completion(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny-random"]
    r = client.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=8, seed=1)
    assert r.object == "text_completion" and r.model == "tiny-random" and len(r.choices) == 1
    assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].text, str)
    assert r.usage is not None and 0 < r.usage.completion_tokens <= 8
    again = client.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=8, seed=1)
    assert again.choices[0].text == r.choices[0].text  # a seed makes it repeatable


def test_a_greedy_completion_over_http_is_the_in_process_one(server: Server) -> None:
    """The server's path (admission, the engine's thread, the event loop) changes no token: a greedy AR continuation
    over HTTP is what the same request gives run in this process."""
    import asyncio

    from canvas.engine.backend import load_backend
    from canvas.server.config import ServerConfig
    from canvas.server.http.core import HttpApi
    from canvas.server.http.openai import CompletionRequest, _task
    from canvas.server.http.textgen import plan
    from canvas.server.http.textrun import Finish, TextRun

    wire = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "seed": 3, "dcanvas": {"mode": "ar"}}
    req = urllib.request.Request(f"{server.url}/v1/completions", json.dumps(wire).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        over_http = json.loads(r.read())["choices"][0]["text"]

    backend = load_backend(server.model, max_batch=1, threads=1)
    api = HttpApi(ServerConfig(), backend)
    task = _task(api, CompletionRequest.model_validate(wire), PROMPT, None, 24)
    the_plan = plan(backend, task, max_context=api.limits.max_context_tokens)

    async def run() -> str:
        text_run = TextRun(backend, the_plan, task)
        await text_run.start()
        async for ev in text_run.events(drafts=False):
            if isinstance(ev, Finish):
                return ev.text
        raise AssertionError("no finish")

    backend.engine.start()
    try:
        in_process = asyncio.run(run())
    finally:
        backend.engine.stop()
    assert over_http == in_process
    assert over_http  # a tiny random model still writes 24 tokens of something


def test_a_completion_with_a_suffix_fills_between(client: openai.OpenAI) -> None:
    suffix = " Then the sun came out."
    r = client.completions.create(model="m", prompt=PROMPT, suffix=suffix, max_tokens=6, seed=2)
    fill = r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens <= 6
    assert suffix not in fill and PROMPT not in fill  # only the middle comes back: the client joins the three
    # The model reads the suffix (pinned after the gap): the prompt counts its tokens too.
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, seed=2)
    assert plain.usage is not None and r.usage.prompt_tokens > plain.usage.prompt_tokens


def test_streaming_sends_text_while_the_generation_runs(client: openai.OpenAI, server: Server) -> None:
    # Two canvases: the first one's text is final, and sent, while the second is still being generated.
    # (The model may end the text with EOS in the first canvas; another seed then tries again.)
    for seed in range(8):
        body: dict[str, Any] = {"model": "m", "prompt": PROMPT, "max_tokens": 64, "seed": seed,
                                "extra_body": {"dcanvas": {"max_steps": 6}}}
        pieces, running_at_first_text, drafts = [], None, 0
        for chunk in client.completions.create(stream=True, **body):
            choice = chunk.choices[0]
            if choice.text and running_at_first_text is None:
                running_at_first_text = server.http()["running"]
            pieces.append(choice.text)
            drafts += (choice.model_extra or {}).get("dcanvas") is not None
        plain = client.completions.create(**body)
        assert "".join(pieces) == plain.choices[0].text and drafts > 0
        if plain.choices[0].finish_reason == "length":
            assert running_at_first_text == 1
            return
    pytest.fail("every seed ended in its first canvas")


def test_a_raw_stream_ends_with_done(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 10, "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    lines = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {TOKEN}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    finished = {c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]}
    assert finished == {0, 1}


def test_n_choices(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, n=3, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # seeds 5, 6, 7
    assert r.usage is not None and 0 < r.usage.completion_tokens <= 3 * 12  # counted over every choice


def test_stop_sequences_cut_the_text(client: openai.OpenAI) -> None:
    text = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, seed=3).choices[0].text
    assert len(text) >= 8
    stop = text[4:7]
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, seed=3, stop=[stop, "never-there"])
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"


def test_unsupported_fields_and_bad_keys_are_refused(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=4, logprobs=2)
    assert refused.value.status_code == 400 and refused.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model="m", prompt=PROMPT, extra_body={"mystery": 1})
    assert "mystery" in unknown.value.message
    for key in ("wrong-key-wrong-key-wrong", ""):
        bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="m", prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=8, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None


def test_a_disconnect_mid_stream_cancels_the_generation(client: openai.OpenAI, server: Server) -> None:
    # The server releases a streamed generation just after its last chunk reached the client: an earlier test's
    # may still count as running for a moment (seen on a busy machine).
    deadline = time.monotonic() + 15
    while server.http()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    before = server.http()
    stream = client.completions.create(model="m", prompt=PROMPT, max_tokens=32, stream=True,
                                       extra_body={"dcanvas": SLOW})
    first = next(iter(stream))
    assert first.choices[0].model_extra and "dcanvas" in first.choices[0].model_extra  # a draft: it is running
    assert server.http()["running"] == 1
    stream.close()
    deadline = time.monotonic() + 15
    while server.http()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = server.http()
    # 1024 denoising steps were left; the generation stopped at once and was counted as cancelled.
    assert after["running"] == 0 and after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"]


# -- llama.cpp's /infill, as llama.vim calls it -------------------------------------------------------------------


def infill(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/infill", json=body, timeout=60, headers={"authorization": f"Bearer {TOKEN}"})


def test_infill_with_the_request_llama_vim_sends(server: Server) -> None:
    r = infill(server, LLAMA_VIM_FIM)
    assert r.status_code == 200
    raw = r.text
    # llama.vim's own checks before it decodes the reply, then the keys it reads.
    assert raw.lstrip().startswith("{") and '"content":"' in raw
    body = r.json()
    assert set(body) == set(LLAMA_VIM_FIM["response_fields"])  # type: ignore[call-overload]
    assert isinstance(body["content"], str) and body["truncated"] is False
    assert 0 <= body["tokens_cached"] <= body["timings/prompt_n"]  # a context encoded lately is reused
    assert 0 < body["timings/predicted_n"] <= 24 and body["timings/prompt_n"] > 10  # the gap: 3/4 of 32 slots
    assert indent_rule(4)(body["content"]) is None  # n_indent: no later line is indented less than 4
    assert infill(server, {**LLAMA_VIM_FIM, "model": "qwen2.5-coder"}).status_code == 200  # a configured model
    unauthorized = httpx.post(f"{server.url}/infill", json=LLAMA_VIM_FIM, timeout=60)
    assert unauthorized.status_code == 401


def test_infill_streaming(server: Server) -> None:
    body = {**LLAMA_VIM_FIM, "stream": True, "seed": 7, "t_max_predict_ms": 0}
    with httpx.stream("POST", f"{server.url}/infill", json=body, timeout=60,
                      headers={"authorization": f"Bearer {TOKEN}"}) as r:
        chunks = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line]
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    final = chunks[-1]
    assert final["content"] == "" and final["stop_type"] in ("eos", "limit", "word") and "timings" in final
    streamed = "".join(c["content"] for c in chunks)
    plain = infill(server, {**body, "stream": False, "response_fields": None}).json()
    assert streamed == plain["content"] and final["tokens_predicted"] == plain["tokens_predicted"]
    assert any("dcanvas" in c for c in chunks[:-1])  # drafts while it converges
