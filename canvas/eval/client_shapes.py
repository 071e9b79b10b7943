"""The requests real clients send, replayed against a server URL for `dcanvas eval --task clients`.

Owns `LineSample` (a half-typed line: a held-out document cut mid-line at a word boundary; the human rest of the
line, removed from the document as not typed yet, is the reference), `line_samples` (seeded, deterministic), the
request bodies of each shape and `send` (one request over HTTP or the websocket, timed, as the client sends it):
- `llama-vim-250` / `llama-vim-1000`: llama.vim's FIM request to `/infill` (autoload/llama.vim at commit
  a1c8e6e40cb45df59b78add5b65d575386832465, `llama#fim` and `s:fim_ctx_local`): `n_prefix` 256 lines before and
  `n_suffix` 64 after, the cursor line's text before the cursor as `prompt`, its rest ("" here) then a newline and
  the lines after as `input_suffix`; `t_max_predict_ms` 250 for the first request at a position and 1000 for the
  later ones; an empty extra-context ring (as right after start-up). The suggestion is `content` without trailing
  empty lines (`s:fim_render`).
- `llama-vim-inst`: its instruction mode on `/v1/chat/completions` (`llama#inst_build`, `llama#inst`,
  `llama#inst_send`): the half-typed line selected, the warm-up with `n_predict` 0, then the streamed edit, read as
  `s:inst_on_response` reads it; the reference is the whole human line.
- `openai-fim`: `/v1/completions` with `prompt` (the text before the cursor) and `suffix`, `max_tokens` 128.
- `ws-gap`: the dcanvas/1 websocket (`canvas.protocol.client`): the text opened as a document, a window move and a
  `ws_gap_tokens` gap at the cursor in one edit, a generation with the model's defaults, the proposal's text in the
  gap; the document is deleted afterwards.
Bodies go out as compact JSON (as Vim's `json_encode` writes them) with the bearer token when one is given. A 429
is tried again once after its Retry-After (the server's admission, not the route, refused it).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from canvas.eval.samples import EvalError

Shape = Literal["llama-vim-250", "llama-vim-1000", "llama-vim-inst", "openai-fim", "ws-gap"]
SHAPES: tuple[Shape, ...] = ("llama-vim-250", "llama-vim-1000", "llama-vim-inst", "openai-fim", "ws-gap")
FIM_SHAPES: tuple[Shape, ...] = ("llama-vim-250", "llama-vim-1000", "openai-fim")  # any llama.cpp server has these
N_PREFIX, N_SUFFIX, N_PREDICT = 256, 64, 128  # llama.vim's defaults (lines, lines, tokens)
FIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
              "tokens_cached"]  # fmt: skip
INST_SYSTEM = ("You are a text-editing assistant. Respond ONLY with the result of applying INSTRUCTION to SELECTION "
               "given the CONTEXT. Maintain the existing text indentation. Do not add extra code blocks. Respond only "
               "with the modified block. If the INSTRUCTION is a question, answer it directly. Do not output any "
               "extra separators. Consider the local context before (PREFIX) and after (SUFFIX) the SELECTION.\n")
INSTRUCTION = "Complete the line."
_WORD_START = re.compile(r"(?<=\s)\S")


@dataclass(frozen=True, slots=True)
class LineSample:
    doc_id: str
    lines_before: tuple[str, ...]  # at most N_PREFIX lines before the cursor's line
    typed: str  # the cursor line up to the cursor
    reference: str  # the human rest of the line (not in any request)
    lines_after: tuple[str, ...]  # at most N_SUFFIX lines after it

    @property
    def input_prefix(self) -> str:
        return "\n".join(self.lines_before) + "\n"  # s:fim_ctx_local: join(lines_prefix, "\n") . "\n"

    @property
    def input_suffix(self) -> str:
        return "\n" + "\n".join(self.lines_after) + "\n"  # the rest of the cursor line is "" (not typed yet)

    @property
    def before(self) -> str:
        """The text before the cursor, as the FIM shapes send it."""
        return self.input_prefix + self.typed

    @property
    def indent(self) -> int:
        return len(self.typed) - len(self.typed.lstrip(" \t"))


def line_samples(docs: Sequence[tuple[str, str]], n: int, seed: int, *, per_doc: int = 2, min_typed: int = 16,
                 min_rest: int = 16, max_rest: int = 160) -> list[LineSample]:  # fmt: skip
    """Up to `n` half-typed lines from `docs`: lines where a word starts at least `min_typed` characters in and
    leaves `min_rest` to `max_rest` characters of the line after it (a long paragraph is cut near its end), at most
    `per_doc` from one document, drawn with `seed`; raises `EvalError` when there is none."""
    found: list[LineSample] = []
    for doc_id, text in docs:
        lines = text.split("\n")
        rng = random.Random(f"{seed}:{doc_id}")
        options = []
        for i, line in enumerate(lines):
            cuts = [m.start() for m in _WORD_START.finditer(line)
                    if m.start() >= min_typed and min_rest <= len(line.rstrip()) - m.start() <= max_rest]  # fmt: skip
            if cuts:
                options.append((i, rng.choice(cuts)))
        for i, cut in sorted(rng.sample(options, min(per_doc, len(options)))):
            line = lines[i]
            found.append(LineSample(doc_id, tuple(lines[max(0, i - N_PREFIX) : i]), line[:cut],
                                    line[cut:].rstrip(), tuple(lines[i + 1 : i + 1 + N_SUFFIX])))  # fmt: skip
    if not found:
        raise EvalError(f"no line of the held-out text has {min_typed}+ characters typed and {min_rest}-{max_rest} "
                        "left")
    random.Random(f"{seed}:lines").shuffle(found)
    return found[:n]


# ---- the bodies ---------------------------------------------------------------------------------------------------
def fim_body(s: LineSample, t_max_predict_ms: int) -> dict[str, Any]:
    """llama#fim's request at the sample's cursor."""
    return {
        "id_slot": 0, "input_prefix": s.input_prefix, "input_suffix": s.input_suffix, "input_extra": [],
        "prompt": s.typed, "n_predict": N_PREDICT, "stop": [], "n_indent": s.indent, "top_k": 40, "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500,
        "t_max_predict_ms": t_max_predict_ms, "response_fields": FIM_FIELDS, "model": "",
    }  # fmt: skip


