"""The original Gemma 3 as the teacher of the FIM fine-tune's plain text.

Owns loading the unconverted Gemma 3 (the build's cached HF copy, fp32) next to a trimmed, converted base and
answering one question: its next-token log-probabilities, over the trimmed vocabulary, at the plain-text targets of a
packed batch (`canvas.training.fim.Rows`). Distilling from it instead of from the converted base lets the adapters
learn back what the conversion cost (the former global layers' rope theta; BENCHMARKS.md, issue 28) while the corpus
only supplies inputs, so its narrow style is not what they learn.

Invariants: the teacher is frozen and runs under `no_grad`; its distribution is renormalised over the trimmed ids
that exist in Gemma's vocabulary (the others, e.g. the FIM sentinels renamed from `<unusedN>`, get probability 0,
as a finite log-probability, so a KL against it stays finite);
rows come out in the row-major order of `kind[:, 1:] == PLAIN`, the order the trainer gathers its own positions in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from canvas.training.fim import PLAIN, Rows


def trimmed_to_gemma_ids(trimmed_tok: Any, gemma_tok: Any) -> Tensor:
    """Gemma's id for each trimmed id, -1 where Gemma has no such token. (V_trim,)"""
    vocab = gemma_tok.get_vocab()
    out = [vocab.get(trimmed_tok.convert_ids_to_tokens(i), -1) for i in range(len(trimmed_tok))]
    return torch.tensor(out, dtype=torch.long)


class GemmaTeacher:
    """Gemma 3 restricted to a trimmed vocabulary: `plain_log_probs(rows)` -> (N_plain, V_trim) log-probabilities."""

    def __init__(self, model: Any, gemma_ids: Tensor) -> None:
        self.model = model.eval().requires_grad_(False)
        self.gemma_ids = gemma_ids
        keep = gemma_ids >= 0
        embed = model.get_input_embeddings().weight
        rows = torch.zeros(gemma_ids.numel(), embed.shape[1], dtype=embed.dtype, device=embed.device)
        rows[keep] = embed[gemma_ids[keep].to(embed.device)]
        self.head = rows  # (V_trim, M): the tied head's rows in the trimmed order
        self.missing = ~keep.to(embed.device)  # (V_trim,)
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    @classmethod
    def load(cls, base: Path, cache: Path | None = None, device: torch.device | None = None) -> GemmaTeacher:
        """The cached HF copy the build made (`<cache>/gemma3/hf`) against the base's own tokenizer."""
        from transformers import AutoTokenizer

        from canvas.convert.source import load_gemma3

        root = cache or Path.home() / ".cache" / "dcanvas"
        hf = root / "gemma3" / "hf"
        if not (hf / "config.json").is_file():
            raise FileNotFoundError(f"no cached Gemma 3 at {hf}: `dcanvas model build` writes it")
        model, gemma_tok = load_gemma3(hf)
        trimmed = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
        return cls(model.to(device or torch.device("cpu")), trimmed_to_gemma_ids(trimmed, gemma_tok))

    @torch.no_grad()
    def plain_log_probs(self, rows: Rows) -> Tensor:
        """Log-probabilities of the next token at every position whose target is PLAIN. (N_plain, V_trim)"""
        # (B, T): position t predicts target t+1; the row's last position has no target inside the row
        plain = F.pad(rows.kind[:, 1:] == PLAIN, (0, 1))
        spans: list[tuple[int, int, int]] = []  # (row, start, end) of each piece with a plain target, in row order
        for b in range(rows.ids.shape[0]):
            seg = rows.segment[b]
            for s in torch.unique(seg[plain[b]]).tolist():  # ascending: pieces in the order they sit in the row
                where = (seg == s).nonzero().flatten()
                spans.append((b, int(where[0]), int(where[-1]) + 1))
        if not spans:
            return torch.empty(0, self.head.shape[0])
        longest = max(e - s for _, s, e in spans)
        ids = torch.zeros(len(spans), longest, dtype=torch.long)
        mask = torch.zeros(len(spans), longest, dtype=torch.long)
        for i, (b, s, e) in enumerate(spans):
            ids[i, : e - s] = self.gemma_ids[rows.ids[b, s:e].cpu()].clamp_min(0)
            mask[i, : e - s] = 1
        device = self.head.device
        h = self.model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state  # (P, L, M)
        picked = [h[i, : e - s][plain[b, s:e].to(device)] for i, (b, s, e) in enumerate(spans)]
        x = torch.cat(picked)  # (N_plain, M)
        logits = F.linear(x, self.head).float()  # (N_plain, V_trim)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        logits = logits.masked_fill(self.missing, -1e9)  # probability 0, yet finite: KL's 0 * log 0 stays 0, not nan
        return torch.log_softmax(logits, dim=-1)
