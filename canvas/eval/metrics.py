"""The metrics of `dcanvas eval`: one record per generated canvas, pooled into one point per task and variant, and
the targets they are read against.

`Record` holds a canvas's judge scores (`SpanScore`: the fill, and for an infill the seam after it) beside the human
text's; `pool` sums NLL over samples before exponentiating (a long sample weighs more than a short one, as in a
perplexity of the concatenation), so a ratio is exp(mean NLL model) / exp(mean NLL human) over the same tasks.
Repetition is the share of repeated 4-grams of model tokens; the human text's is measured the same way on its own
tokens. Targets (issue 29): fill ratio within `FILL_RANGE`, seam ratio at most `SEAM_MAX`, repetition within
`REPEAT_POINTS` of the human text's, and the speed bounds of `speed_bound`; a fill ratio under the range's floor
with more repetition than the human text is degenerate (low perplexity bought with loops), never better than human.
Joins (`join_faults`): what a reader sees at an infill's two edges that a judge's perplexity barely weighs (one odd
token among dozens), counted beside the human text's faults at the same places: "night.The" (a word glued to
punctuation), "night. and" (a lowercase sentence start) and doubled spaces.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from canvas.eval.judge import SpanScore, perplexity
from canvas.eval.samples import CONTINUATION, EvalError
from canvas.sampling.sampler import Mode

# The `SamplerConfig` fields of the AR infill an eval can vary, each a dimension of the AR variants.
AR_SETTINGS = ("ar_drafts", "ar_seam_tokens", "ar_temperature", "fim", "ar_smc_every", "ar_min_p")
_SHORT = {"ar_drafts": "K", "ar_seam_tokens": "S", "ar_temperature": "t", "fim": "fim", "ar_smc_every": "smc",
          "ar_min_p": "minp"}
FILL_RANGE = (0.8, 1.5)
SEAM_MAX = 1.8
REPEAT_POINTS = 0.05  # 5 points of the share of repeated 4-grams
# Seconds per infill at which editing stays interactive, for a 32- and a 64-token gap (issue 29, on 2 cores).
INFILL_SECONDS = ((32, 2.0), (64, 3.5))


def speed_bound(task: str, scale: float = 1.0) -> float | None:
    """The most seconds per canvas `task` may take (None: no bound, as for a continuation); gaps between and past
    the two measured sizes get the next size's bound, scaled by the gap past the largest."""
    if task == CONTINUATION:
        return None
    gap = int(task.removeprefix("infill-"))
    for size, seconds in INFILL_SECONDS:
        if gap <= size:
            return seconds * scale
    size, seconds = INFILL_SECONDS[-1]
    return seconds * gap / size * scale


def is_degenerate(fill_ratio: float, repeat: float, repeat_human: float) -> bool:
    return bool(fill_ratio < FILL_RANGE[0] and repeat > repeat_human)


@dataclass(frozen=True, slots=True)
class Variant:
    """A mode and the AR settings it runs with (None: the model's own)."""

    mode: Mode
    ar_drafts: int | None = None
    ar_seam_tokens: int | None = None
    ar_temperature: float | None = None
    fim: bool | None = None
    ar_smc_every: int | None = None
    ar_min_p: float | None = None

    def settings(self) -> dict[str, Any]:
        return {k: v for k in AR_SETTINGS if (v := getattr(self, k)) is not None}

    @classmethod
    def of(cls, row: Any) -> Variant:
        """The variant a `Record` or `Point` ran."""
        return cls(row.mode, **{k: getattr(row, k) for k in AR_SETTINGS})

    @property
    def label(self) -> str:
        def show(v: Any) -> str:
            return ("on" if v else "off") if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)

        return " ".join([self.mode, *(f"{_SHORT[k]}={show(v)}" for k, v in self.settings().items())])


@dataclass(frozen=True, slots=True)
class Record:
    """One canvas: what was generated, how, and how the judge scored it and the human text it replaced."""

    task: str
    mode: Mode
    max_steps: int
    entropy_bound: float
    index: int
    doc_id: str
    slots: int  # free slots
    kept_tokens: int  # generated tokens in the text (nulls dropped, cut at EOS)
    nulls: int  # free slots that came out <null>
    eos: bool  # an EOS ended the region early
    steps: int
    forwards: int
    generated: int
    wall_s: float
    model: SpanScore
    human: SpanScore
    repeats: tuple[int, int]  # (repeated 4-grams, 4-grams) of the generated tokens
    human_repeats: tuple[int, int]  # the same of the human text's tokens
    text: str = field(repr=False)
    joins: tuple[int, int] = (0, 0)  # (faults, joins) at the fill's edges (`join_faults`)
    human_joins: tuple[int, int] = (0, 0)  # the same of the human text in its place
    ar_drafts: int | None = None  # the variant's AR settings (None: the model's own)
    ar_seam_tokens: int | None = None
    ar_temperature: float | None = None
    fim: bool | None = None
    ar_smc_every: int | None = None
    ar_min_p: float | None = None


