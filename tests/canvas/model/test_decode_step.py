"""The encoder's decode step (one token a row through the static cache) and its int8 decode weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from canvas.env import DECODE_INT8, Q8_ISA
from canvas.model import DiffusionModel, ModelConfig
from canvas.model.int8 import (
    DECODE_ROWS,
    Q8_AVX2_ROWS,
    ROW_LIMITS,
    Int8Linear,
    Scheme,
    decode_scheme,
    quantize_decode,
    row_limit,
)
from kernels import q8_gemm

# A converted Gemma-3-270M that `dcanvas model build` left in its cache (any vocabulary size).
_BUILT = sorted((Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dcanvas" / "models").glob(
    "gemma3-270m-dg*/config.json"))
REAL = _BUILT[0].parent if _BUILT else Path("no-converted-gemma3")


@pytest.fixture()
def model() -> DiffusionModel:
    torch.manual_seed(0)
    return DiffusionModel(ModelConfig.from_name("tiny")).eval()


def _steps(model: DiffusionModel, prefix: torch.Tensor, fed: torch.Tensor, *, mask: bool = False) -> torch.Tensor:
    """Logits (B, n, V) of feeding `fed` (B, n) one token at a time after `prefix` (B, P); `mask` passes an
    all-true attention mask with each step (the general, masked path)."""
    B, n = fed.shape
    _, cache = model.encode(prefix, cache=model.new_cache(B, prefix.shape[1] + n), logits="none")
    out = []
    for i in range(n):
        am = torch.ones(B, 1, dtype=torch.bool) if mask else None
        logits, _ = model.encode(fed[:, i : i + 1], am, cache, logits="last")
        assert logits is not None
        out.append(logits[:, -1])
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("prefix_len", [3, 40])  # inside the sliding window (16) and past it
def test_decode_steps_equal_one_pass_over_the_whole_text(model: DiffusionModel, prefix_len: int) -> None:
    """Step by step through the window filling up and sliding, batch of 3: the same logits as one causal pass."""
    g = torch.Generator().manual_seed(1)
    V, n = model.config.vocab_size, 2 * model.config.sliding_window
    ids = torch.randint(3, V, (3, prefix_len + n), generator=g)
    stepped = _steps(model, ids[:, :prefix_len], ids[:, prefix_len:])
    whole, _ = model.encode(ids)
    assert whole is not None
    torch.testing.assert_close(stepped, whole[:, prefix_len:], rtol=1e-4, atol=1e-4)
    assert torch.equal(stepped.argmax(-1), whole[:, prefix_len:].argmax(-1))
    torch.testing.assert_close(stepped, _steps(model, ids[:, :prefix_len], ids[:, prefix_len:], mask=True))


@pytest.mark.parametrize("batch", [1, 3])  # the sparse (picked experts) and the dense experts paths
def test_a_zero_routed_norm_skips_the_experts_exactly(model: DiffusionModel, batch: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The converted Gemma's routed branch ends in an all-zero norm weight: the step skips the experts, and its
    logits are those of running them, bit for bit; a nonzero weight turns them back on."""
    from canvas.model import decode

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, model.config.vocab_size, (batch, 12), generator=g)
    with torch.no_grad():
        for layer in model.blocks:
            layer.post_feedforward_layernorm_2.zero_()
    assert not any(decode._routed_on(layer) for layer in model.blocks)
    skipped = _steps(model, ids[:, :4], ids[:, 4:])
    monkeypatch.setattr(decode, "_routed_on", lambda layer: True)
    assert torch.equal(skipped, _steps(model, ids[:, :4], ids[:, 4:]))
    monkeypatch.undo()
    whole, _ = model.encode(ids)
    assert whole is not None
    torch.testing.assert_close(skipped, whole[:, 4:], rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        model.blocks[0].post_feedforward_layernorm_2[0] = 1.0
    assert decode._routed_on(model.blocks[0])  # in-place change seen (version counter)


def test_decode_steps_after_a_padded_prefix_mask_the_padding(model: DiffusionModel) -> None:
    """A left-padded row's steps see none of its padding: they equal the same row encoded without it."""
    g = torch.Generator().manual_seed(2)
    V = model.config.vocab_size
    text = torch.randint(3, V, (1, 6), generator=g)
    fed = torch.randint(3, V, (1, 5), generator=g)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), text], dim=1)
    am = torch.cat([torch.zeros(1, 4, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)], dim=1)
    _, cache = model.encode(padded, am, model.new_cache(1, 15), logits="none")
    got = []
    for i in range(5):
        logits, _ = model.encode(fed[:, i : i + 1], cache=cache, logits="last")
        assert logits is not None
        got.append(logits[:, -1])
    # Positions count the padding (as in the reference), so the unpadded row runs at shifted positions: compare
    # against the general masked path on the same padded cache instead.
    _, cache2 = model.encode(padded, am, model.new_cache(1, 15), logits="none")
    want = [model.encode(fed[:, i : i + 1], torch.ones(1, 1, dtype=torch.bool), cache2, logits="last")[0]
            for i in range(5)]
    torch.testing.assert_close(torch.stack(got), torch.stack([w[:, -1] for w in want if w is not None]))


