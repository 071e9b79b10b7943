"""The OpenAI-compatible routes: `POST /v1/completions` (with `suffix`: fill-in-the-middle), `POST /v1/chat/completions`
(plain chat-style continuation), `GET /v1/models`.

Owns the request models (pydantic, at the wire only) and the response and chunk shapes. The field-by-field support
table is docs/openai-llama.md; in short, a field is either supported, ignored (a sampling hint the entropy-bound
sampler has no counterpart for; the response's shape does not depend on it) or refused with a 400 and an OpenAI error
object (the response would have to contain or honour something a diffusion canvas cannot give: `logprobs`, `echo`,
`logit_bias`, tools, ...). An unknown field is refused, as OpenAI refuses it.

Streaming sends `data: {...}` chunks and `data: [DONE]`. Diffusion has no token order, so a chunk's text is only
text that has become final (a committed canvas); between commits, chunks with empty text carry the extension field
`dcanvas: {draft, step, max_steps, canvas}` on the choice (turn it off with `"dcanvas": {"draft": false}`).
The request's own extension object `dcanvas` also takes `max_steps`, `entropy_bound` and `mode` (left out: the
model's default mode for an infill, with a suffix, or for a continuation).

llama.cpp's server takes its own fields on these routes, and its clients send them: they are honoured, ignored by
name or refused as `canvas.server.http.llama_fields` says (an unknown name is still refused). A chat request in
llama.vim's instruction shape (`canvas.server.http.llama_instruct`) is a rewrite: its answer is the new selection,
filled between the text before and after it, with the instruction and the selection before that text; when the
selection is too long for one canvas's gap, or nothing follows it, the text before it is continued instead. Its
candidates are screened and answered by `canvas.server.http.llama_rewrite` (nothing copied from outside the selection).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from canvas.sampling.sampler import Mode
from canvas.server.http.core import ClientGone, HttpApi, Refusal, sse
from canvas.server.http.endings import suggestion_endings
from canvas.server.http.llama_fields import (
    REFUSED,
    Deadline,
    LlamaFields,
    llama_budget,
    llama_seed,
    refused_value,
    without_ignored,
)
from canvas.server.http.llama_infill import indent_rule
from canvas.server.http.llama_instruct import Edit, edit_prompt, find_edit
from canvas.server.http.llama_rewrite import serve_rewrite
from canvas.server.http.textgen import TextTask, max_gap, plan, sampler_config
from canvas.server.http.textrun import Delta, Draft, Event, Finish, GenerationFailed

_DONE = "data: [DONE]\n\n"
_CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
# A new turn ends where the transcript would go on with someone else's line.
_CHAT_STOPS = ("\nUser:", "\nSystem:")
_END_OF_TEXT = "<|endoftext|>"
# A rewrite's budget when the request sets none: room for the selection to double (an edit rarely grows more),
# never under `_REWRITE_MIN` (an empty or one-word selection); the fill may be shorter (nulls), never longer.
_REWRITE_GROWTH = 2
_REWRITE_MIN = 16
# A selection of more characters than this per gap slot is too long for a gap whatever its tokens: only that much of
# it is tokenized (a selection can be a whole file).
_CHARS_PER_SLOT = 64


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Extension(_Wire):
    """`dcanvas`: settings of ours that the OpenAI API has no field for."""

    max_steps: int | None = Field(default=None, ge=1, le=1024)  # denoising steps per canvas (default: the model's)
    entropy_bound: float | None = Field(default=None, gt=0, le=1e6)  # higher: more slots accepted per step
    draft: bool = True  # streamed chunks between commits carry the current draft
    mode: Mode | None = None  # "diffusion" or "ar"; None: the model's default for an infill (suffix) or continuation


class StreamOptions(_Wire):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: nothing here to pad


class _Common(_Wire, LlamaFields):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None  # ignored: one model is served; responses name it
    temperature: float | None = Field(default=None, ge=0, le=2)
    seed: int | None = None  # negative (llama.cpp's -1): a random seed
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    dcanvas: Extension | None = None
    # AR mode cuts the next-token tail by it (with llama.cpp's top_k and min_p); diffusion has no such step.
    top_p: float | None = Field(default=None, ge=0, le=1)
    # Ignored: penalties the entropy-bound sampler has no counterpart for.
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None
    # Refused unless absent or neutral (see `_refuse`).
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]
    suffix: str | None = None
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients echo back fields of earlier replies (refusal, annotations)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None  # ignored: no tools
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: str | None = None  # ignored
    service_tier: str | None = None  # ignored
    store: bool | None = None  # ignored
    metadata: dict[str, str] | None = None  # ignored


# -- refusals ----------------------------------------------------------------------------------------------------


def _error(e: Refusal) -> Response:
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=e.headers())


def _parse(model: type[_Common], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(without_ignored(data))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise Refusal(400, f"Unrecognized request argument supplied: {loc}", param=loc,
                          code="unsupported_parameter") from None
        raise Refusal(400, f"{loc}: {err['msg']}", param=loc or None) from None


def _refuse(req: _Common) -> None:
    """The fields a diffusion canvas cannot honour: a 400 naming the field, unless it is absent or neutral."""
    why = {
        "logprobs": "the sampler commits a canvas at once, with no per-token probabilities in order",
        "top_logprobs": "the sampler commits a canvas at once, with no per-token probabilities in order",
        "echo": "the prompt is not echoed",
        "best_of": "there is no ranking of choices (use n)",
        "logit_bias": "the sampler takes no logit bias",
        "tools": "there is no tool calling", "tool_choice": "there is no tool calling",
        "functions": "there is no function calling", "function_call": "there is no function calling",
        "response_format": "there is no constrained output (text only)",
        "modalities": "text is the only modality", "audio": "text is the only modality",
        "prediction": "predicted outputs are not supported",
        "web_search_options": "there is no web search",
    }
    for name, reason in why.items():
        value = getattr(req, name, None)
        neutral = (
            value is None or value is False or value in ({}, []) or (name == "best_of" and value in (1, req.n))
            or (name == "response_format" and value == {"type": "text"}) or (name == "modalities" and value == ["text"])
            or (name == "tool_choice" and value == "none")
        )
        if not neutral:
            raise Refusal(400, f"`{name}` is not supported by this server: {reason}", param=name,
                          code="unsupported_parameter")
    for name, reason in REFUSED.items():  # llama.cpp's
        if name not in why and refused_value(name, getattr(req, name)):
            raise Refusal(400, f"`{name}` is not supported by this server: {reason}", param=name,
                          code="unsupported_parameter")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4 or any(not s for s in stops):
        raise Refusal(400, "stop: at most 4 sequences, none empty", param="stop")
    return stops


def _task(api: HttpApi, req: _Common, prompt: str, suffix: str | None, max_tokens: int,
          extra_stops: tuple[str, ...] = ()) -> TextTask:
    if req.n > api.limits.max_n:
        raise Refusal(400, f"n: at most {api.limits.max_n} choices", param="n")
    L = api.backend.canvas_length
    infill = bool(suffix)
    limit = L * (1 if infill else api.limits.max_canvases)
    if max_tokens > limit:
        what = "an infill (one canvas)" if infill else f"{api.limits.max_canvases} canvases of {L}"
        raise Refusal(400, f"max_tokens: at most {limit} for {what}", param="max_tokens")
    ext = req.dcanvas or Extension()
    api.check_text(prompt, suffix)
    try:
        config = sampler_config(api.backend.sampler_defaults, temperature=req.temperature, max_steps=ext.max_steps,
                                entropy_bound=ext.entropy_bound, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                                mode=api.backend.mode_for(ext.mode, "infill" if infill else "continuation"))
    except ValueError as e:
        raise Refusal(400, str(e)) from None
    if infill:  # an editor's FIM request: it ends where the text after it takes over, as /infill's do
        ends = suggestion_endings(prompt, suffix or "", config, n_indent=req.n_indent)
        return TextTask(prompt, suffix, max_tokens, ends.config, llama_seed(req.seed), req.n,
                        _stops(req.stop) + extra_stops, ends.cut, ends.join)
    cut = indent_rule(req.n_indent) if req.n_indent > 0 else None
    return TextTask(prompt, suffix, max_tokens, config, llama_seed(req.seed), req.n, _stops(req.stop) + extra_stops,
                    cut)


def _edit_task(api: HttpApi, req: ChatRequest, edit: Edit) -> TextTask:
    """llama.vim's edit as a rewrite: the gap between the text before and after the selection, when the selection
    fits one gap and text follows it; else the text before it continued, up to the first line after it."""
    L, tok = api.backend.canvas_length, api.backend.tokenizer
    longest = max_gap(L)
    clipped = edit.selection[: _CHARS_PER_SLOT * longest]  # enough to tell "too long" without tokenizing it all
    selection = len(tok.encode(clipped).ids) if clipped else 0
    infill = bool(edit.after) and selection <= longest and len(clipped) == len(edit.selection)
    asked = req.n_predict if req.n_predict is not None else _chat_budget(req)
    ceiling = longest if infill else L * api.limits.max_canvases
    budget = min(max(_REWRITE_GROWTH * selection, _REWRITE_MIN) if asked is None or asked < 0 else asked, ceiling)
    prompt = edit_prompt(edit)
    if infill:
        return _task(api, req, prompt, edit.after, budget)
    first_line = next((line for line in edit.after.split("\n") if line.strip()), None)
    ends = ("\n" + first_line,) if first_line is not None and len(_stops(req.stop)) < 4 else ()
    return _task(api, req, prompt, None, budget, extra_stops=ends)


def _chat_budget(req: ChatRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def _finish_reason(f: Finish) -> str:
    """OpenAI's two reasons: the text ended on its own (or at a stop sequence), or at the budget."""
    return "length" if f.reason in ("length", "time") else "stop"


