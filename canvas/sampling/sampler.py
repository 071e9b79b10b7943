"""The pin-aware entropy-bound sampler: pure functions for one denoising step of a batch of canvases.

Algorithm (transformers `EntropyBoundSampler` + `LinearTemperatureScheduleLogitsProcessor` +
`StableAndConfidentStoppingCriteria`, generation_diffusion_gemma.py, v5.23.0): at step n of N (counting down
N..1) the logits are divided by t = t_min + (t_max - t_min) * n / N; a denoised canvas is sampled; the slots with
the lowest entropy are accepted while (cumulative entropy - max entropy) <= entropy_bound (arXiv 2505.24857); the
rest are renoised with uniform random tokens; the processed logits feed the next step as self-conditioning; a row
stops when its argmax canvas is unchanged for `stability_threshold` steps and its mean entropy is below
`confidence_threshold`.

Editing extension (ours): pinned slots always hold their token, are never renoised, never take part in the entropy
ranking or the stopping statistics, and are forced in the committed (argmax) canvas. With no pins, every function
here reproduces the reference bit for bit given the same random stream.

`step_stats_at` runs the per-slot work only for the slots that are sampled (the engine's free slots): pinned slots
get no logits, no sample and no entropy.

Randomness comes from a `NoiseSource`: `ReferenceNoise` replays the reference's calls on a generator (the global
one by default) for parity tests; `GumbelNoise` is the fast path, which samples inside the fused sampler step and
never builds a probability tensor. Legend: B rows, L canvas slots, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from canvas.sampling.modes import EXTRA_FILE, Mode
from kernels.sample_cpu import inverse_cdf
from kernels.sampler_step import sampler_step


@dataclass(frozen=True, slots=True)
class SamplerConfig:
    max_steps: int = 48  # the reference's max_denoising_steps
    entropy_bound: float = 0.1  # higher accepts more slots per step: faster, less careful
    t_max: float = 0.8  # temperature at the first step...
    t_min: float = 0.4  # ...annealed linearly to this at the last
    stability_threshold: int = 1  # steps the argmax canvas must stay unchanged before stopping
    confidence_threshold: float = 0.005  # mean entropy (nats) under which a stable canvas may stop
    seed: int | None = None  # None: nondeterministic
    mode: Mode = "diffusion"
    ar_temperature: float = 0.0  # AR mode: 0 is greedy
    # AR mode, an infill or rewrite gap of more than `ar_long_gap` tokens drafts at `ar_temperature_long` instead
    # (0: off, every gap at `ar_temperature`): with FIM prompting a 64-token middle sampled at the temperature that
    # puts 32-token fills in the judge's band ran hot with early adapters; the default's adapters do not need it
    # (BENCHMARKS.md, "Suffix-aware infill quality").
    ar_long_gap: int = 0
    ar_temperature_long: float = 0.7
    # Share of each gap (a run of free slots with a pin after it) that must hold text: `<null>` is never sampled in
    # its first ceil(gap_min_fill * size) slots. A model trained to leave at most a quarter of a gap null gets 0.75
    # (its export writes it, in EXTRA_FILE); 0 leaves nulls free, as the reference (which has no gaps) does.
    gap_min_fill: float = 0.0
    # AR infills and rewrites prompt with the fill-in-the-middle format (`canvas.convert.fim`: both sides, then the
    # K drafts write the middle until `<|fim_end|>` or the budget). None: when the model has the format (its build
    # applied FIM adapters: `canvas.convert.fim.model_fim_tokens`); True: required (a model without it refuses the
    # request); False: plain drafts from the left side. Continuations are always plain AR.
    fim: bool | None = None
    # AR mode, a gap with pinned text after it (an infill or rewrite): `ar_drafts` candidates are drafted side by
    # side from the left context at `ar_temperature`, each may end at a clause or sentence end or at the gap's budget,
    # and each (draft, ending) is scored by the model's log-likelihood of the first `ar_seam_tokens` pinned tokens
    # after it. ar_drafts=1 with ar_seam_tokens=0 is the plain left-to-right fill (every free slot, no `<null>`).
    # Defaults measured on held-out text (BENCHMARKS.md, "Suffix-aware infill quality"): drafts chosen by their seam
    # join the text after the gap far better than one plain left-to-right fill.
    ar_drafts: int = 8
    ar_seam_tokens: int = 8
    ar_min_fill: float = 0.5  # the shortest ending keeps this share of the gap (the rest becomes `<null>`)
    ar_endings: int = 4  # endings scored per draft: the budget and the clause ends nearest it
    ar_draft_weight: float = 0.0  # weight of the draft's own mean log-likelihood (per token) beside the seam's
    ar_select_temperature: float = 0.0  # 0 picks the best-scoring candidate; > 0 samples by softmax(score / this)
    # An AR draft (an infill's or a continuation's) never repeats an n-gram of its own of this many tokens (0: off):
    # a small model's samples fall into loops ("of the children of the fathers of the children of ...") that no seam
    # score can repair.
    ar_no_repeat: int = 4
    # Sequential Monte Carlo over an infill's drafts: every `ar_smc_every` tokens (0: off, scoring only at the end)
    # each draft's running seam score (the log-likelihood of the seam tokens right after it as it stands) weighs it,
    # and the K drafts are resampled by softmax(gain / ar_smc_temperature), the gain being the score's change since
    # the draft's ancestor was last weighed; drafts that lead nowhere near the right side are dropped early.
    ar_smc_every: int = 0
    ar_smc_temperature: float = 1.0
    # AR mode's truncation before sampling, in llama.cpp's order (top-k, then top-p, then min-p, temperature last),
    # each off at its default: per request (llama.cpp's fields on the HTTP routes); min-p may also be a model's own
    # default (its dcanvas_sampler.json, written by `dcanvas eval --write-defaults` when it measures better).
    ar_top_k: int = 0
    ar_top_p: float = 1.0
    ar_min_p: float = 0.0
    # AR mode, per request: False bans the tokens that break the line before writing on it (a newline with at most
    # whitespace before it, from the tokenizer: `canvas.engine.ar.line_tokens`) while a gap's draft is blank (its
    # first token, or after spaces only). An editor's suggestion then never starts with an empty line
    # (`canvas.server.http.endings`); never a model default.
    ar_first_newline: bool = True
    # AR mode, per request: the text the first gap's draft must start with, the writer's partial word (" applie") or
    # the space typed before the next word (" "), which the caller took out of the prompt and drops from the answer
    # (token healing by constraint: `canvas.convert.fim.LeadTokens`); "" for none. Never a model default.
    ar_lead: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.max_steps, int) or not 1 <= self.max_steps <= 1024:
            raise ValueError(f"max_steps must be an integer in [1, 1024], got {self.max_steps!r}")
        if not self.entropy_bound > 0:
            raise ValueError(f"entropy_bound must be > 0, got {self.entropy_bound}")
        if not 0 < self.t_min <= self.t_max:
            raise ValueError(f"need 0 < t_min <= t_max, got t_min={self.t_min}, t_max={self.t_max}")
        if self.stability_threshold < 0:
            raise ValueError(f"stability_threshold must be >= 0, got {self.stability_threshold}")
        if not self.confidence_threshold > 0:
            raise ValueError(f"confidence_threshold must be > 0, got {self.confidence_threshold}")
        if self.mode not in ("diffusion", "ar"):
            raise ValueError(f"mode must be 'diffusion' or 'ar', got {self.mode!r}")
        if self.ar_temperature < 0:
            raise ValueError(f"ar_temperature must be >= 0, got {self.ar_temperature}")
        if self.ar_temperature_long < 0:
            raise ValueError(f"ar_temperature_long must be >= 0, got {self.ar_temperature_long}")
        if not isinstance(self.ar_long_gap, int) or self.ar_long_gap < 0:
            raise ValueError(f"ar_long_gap must be an integer >= 0 (0: off), got {self.ar_long_gap!r}")
        if not 0.0 <= self.gap_min_fill <= 1.0:
            raise ValueError(f"gap_min_fill must be in [0, 1], got {self.gap_min_fill}")
        if not isinstance(self.ar_drafts, int) or not 1 <= self.ar_drafts <= 64:
            raise ValueError(f"ar_drafts must be an integer in [1, 64], got {self.ar_drafts!r}")
        if not isinstance(self.ar_seam_tokens, int) or not 0 <= self.ar_seam_tokens <= 256:
            raise ValueError(f"ar_seam_tokens must be an integer in [0, 256], got {self.ar_seam_tokens!r}")
        if not 0.0 <= self.ar_min_fill <= 1.0:
            raise ValueError(f"ar_min_fill must be in [0, 1], got {self.ar_min_fill}")
        if not isinstance(self.ar_endings, int) or not 1 <= self.ar_endings <= 64:
            raise ValueError(f"ar_endings must be an integer in [1, 64], got {self.ar_endings!r}")
        if not self.ar_draft_weight >= 0:
            raise ValueError(f"ar_draft_weight must be >= 0, got {self.ar_draft_weight}")
        if not self.ar_select_temperature >= 0:
            raise ValueError(f"ar_select_temperature must be >= 0, got {self.ar_select_temperature}")
        if not isinstance(self.ar_no_repeat, int) or not (self.ar_no_repeat == 0 or 2 <= self.ar_no_repeat <= 64):
            raise ValueError(f"ar_no_repeat must be 0 or an integer in [2, 64], got {self.ar_no_repeat!r}")
        if not isinstance(self.ar_smc_every, int) or not 0 <= self.ar_smc_every <= 1024:
            raise ValueError(f"ar_smc_every must be an integer in [0, 1024] (0: off), got {self.ar_smc_every!r}")
        if not self.ar_smc_temperature > 0:
            raise ValueError(f"ar_smc_temperature must be > 0, got {self.ar_smc_temperature}")
        if self.fim is not None and not isinstance(self.fim, bool):
            raise ValueError(f"fim must be true, false or null (when the model has it), got {self.fim!r}")
        if not isinstance(self.ar_top_k, int) or self.ar_top_k < 0:
            raise ValueError(f"ar_top_k must be an integer >= 0 (0: off), got {self.ar_top_k!r}")
        if not 0 < self.ar_top_p <= 1 or not 0 <= self.ar_min_p <= 1:
            raise ValueError(f"ar_top_p must be in (0, 1] and ar_min_p in [0, 1], got {self.ar_top_p}, {self.ar_min_p}")
        if not isinstance(self.ar_first_newline, bool):
            raise ValueError(f"ar_first_newline must be true or false, got {self.ar_first_newline!r}")
        if not isinstance(self.ar_lead, str) or len(self.ar_lead) > 64:
            raise ValueError(f"ar_lead must be a string of at most 64 characters, got {self.ar_lead!r}")

    # ---- generation_config.json: a model's own sampler defaults (the file transformers' `generate` reads) ----------
    def to_generation_config(self) -> dict[str, Any]:
        """The sampler fields in the transformers `generation_config.json` layout of DiffusionGemma."""
        return {
            "max_denoising_steps": self.max_steps,
            "t_min": self.t_min,
            "t_max": self.t_max,
            "stability_threshold": self.stability_threshold,
            "confidence_threshold": self.confidence_threshold,
            "sampler_config": {"entropy_bound": self.entropy_bound, "_cls_name": "EntropyBoundSamplerConfig"},
        }

    @classmethod
    def from_generation_config(cls, raw: dict[str, Any]) -> SamplerConfig:
        """Defaults from a `generation_config.json` dict; absent keys keep the reference defaults."""
        fields: dict[str, Any] = {}
        for ours, theirs in _GENERATION_KEYS.items():
            if theirs in raw:
                fields[ours] = raw[theirs]
        sampler = raw.get("sampler_config")
        if isinstance(sampler, dict) and "entropy_bound" in sampler:
            fields["entropy_bound"] = sampler["entropy_bound"]
        return dataclasses.replace(cls(), **_numbers(fields, _GENERATION_KEYS))

    @property
    def seam_aware(self) -> bool:
        """Whether AR mode drafts and scores candidates for a gap that has pinned text after it."""
        return self.ar_drafts > 1 or self.ar_seam_tokens > 0

    def temperature(self, remaining: int) -> Tensor:
        """Temperature when `remaining` steps are left (the reference counts down from max_steps to 1), as a 0-dim
        fp32 tensor computed the way the reference computes it, so that dividing by it rounds identically."""
        step = torch.tensor(remaining, dtype=torch.int32)
        return self.t_min + (self.t_max - self.t_min) * (step / self.max_steps)


_GENERATION_KEYS = {
    "max_steps": "max_denoising_steps",
    "t_min": "t_min",
    "t_max": "t_max",
    "stability_threshold": "stability_threshold",
    "confidence_threshold": "confidence_threshold",
}
# Settings of ours that transformers' DiffusionGemma generation config would reject (it refuses unknown keys): they
# live beside it in this file of the model directory.
def truncate_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Tensor:
    """Logits (K, V) with the tail cut off as llama.cpp's samplers do, in its order: the `top_k` most likely, then
    the smallest set whose probability reaches `top_p`, then those at least `min_p` times the most likely; the rest
    -inf. Each is off at its default (0, 1, 0), and the most likely token always stays. Probabilities are the
    untempered ones (temperature comes last in llama.cpp's chain)."""
    if top_k <= 0 and top_p >= 1 and min_p <= 0:
        return logits
    out = logits  # each cut makes a new tensor: the caller's logits are never written
    if 0 < top_k < out.shape[-1]:
        top = out.topk(top_k, dim=-1).values  # (K, k) descending
        out = out.masked_fill(out < top[:, -1:], -math.inf)
        distinct = not bool((top[:, 1:] == top[:, :-1]).any()) and not bool(((out > -math.inf).sum(-1) > top_k).any())
        if top_p < 1 and distinct:
            # The top-p cut within the k survivors, no sort over the vocabulary (which cost as much as the decode step
            # at a 98k vocabulary): the same tokens as the general path below when no two of them tie.
            p = top.softmax(-1)
            floor = top.masked_fill(p.cumsum(-1) - p >= top_p, math.inf).amin(-1, keepdim=True)  # least one kept
            out = out.masked_fill(out < floor, -math.inf)
            top_p = 1.0
    if top_p < 1:
        sorted_, order = out.sort(dim=-1, descending=True)
        cum = sorted_.softmax(-1).cumsum(-1)
        drop = cum - sorted_.softmax(-1) >= top_p  # a token goes once the ones before it already reach top_p
        out = out.scatter(-1, order, sorted_.masked_fill(drop, -math.inf))
    if min_p > 0:
        # p / p_max < min_p  <=>  logit < max logit + log(min_p): no softmax over the vocabulary, which cost a sizeable
        # share of a decode step (BENCHMARKS.md, "Kernels"); the cuts above never remove the maximum.
        floor = out.max(dim=-1, keepdim=True).values + math.log(min_p)  # (K, 1)
        out = out.masked_fill(out < floor, -math.inf)
    return out


def sample_categorical(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index a row drawn from probs (K, V) (non-negative, any positive sum) -> (K,): by inverting the cumulative
    sum at a uniform draw. Why not `torch.multinomial`: on the CPU it draws V random numbers a row, which at a 98k
    vocabulary cost more than the decode step it follows; this draws one (BENCHMARKS.md, "Kernels"). Never returns an
    index of zero probability: the draw is kept below the total, and the first cumulative sum above it belongs to a
    token whose probability is positive (`kernels.sample_cpu.inverse_cdf`)."""
    return inverse_cdf(probs, torch.rand(probs.shape[0], generator=generator, device=probs.device))


_EXTRA_KEYS = ("gap_min_fill", "ar_temperature", "ar_long_gap", "ar_temperature_long", "fim", "ar_drafts",
               "ar_seam_tokens", "ar_min_fill", "ar_endings", "ar_draft_weight", "ar_select_temperature",
               "ar_no_repeat", "ar_smc_every", "ar_smc_temperature", "ar_min_p")
_INT_FIELDS = ("max_steps", "stability_threshold", "ar_long_gap", "ar_drafts", "ar_seam_tokens", "ar_endings",
               "ar_no_repeat", "ar_smc_every")


def extra_settings(cfg: SamplerConfig) -> dict[str, Any]:
    """Our sampler settings that have no place in `generation_config.json`, for `EXTRA_FILE` (`fim` only when set:
    None, when the model has the format, is what a file without the key means)."""
    return {k: getattr(cfg, k) for k in _EXTRA_KEYS if k != "fim" or cfg.fim is not None}


def _numbers(fields: dict[str, Any], file_keys: dict[str, str]) -> dict[str, Any]:
    """Sampler fields read from a file, checked to be numbers (integers for the integer fields); errors name the
    file's key for each field."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        kind = int if name in _INT_FIELDS else float
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ValueError(f"{file_keys.get(name, name)} must be a number, got {value!r}")
        out[name] = kind(value)
    return out


def _read(path: Path, parse: Callable[[dict[str, Any]], SamplerConfig]) -> SamplerConfig:
    """`parse` of a JSON object file; any problem is a ValueError that names the file."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        return parse(raw)
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {exc}") from None


def load_sampler_defaults(model_dir: str | Path) -> SamplerConfig:
    """A model directory's sampler defaults from its `generation_config.json` and `EXTRA_FILE` (the reference
    defaults for whatever they leave out).

    Raises ValueError naming the file when it is unreadable JSON or holds values the sampler rejects."""
    gen, extra = Path(model_dir) / "generation_config.json", Path(model_dir) / EXTRA_FILE
    cfg = _read(gen, SamplerConfig.from_generation_config) if gen.is_file() else SamplerConfig()
    return _read(extra, functools.partial(_with_extra, cfg)) if extra.is_file() else cfg


def _with_extra(cfg: SamplerConfig, raw: dict[str, Any]) -> SamplerConfig:
    fim = raw.get("fim", cfg.fim)
    if fim is not None and not isinstance(fim, bool):
        raise ValueError(f"fim must be true, false or null, got {fim!r}")
    numbers = _numbers({k: raw[k] for k in _EXTRA_KEYS if k in raw and k != "fim"}, {})
    return dataclasses.replace(cfg, **numbers, fim=fim)


# ---- noise --------------------------------------------------------------------------------------------------------
class NoiseSource(Protocol):
    """Where the sampler's randomness comes from. `sample` returns None when the fused step samples itself."""

    def uniform_tokens(self, shape: tuple[int, int], vocab_size: int, device: torch.device) -> Tensor: ...

    def sample(self, processed: Tensor) -> Tensor | None: ...

    def step_seed(self) -> int | None:
        """Seed for the fused step's Gumbel draw (never None: None would consume torch's global generator)."""
        ...


class ReferenceNoise:
    """Replays the reference's random calls: randint for canvases, multinomial over softmax for samples.

    With `generator=None` it draws from torch's global generator exactly as `DiffusionGemmaForBlockDiffusion.generate`
    does, so seeding both the same way gives identical tokens. Materialises a probability tensor (B*L, V): use it
    for parity, not for speed."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def uniform_tokens(self, shape: tuple[int, int], vocab_size: int, device: torch.device) -> Tensor:
        return torch.randint(0, vocab_size, shape, device=device, generator=self.generator)

    def sample(self, processed: Tensor) -> Tensor | None:
        B, L, V = processed.shape
        probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
        return torch.multinomial(probs.view(-1, V), 1, generator=self.generator).view(B, L)

    def step_seed(self) -> int | None:
        # The fused step's own draw is discarded in favour of `sample`; a fixed seed keeps it off the global stream.
        return 0


class GumbelNoise:
    """Fast path: uniform tokens from a seeded generator, samples by Gumbel-max inside the fused sampler step."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else int(torch.seed() % 2**62))

    def uniform_tokens(self, shape: tuple[int, int], vocab_size: int, device: torch.device) -> Tensor:
        return torch.randint(0, vocab_size, shape, generator=self.generator).to(device)

    def sample(self, processed: Tensor) -> Tensor | None:
        return None

    def step_seed(self) -> int | None:
        return int(torch.randint(0, 2**62, (1,), generator=self.generator).item())


# ---- one step -----------------------------------------------------------------------------------------------------
@dataclass
class StepStats:
    """Per-slot results of one step: sampled, argmax and entropy (B, L)."""

    sample: Tensor
    argmax: Tensor
    entropy: Tensor


# Rows per fused call: bounds the temporaries of the reference implementation to (CHUNK, V) fp32 each, well
# under one (B, L, V) tensor, whatever B is.
_CHUNK_ROWS = 32


def step_stats(processed: Tensor, noise: NoiseSource) -> StepStats:
    """Sample, argmax and entropy of processed (temperature-scaled) logits (B, L, V), chunked over rows."""
    B, L, V = processed.shape
    ref_sample = noise.sample(processed)
    flat = processed.view(-1, V)
    seed = noise.step_seed()
    samples, argmaxes, entropies = [], [], []
    for i in range(0, flat.shape[0], _CHUNK_ROWS):
        out = sampler_step(flat[i : i + _CHUNK_ROWS], 1.0, seed=(seed or 0) + i)
        samples.append(out.sample)
        argmaxes.append(out.argmax)
        entropies.append(out.entropy)
    sample = ref_sample if ref_sample is not None else torch.cat(samples).view(B, L)
    return StepStats(sample, torch.cat(argmaxes).view(B, L), torch.cat(entropies).view(B, L))


def step_stats_at(processed: Tensor, slots: Tensor, length: int, noise: NoiseSource) -> StepStats:
    """`step_stats` of one canvas of `length` slots sampled only at `slots` (K,), whose processed logits are the
    rows of `processed` (K, V), in that order (the engine asks the model for nothing else: pinned slots need no
    logits). Returns (1, length) stats; a slot not in `slots` gets sample and argmax -1 (callers force pinned
    tokens there) and entropy 0. The random draws go to the K sampled slots in order."""
    sample = torch.full((1, length), -1, dtype=torch.long, device=processed.device)
    argmax = sample.clone()
    entropy = torch.zeros(1, length, device=processed.device)
    if slots.numel():
        stats = step_stats(processed[None], noise)  # (1, K)
        sample[0, slots], argmax[0, slots], entropy[0, slots] = stats.sample[0], stats.argmax[0], stats.entropy[0]
    return StepStats(sample, argmax, entropy)


def select_accepted(entropy: Tensor, free: Tensor, entropy_bound: float) -> Tensor:
    """Entropy-bound acceptance over free slots: (B, L) entropy, (B, L) bool free -> (B, L) bool accepted.

    Sorting ascending, slot j is accepted when sum(entropy[:j+1]) - entropy[j] <= bound. Pinned (non-free) slots
    are ranked last with +inf entropy and so can never be accepted nor shift the sums of free slots."""
    ranked = torch.where(free, entropy, torch.full_like(entropy, float("inf")))
    sorted_e, order = torch.sort(ranked, dim=-1)
    # cumsum of inf tails is inf/nan only after every free slot; those positions are pinned and masked below.
    cum = torch.cumsum(torch.nan_to_num(sorted_e, posinf=0.0), dim=-1)
    chosen = (cum - torch.nan_to_num(sorted_e, posinf=0.0)) <= entropy_bound
    accepted = torch.zeros_like(chosen).scatter(-1, order, chosen)
    return accepted & free


class StoppingState:
    """Stable-and-confident stopping for B rows, over free slots only."""

    def __init__(self, threshold: int, confidence: float, batch: int, length: int, device: torch.device) -> None:
        self.threshold = threshold
        self.confidence = confidence
        self.history = torch.full((max(threshold, 1), batch, length), -1, dtype=torch.long, device=device)

    def update(self, argmax: Tensor, entropy: Tensor, free: Tensor) -> Tensor:
        """argmax (B, L), entropy (B, L), free (B, L) -> (B,) bool: stop now."""
        if self.threshold == 0:
            stable = torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device)
        else:
            same = (self.history == argmax[None]) | ~free[None]
            stable = same.all(dim=-1).all(dim=0)
            self.history = torch.roll(self.history, shifts=-1, dims=0)
            self.history[-1] = argmax
        n_free = free.sum(-1).clamp(min=1)
        mean_entropy = (entropy * free).sum(-1) / n_free
        return stable & (mean_entropy < self.confidence)

    def select(self, rows: Tensor) -> None:
        """Keep only the given rows (after a batch shrinks)."""
        self.history = self.history[:, rows]