def inst_messages(s: LineSample, instruction: str) -> list[dict[str, str]]:
    """llama#inst_build with the cursor line (as typed so far) selected and an empty extra-context ring."""
    dashes = "-" * 40
    system = (INST_SYSTEM + "\n" + f"--- CONTEXT     {dashes}\n" + "\n"
              + f"--- PREFIX      {dashes}\n" + "\n".join(s.lines_before) + "\n"
              + f"--- SELECTION   {dashes}\n" + s.typed + "\n"
              + f"--- SUFFIX      {dashes}\n" + "\n".join(s.lines_after) + "\n")  # fmt: skip
    user = f"INSTRUCTION: {instruction}" if instruction else ""
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def inst_bodies(s: LineSample) -> tuple[dict[str, Any], dict[str, Any]]:
    """llama#inst's warm-up (sent while the user types the instruction) and llama#inst_send's edit."""
    warm = {"id_slot": 0, "messages": inst_messages(s, ""), "samplers": [], "n_predict": 0, "stream": False,
            "cache_prompt": True, "response_fields": [""], "model": ""}  # fmt: skip
    edit = {"id_slot": 0, "messages": inst_messages(s, INSTRUCTION), "min_p": 0.1, "temperature": 0.1,
            "samplers": ["min_p", "temperature"], "stream": True, "cache_prompt": True, "model": ""}  # fmt: skip
    return warm, edit


def openai_body(s: LineSample, model: str) -> dict[str, Any]:
    return {"model": model, "prompt": s.before, "suffix": s.input_suffix, "max_tokens": N_PREDICT, "stream": False}


def read_inst_stream(raw: str) -> str:
    """s:inst_on_response over a whole reply: per line, drop "data: ", decode JSON (lines that do not decode are
    skipped), and add choices[0].delta.content (a stream) or choices[0].message.content."""
    out = []
    for line in raw.splitlines():
        line = line[6:] if line.startswith("data: ") else line
        if not line.strip():
            continue
        try:
            choice = (json.loads(line).get("choices") or [{}])[0]
        except (json.JSONDecodeError, AttributeError):
            continue
        part = (choice.get("delta") or {}).get("content") if "delta" in choice else (
            (choice.get("message") or {}).get("content"))  # fmt: skip
        if isinstance(part, str):
            out.append(part)
    return "".join(out)


# ---- sending ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Reply:
    text: str  # the suggestion as the client shows it ("" on error)
    seconds: float  # from sending the request to its whole reply (the warm-up of llama-vim-inst not included)
    error: str = ""  # why there is no suggestion: an HTTP status and its message, a protocol error


