"""llama.cpp's `POST /infill`, as its server defines it, so that editor plugins written for it (llama.vim,
llama.vscode) work unmodified against `dcanvas serve`.

Owns the request model and the response shapes. The text before the gap is the extra context chunks (`input_extra`,
oldest first; their file names are not used), then `input_prefix`, then `prompt` (llama.vim sends the current line
up to the cursor there); `input_suffix` follows the gap. `n_predict` is the token budget (-1: the largest gap; 0:
nothing is generated, as llama.vim's context warm-up requests expect; with no suffix, -1 is one canvas).

Like llama.cpp, unknown fields are ignored, and so are the sampler chain's knobs (`samplers`, penalties, ...; `top_k`,
`top_p` and `min_p` cut the tail of AR mode's next-token distribution) and the slot and cache hints; a field that could
not be ignored without changing what the client gets (`grammar`, `json_schema`, `n_probs`, `logit_bias`, `lora`, ...) is
refused with a 400. Supported: `n_indent` (the text ends at the first later line indented less), `t_max_predict_ms`
(after that long, the next draft ends it: `llama_fields.Deadline`), `stop`, `seed`,
`temperature`, `stream` and `response_fields` (paths such as `timings/prompt_n` become top-level keys, as llama.vim
reads them), and our extension `dcanvas: {mode}` (left out: the model's default mode for an infill). Responses are
compact JSON: llama.vim matches `"content":"` literally. The budget, seed, time limit and refused fields are shared with
the OpenAI routes (`canvas.server.http.llama_fields`). The field table is docs/openai-llama.md.

Where a suggestion ends (`canvas.server.http.endings`, which sets out how it matches llama.cpp's server): besides
llama.cpp's rules (EOS, `stop`, the budget, `n_indent`, `t_max_predict_ms`), a cursor line with text before the
cursor gets the rest of that line only, cut before a repeat of what follows the cursor on it, drafted with a
`<|fim_end|>` allowed from the first token (`ar_min_fill` 0); the first token never breaks the line unless the cursor
is at the start of a line with text after it (`SamplerConfig.ar_first_newline`). An AR row stops as soon as every
draft has reached its end (`draft_ends.early_end`), so such a suggestion costs its line. In AR mode the cursor line's
partial word (or the space typed after its last word) is token-healed by constraint (`endings.typed_lead`): the
prompt ends before it, the drafts write it again first, and `content` is what follows it. At a time limit the answer
is the best-scored draft that has reached its end (`draft_ends.deadline_end`); a whole (not streamed) answer that time
cut where it stood loses the words it cannot end on (`endings.trim_tail`), and one that says nothing
(function words only) or echoes its surroundings (a copy of lines that follow, or of what was just written before
the cursor) is dropped (`endings.sensible`; a repeat of a run of the cursor line's words is cut off first,
`endings.cut_line_echo`); a stream has sent its text by then and keeps it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from canvas.sampling.sampler import Mode
from canvas.server.http.core import ClientGone, HttpApi, Refusal, sse
from canvas.server.http.endings import LeadCut, cut_line_echo, drop_lead, sensible, suggestion_endings, trim_tail
from canvas.server.http.endings import indent_rule as indent_rule  # where it was: the OpenAI routes import it here
from canvas.server.http.llama_fields import REFUSED, Deadline, llama_budget, llama_seed, refused_value
from canvas.server.http.textgen import Plan, TextTask, plan, sampler_config
from canvas.server.http.textrun import Delta, Draft, Event, Finish, GenerationFailed


class ExtraChunk(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str = ""
    filename: str = ""  # not used: the model has no file-separator tokens


class InfillExtension(BaseModel):
    """`dcanvas`: settings of ours that llama.cpp has no field for."""

    model_config = ConfigDict(extra="forbid")
    mode: Mode | None = None  # "diffusion" or "ar"; None: the model's default for an infill (or a continuation)


class InfillRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # llama.cpp ignores what it does not know
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""
    n_predict: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=-1)  # llama.cpp's alias when n_predict is absent
    temperature: float | None = Field(default=None, ge=0)
    top_k: int | None = None  # AR mode's truncation (<= 0: off); diffusion has no such step
    top_p: float | None = Field(default=None, ge=0, le=1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None  # -1: a random seed
    stop: str | list[str] = Field(default_factory=list)
    stream: bool = False
    t_max_predict_ms: int = Field(default=0, ge=0)
    n_indent: int = Field(default=0, ge=0)
    response_fields: list[str] | None = None
    dcanvas: InfillExtension | None = None
    # Refused unless absent or neutral.
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    n_probs: int | None = None
    logit_bias: Any = None
    lora: list[Any] | None = None
    n_cmpl: int | None = None
    ignore_eos: bool | None = None
    multimodal_data: Any = None


def _error(e: Refusal) -> Response:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "unavailable_error",
            500: "server_error"}.get(e.status, "invalid_request_error")
    return JSONResponse({"error": {"code": e.status, "message": e.message, "type": kind}}, status_code=e.status,
                        headers=e.headers())


def _parse(data: dict[str, Any]) -> InfillRequest:
    try:
        req = InfillRequest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise Refusal(400, f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from None
    for name, reason in REFUSED.items():
        if refused_value(name, getattr(req, name)):
            raise Refusal(400, f"`{name}` is not supported by this server: {reason}")
    return req


def _task(api: HttpApi, req: InfillRequest) -> tuple[TextTask, str]:
    """The text task of a request, and the lead its answer starts with (`endings.typed_lead`; "" for none)."""
    extra = "".join(c.text if c.text.endswith("\n") or not c.text else c.text + "\n" for c in req.input_extra)
    before = extra + req.input_prefix + req.prompt
    api.check_text(before, req.input_suffix)
    infill = bool(req.input_suffix)
    asked = req.n_predict if req.n_predict is not None else req.max_tokens
    budget = llama_budget(-1 if asked is None else asked, infill=infill,
                          canvas_length=api.backend.canvas_length, max_canvases=api.limits.max_canvases)
    try:
        mode = api.backend.mode_for(req.dcanvas.mode if req.dcanvas else None, "infill" if infill else "continuation")
        config = sampler_config(api.backend.sampler_defaults, temperature=req.temperature, mode=mode,
                                top_k=req.top_k, top_p=req.top_p, min_p=req.min_p)
    except ValueError as e:
        raise Refusal(400, str(e)) from None
    seed = llama_seed(req.seed)
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    ends = suggestion_endings(before, req.input_suffix, config, n_indent=req.n_indent,
                              one_gap=infill or budget <= api.backend.canvas_length, heal=True)
    prompt = before[: len(before) - len(ends.lead)]
    return TextTask(prompt, req.input_suffix or None, budget, ends.config, seed, 1, tuple(s for s in stops if s),
                    ends.cut, ends.join), ends.lead


def _stop_type(f: Finish) -> str:
    """llama.cpp's `stop_type`: "eos" (the model ended the text), "word" (a stop sequence), "limit" (the budget,
    `n_indent` or `t_max_predict_ms`)."""
    return {"eos": "eos", "word": "word", "length": "limit", "rule": "limit", "time": "limit"}.get(f.reason, "none")


def _prompt_tokens(p: Plan, f: Finish) -> tuple[int, int]:
    """(the prompt's tokens, those encoded): an AR infill drafted from a FIM prompt reads that prompt, and encodes
    what the engine's cache did not restore of it (llama.cpp's `tokens_evaluated` and `prompt_n`); any other
    generation reads the context and pinned text (`Plan.prompt_tokens`), counted whole as before."""
    if f.fim_tokens:
        return f.fim_tokens, max(0, f.fim_tokens - f.cached_tokens)
    return p.prompt_tokens, p.prompt_tokens


def _timings(p: Plan, f: Finish) -> dict[str, float | int]:
    """llama.cpp's `timings`. For an AR infill drafted from a FIM prompt, `prompt_n` and `prompt_ms` are that prompt's
    tokens encoded (less those the cache restored, `tokens_cached`) and its prefill's time, as the engine timed it;
    otherwise the context's (`Finish.prompt_s`: its encoding, near 0 when a kept cache was reused, and, for an AR
    infill, the prefill of its pinned text up to the drafts' first step). `predicted_ms` is the rest of the
    generation: the drafting, and the choice among the drafts (with the plain context a FIM infill encodes only
    then). The wait in the queue is in neither figure."""
    prompt_ms, predicted_ms = f.prompt_s * 1000, max(0.0, f.wall_s - f.prefill_s) * 1000
    prompt_n = _prompt_tokens(p, f)[1]
    return {
        "prompt_n": prompt_n,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(prompt_ms / max(prompt_n, 1), 3),
        "prompt_per_second": round(prompt_n / prompt_ms * 1000, 3) if prompt_ms > 0 else 0.0,
        "predicted_n": f.tokens,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(predicted_ms / max(f.tokens, 1), 3),
        "predicted_per_second": round(f.tokens / predicted_ms * 1000, 3) if predicted_ms > 0 else 0.0,
    }


def _result(api: HttpApi, req: InfillRequest, task: TextTask, p: Plan, f: Finish, lead: str = "", *,
            timed_out: bool = False) -> dict[str, Any]:
    """The final object: llama.cpp's completion result (content, stop_type, timings, ...); `content` is the text
    after `lead` (`endings.drop_lead`), less the words a text ended by the time limit (`timed_out`) cannot end on
    (`endings.trim_tail`), and nothing where it is not worth showing (`endings.sensible`: function words only, a
    copy of lines that follow or of what was just written before the cursor)."""
    content = drop_lead(f.text, lead)
    if timed_out and f.reason == "time":  # cut where time found it (a whole draft taken at the deadline is kept)
        content = trim_tail(content)
    content = cut_line_echo(content, req.input_prefix + req.prompt)  # its repeat of the cursor line goes
    if not sensible(content, req.input_prefix + req.prompt, req.input_suffix):
        content = ""  # function words only, or an echo: accepted, it would say nothing or say something twice
    cfg = task.config
    settings = {"n_predict": task.max_tokens, "temperature": cfg.t_max, "seed": task.seed if task.seed is not None
                else -1, "stop": list(task.stop), "n_indent": req.n_indent, "t_max_predict_ms": req.t_max_predict_ms,
                "stream": req.stream, "max_steps": cfg.max_steps, "entropy_bound": cfg.entropy_bound, "mode": cfg.mode,
                "gap_min_fill": p.request.config.gap_min_fill}  # fmt: skip
    return {
        "index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": True, "model": api.backend.name,
        "tokens_predicted": f.tokens, "tokens_evaluated": _prompt_tokens(p, f)[0], "generation_settings": settings,
        "prompt": "", "has_new_line": "\n" in content, "truncated": p.truncated, "stop_type": _stop_type(f),
        "stopping_word": f.stop_word or "", "tokens_cached": f.cached_tokens, "timings": _timings(p, f),
        # An extension: the steps it took, and why it ended (`textgen.End`: "time" is a `t_max_predict_ms` end).
        "dcanvas": {"steps": f.steps, "end": f.reason},
    }  # fmt: skip


def project(result: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """llama.cpp's `response_fields`: each path (`timings/prompt_n`) becomes a top-level key named by the path;
    missing paths are left out."""
    out: dict[str, Any] = {}
    for path in fields:
        node: Any = result
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out


def infill_routes(api: HttpApi) -> list[BaseRoute]:
    async def infill(request: Request) -> Response:
        try:
            req = _parse(await api.read_json(request))
            task, lead = _task(api, req)
            try:  # tokenizing a long prompt is work: off the event loop
                the_plan = await asyncio.to_thread(plan, api.backend, task, max_context=api.limits.max_context_tokens)
            except ValueError as e:
                raise Refusal(400, str(e)) from None
            if task.max_tokens == 0:  # a warm-up: nothing to generate
                body = _result(api, req, task, the_plan, Finish(0, "length", "", 0, None, 0, 0.0, 0.0))
                return JSONResponse(project(body, req.response_fields) if req.response_fields else body)
            run = await api.start(the_plan, task, api.owner(request))
        except Refusal as e:
            return _error(e)
        deadline = Deadline(run, req.t_max_predict_ms)
        if not req.stream:
            try:
                (done,) = await api.collect(request, run, deadline)
            except ClientGone:
                return Response(status_code=499)  # nobody reads it
            except GenerationFailed as e:
                return _error(Refusal(e.refusal_status(), f"the generation failed: {e}",
                                      retry_after=1.0 if e.retryable else None))
            body = _result(api, req, task, the_plan, done, lead, timed_out=done.index in deadline.fired)
            return JSONResponse(project(body, req.response_fields) if req.response_fields else body)

        cut_lead = LeadCut(lead)

        def render(ev: Event) -> list[str]:
            deadline(ev)
            base = {"index": 0, "tokens": [], "stop": False, "id_slot": 0, "tokens_evaluated": the_plan.prompt_tokens}
            if isinstance(ev, Delta):
                return [sse({**base, "content": cut_lead(ev.text)})]
            if isinstance(ev, Draft):
                info = {"draft": ev.text, "step": ev.step, "max_steps": ev.max_steps, "canvas": ev.canvas}
                return [sse({**base, "content": "", "dcanvas": info})]
            return [sse({**_result(api, req, task, the_plan, ev, lead), "content": ""})]

        def failed(message: str) -> list[str]:
            return [sse({"error": {"code": 500, "message": f"the generation failed: {message}",
                                   "type": "server_error"}})]

        return api.stream(run, render, list, failed)

    return [Route("/infill", infill, methods=["POST"])]