@pytest.mark.parametrize("scheme", ["weight", "dynamic", "q8"])
@pytest.mark.parametrize("k", [40, 64, 1032])  # 40 and 1032: not multiples of int8pack's 16 (40: nor of q8's 32)
def test_int8_linear_is_close_to_the_fp32_linear(scheme: str, k: int) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, k, generator=g) * 0.05
    w[5] = 0.0  # an all-zero output channel
    for rows in (1, 8):
        x = torch.randn(2, rows, k, generator=g)
        want = F.linear(x, w)
        got = Int8Linear(w, scheme)(x)  # type: ignore[arg-type]
        assert got.shape == want.shape and got.dtype == torch.float32
        assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())
        assert torch.equal(got[..., 5], torch.zeros_like(got[..., 5]))


def test_int8_linear_rejects_what_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="fp32"):
        Int8Linear(torch.zeros(4, 4, dtype=torch.bfloat16), "weight")
    with pytest.raises(ValueError, match="scheme"):
        Int8Linear(torch.zeros(4, 4), "int4")  # type: ignore[arg-type]


def test_q8_serves_prefill_only_where_its_kernel_has_vnni(model: DiffusionModel,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without VNNI (the AVX2 and scalar builds) the q8 kernel loses to fp32's GEMM at prefill's row counts: only
    passes of at most Q8_AVX2_ROWS rows (a few users' drafts) take the q8 weights there."""
    quantize_decode(model, "q8")
    for isa in ("avx2", "scalar"):
        monkeypatch.setenv(Q8_ISA.name, isa)
        try:
            q8_gemm.build_isa()
        except ValueError as e:  # a CPU without AVX2
            assert isa == "avx2", e
            continue
        assert row_limit("q8") == Q8_AVX2_ROWS
        assert model.int8_for(Q8_AVX2_ROWS) and not model.int8_for(Q8_AVX2_ROWS + 1)
    monkeypatch.delenv(Q8_ISA.name)
    if q8_gemm.build_isa() == "avx512_vnni":
        assert row_limit("q8") == ROW_LIMITS["q8"] and model.int8_for(4096)
    assert row_limit("weight") == row_limit("dynamic") == DECODE_ROWS


@pytest.mark.parametrize("scheme", ["weight", "q8"])
def test_int8_weights_serve_decode_steps_only(model: DiffusionModel, scheme: Scheme) -> None:
    """The denoiser keeps exact fp32, and prefill (more than DECODE_ROWS rows) too under "weight" ("q8" serves it:
    `ROW_LIMITS`); decode steps change, but little; dropping the int8 weights restores fp32 exactly."""
    g = torch.Generator().manual_seed(4)
    V, L = model.config.vocab_size, model.config.canvas_length
    prefix = torch.randint(3, V, (1, DECODE_ROWS + 4), generator=g)
    fed = torch.randint(3, V, (1, 6), generator=g)
    canvas = torch.randint(3, V, (1, L), generator=g)
    pre, cache = model.encode(prefix, logits="all")
    denoised = model.denoise(canvas, cache)
    fp32_steps = _steps(model, prefix, fed)
    quantize_decode(model, scheme)
    assert model.decode_int8 == scheme and all(b.attn.qkv_int8 is not None for b in model.blocks)
    pre_q, cache_q = model.encode(prefix, logits="all")
    assert pre is not None and pre_q is not None
    assert torch.equal(model.denoise(canvas, cache), denoised)
    if scheme == "q8":
        # Random tiny weights: close in direction (the real model's bound is the probe check's). A random model
        # amplifies rounding chaotically (one 20-token prefix's logits: cosine 0.91-0.995 over seeds), so the
        # direction is judged over 8 prefixes at once.
        assert not torch.equal(pre, pre_q)
        batch = torch.randint(3, V, (8, DECODE_ROWS + 4), generator=g)
        many_q = model.encode(batch, logits="all")[0]
        model.int8_rows = 0  # every pass in fp32
        many = model.encode(batch, logits="all")[0]
        assert many is not None and many_q is not None
        assert float(F.cosine_similarity(many.flatten(), many_q.flatten(), dim=0)) > 0.95
        model.int8_rows = DECODE_ROWS  # below: the steps alone through int8, after an fp32 prefill, as "weight"
    else:
        assert torch.equal(pre, pre_q) and torch.equal(model.denoise(canvas, cache_q), denoised)
    int8_steps = _steps(model, prefix, fed)
    model.int8_rows = None
    assert not torch.equal(int8_steps, fp32_steps)
    # Random tiny weights amplify rounding (bf16 activations, int8 weights) through every layer; real weights stay far
    # closer (the slow test below). Here: the same direction, the same top-1.
    assert float(F.cosine_similarity(int8_steps.flatten(), fp32_steps.flatten(), dim=0)) > 0.95
    assert torch.equal(int8_steps.argmax(-1), fp32_steps.argmax(-1))
    quantize_decode(model, None)
    assert model.head_int8 is None and torch.equal(_steps(model, prefix, fed), fp32_steps)


def test_decode_scheme_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DECODE_INT8.name, raising=False)
    assert decode_scheme() is None
    monkeypatch.setenv(DECODE_INT8.name, "Weight")
    assert decode_scheme() == "weight"
    assert decode_scheme("off") is None and decode_scheme("dynamic") == "dynamic"
    monkeypatch.setenv(DECODE_INT8.name, "int4")
    with pytest.raises(ValueError, match=DECODE_INT8.name):
        decode_scheme()


def test_int8_decode_needs_an_fp32_model(model: DiffusionModel) -> None:
    with pytest.raises(ValueError, match="fp32"):
        quantize_decode(model.to(torch.bfloat16), "weight")


@pytest.mark.slow
@pytest.mark.skipif(not (REAL / "config.json").is_file(), reason=f"no converted model at {REAL}")
def test_real_model_decode_steps_greedy_tokens_equal_one_pass_and_int8_stays_close() -> None:
    from canvas.bench.ar import ArShape, int8_fidelity

    torch.set_num_threads(1)
    model = DiffusionModel.from_pretrained(str(REAL)).eval()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, model.config.vocab_size, (1, 520 + 24), generator=g)  # the 512 window slides
    stepped = _steps(model, ids[:, :520], ids[:, 520:])
    whole, _ = model.encode(ids, logits="all")
    assert whole is not None
    assert torch.equal(stepped.argmax(-1), whole[:, 520:].argmax(-1))
    fid = int8_fidelity(model, "weight", ArShape(prompt=64, tokens=24, batch=1, runs=1))
    assert fid["top1_agree"] >= 0.8 and fid["kl"] < 0.05 and 0.9 < fid["ppl_ratio"] < 1.1