@dataclass(frozen=True, slots=True)
class Point:
    """Pooled metrics of one (task, variant, sampler settings) over its samples."""

    task: str
    mode: Mode
    variant: str  # the mode and its AR settings, as the tables show it
    max_steps: int
    entropy_bound: float
    samples: int
    judge_ppl: float  # fill and seam together
    judge_ppl_human: float
    ratio: float
    span_ppl: float  # the fill alone
    span_ppl_human: float
    fill_ratio: float
    seam_ppl: float  # the first seam_tokens judge tokens after an infill (NaN for a continuation)
    seam_ppl_human: float
    seam_ratio: float
    tokens_per_forward: float
    seconds_per_canvas: float
    steps_per_canvas: float
    null_share: float  # free slots left null
    exact_length: float  # share of canvases whose text fills every free slot (no null, no early EOS)
    repeat_4gram: float
    repeat_4gram_human: float
    degenerate: bool  # fill ratio under the target's floor with more repetition than the human text
    join_faults: float = math.nan  # share of an infill's joins with a fault (`join_faults`; NaN: none measured)
    join_faults_human: float = math.nan
    # 90% bootstrap intervals (samples drawn with replacement, `bootstrap_interval`): one sample's seam excess
    # spreads ~0.7 nats a token, so 64 samples put a pooled seam ratio within about +-12% and 24 within +-20%.
    fill_ratio_ci: tuple[float, float] = (math.nan, math.nan)
    seam_ratio_ci: tuple[float, float] = (math.nan, math.nan)
    ar_drafts: int | None = None
    ar_seam_tokens: int | None = None
    ar_temperature: float | None = None
    fim: bool | None = None
    ar_smc_every: int | None = None
    ar_min_p: float | None = None


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) and not math.isnan(b) else math.nan


BOOTSTRAP_DRAWS = 1000


