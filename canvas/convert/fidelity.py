"""How close the converted encoder is to the Gemma 3 it came from: perplexity, KL and top-1 agreement.

`compare(source, model, passages)` runs both causal passes over the same token ids (both with the full
vocabulary: a trimmed head renormalises over fewer tokens, which no longer measures the conversion) and reports
the original's and the converted model's perplexity over every next-token prediction, their ratio, the mean
KL(original || converted) in nats and the share of positions whose argmax agrees. `validation_passages` reads
the project corpus's validation split (`dcanvas data build`): Austen and World English Bible documents in turn.
`compare_builds` is the same comparison between two built models over one tokenizer (a build with FIM adapters
against the build without them: issue 30's bound, plain perplexity within `MAX_BUILD_PPL_RATIO` of before).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from canvas.model import DiffusionModel


@dataclass(frozen=True, slots=True)
class Fidelity:
    passages: int
    predictions: int
    ppl_original: float
    ppl_converted: float
    ratio: float
    kl: float  # mean KL(original || converted) per prediction, nats
    top1_agree: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def validation_passages(corpus: Path, n: int, sources: tuple[str, ...] = ("austen", "web"),
                        min_chars: int = 1200) -> list[str]:
    """`n` validation passages, alternating between `sources`: runs of consecutive paragraphs of one document, each
    at least `min_chars` long (a document's last short run is dropped), in file order."""
    valid = corpus / "valid.jsonl"
    if not valid.is_file():
        raise FileNotFoundError(f"{valid}: no validation split; run `dcanvas data build --stages corpus` first")
    by_source: dict[str, list[str]] = {s: [] for s in sources}
    for line in valid.read_text(encoding="utf-8").splitlines():
        doc = json.loads(line)
        if doc["source"] not in by_source:
            continue
        run: list[str] = []
        for para in doc["text"].split("\n\n"):
            run.append(para)
            if sum(len(p) for p in run) >= min_chars:
                by_source[doc["source"]].append("\n\n".join(run))
                run = []
    out: list[str] = []
    for k in range(max(len(v) for v in by_source.values()) if by_source else 0):
        out += [by_source[s][k] for s in sources if k < len(by_source[s])]
    return out[:n]


@torch.no_grad()
def compare(source: Any, model: DiffusionModel, tok: Any, passages: list[str], max_tokens: int = 400) -> Fidelity:
    nll_o = nll_c = kl = 0.0
    agree = n = 0
    for text in passages:
        ids = tok(text, return_tensors="pt").input_ids[:, :max_tokens]  # BOS first, as the models read text
        orig = source(input_ids=ids).logits[0, :-1].float()  # (T-1, V)
        conv, _ = model.encode(ids)
        assert conv is not None
        conv = conv[0, :-1].float()
        target = ids[0, 1:]
        nll_o += float(F.cross_entropy(orig, target, reduction="sum"))
        nll_c += float(F.cross_entropy(conv, target, reduction="sum"))
        lp_o, lp_c = orig.log_softmax(-1), conv.log_softmax(-1)
        kl += float((lp_o.exp() * (lp_o - lp_c)).sum())
        agree += int((orig.argmax(-1) == conv.argmax(-1)).sum())
        n += target.numel()
    if n == 0:
        raise ValueError("no predictions: the passages are empty")
    return Fidelity(len(passages), n, math.exp(nll_o / n), math.exp(nll_c / n), math.exp((nll_c - nll_o) / n),
                    kl / n, agree / n)


# A build's trained additions (the FIM adapters) may cost plain text at most this much perplexity (issue 30).
MAX_BUILD_PPL_RATIO = 1.02


class _AsCausalLM:
    """A model's causal encoder called as `compare` calls the original (`source(input_ids=ids).logits`)."""

    def __init__(self, model: DiffusionModel) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor) -> Any:
        logits, _ = self.model.encode(input_ids)
        return SimpleNamespace(logits=logits)


def compare_builds(model_dir: Path, reference_dir: Path, passages: list[str], max_tokens: int = 400) -> Fidelity:
    """`compare` of the build in `model_dir` (as "converted") against the build in `reference_dir` (as "original"),
    fp32 both; they must share a tokenizer (the same vocabulary: perplexities over different ids do not compare)."""
    from transformers import AutoTokenizer

    a, b = model_dir / "tokenizer.json", reference_dir / "tokenizer.json"
    if not (a.is_file() and b.is_file()) or a.read_bytes() != b.read_bytes():
        raise ValueError(f"{model_dir} and {reference_dir} do not share a tokenizer (compare builds of one vocabulary)")
    model = DiffusionModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    reference = DiffusionModel.from_pretrained(str(reference_dir), dtype=torch.float32).eval()
    return compare(_AsCausalLM(reference), model, AutoTokenizer.from_pretrained(str(model_dir)), passages, max_tokens)