def test_auto_gives_int8_decoding_to_large_fp32_models_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from canvas.model.int8 import AUTO_MIN_PARAMS, scheme_for
    from kernels import q8_gemm

    monkeypatch.delenv(DECODE_INT8.name, raising=False)
    torch.manual_seed(0)
    tiny = DiffusionModel(ModelConfig.from_name("tiny")).eval()
    assert sum(p.numel() for p in tiny.parameters()) < AUTO_MIN_PARAMS
    assert scheme_for(tiny) is None and scheme_for(tiny, "auto") is None  # small: exact fp32
    assert scheme_for(tiny, "weight") == "weight"
    with torch.device("meta"):  # the converted Gemma-3-270M's size, no memory
        big = DiffusionModel(ModelConfig.from_name("tiny").replace(vocab_size=98_304, hidden_size=640), init=False)
    # q8 where its kernel builds (within the probe bound, BENCHMARKS.md issue 31); "weight" where it does not.
    assert scheme_for(big) == "q8"
    monkeypatch.setattr(q8_gemm, "available", lambda: False)
    assert scheme_for(big) == "weight"
    assert scheme_for(tiny, "q8") == "q8"
    monkeypatch.setenv(DECODE_INT8.name, "off")
    assert scheme_for(big) is None
    assert scheme_for(tiny.to(torch.bfloat16), "weight") is None  # never for a non-fp32 model
    with pytest.raises(ValueError, match=DECODE_INT8.name):
        scheme_for(tiny, "int4")


def test_the_attention_output_masks_its_dead_columns_under_q8() -> None:
    """The converted Gemma's anchor dims (large values under weight columns that quantise to zero) would set their
    q8 block's scale and cost that block's other values their precision (news NLL/char 1.099x fp32): under q8 the
    attention output's activations there are masked out before quantisation; "dynamic" keeps it weight-only."""
    from canvas.model.int8 import quantize_decode

    torch.manual_seed(0)
    model = DiffusionModel(ModelConfig.from_name("tiny")).eval()
    dead = [1, 7]
    with torch.no_grad():
        for b in model.blocks:
            b.attn.o_proj[:, dead] = 0
            b.attn.o_proj[0, dead] = 1e-6 * b.attn.o_proj.abs().max()  # rounds to zero in q8: dead too
    quantize_decode(model, "q8")
    for b in model.blocks:
        assert b.attn.o_proj_int8.scheme == "q8"
        t = b.attn.o_proj_int8.weight_tensors()
        assert t is not None and t[3] is not None
        assert t[3].nonzero().numel() == b.attn.o_proj.shape[1] - 2 and (t[3][dead] == 0).all()
        assert b.attn.qkv_int8.scheme == "q8" and b.mlp_down_int8.scheme == "q8"
        assert b.attn.qkv_int8.weight_tensors()[3] is None  # every column live: no mask, no cost
    quantize_decode(model, "dynamic")
    assert all(b.attn.o_proj_int8.scheme == "weight" for b in model.blocks)