def bootstrap_interval(records: Sequence[Record], part: str, level: float = 0.9,
                       draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> tuple[float, float]:
    """The `level` percentile interval of the pooled model / human perplexity ratio of `part` ("span": the fill,
    "seam") over `draws` resamples of `records` with replacement (a fixed seed: the same records give the same
    interval). NaN when a ratio is undefined."""
    if part not in ("span", "seam"):
        raise ValueError(f"part must be 'span' or 'seam', got {part!r}")
    key = "nll" if part == "span" else "seam_nll"
    tok = "tokens" if part == "span" else "seam_tokens"
    rows = torch.tensor([[getattr(r.model, key), getattr(r.model, tok), getattr(r.human, key), getattr(r.human, tok)]
                         for r in records], dtype=torch.float64)  # (N, 4)
    idx = torch.randint(len(records), (draws, len(records)), generator=torch.Generator().manual_seed(seed))
    sums = rows[idx].sum(1)  # (draws, 4)
    ratios = torch.exp(sums[:, 0] / sums[:, 1] - sums[:, 2] / sums[:, 3])  # not finite where a side has no tokens
    if not bool(ratios.isfinite().all()):
        return math.nan, math.nan
    lo, hi = torch.quantile(ratios, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return lo, hi


def pool(records: Sequence[Record]) -> Point:
    if not records:
        raise EvalError("no records to pool")
    r0 = records[0]

    def ppl(scores: list[SpanScore], part: str) -> float:
        if part == "total":
            return perplexity(sum(s.total_nll for s in scores), sum(s.total_tokens for s in scores))
        if part == "seam":
            return perplexity(sum(s.seam_nll for s in scores), sum(s.seam_tokens for s in scores))
        return perplexity(sum(s.nll for s in scores), sum(s.tokens for s in scores))

    def share(pairs: list[tuple[int, int]]) -> float:
        grams = sum(g for _, g in pairs)
        return sum(r for r, _ in pairs) / grams if grams else 0.0

    model, human = [r.model for r in records], [r.human for r in records]
    p, ph = ppl(model, "total"), ppl(human, "total")
    span, span_h = ppl(model, "span"), ppl(human, "span")
    seam, seam_h = ppl(model, "seam"), ppl(human, "seam")
    forwards = sum(r.forwards for r in records)
    rep, rep_h = share([r.repeats for r in records]), share([r.human_repeats for r in records])
    fill = _ratio(span, span_h)
    n = len(records)
    variant = Variant.of(r0)
    joins = sum(r.joins[1] for r in records)
    faults = (sum(r.joins[0] for r in records) / joins, sum(r.human_joins[0] for r in records) / joins) if joins \
        else (math.nan, math.nan)
    return Point(
        r0.task, r0.mode, variant.label, r0.max_steps, r0.entropy_bound, n, p, ph, _ratio(p, ph),
        span, span_h, fill, seam, seam_h, _ratio(seam, seam_h),
        sum(r.generated for r in records) / forwards if forwards else 0.0,
        sum(r.wall_s for r in records) / n, sum(r.steps for r in records) / n,
        sum(r.nulls for r in records) / max(1, sum(r.slots for r in records)),
        sum(r.nulls == 0 and not r.eos for r in records) / n,
        rep, rep_h, is_degenerate(fill, rep, rep_h), *faults,
        bootstrap_interval(records, "span"), bootstrap_interval(records, "seam"), **variant.settings(),
    )  # fmt: skip


def repeated_4grams(ids: Sequence[int]) -> tuple[int, int]:
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return len(grams) - len(set(grams)), len(grams)


_GLUE = ".!?;:,"  # punctuation a word never follows without a space (in prose; numbers aside: a letter must follow)
_SENTENCE_END = re.compile(r"[.!?][\"')\]\u201d\u2019]*$")


def _join_fault(a: str, b: str) -> bool:
    """Whether the join of text `a` then text `b` (both non-empty) shows a fault: a letter right after clause or
    sentence punctuation, a sentence starting lowercase, or a doubled space."""
    if a[-1] in _GLUE and b[0].isalpha():
        return True
    if a[-1] == " " and b[0] == " ":
        return True
    if (a[-1].isspace() or b[0].isspace()) and _SENTENCE_END.search(a.rstrip()):
        word = b.lstrip()
        return bool(word) and word[0].islower()
    return False


def join_faults(before: str, middle: str, after: str) -> tuple[int, int]:
    """(faults, joins) of `middle` written between `before` and `after`: its two joins, or, for an empty middle, the
    one where the sides meet; a join with nothing on one side is not counted."""
    pairs = [(before, middle), (middle, after)] if middle else [(before, after)]
    pairs = [(a, b) for a, b in pairs if a and b]
    return sum(_join_fault(a, b) for a, b in pairs), len(pairs)


def headline(results: Sequence[dict[str, Any]], variants: dict[str, str]) -> list[dict[str, Any]]:
    """The results of the variants the headline shows (`variants`: kind -> variant label), one row per task."""
    keys = ("task", "variant", "fill_ratio", "seam_ratio", "repeat_4gram", "repeat_4gram_human", "null_share",
            "seconds_per_canvas", "degenerate", "join_faults", "join_faults_human", "fill_ratio_ci",
            "seam_ratio_ci")  # fmt: skip
    kind = {True: "continuation", False: "infill"}
    tasks = list(dict.fromkeys(p["task"] for p in results))  # in the order the eval ran them
    rows = [p for p in results if p["variant"] == variants[kind[p["task"] == CONTINUATION]]]
    return [{k: p[k] for k in keys} for p in sorted(rows, key=lambda p: tasks.index(p["task"]))]


def _met(value: float, low: float | None, high: float | None) -> bool:
    if math.isnan(value):
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def targets(result: dict[str, Any], speed_scale: float = 1.0) -> list[dict[str, Any]]:
    """The issue's targets against the headline figures (the default modes), one row per task and target; a missed
    target is reported, not hidden. With a sweep, its tokens-per-forward target too."""
    out: list[dict[str, Any]] = []

    def add(row: dict[str, Any], what: str, measured: float, low: float | None, high: float | None,
            ci: Sequence[float] | None = None) -> None:
        out.append({"task": row["task"], "variant": row["variant"], "target": what, "measured": measured,
                    "limit": [low, high], "met": _met(measured, low, high),
                    **({"ci": list(ci)} if ci is not None else {})})  # fmt: skip

    lo, hi = FILL_RANGE
    for row in result["headline"]:
        add(row, f"fill ratio {lo:g}-{hi:g}", row["fill_ratio"], lo, hi, row.get("fill_ratio_ci"))
        if row["task"] != CONTINUATION:
            add(row, f"seam ratio <= {SEAM_MAX:g}", row["seam_ratio"], None, SEAM_MAX, row.get("seam_ratio_ci"))
        human = row["repeat_4gram_human"]
        add(row, f"repeated 4-grams within {100 * REPEAT_POINTS:.0f} points of human ({100 * human:.0f}%)",
            row["repeat_4gram"], human - REPEAT_POINTS, human + REPEAT_POINTS)
        bound = speed_bound(row["task"], speed_scale)
        if bound is not None:
            add(row, f"seconds per infill <= {bound:g}", row["seconds_per_canvas"], None, bound)
    sweep = result.get("sweep")
    if sweep:
        best = sweep["best_within_10pct"]
        out.append({"task": sweep["task"], "variant": "diffusion", "target": ">= 16 tokens/forward within 10% of the "
                    "48-step ppl", "limit": [16.0, None], "measured": best["tokens_per_forward"],
                    "met": bool(best["tokens_per_forward"] >= 16.0),
                    "at": f"steps {best['max_steps']}, bound {best['entropy_bound']}"})  # fmt: skip
    return out
