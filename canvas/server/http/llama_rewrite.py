"""Serving llama.vim's instruction mode (`canvas.server.http.llama_instruct`) on `/v1/chat/completions`: the rewrite is
generated as several candidates, each screened (`Screen`), and the first that passes is the answer.

Owns `serve_rewrite` and `NOTE`. The model is not instruction-tuned: it fills the selection's place between the text
around it with the instruction as context, and a fill that copies the lines below the selection is a typical miss.
Invariants: the answer never holds a candidate the screen refused, so no line from outside the selection reaches the
buffer; when every candidate is refused the answer is the selection unchanged, and the reason is in the choice's
`dcanvas` field (which llama.vim ignores; it reads `message.content` or `delta.content` only). The candidates are
`max(n, CANDIDATES)` engine generations of one run (`n` when admission has no room for more), tried in their index order
(choice i runs with seed + i, so a seeded request answers the same). A streamed answer cannot take back text it sent, so
its text goes out once every candidate is done: the role chunk at once, then the chosen text as one `delta.content`
chunk per choice, a last chunk with `finish_reason` and the `dcanvas` field, the usage chunk when asked for,
`data: [DONE]`; there are no draft chunks (a draft of a candidate that is then refused would show text that will not
be the answer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from canvas.server.http.core import ClientGone, HttpApi, Refusal, sse
from canvas.server.http.llama_fields import Deadline
from canvas.server.http.llama_instruct import Edit, Screen
from canvas.server.http.textgen import TextTask, plan
from canvas.server.http.textrun import Event, Finish, GenerationFailed

# Candidates per answer, batched in one run. At llama.vim's temperature (0.1) they differ by a word or two on the
# default model, so a few suffice; where admission has no room for them, only the choices asked for run.
CANDIDATES = 4
NOTE = ("the model is not instruction-tuned: the instruction is read as context before the selection, the selection's "
        "place is filled between the text around it, and a fill that copies text from outside the selection is refused")
# A refusal's first word (`Screen.check`) -> what the fallback says of it.
_FAULTS = {"empty:": "was blank", "too": "was too long", "copies": "copied text from outside the selection",
           "repeats": "copied text from outside the selection"}


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    finish_reason: str  # OpenAI's: "stop" or "length"
    tokens: int  # generated tokens in `text` (0 for the selection unchanged)
    meta: dict[str, Any]  # the choice's `dcanvas` field


def choose(screen: Screen, selection: str, finishes: Sequence[Finish], n: int) -> list[Answer]:
    """The first `n` candidates the screen passes, in index order; the selection unchanged for each one short."""
    refused: list[dict[str, Any]] = []
    answers: list[Answer] = []
    for f in finishes:
        verdict = screen.check(f.text)
        if verdict.reason is not None:
            refused.append({"candidate": f.index, "reason": verdict.reason})
        elif len(answers) < n:
            answers.append(Answer(verdict.text, "length" if f.reason in ("length", "time") else "stop", f.tokens,
                                  {"candidate": f.index}))
    common = {"instruction_tuned": False, "note": NOTE, "candidates": len(finishes), "refused": refused}
    out = [dataclasses.replace(a, meta={**common, **a.meta}) for a in answers]
    if len(out) < n:
        faults = " or ".join(sorted({_FAULTS[r["reason"].split(" ", 1)[0]] for r in refused}))
        who = "every candidate" if not answers else "the other candidates"
        unchanged = {**common, "candidate": None, "fallback": f"unchanged: {who} {faults}" if faults else "unchanged"}
        out += [Answer(selection, "stop", 0, unchanged) for _ in range(n - len(out))]
    return out


async def serve_rewrite(api: HttpApi, request: Request, edit: Edit, task: TextTask, *, stream: bool,
                        include_usage: bool = False, t_max_predict_ms: int = -1) -> Response:
    """Answer `edit` (generated as `task`, its `n` the choices asked for) in the chat shape. Raises Refusal where
    nothing was sent yet; a streamed failure is an error chunk."""
    n = task.n
    candidates = dataclasses.replace(task, n=max(n, min(CANDIDATES, api.limits.max_n)))
    try:  # tokenizing a long prompt is work: off the event loop
        the_plan = await asyncio.to_thread(plan, api.backend, candidates, max_context=api.limits.max_context_tokens)
    except ValueError as e:
        raise Refusal(400, str(e), param="messages") from None
    screen = await asyncio.to_thread(Screen.of, edit)
    rid, created, name = "chatcmpl-" + secrets.token_hex(12), int(time.time()), api.backend.name

    def usage(answers: list[Answer]) -> dict[str, int]:
        completion = sum(a.tokens for a in answers)
        return {"prompt_tokens": the_plan.prompt_tokens, "completion_tokens": completion,
                "total_tokens": the_plan.prompt_tokens + completion}

    if task.max_tokens == 0:  # llama.vim's warm-up: the prompt only
        answers = [Answer("", "length", 0, {"instruction_tuned": False, "note": NOTE}) for _ in range(n)]
        return JSONResponse(_completion(rid, created, name, answers, usage(answers)))
    try:
        run = await api.start(the_plan, candidates, api.owner(request))
    except Refusal as e:  # no room for the extra candidates (admission's bound): the choices asked for only
        if e.status != 429 or candidates.n == n:
            raise
        candidates = task
        run = await api.start(the_plan, task, api.owner(request))
    deadline = Deadline(run, t_max_predict_ms)
    if not stream:
        try:
            finishes = await api.collect(request, run, deadline)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except GenerationFailed as e:
            raise Refusal(e.refusal_status(), f"the generation failed: {e}", kind="server_error",
                          retry_after=1.0 if e.retryable else None) from None
        answers = choose(screen, edit.selection, finishes, n)
        return JSONResponse(_completion(rid, created, name, answers, usage(answers)))

    finished: list[Finish] = []

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": choices, **extra})

    def render(ev: Event) -> list[str]:
        deadline(ev)
        if isinstance(ev, Finish):
            finished.append(ev)
        return []

    def end() -> list[str]:
        answers = choose(screen, edit.selection, sorted(finished, key=lambda f: f.index), n)
        out = []
        for i, a in enumerate(answers):
            if a.text:
                out.append(chunk([{"index": i, "delta": {"content": a.text}, "logprobs": None,
                                   "finish_reason": None}]))
            out.append(chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": a.finish_reason,
                               "dcanvas": a.meta}]))
        if include_usage:
            out.append(chunk([], usage=usage(answers)))
        return [*out, "data: [DONE]\n\n"]

    def failed(message: str) -> list[str]:
        body = {"error": {"message": f"the generation failed: {message}", "type": "server_error", "param": None,
                          "code": None}}
        return [sse(body), "data: [DONE]\n\n"]

    head = [chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(n)])]
    return api.stream(run, render, end, failed, head=head)


def _completion(rid: str, created: int, name: str, answers: list[Answer], usage: dict[str, int]) -> dict[str, Any]:
    choices = [{"index": i, "message": {"role": "assistant", "content": a.text}, "logprobs": None,
                "finish_reason": a.finish_reason, "dcanvas": a.meta} for i, a in enumerate(answers)]
    return {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
            "usage": usage}
