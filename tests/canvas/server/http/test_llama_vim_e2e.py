"""End to end: llama.vim's own requests against a real `dcanvas serve` process on the embedded `canvas-6m` model:
its FIM (`/infill`: the extra-context warm-up, then a completion) and its instruction mode
(`/v1/chat/completions`: the warm-up with `n_predict: 0` while the user types, then the streamed edit), read back the
way the plugin reads them; and an unknown field that is neither OpenAI's nor llama.cpp's, still refused.

The bodies are the ones llama.vim builds (autoload/llama.vim at commit a1c8e6e40cb45df59b78add5b65d575386832465:
`s:ring_update`, `llama#fim`, `llama#inst`, `llama#inst_send`, `llama#inst_build`), for the buffer below, written as
data here (the plugin itself is not in this repository). They go out as compact JSON, as Vim's `json_encode` writes
it; only the key order may differ (Vim's dictionaries have none). llama.vim always sets `model` (its check is on the
length of the option's name, not its value) and sends `Authorization: Bearer <api_key>`. The plugin in a headless
vim is not driven here: it cannot be fetched during the tests and is not vendored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from canvas.engine.backend import default_model_dir
from tests.canvas.server.http.test_openai_e2e import TOKEN, Server

pytestmark = pytest.mark.timeout(300)

# The buffer. FIM: the user is typing line 5, "    y = " so far; instruction mode: line 5 is selected.
BUFFER = ["import math", "", "", "def area(r):", "    y = math.pi * r * r", "    return y", "", "",
          "print(area(2.0))"]  # fmt: skip
CHUNK = {"text": "def perimeter(r):\n    return 2 * math.pi * r\n", "time": [1733400000, 123456],
         "filename": "shapes.py"}  # a ring chunk from another buffer; `time` is Vim's reltime()

# s:ring_update: the extra context sent ahead of the next FIM ("no samplers needed here").
RING_WARM_UP = {
    "id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": [CHUNK], "prompt": "", "n_predict": 0,
    "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 1,
    "t_max_predict_ms": 1, "response_fields": [""], "model": "",
}  # fmt: skip
FIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]
# llama#fim with the cursor after "    y = " on line 5 (s:fim_ctx_local; the first request of a position: 250 ms).
FIM = {
    "id_slot": 0, "input_prefix": "import math\n\n\ndef area(r):\n",
    "input_suffix": "\n    return y\n\n\nprint(area(2.0))\n", "input_extra": [CHUNK], "prompt": "    y = ",
    "n_predict": 128, "stop": [], "n_indent": 4, "top_k": 40,
    "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
    "t_max_prompt_ms": 500, "t_max_predict_ms": 250,
    "response_fields": FIM_FIELDS,
    "model": "",
}  # fmt: skip


def inst_messages(instruction: str) -> list[dict[str, str]]:
    """llama#inst_build for line 5 selected (n_prefix 256 and n_suffix 64 lines: the whole buffer), with the ring's
    extra context empty as right after start-up (`join([], "\\n")` is "")."""
    dashes = "-" * 40
    system = ("You are a text-editing assistant. Respond ONLY with the result of applying INSTRUCTION to SELECTION "
              "given the CONTEXT. Maintain the existing text indentation. Do not add extra code blocks. Respond only "
              "with the modified block. If the INSTRUCTION is a question, answer it directly. Do not output any "
              "extra separators. Consider the local context before (PREFIX) and after (SUFFIX) the SELECTION.\n"
              "\n"
              f"--- CONTEXT     {dashes}\n" + "\n"
              + f"--- PREFIX      {dashes}\n" + "\n".join(BUFFER[:4]) + "\n"
              + f"--- SELECTION   {dashes}\n" + "\n".join(BUFFER[4:5]) + "\n"
              + f"--- SUFFIX      {dashes}\n" + "\n".join(BUFFER[5:]) + "\n")  # fmt: skip
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"INSTRUCTION: {instruction}" if instruction else ""}]  # fmt: skip


# llama#inst: the warm-up sent while the user types the instruction; llama#inst_send: the edit itself.
INST_WARM_UP = {"id_slot": 0, "messages": inst_messages(""), "samplers": [], "n_predict": 0, "stream": False,
                "cache_prompt": True, "response_fields": [""], "model": ""}  # fmt: skip
INST = {"id_slot": 0, "messages": inst_messages("use r ** 2"), "min_p": 0.1, "temperature": 0.1,
        "samplers": ["min_p", "temperature"], "stream": True, "cache_prompt": True, "model": ""}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = default_model_dir()
    if model is None:
        pytest.skip("this installation has no embedded default model")
    s = Server(Path(model), tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    """As llama.vim's curl sends it: compact JSON, a JSON content type and the bearer key. A 429 is tried again once
    after its Retry-After: the previous request's generation, ended early (a cut, a time limit), may still hold its
    engine row for a step after its reply, and on a loaded machine admission may allow no wait at all (llama.vim
    itself does not retry; that race is admission's, not these routes')."""
    data = json.dumps(body, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{server.url}{path}", content=data, headers=headers, timeout=120)
    if r.status_code == 429:
        time.sleep(float(r.headers.get("retry-after", "1")))
        r = httpx.post(f"{server.url}{path}", content=data, headers=headers, timeout=120)
    return r


def test_fim_as_llama_vim_sends_it(server: Server) -> None:
    started = time.monotonic()
    assert post(server, "/infill", RING_WARM_UP).status_code == 200
    assert time.monotonic() - started < 10  # n_predict 0: nothing generated
    r = post(server, "/infill", FIM)
    assert r.status_code == 200
    # s:fim_on_response: the raw reply must start with "{" and hold "content":" before it is decoded.
    assert r.text.lstrip().startswith("{") and '"content":"' in r.text
    body = r.json()
    assert set(body) == set(FIM_FIELDS)
    assert isinstance(body["content"], str) and body["content"] and body["timings/predicted_n"] > 0


def read_stream_as_llama_vim(raw: str) -> str:
    """s:inst_on_response: per line, drop "data: ", decode JSON (lines that do not decode are skipped), and add
    choices[0].delta.content (a stream) or choices[0].message.content."""
    content = ""
    for line in raw.split("\n"):
        if len(line) > 5 and line.startswith("data: "):
            line = line[6:]
        if not line.strip():
            continue
        try:
            choice = json.loads(line).get("choices", [{}])[0]
        except (ValueError, IndexError, AttributeError):
            continue
        if "delta" in choice:
            part = choice["delta"].get("content")
        else:
            part = choice.get("message", {}).get("content")
        content += part if isinstance(part, str) else ""
    return content


def test_instruction_mode_as_llama_vim_sends_it(server: Server) -> None:
    started = time.monotonic()
    warm = post(server, "/v1/chat/completions", INST_WARM_UP)
    assert warm.status_code == 200 and warm.json()["choices"][0]["message"]["content"] == ""
    assert time.monotonic() - started < 10  # n_predict 0: the reply comes at once
    r = post(server, "/v1/chat/completions", INST)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.rstrip().endswith("data: [DONE]")
    result = read_stream_as_llama_vim(r.text)
    assert result.strip()
    # s:inst_callback replaces the selected line by the result's lines: the text around it is not in the answer.
    assert "def area(r):" not in result and "print(area(2.0))" not in result and "INSTRUCTION" not in result
    assert server.http()["failed"] == 0


def test_fields_outside_openai_and_llama_cpp_are_still_refused(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {**INST, "stream": False, "frobnicate": True})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "frobnicate" and err["type"] == "invalid_request_error" and "frobnicate" in err["message"]
    assert err["code"] == "unsupported_parameter"
    # llama.cpp's fields on /v1/completions, as llama.cpp-targeting clients send them.
    body = {"prompt": "def area(r):\n", "n_predict": 8, "cache_prompt": True, "id_slot": -1, "top_k": 40,
            "min_p": 0.05, "samplers": ["top_k", "min_p", "temperature"], "seed": -1}  # fmt: skip
    done = post(server, "/v1/completions", body)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] <= 8
