"""llama.cpp server's request fields, shared by `/infill` and the OpenAI-compatible routes (llama.cpp accepts its
`/completion` options on `/v1/completions` and `/v1/chat/completions` too, and the clients built for it send them).

Owns the three sets every llama.cpp field falls in, so that both dialects and docs/openai-llama.md agree:
- honoured (`LlamaFields`): `n_predict` (the token budget, clamped as llama.cpp clamps it; -1: the route's
  default), `seed` (negative, llama.cpp's default -1: random), `t_max_predict_ms` (`Deadline`), `n_indent`,
  `id_slot` (a hint: accepted; there are no slots to pin a request to), and `top_k` / `top_p` / `min_p`, which
  cut the tail of AR mode's next-token distribution as llama.cpp does (the diffusion sampler has no such step);
- ignored by name (`IGNORED`): cache, slot, progress and sampler-chain knobs with no meaning here;
- refused unless absent or neutral (`REFUSED`): what would change what the client gets (grammars, probabilities).
A name in none of the sets is still unknown: the OpenAI routes refuse it (400), `/infill` ignores it, as llama.cpp.
Field list: llama.cpp tools/server/README.md, "POST /completion" options, at commit
00dc8057ab28c9cb4c79a6dd6dfce07fe779f63b.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field

from canvas.server.http.textgen import max_gap
from canvas.server.http.textrun import Draft, Event, TextRun

# Accepted and ignored: each has no counterpart in a diffusion engine that batches every request in one queue.
IGNORED = frozenset({
    "cache_prompt", "n_cache_reuse", "n_keep", "n_discard",  # the engine keeps its own cache of recent contexts
    "samplers", "typical_p", "top_n_sigma", "min_keep", "dynatemp_range", "dynatemp_exponent",  # sampler chain
    "repeat_penalty", "repeat_last_n", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
    "dry_sequence_breakers", "xtc_probability", "xtc_threshold", "mirostat", "mirostat_tau", "mirostat_eta",
    "t_max_prompt_ms",  # the context is encoded in one pass, before the first step
    "response_fields", "return_tokens", "return_progress", "timings_per_token", "post_sampling_probs",
    "sse_ping_interval",  # response decorations of llama.cpp's own shape (OpenAI routes answer in OpenAI's)
    "chat_template_kwargs", "reasoning_format",  # no chat template, no reasoning
})  # fmt: skip

REFUSED = {
    "grammar": "there is no grammar-constrained sampling",
    "json_schema": "there is no schema-constrained sampling",
    "n_probs": "the sampler commits a canvas at once, with no per-token probabilities in order",
    "logit_bias": "the sampler takes no logit bias",
    "lora": "there are no LoRA adapters",
    "n_cmpl": "one completion per prompt (the OpenAI routes take n)",
    "ignore_eos": "the end of the text is the model's to choose",
    "multimodal_data": "text is the only modality",
}


def refused_value(name: str, value: Any) -> bool:
    """Whether `value` of the REFUSED field `name` asks for something (absent, empty, false and 0 do not; nor one
    completion)."""
    if name == "n_cmpl" and value == 1:
        return False
    return value not in (None, False, "", {}, [], 0)


class LlamaFields(BaseModel):
    """The llama.cpp fields an OpenAI route honours or refuses (mixed into its request model)."""

    n_predict: int | None = Field(default=None, ge=-1)  # wins over max_tokens, as in llama.cpp
    top_k: int | None = None  # AR mode's truncation; <= 0 is off, as in llama.cpp
    min_p: float | None = Field(default=None, ge=0, le=1)  # AR mode's truncation
    t_max_predict_ms: int = Field(default=0, ge=0)
    n_indent: int = Field(default=0, ge=0)
    id_slot: int | None = Field(default=None, ge=-1)  # a hint only
    # Refused unless absent or neutral (REFUSED).
    grammar: Any = None
    json_schema: Any = None
    n_probs: Any = None
    lora: Any = None
    n_cmpl: Any = None
    ignore_eos: Any = None
    multimodal_data: Any = None


def without_ignored(data: dict[str, Any]) -> dict[str, Any]:
    """The request body less the IGNORED fields (before strict validation)."""
    return {k: v for k, v in data.items() if k not in IGNORED}


def llama_seed(seed: int | None) -> int | None:
    """llama.cpp's seed: a negative one (its default, -1) draws a random seed."""
    return None if seed is None or seed < 0 else seed


def llama_budget(n_predict: int, *, infill: bool, canvas_length: int, max_canvases: int) -> int:
    """llama.cpp's `n_predict` as a token budget: -1 ("no limit") is the largest gap for an infill and one canvas for
    a continuation; a larger budget than fits is clamped (llama.cpp clamps it to its context), not refused."""
    if n_predict < 0:
        return max_gap(canvas_length) if infill else canvas_length
    return min(n_predict, max_gap(canvas_length) if infill else max_canvases * canvas_length)


class Deadline:
    """`t_max_predict_ms`: once it has passed since a choice's first draft (its prompt is encoded by then), the next
    draft ends that choice, with the text the model has written so far (`TextRun.settle`): of an AR infill's drafts,
    the best-scored one that has reached its end (`draft_ends.deadline_end`), else a draft's written slots (an AR
    row's others still hold noise), cut back to a word boundary where the text goes on. llama.cpp stops only at a
    draft with a newline once time is up, and runs on to `n_predict` without one; here a single-line suggestion never
    holds one (its newline is cut), so waiting for it would run to the token budget, seconds past the limit an editor
    asked for. It ends as llama.cpp's "limit", OpenAI's "length". Feed it every event of the run. `fired`: the
    choices it ended (a text that ends where time ran out, `End` "time", not where the model chose: `endings.trim_tail`
    tidies it)."""

    def __init__(self, run: TextRun, limit_ms: int) -> None:
        self.run, self.limit_s = run, limit_ms / 1000
        self.first: dict[int, float] = {}
        self.fired: set[int] = set()

    def __call__(self, ev: Event) -> None:
        if not isinstance(ev, Draft) or self.limit_s <= 0:
            return
        now = time.monotonic()
        first = self.first.setdefault(ev.index, now)
        if now - first >= self.limit_s:
            self.fired.add(ev.index)
            self.run.settle(ev.index)
