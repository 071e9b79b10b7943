"""The probe set: short texts of the kinds users write that the training corpus lacks, for vocabulary and fidelity.

Owns `probes.jsonl` (committed, read-only at run time) and the two measures `dcanvas model check` reports per kind:
- tokens per character of a (trimmed) tokenizer against Gemma 3's full one on the same text (1.00 = no extra
  tokens; a trimmed vocabulary that splits common words shows here first), and
- NLL per character of a causal model over a text, each model under its own tokenizer (so a vocabulary that
  splits words into pieces the model never saw pays for it here, where a per-token perplexity would hide it).

Kinds: news and fiction (original texts written for this probe, in the style of a wire service and of present-day
fiction), technical prose (package READMEs shipped in wheels: starlette, httpx, uvicorn, textual, rich), code
(CPython's textwrap.py and shlex.py, npm's JavaScript) and dialogue (chatterbot-corpus's English conversations).
None of it is in the corpus (the Bible, Austen, the Python documentation's reST, fortunes). Each record says its
source and licence. `python -m canvas.convert.probes build SRC_DIR` rebuilds the file from those sources (how
exactly is in `build`); `... sweep` prints tokens per character for several trimmed sizes. The committed file is
what every measurement reads, so figures stay comparable from run to run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

PROBES = Path(__file__).resolve().parent / "probes.jsonl"
KINDS = ("news", "fiction", "technical", "code", "dialogue")


@dataclass(frozen=True, slots=True)
class Probe:
    kind: str
    source: str
    licence: str
    text: str


def load_probes(path: Path = PROBES) -> list[Probe]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("kind") not in KINDS or not rec.get("text"):
            raise ValueError(f"{path}:{n}: a probe needs a kind in {KINDS} and a text")
        out.append(Probe(rec["kind"], rec["source"], rec["licence"], rec["text"]))
    return out


def by_kind(probes: Iterable[Probe]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {k: [] for k in KINDS}
    for p in probes:
        out[p.kind].append(p.text)
    return {k: v for k, v in out.items() if v}


# ---- measures ---------------------------------------------------------------------------------------------------
def token_count(tokenizer: Any, texts: Sequence[str]) -> int:
    """Tokens over `texts` with no special tokens (a `tokenizers.Tokenizer` or a transformers fast tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return sum(len(e.ids) for e in backend.encode_batch(list(texts), add_special_tokens=False))


def tokens_per_char_ratio(tokenizer: Any, full: Any, texts: Sequence[str]) -> float:
    """Tokens `tokenizer` needs on `texts` over the tokens `full` needs (1.03 = 3% more)."""
    return token_count(tokenizer, texts) / max(1, token_count(full, texts))


@torch.no_grad()
def nll_per_char(logits_fn: Any, tok: Any, texts: Sequence[str], max_chars: int = 1600) -> float:
    """Mean NLL (nats) per character of `texts`, each cut to its first `max_chars` characters at a space.

    `logits_fn(ids (1, T)) -> (1, T, V)` logits; `tok` a transformers tokenizer that adds BOS. Every token after
    BOS is predicted, so the sum covers the whole text whatever the tokenization: per character it compares
    models with different vocabularies fairly."""
    nll = 0.0
    chars = 0
    for text in texts:
        cut = text if len(text) <= max_chars else text[: text.rfind(" ", 0, max_chars) or max_chars]
        ids = tok(cut, return_tensors="pt").input_ids  # (1, T), BOS first
        logits = logits_fn(ids)[0, :-1].float()  # (T-1, V)
        nll += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        chars += len(cut)
    if chars == 0:
        raise ValueError("no text to score")
    return nll / chars


@dataclass(frozen=True, slots=True)
class KindReport:
    kind: str
    texts: int
    chars: int
    tokens_ratio: float  # tokens the model's tokenizer needs / tokens Gemma 3's full one needs
    nll_original: float  # nats per character, Gemma 3 (fp32, its own tokenizer)
    nll_model: float  # nats per character, our encoder (its own tokenizer)

    @property
    def nll_ratio(self) -> float:
        return self.nll_model / self.nll_original


# The bounds a regression must not cross (issue 28): a trimmed vocabulary within 3% of the full one's tokens, and
# the converted, trimmed encoder within 5% of the original's NLL per character, on every kind.
MAX_TOKENS_RATIO = 1.03
MAX_NLL_RATIO = 1.05


@torch.no_grad()
def probe_report(original: Any, original_tok: Any, model: Any, model_tok: Any,
                 probes: Sequence[Probe] | None = None, max_chars: int = 1600) -> list[KindReport]:
    """Per kind: our tokenizer's tokens against the original's, and NLL per character of both models.

    `original` is a transformers causal LM (`.logits`), `model` a `DiffusionModel` (its encoder's AR logits)."""
    out = []
    for kind, texts in by_kind(load_probes() if probes is None else probes).items():
        nll_o = nll_per_char(lambda ids: original(input_ids=ids).logits, original_tok, texts, max_chars)
        nll_m = nll_per_char(lambda ids: model.encode(ids)[0], model_tok, texts, max_chars)
        out.append(KindReport(kind, len(texts), sum(map(len, texts)),
                              tokens_per_char_ratio(model_tok, original_tok, texts), nll_o, nll_m))
    return out


# ---- building the committed file ----------------------------------------------------------------------------------
def chunks(text: str, size: int = 1500, limit: int | None = None) -> list[str]:
    """`text` cut into runs of whole paragraphs (blank-line separated) of about `size` characters; at most
    `limit` characters in all."""
    out: list[str] = []
    run: list[str] = []
    total = 0
    for para in re.split(r"\n\s*\n", text.strip()):
        if not para.strip():
            continue
        run.append(para.rstrip())
        if sum(len(p) for p in run) >= size:
            out.append("\n\n".join(run))
            total += len(out[-1])
            run = []
            if limit is not None and total >= limit:
                return out
    if run and (limit is None or total < limit):
        out.append("\n\n".join(run))
    return out


def _metadata_description(path: Path) -> str:
    """A wheel's long description: what follows the first blank line of its METADATA."""
    text = path.read_text(encoding="utf-8")
    return text.split("\n\n", 1)[1] if "\n\n" in text else ""


def _conversations(path: Path) -> list[str]:
    """chatterbot-corpus YAML: each conversation as lines of turns."""
    import yaml

    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    return ["\n".join(str(t) for t in conv) for conv in doc.get("conversations", []) if len(conv) > 1]


def build(src: Path, per_kind: int = 24_000) -> list[dict[str, str]]:
    """The records, from `src`: news.txt and fiction.txt (items split by `---` lines), site-packages (the wheels'
    METADATA), a CPython lib directory (`python/`), npm's lib (`npm/`) and chatterbot-corpus's English data
    (`chatterbot/`). About `per_kind` characters of each kind."""
    recs: list[dict[str, str]] = []

    def add(kind: str, source: str, licence: str, texts: Iterable[str]) -> None:
        have = sum(len(r["text"]) for r in recs if r["kind"] == kind)
        for t in texts:
            if have >= per_kind:
                return
            recs.append({"kind": kind, "source": source, "licence": licence, "text": t.strip()})
            have += len(t)

    for kind in ("news", "fiction"):
        items = [t.strip() for t in (src / f"{kind}.txt").read_text(encoding="utf-8").split("\n---\n")]
        add(kind, f"original text written for this probe ({kind})", "same as this project", items)
    for pkg, lic in (("starlette", "BSD-3-Clause"), ("httpx", "BSD-3-Clause"), ("uvicorn", "BSD-3-Clause"),
                     ("textual", "MIT"), ("rich", "MIT")):
        meta = next((src / "site-packages").glob(f"{pkg}-*.dist-info/METADATA"))
        add("technical", f"{meta.parent.name} README", lic, chunks(_metadata_description(meta), limit=6_000))
    for name in ("textwrap.py", "shlex.py"):
        add("code", f"CPython 3.11 Lib/{name}", "PSF-2.0", chunks((src / "python" / name).read_text(), limit=9_000))
    for js in sorted((src / "npm").glob("*.js")):
        add("code", f"npm lib/{js.name}", "Artistic-2.0", chunks(js.read_text(encoding="utf-8"), limit=3_000))
    for yml in sorted((src / "chatterbot").glob("*.yml")):
        convs = _conversations(yml)
        add("dialogue", f"chatterbot-corpus english/{yml.name}", "BSD-3-Clause",
            ["\n\n".join(convs[i : i + 6]) for i in range(0, len(convs), 6)])
    return recs


def sweep(sizes: Sequence[int], tokenizer_json: Path, ranking: Path | None = None,
          probes: Sequence[Probe] | None = None) -> dict[int, dict[str, float]]:
    """Tokens per character against the full tokenizer, per kind, for each trimmed size (the build's selection)."""
    from tokenizers import Tokenizer

    from canvas.convert.vocab import FIM_SOURCES, RANKING, load_ranking, trim_vocab

    tj = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    full = Tokenizer.from_str(json.dumps(tj))
    kinds = by_kind(load_probes() if probes is None else probes)
    ranked = load_ranking(ranking or RANKING)
    out = {}
    for size in sizes:
        tok = trim_vocab(tj, ranked, size, sentinels=FIM_SOURCES).tokenizer()
        out[size] = {k: tokens_per_char_ratio(tok, full, texts) for k, texts in kinds.items()}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m canvas.convert.probes",
                                description="Rebuild probes.jsonl, or sweep trimmed sizes over it.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="rebuild probes.jsonl from its sources")
    b.add_argument("src", type=Path, help="news.txt, fiction.txt, site-packages/, python/, npm/, chatterbot/")
    b.add_argument("--out", type=Path, default=PROBES)
    b.add_argument("--per-kind", type=int, default=24_000, help="characters of each kind (about)")
    w = sub.add_parser("sweep", help="tokens per character against the full vocabulary, per kind and size")
    w.add_argument("--sizes", default="32768,49152,57344,65536,98304")
    w.add_argument("--tokenizer", type=Path, default=Path.home() / ".cache/dcanvas/gemma3/hf/tokenizer.json")
    w.add_argument("--ranking", type=Path, default=None, help="default: the committed ranking")
    args = p.parse_args(argv)
    if args.cmd == "sweep":
        table = sweep([int(x) for x in args.sizes.split(",")], args.tokenizer, args.ranking)
        kinds = list(next(iter(table.values())))
        print(f"{'size':>7} " + " ".join(f"{k:>10}" for k in kinds) + f" {'worst':>8}")
        for size, row in table.items():
            print(f"{size:>7} " + " ".join(f"{v:>9.3f}x" for v in row.values()) + f" {max(row.values()):>7.3f}x")
        print(json.dumps({str(k): v for k, v in table.items()}))
        return 0
    recs = build(args.src, args.per_kind)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    sizes = {k: sum(len(r["text"]) for r in recs if r["kind"] == k) for k in KINDS}
    print(f"{len(recs)} probes -> {args.out}: " + ", ".join(f"{k} {v:,}" for k, v in sizes.items()), file=sys.stderr)
    return 0 if all(sizes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