class Sender:
    """One server: its base URL, the bearer token, the model name its `/v1/models` gives (for `openai-fim`)."""

    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 120.0, ws_gap_tokens: int = 32):
        if not url.startswith(("http://", "https://")):
            raise EvalError(f"--url must be an http(s) URL, got {url!r}")
        self.url, self.token, self.timeout_s, self.ws_gap_tokens = url.rstrip("/"), token, timeout_s, ws_gap_tokens
        self._model: str | None = None

    def post(self, path: str, body: dict[str, Any]) -> str:
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.token}"}
                                                           if self.token else {})}  # fmt: skip
        for attempt in (0, 1):
            req = urllib.request.Request(self.url + path, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    return str(r.read().decode("utf-8"))
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", "replace")[:300]
                if e.code == 429 and attempt == 0:
                    time.sleep(min(5.0, float(e.headers.get("Retry-After") or 1)))
                    continue
                raise EvalError(f"HTTP {e.code} from {path}: {detail}") from None
        raise AssertionError("unreachable")

    def model(self) -> str:
        if self._model is None:
            try:
                req = urllib.request.Request(self.url + "/v1/models", headers={"Authorization": f"Bearer {self.token}"}
                                             if self.token else {})  # fmt: skip
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    self._model = str(json.loads(r.read())["data"][0]["id"])
            except (OSError, ValueError, KeyError, IndexError, TypeError):
                self._model = ""  # a server without the route: the field is sent empty, as llama.vim sends it
        return self._model

    def send(self, shape: Shape, s: LineSample) -> Reply:
        t0 = time.perf_counter()
        try:
            if shape == "ws-gap":
                return asyncio.run(self._ws_gap(s))
            if shape in ("llama-vim-250", "llama-vim-1000"):
                body = json.loads(self.post("/infill", fim_body(s, 250 if shape == "llama-vim-250" else 1000)))
                content = body.get("content")
                if not isinstance(content, str):
                    raise EvalError(f"/infill answered without a content string: {str(body)[:200]}")
                text = content.rstrip("\n")  # s:fim_render drops trailing empty lines
            elif shape == "llama-vim-inst":
                warm, edit = inst_bodies(s)
                self.post("/v1/chat/completions", warm)
                t0 = time.perf_counter()
                text = read_inst_stream(self.post("/v1/chat/completions", edit))
            else:
                body = json.loads(self.post("/v1/completions", openai_body(s, self.model())))
                text = str(body["choices"][0]["text"])
        except (EvalError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
            return Reply("", time.perf_counter() - t0, str(e) or type(e).__name__)
        return Reply(text, time.perf_counter() - t0)

    async def _ws_gap(self, s: LineSample) -> Reply:
        from canvas.protocol import EditOp, InsertGapOp, MoveWindowOp, ProtocolError
        from canvas.protocol.client import ConnectionLost, DcanvasClient

        ws_url = "ws" + self.url.removeprefix("http") + "/ws"
        before, after = s.before, s.input_suffix
        text = before + after
        try:
            async with DcanvasClient.connect(ws_url, token=self.token, client_name="dcanvas-eval",
                                             request_timeout=self.timeout_s) as c:  # fmt: skip
                length = c.welcome.model.canvas_length if c.welcome is not None else 64
                t0 = time.perf_counter()
                doc = await c.open(text=text)
                try:
                    ops: list[EditOp] = [MoveWindowOp(start=window_start(text, len(before), length)),
                           InsertGapOp(at=len(before), n_tokens=self.ws_gap_tokens)]  # fmt: skip
                    doc = await c.edit(doc.doc_id, doc.v, ops)
                    done = await c.generate(doc.doc_id, doc.v).result()
                    seconds = time.perf_counter() - t0
                    if done.status != "completed" or done.proposal is None:
                        return Reply("", seconds, f"gen.done {done.status}: {done.message or ''}".strip())
                    p = done.proposal
                    new = doc.text[: p.start] + p.text + doc.text[p.end :]
                    if not (new.startswith(before) and new.endswith(after)) or len(new) < len(text):
                        return Reply("", seconds, "the proposal changed text outside the gap")
                    return Reply(new[len(before) : len(new) - len(after)], seconds)
                finally:
                    await c.delete(doc.doc_id)
        except (ProtocolError, ConnectionLost, OSError, TimeoutError) as e:
            return Reply("", 0.0, f"websocket: {e}")


def window_start(text: str, at: int, canvas_length: int) -> int:
    """Where the canvas window starts so that offset `at` is in it with text before it (the TUI's rule): the start
    of its line when that is near, else a word boundary about `canvas_length` characters before it."""
    line_start = text.rfind("\n", 0, at) + 1
    if at - line_start <= canvas_length:
        return line_start
    space = text.rfind(" ", at - canvas_length, at)
    return space + 1 if space >= 0 else at
