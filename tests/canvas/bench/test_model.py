"""`dcanvas bench model` pieces: the trimmed-vocabulary emulation keeps the logits of the kept tokens, and a run
reports every component for fp32 and the compared dtype."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from canvas.bench.model import COMPONENTS, bench_model, register, trim_reference, trim_vocab
from canvas.model import DiffusionModel, ModelConfig


def test_trimmed_vocab_keeps_the_kept_tokens_logits(tmp_path: Path) -> None:
    """Ours and the reference, both cut to the first n rows, give the full models' logits for those n tokens."""
    from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

    cfg = dataclasses.replace(ModelConfig.from_name("tiny"), final_logit_softcapping=None)
    torch.manual_seed(0)
    DiffusionModel(cfg).save_pretrained(str(tmp_path))
    full = DiffusionModel.from_pretrained(str(tmp_path))
    n = 200
    small = trim_vocab(full, n)
    assert small.config.vocab_size == n and small.embed.shape == (n, cfg.hidden_size)
    g = torch.Generator().manual_seed(1)
    prompt, canvas = torch.randint(3, n, (1, 7), generator=g), torch.randint(0, n, (1, cfg.canvas_length), generator=g)
    want = full.denoise(canvas, full.encode(prompt, logits="none")[1])[..., :n]
    torch.testing.assert_close(small.denoise(canvas, small.encode(prompt, logits="none")[1]), want)
    ref = trim_reference(DiffusionGemmaForBlockDiffusion.from_pretrained(str(tmp_path)).eval(), n)
    with torch.no_grad():
        cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
        ref.model.encoder(input_ids=prompt, past_key_values=cache)
        h = ref.model.decoder(decoder_input_ids=canvas, past_key_values=cache).last_hidden_state
        theirs = ref.lm_head(h)
    assert theirs.shape[-1] == n
    torch.testing.assert_close(theirs, want, rtol=1e-4, atol=1e-4)


def test_bench_model_reports_every_component_per_dtype() -> None:
    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args(["--preset", "tiny", "--prompt", "6", "--window", "20", "--gap", "6", "--runs", "1",
                              "--steps", "2", "--dtype", "bf16", "--trim-vocab", "300", "--no-reference"])
    out = bench_model(args)
    assert out["dtype_chosen"] == "bf16" and set(out["rows"]) == {"fp32", "bf16"}
    for row in out["rows"].values():
        assert set(row["ours_ms"]) == set(COMPONENTS) and row["reference_ms"] is None
        assert row["shape"] == {"vocab": 300, "prompt": 6, "window": 20, "gap": 6, "canvas": 32}
        assert all(ms > 0 for c, ms in row["ours_ms"].items() if c != "soft_embedding")
    assert 0.0 <= out["bf16_vs_fp32"]["top1_agreement"] <= 1.0
    assert out["machine"]["cpu_kind"] in ("amx", "avx512_bf16", "arm_bf16", "avx2", "other")
    assert out["acceptance"]["window_step_s"] > 0