def _usage(prompt_tokens: int, finishes: list[Finish]) -> dict[str, int]:
    completion = sum(f.tokens for f in finishes)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


# -- the routes ----------------------------------------------------------------------------------------------------


def openai_routes(api: HttpApi) -> list[BaseRoute]:
    created = int(time.time())

    def model_card() -> dict[str, Any]:
        return {"id": api.backend.name, "object": "model", "created": created, "owned_by": "dcanvas"}

    async def models(request: Request) -> Response:
        try:
            api.check_caller(request)
        except Refusal as e:
            return _error(e)
        if "model" in request.path_params and request.path_params["model"] != api.backend.name:
            return _error(Refusal(404, f"The model '{request.path_params['model']}' does not exist",
                                  param="model", code="model_not_found"))
        if "model" in request.path_params:
            return JSONResponse(model_card())
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def completions(request: Request) -> Response:
        try:
            req: CompletionRequest = _parse(CompletionRequest, await api.read_json(request))
            _refuse(req)
            if isinstance(req.prompt, list) and len(req.prompt) != 1:
                raise Refusal(400, "prompt: one prompt per request (send a string)", param="prompt")
            prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
            # Some FIM clients send an end-of-text marker as the suffix when nothing follows the cursor.
            suffix = None if req.suffix in (None, "", _END_OF_TEXT) else req.suffix
            if req.n_predict is not None:
                max_tokens = llama_budget(req.n_predict, infill=bool(suffix), canvas_length=api.backend.canvas_length,
                                          max_canvases=api.limits.max_canvases)
            else:
                max_tokens = 16 if req.max_tokens is None else req.max_tokens
            task = _task(api, req, prompt, suffix, max_tokens)
        except Refusal as e:
            return _error(e)
        return await _serve(api, request, req, task, chat=False, fresh_turn=False)

    async def chat(request: Request) -> Response:
        try:
            req: ChatRequest = _parse(ChatRequest, await api.read_json(request))
            _refuse(req)
            edit = find_edit([(m.role, m.text) for m in req.messages])
            if edit is not None:  # tokenizing the selection is work: off the event loop
                task = await asyncio.to_thread(_edit_task, api, req, edit)
                usage = req.stream_options is not None and req.stream_options.include_usage
                return await serve_rewrite(api, request, edit, task, stream=bool(req.stream), include_usage=usage,
                                           t_max_predict_ms=req.t_max_predict_ms)
            last = req.messages[-1]
            lines = [f"{_CHAT_ROLES[m.role]}: {m.text}" for m in req.messages]
            # A last assistant message is a reply to continue; otherwise the assistant's turn starts.
            prompt = "\n".join(lines) if last.role == "assistant" else "\n".join([*lines, "Assistant:"])
            L = api.backend.canvas_length
            if req.n_predict is not None:
                max_tokens = llama_budget(req.n_predict, infill=False, canvas_length=L,
                                          max_canvases=api.limits.max_canvases)
            else:
                budget = _chat_budget(req)
                max_tokens = budget if budget is not None else L
            task = _task(api, req, prompt, None, max_tokens, extra_stops=_CHAT_STOPS)
        except Refusal as e:
            return _error(e)
        return await _serve(api, request, req, task, chat=True, fresh_turn=last.role != "assistant")

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ]


