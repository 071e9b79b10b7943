"""llama.cpp's extension fields on the OpenAI-compatible routes, and llama.vim's instruction requests read as a rewrite
(canvas.server.http.llama_fields, canvas.server.http.llama_instruct), in this process on the tiny random model: which
fields are honoured, ignored or refused, what budget `n_predict` gives, and the rewrite's layout (gap, prompt, stop)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.server.app import create_app
from canvas.server.config import ServerConfig
from canvas.server.http.llama_fields import IGNORED, REFUSED, llama_budget, without_ignored
from canvas.server.http.llama_instruct import Edit, edit_prompt, find_edit
from canvas.server.http.textgen import max_gap

pytestmark = pytest.mark.timeout(120)
SLOW: dict[str, Any] = {"max_steps": 1024, "entropy_bound": 1e-9}  # a random model never settles: 1024 steps a canvas


def vim_system(prefix: list[str], selection: list[str], suffix: list[str], extra: str = "") -> str:
    """The system message llama.vim's `llama#inst_build` writes (autoload/llama.vim at commit
    a1c8e6e40cb45df59b78add5b65d575386832465): its instructions, then four sections of lines."""
    head = ("You are a text-editing assistant. Respond ONLY with the result of applying INSTRUCTION to SELECTION given "
            "the CONTEXT. Maintain the existing text indentation. Do not add extra code blocks. Respond only with the "
            "modified block. If the INSTRUCTION is a question, answer it directly. Do not output any extra separators. "
            "Consider the local context before (PREFIX) and after (SUFFIX) the SELECTION.\n\n")  # fmt: skip
    dashes = "-" * 40
    return (head + f"--- CONTEXT     {dashes}\n{extra}\n" + f"--- PREFIX      {dashes}\n" + "\n".join(prefix) + "\n"
            + f"--- SELECTION   {dashes}\n" + "\n".join(selection) + "\n" + f"--- SUFFIX      {dashes}\n"
            + "\n".join(suffix) + "\n")  # fmt: skip


PREFIX = ["import math", "", "", "def area(r):"]
SELECTION = ["    y = math.pi * r * r"]
SUFFIX = ["    return y", "", "", "print(area(2.0))"]
SYSTEM = vim_system(PREFIX, SELECTION, SUFFIX)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Backend:
    b = load_backend(write_tiny_checkpoint(Path(tmp_path_factory.mktemp("tiny"))), max_batch=4)
    return dataclasses.replace(b, sampler_defaults=dataclasses.replace(b.sampler_defaults, max_steps=3))


@pytest.fixture
def client(backend: Backend, tmp_path: Path) -> Iterator[TestClient]:
    config = ServerConfig(db=":memory:", port=8765, hosts=("testserver",), web_dir=str(tmp_path))
    with TestClient(create_app(config, backend=backend)) as c:
        yield c


# -- reading llama.vim's instruction shape ------------------------------------------------------------------------


def test_an_instruction_request_is_read_as_an_edit_of_its_selection() -> None:
    edit = find_edit([("system", SYSTEM), ("user", "INSTRUCTION: use r ** 2")])
    assert edit == Edit(instruction="INSTRUCTION: use r ** 2", context="", before="import math\n\n\ndef area(r):\n",
                        selection="    y = math.pi * r * r", after="\n    return y\n\n\nprint(area(2.0))")
    # The document is the text around the gap, as it was in the buffer.
    assert edit.before + edit.selection + edit.after + "\n" == "\n".join(PREFIX + SELECTION + SUFFIX) + "\n"
    assert edit_prompt(edit) == edit.before + "Instruction: use r ** 2\nOriginal:\n" + edit.selection + "\nRewritten:\n"


def test_the_warm_up_and_a_continued_instruction() -> None:
    warm = find_edit([("system", SYSTEM), ("user", "")])
    assert warm is not None and warm.instruction == "" and edit_prompt(warm).startswith(warm.before + "Original:\n")
    # inst_continue: the earlier answer is what the next instruction edits; both instructions stay in the prompt.
    more = find_edit([("system", vim_system(PREFIX, SELECTION, SUFFIX, extra="x = 1")), ("user", "INSTRUCTION: a"),
                      ("assistant", "    y = r ** 2\n"), ("user", "INSTRUCTION: b")])  # fmt: skip
    assert more is not None and more.selection == "    y = r ** 2" and more.context == "x = 1"
    assert edit_prompt(more) == ("x = 1\n\n" + more.before + "Instruction: a\nInstruction: b\nOriginal:\n"
                                 "    y = r ** 2\nRewritten:\n")


def test_other_chats_are_not_edits() -> None:
    assert find_edit([("user", SYSTEM)]) is None  # no system message before the request
    assert find_edit([("system", SYSTEM), ("user", "x"), ("assistant", "y")]) is None  # the last turn is not a user's
    assert find_edit([("system", "Be brief."), ("user", "INSTRUCTION: x")]) is None
    swapped = SYSTEM.replace("--- PREFIX ", "--- X ").replace("--- SELECTION ", "--- PREFIX ").replace("--- X ",
                                                                                                    "--- SELECTION ")
    assert swapped != SYSTEM and find_edit([("system", swapped), ("user", "x")]) is None
    twice = SYSTEM + "--- SUFFIX      " + "-" * 40 + "\n"
    assert find_edit([("system", twice), ("user", "x")]) is None


def test_an_edit_at_the_start_and_end_of_a_file() -> None:
    edit = find_edit([("system", vim_system([], ["a = 1"], [])), ("user", "INSTRUCTION: x")])
    assert edit is not None and edit.before == "" and edit.after == "" and edit.selection == "a = 1"


# -- the fields ---------------------------------------------------------------------------------------------------


def test_n_predict_budgets() -> None:
    L = 32
    assert llama_budget(-1, infill=True, canvas_length=L, max_canvases=16) == max_gap(L)
    assert llama_budget(-1, infill=False, canvas_length=L, max_canvases=16) == L
    assert llama_budget(10**6, infill=True, canvas_length=L, max_canvases=16) == max_gap(L)  # clamped
    assert llama_budget(10**6, infill=False, canvas_length=L, max_canvases=16) == 16 * L
    assert llama_budget(0, infill=False, canvas_length=L, max_canvases=16) == 0
    assert without_ignored({"cache_prompt": True, "samplers": [], "prompt": "x"}) == {"prompt": "x"}
    assert not IGNORED & set(REFUSED)


LLAMA = {"n_predict": 4, "top_k": 40, "top_p": 0.9, "min_p": 0.1, "id_slot": 3, "seed": -1, "n_indent": 0,
         "t_max_predict_ms": 0, "cache_prompt": True, "samplers": ["min_p", "temperature"], "response_fields": [""],
         "t_max_prompt_ms": 500, "typical_p": 1.0, "repeat_penalty": 1.1, "mirostat": 0, "n_keep": 0,
         "dry_multiplier": 0.0, "xtc_probability": 0.0, "return_tokens": False, "timings_per_token": False,
         "grammar": "", "n_probs": 0, "ignore_eos": False}  # fmt: skip


def test_llama_fields_are_accepted_on_both_routes(client: TestClient) -> None:
    for route, base in (("/v1/completions", {"prompt": "The cat"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        r = client.post(route, json={**base, **LLAMA, "max_tokens": 30, "n_predict": 2, "seed": 1})
        assert r.status_code == 200, r.text
        assert 0 < r.json()["usage"]["completion_tokens"] <= 2  # n_predict wins over max_tokens
        alone = client.post(route, json={**base, "max_tokens": 30, "seed": 1}).json()
        assert alone["usage"]["completion_tokens"] > 2  # (max_tokens alone would have given more)
    # A budget past the limit is clamped for n_predict, as llama.cpp does; OpenAI's max_tokens is still refused.
    assert client.post("/v1/completions", json={"prompt": "x", "n_predict": 10**6, "dcanvas": {"max_steps": 1},
                                                "stop": ["a", "e", "i", "o"]}).status_code == 200  # fmt: skip
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6}).status_code == 400


@pytest.mark.parametrize(("body", "param"), [
    ({"mystery": 1}, "mystery"), ({"n_probs": 3}, "n_probs"), ({"grammar": "root ::= \"a\""}, "grammar"),
    ({"json_schema": {"type": "string"}}, "json_schema"), ({"lora": [{"id": 0, "scale": 1}]}, "lora"),
    ({"ignore_eos": True}, "ignore_eos"), ({"n_cmpl": 2}, "n_cmpl"), ({"n_predict": -2}, "n_predict"),
    ({"min_p": 2}, "min_p"), ({"top_k": "many"}, "top_k"), ({"t_max_predict_ms": -1}, "t_max_predict_ms"),
])  # fmt: skip
def test_unknown_and_refused_fields_get_an_openai_error(client: TestClient, body: dict[str, Any],
                                                        param: str) -> None:
    for route, base in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = client.post(route, json={**base, "max_tokens": 2, **body})
        assert r.status_code == 400, (route, body)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_n_indent_and_the_time_limit_on_a_completion(client: TestClient, backend: Backend) -> None:
    body = {"prompt": "def f(x):\n", "suffix": "\n\nprint(f(1))\n", "n_predict": 20, "seed": 5, "n_indent": 4}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert "\n" not in text or all(line.startswith("    ") or not line.strip() for line in text.split("\n")[1:])
    fast = backend.sampler_defaults
    backend.sampler_defaults = dataclasses.replace(fast, **SLOW)
    try:  # 1024 steps a canvas were allowed: the first draft after 1 ms was taken instead
        r = client.post("/v1/completions", json={"prompt": "The cat\n", "suffix": "\nThe end.\n", "n_predict": 20,
                                                 "seed": 5, "t_max_predict_ms": 1}).json()  # fmt: skip
    finally:
        backend.sampler_defaults = fast
    assert r["choices"][0]["finish_reason"] == "length"
    assert client.get("/health").json()["http_generations"]["running"] == 0


# -- the rewrite --------------------------------------------------------------------------------------------------


def chat(client: TestClient, messages: list[dict[str, str]], **fields: Any) -> Any:
    r = client.post("/v1/chat/completions", json={"messages": messages, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_an_instruction_is_served_as_a_rewrite_between_the_text_around_it(client: TestClient,
                                                                            backend: Backend) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "INSTRUCTION: use r ** 2"}]
    warm = chat(client, [messages[0], {"role": "user", "content": ""}], n_predict=0, samplers=[], id_slot=0,
                stream=False, cache_prompt=True, response_fields=[""], model="")
    assert warm["choices"][0]["message"]["content"] == "" and warm["usage"]["completion_tokens"] == 0
    r = chat(client, messages, seed=3, temperature=0.1, min_p=0.1, samplers=["min_p", "temperature"])
    tok = backend.tokenizer
    edit = find_edit([(m["role"], m["content"]) for m in messages])
    assert edit is not None
    # The model read the instruction and the text before (context and pinned), and the head of the text after
    # (pinned after the gap: as much as the canvas has room for).
    before, after = len(tok.encode(edit_prompt(edit)).ids), len(tok.encode(edit.after).ids)
    assert 1 + before < r["usage"]["prompt_tokens"] <= 1 + before + after
    # The fill: at most the default budget, twice the selection's tokens; it keeps its indentation (no lstrip).
    selection = len(tok.encode(edit.selection).ids)
    assert 0 < r["usage"]["completion_tokens"] <= min(2 * selection, max_gap(backend.canvas_length))
    again = chat(client, messages, seed=3, temperature=0.1, stream=False)
    assert again["choices"][0]["message"]["content"] == r["choices"][0]["message"]["content"]


def test_a_selection_too_long_for_a_gap_is_continued_up_to_the_line_after_it(client: TestClient,
                                                                              backend: Backend) -> None:
    long = [f"    y{i} = {i} * r" for i in range(12)]  # far more tokens than the tiny model's 24-slot gap
    messages = [{"role": "system", "content": vim_system(PREFIX, long, SUFFIX)},
                {"role": "user", "content": "INSTRUCTION: x"}]  # fmt: skip
    r = chat(client, messages, seed=1, n_predict=40)
    edit = find_edit([(m["role"], m["content"]) for m in messages])
    assert edit is not None
    # No suffix read: the prompt is the text before the selection only.
    assert r["usage"]["prompt_tokens"] == 1 + len(backend.tokenizer.encode(edit_prompt(edit)).ids)
    assert "\n    return y" not in r["choices"][0]["message"]["content"]  # the stop: the first line after it
    assert r["usage"]["completion_tokens"] <= 40


def test_a_streamed_rewrite_ends_as_llama_cpp_streams_it(client: TestClient) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "INSTRUCTION: use r ** 2"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "stream": True, "seed": 3,
                                                  "temperature": 0.1})  # fmt: skip
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b.removeprefix("data: ") for b in r.text.split("\n\n") if b]
    assert blocks[-1] == "[DONE]"
    chunks = [json.loads(b) for b in blocks[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    plain = chat(client, messages, seed=3, temperature=0.1)
    assert text == plain["choices"][0]["message"]["content"] and text


def test_the_docs_table_names_every_llama_cpp_field() -> None:
    doc = (Path(__file__).resolve().parents[4] / "docs" / "openai-llama.md").read_text()
    section = doc.split("## llama.cpp's fields on the OpenAI routes", 1)[1].split("\n## ", 1)[0]
    honoured = {"n_predict", "seed", "t_max_predict_ms", "n_indent", "id_slot", "top_k", "top_p", "min_p"}
    refused = set(REFUSED) - {"logit_bias"}  # OpenAI's too: its row is in the completions table
    assert [name for name in sorted(IGNORED | refused | honoured) if f"`{name}`" not in section] == []
