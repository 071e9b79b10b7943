"""The OpenAI-compatible routes and llama.cpp's /infill in this process: shapes, refusals, the dcanvas/1 security
policy (origin, bearer token, body size, concurrency), and a client that disconnects cancelling its generation in
the engine (real uvicorn sockets), streaming or not."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.engine.core import GenHandle
from canvas.protocol import ServerLimits
from canvas.server.admission import AdmissionConfig
from canvas.server.app import create_app
from canvas.server.config import ServerConfig
from canvas.server.embedded import EmbeddedServer

pytestmark = pytest.mark.timeout(120)
TOKEN = "a-test-token-of-32-characters-xx"
SLOW = {"max_steps": 1024, "entropy_bound": 1e-9}  # a random model never settles: 1024 steps a canvas


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Backend:
    b = load_backend(write_tiny_checkpoint(Path(tmp_path_factory.mktemp("tiny"))), max_batch=4)
    return dataclasses.replace(b, sampler_defaults=dataclasses.replace(b.sampler_defaults, max_steps=3))


Factory = Callable[..., TestClient]


@pytest.fixture
def serve(backend: Backend, tmp_path: Path) -> Iterator[Factory]:
    clients: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        fields: dict[str, Any] = {"db": ":memory:", "port": 8765, "hosts": ("testserver",), "web_dir": str(tmp_path)}
        client = TestClient(create_app(ServerConfig(**{**fields, **overrides}), backend=backend))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def events(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded ([DONE] kept as a string)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# -- shapes -----------------------------------------------------------------------------------------------------


def test_models_and_a_completion_with_usage(serve: Factory) -> None:
    c = serve()
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny-random"]
    assert c.get("/v1/models/tiny-random").json()["id"] == "tiny-random"
    assert c.get("/v1/models/gpt-4").status_code == 404
    r = c.post("/v1/completions", json={"model": "anything", "prompt": "The cat", "max_tokens": 5, "seed": 2}).json()
    assert r["object"] == "text_completion" and r["model"] == "tiny-random"
    (choice,) = r["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length") and choice["logprobs"] is None
    assert r["usage"]["completion_tokens"] <= 5 and r["usage"]["prompt_tokens"] == 3  # <bos> The cat
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
    empty = c.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 0, "n": 2}).json()
    assert [ch["text"] for ch in empty["choices"]] == ["", ""] and empty["usage"]["completion_tokens"] == 0


def test_chat_continues_a_transcript(serve: Factory) -> None:
    c = serve()
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Hello"}]}], "max_tokens": 6, "seed": 4}  # fmt: skip
    r = c.post("/v1/chat/completions", json=body).json()
    assert r["object"] == "chat.completion"
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    transcript = "System: Be brief.\nUser: Hello\nAssistant:"
    assert r["usage"]["prompt_tokens"] == len(c.app.state.hub.backend.tokenizer.encode(transcript).ids) + 1
    stream = events(c.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert stream[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and stream[-1] == "[DONE]"
    chunks = [e for e in stream[1:-1] if "dcanvas" not in e["choices"][0]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(e["object"] == "chat.completion.chunk" for e in stream[:-1])


def test_a_stream_sends_drafts_then_text_then_done(serve: Factory) -> None:
    c = serve()
    body = {"prompt": "The cat", "max_tokens": 40, "seed": 9, "stream": True, "stream_options": {"include_usage": True}}
    stream = events(c.post("/v1/completions", json=body).text)
    assert stream[-1] == "[DONE]" and stream[-2]["choices"] == [] and "usage" in stream[-2]
    drafts = [e["choices"][0]["dcanvas"] for e in stream[:-2] if "dcanvas" in e["choices"][0]]
    assert drafts and {"draft", "step", "max_steps", "canvas"} <= set(drafts[0]) and drafts[0]["max_steps"] == 3
    text = "".join(e["choices"][0]["text"] for e in stream[:-2])
    plain = c.post("/v1/completions", json={**body, "stream": False}).json()
    assert text == plain["choices"][0]["text"]  # same seed: the streamed text is the text
    quiet = events(c.post("/v1/completions", json={**body, "dcanvas": {"draft": False}}).text)
    assert not any("dcanvas" in e["choices"][0] for e in quiet[:-2])


# -- refusals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({"logprobs": 1}, "logprobs"), ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"),
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"frobnicate": 1}, "frobnicate"), ({"n": 99}, "n"),
    ({"max_tokens": 100_000}, "max_tokens"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"temperature": 3}, "temperature"), ({"dcanvas": {"x": 1}}, "dcanvas.x"),
])  # fmt: skip
def test_unsupported_fields_are_refused_with_an_openai_error(serve: Factory, body: dict[str, Any], param: str) -> None:
    r = serve().post("/v1/completions", json={"prompt": "x", **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_neutral_values_of_refused_fields_are_accepted(serve: Factory) -> None:
    c = serve()
    ok = {"prompt": "x", "max_tokens": 2, "logprobs": None, "echo": False, "best_of": 1, "logit_bias": {},
          "top_p": 0.9, "user": "me"}  # fmt: skip
    assert c.post("/v1/completions", json=ok).status_code == 200
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tools": [{"type": "function"}]}
    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert c.post("/v1/chat/completions", json={**chat, "tools": None, "response_format": {"type": "text"}}).is_success


def test_bad_bodies(serve: Factory) -> None:
    c = serve(limits=ServerLimits.tiny())
    assert c.post("/v1/completions", content=b"{not json").status_code == 400
    assert c.post("/v1/completions", json=[1, 2]).status_code == 400
    big = c.post("/v1/completions", json={"prompt": "x" * 5000})
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    r = c.post("/infill", json={"input_prefix": "x" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


# -- security ---------------------------------------------------------------------------------------------------


def test_a_token_is_required_on_every_route_when_the_server_has_one(serve: Factory) -> None:
    c = serve(token=TOKEN)
    body = {"prompt": "x", "max_tokens": 2}
    for auth in ({}, {"authorization": "Bearer wrong-token-of-some-length"}, {"authorization": TOKEN}):
        assert c.get("/v1/models", headers=auth).status_code == 401
        r = c.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/infill", json={"input_prefix": "a"}, headers=auth)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    good = {"authorization": f"Bearer {TOKEN}"}
    assert c.post("/v1/completions", json=body, headers=good).status_code == 200
    assert c.post("/infill", json={"input_prefix": "a", "n_predict": 2}, headers=good).status_code == 200
    assert serve().post("/v1/completions", json=body).status_code == 200  # loopback without a token: open


def test_pages_from_other_origins_are_refused(serve: Factory) -> None:
    c = serve()
    body = {"prompt": "x", "max_tokens": 2}
    assert c.post("/v1/completions", json=body, headers={"origin": "https://evil.example"}).status_code == 403
    assert c.post("/infill", json={}, headers={"origin": "null"}).status_code == 403
    assert c.post("/v1/completions", json=body, headers={"origin": "http://127.0.0.1:8765"}).status_code == 200


def test_http_generations_are_capped(serve: Factory) -> None:
    # Room for 4 engine generations from HTTP. The queue's bound is fixed: sized from the load (the default), it
    # follows the step times the module's shared engine measured in earlier tests, and on a busy machine it may
    # refuse the 4 (HTTP's cap is what this test is about).
    c = serve(max_batch=1, admission=AdmissionConfig(max_queue=8))
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 5})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 4}).status_code == 200
    assert c.get("/health").json()["http_generations"] == {"running": 0, "completed": 1, "cancelled": 0, "failed": 0}


def test_an_end_of_text_suffix_is_a_continuation(serve: Factory) -> None:
    c = serve()
    body = {"prompt": "The cat", "max_tokens": 4, "seed": 1}
    marked = c.post("/v1/completions", json={**body, "suffix": "<|endoftext|>"}).json()
    plain = c.post("/v1/completions", json=body).json()
    assert marked["choices"][0]["text"] == plain["choices"][0]["text"] and marked["usage"] == plain["usage"]


# -- /infill ----------------------------------------------------------------------------------------------------


def test_infill_warm_up_and_refusals(serve: Factory) -> None:
    c = serve()
    warm = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": [{"text": "x = 1\n", "time": 1,
            "filename": "a.py"}], "prompt": "", "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False,
            "cache_prompt": True, "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}  # fmt: skip
    r = c.post("/infill", json=warm)
    assert r.status_code == 200 and r.json() == {}
    assert c.get("/health").json()["http_generations"]["running"] == 0  # nothing was generated
    bad = c.post("/infill", json={"input_prefix": "a", "grammar": "root ::= \"x\""})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert c.post("/infill", json={"input_prefix": "a", "n_predict": 2, "grammar": ""}).status_code == 200


def test_infill_result_shape(serve: Factory) -> None:
    c = serve()
    r = c.post("/infill", json={"input_prefix": "def f(x):\n", "prompt": "    y = ", "input_suffix": "\n    return y\n",
                                "n_predict": 6, "seed": 1})  # fmt: skip
    assert b'"content":"' in r.content  # compact JSON: llama.vim looks for this literally
    body = r.json()
    assert body["stop"] is True and body["stop_type"] in ("eos", "limit", "word") and body["truncated"] is False
    assert body["tokens_predicted"] <= 6 and body["generation_settings"]["n_predict"] == 6
    assert set(body["timings"]) == {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                                    "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


# -- a client that goes away ------------------------------------------------------------------------------------


@pytest.fixture
def recorded(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> list[GenHandle]:
    """Every engine handle submitted while the test runs."""
    handles: list[GenHandle] = []
    submit = backend.engine.submit

    def spy(*args: Any, **kwargs: Any) -> GenHandle:
        handle = submit(*args, **kwargs)
        handles.append(handle)
        return handle

    monkeypatch.setattr(backend.engine, "submit", spy)
    return handles


def wait_cancelled(handles: list[GenHandle], server: EmbeddedServer) -> None:
    assert handles
    for h in handles:
        assert h.wait(30).status == "cancelled"
    deadline = time.monotonic() + 10
    while server.app.state.hub.backend.engine.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server.app.state.hub.backend.engine.busy()


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(backend: Backend,
                                                                     recorded: list[GenHandle]) -> None:
    with EmbeddedServer(backend=backend) as server:
        body = {"prompt": "The cat", "max_tokens": 32, "n": 2, "stream": True, "dcanvas": SLOW}
        with httpx.Client(base_url=server.http_url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # the first draft: the generation is running
        wait_cancelled(recorded, server)
        health = httpx.get(f"{server.http_url}/health").json()["http_generations"]
        assert health["running"] == 0 and health["cancelled"] == 1


def test_a_client_that_disconnects_while_waiting_cancels_its_generation(backend: Backend,
                                                                        recorded: list[GenHandle]) -> None:
    with EmbeddedServer(backend=backend) as server:

        async def give_up() -> None:
            async with httpx.AsyncClient(base_url=server.http_url) as client:
                body = {"input_prefix": "a", "input_suffix": " b", "n_predict": 8, "seed": 1}
                with pytest.raises(httpx.ReadTimeout):
                    await client.post("/infill", json={**body, "samplers": []}, timeout=0.5)

        # /infill takes no sampler settings: make the model's defaults slow for this one request.
        fast = backend.sampler_defaults
        backend.sampler_defaults = dataclasses.replace(fast, **SLOW)
        try:
            asyncio.run(give_up())
        finally:
            backend.sampler_defaults = fast
        wait_cancelled(recorded, server)


def test_infill_time_limit_returns_the_first_draft_past_it(serve: Factory, backend: Backend) -> None:
    c = serve()
    fast = backend.sampler_defaults
    backend.sampler_defaults = dataclasses.replace(fast, **SLOW)
    try:
        body = {"input_prefix": "The cat\n", "input_suffix": "\nThe end.\n", "n_predict": 24, "seed": 5,
                "t_max_predict_ms": 1}
        r = c.post("/infill", json=body).json()
    finally:
        backend.sampler_defaults = fast
    assert r["stop_type"] == "limit" and r["dcanvas"]["end"] == "time"  # no newline waited for
    assert 1 <= r["dcanvas"]["steps"] < 1024  # 1024 steps were allowed; an early draft was taken
    assert c.get("/health").json()["http_generations"]["running"] == 0