async def _serve(api: HttpApi, request: Request, req: _Common, task: TextTask, *, chat: bool,
                 fresh_turn: bool) -> Response:
    """Run `task` and answer in the completions or the chat shape, streaming or not. `fresh_turn`: the text starts a
    new chat turn (the space the model writes after "Assistant:" is dropped)."""
    try:  # tokenizing a long prompt is work: off the event loop
        the_plan = await asyncio.to_thread(plan, api.backend, task, max_context=api.limits.max_context_tokens)
    except ValueError as e:
        return _error(Refusal(400, str(e), param="prompt"))
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    created, name = int(time.time()), api.backend.name
    kind = "chat.completion" if chat else "text_completion"
    if task.max_tokens == 0:  # the prompt only, as OpenAI answers it
        empty = [Finish(i, "length", "", 0, None, 0, 0.0, 0.0) for i in range(task.n)]
        return JSONResponse(_final(rid, created, name, kind, empty, the_plan.prompt_tokens, fresh_turn))
    try:
        run = await api.start(the_plan, task, api.owner(request))
    except Refusal as e:
        return _error(e)
    deadline = Deadline(run, req.t_max_predict_ms)
    timed = req.t_max_predict_ms > 0  # only then does the deadline read drafts
    if not req.stream:
        try:
            done = await api.collect(request, run, deadline, drafts=timed)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except GenerationFailed as e:
            return _error(Refusal(e.refusal_status(), f"the generation failed: {e}", kind="server_error",
                                  retry_after=1.0 if e.retryable else None))
        return JSONResponse(_final(rid, created, name, kind, done, the_plan.prompt_tokens, fresh_turn))

    chunk_kind = "chat.completion.chunk" if chat else "text_completion"
    want_draft = req.dcanvas is None or req.dcanvas.draft
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    started = [not fresh_turn] * task.n  # a new chat turn drops the space the model writes after "Assistant:"
    finishes: list[Finish] = []

    def chunk(index: int, text: str | None, finish: str | None = None, extra: dict[str, Any] | None = None) -> str:
        if chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        if extra:
            choice["dcanvas"] = extra
        return sse({"id": rid, "object": chunk_kind, "created": created, "model": name, "choices": [choice]})

    def render(ev: Event) -> list[str]:
        deadline(ev)
        if isinstance(ev, Delta):
            text = ev.text
            if not started[ev.index]:
                text = text.lstrip()
                started[ev.index] = bool(text)
            return [chunk(ev.index, text)] if text else []
        if isinstance(ev, Draft):
            if not want_draft:
                return []
            draft = ev.text.lstrip() if fresh_turn else ev.text
            info = {"draft": draft, "step": ev.step, "max_steps": ev.max_steps, "canvas": ev.canvas}
            return [chunk(ev.index, None if chat else "", extra=info)]
        finishes.append(ev)
        return [chunk(ev.index, None if chat else "", finish=_finish_reason(ev))]

    def end() -> list[str]:
        out = []
        if include_usage:
            out.append(sse({"id": rid, "object": chunk_kind, "created": created, "model": name, "choices": [],
                            "usage": _usage(the_plan.prompt_tokens, finishes)}))
        return [*out, _DONE]

    def failed(message: str) -> list[str]:
        body = {"error": {"message": f"the generation failed: {message}", "type": "server_error", "param": None,
                          "code": None}}
        return [sse(body), _DONE]

    head = []
    if chat:  # the first chunk of a chat stream gives the role
        head.append(sse({"id": rid, "object": chunk_kind, "created": created, "model": name,
                         "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None} for i in range(task.n)]}))
    return api.stream(run, render, end, failed, head=head, drafts=want_draft or timed)


def _final(rid: str, created: int, name: str, kind: str, finishes: list[Finish], prompt_tokens: int,
           fresh_turn: bool) -> dict[str, Any]:
    if kind == "chat.completion":
        choices: list[dict[str, Any]] = [
            {"index": f.index, "message": {"role": "assistant", "content": f.text.lstrip() if fresh_turn else f.text},
             "logprobs": None, "finish_reason": _finish_reason(f)}
            for f in finishes
        ]
    else:
        choices = [{"index": f.index, "text": f.text, "logprobs": None, "finish_reason": _finish_reason(f)}
                   for f in finishes]
    return {"id": rid, "object": kind, "created": created, "model": name, "choices": choices,
            "usage": _usage(prompt_tokens, finishes)}
