"""Sampler settings: a model's generation_config.json round-trips, feeds the defaults, and bad files say where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from canvas.model import PRESETS, DiffusionModel, save_pretrained
from canvas.protocol import GenDefaults, ModelInfo
from canvas.sampling.modes import EXTRA_FILE
from canvas.sampling.sampler import SamplerConfig, load_sampler_defaults, select_accepted


def test_generation_config_round_trip() -> None:
    cfg = SamplerConfig(max_steps=16, entropy_bound=0.3, t_max=0.7, t_min=0.2, confidence_threshold=0.05)
    raw = json.loads(json.dumps(cfg.to_generation_config()))
    assert raw["max_denoising_steps"] == 16 and raw["sampler_config"]["entropy_bound"] == 0.3
    assert SamplerConfig.from_generation_config(raw) == cfg
    # The transformers layout with keys we do not use, and a partial file keeping the reference defaults.
    assert SamplerConfig.from_generation_config({"max_denoising_steps": 8, "bos_token_id": 1}) == SamplerConfig(
        max_steps=8
    )


@pytest.mark.parametrize("fill", [-0.1, 1.5])
def test_gap_min_fill_is_a_share(fill: float) -> None:
    with pytest.raises(ValueError, match="gap_min_fill"):
        SamplerConfig(gap_min_fill=fill)


def test_save_pretrained_writes_the_model_defaults(tmp_path: Path) -> None:
    model = DiffusionModel(PRESETS["tiny"])
    save_pretrained(model, tmp_path / "reference")
    assert load_sampler_defaults(tmp_path / "reference") == SamplerConfig()
    tuned = SamplerConfig(max_steps=12, entropy_bound=0.5, gap_min_fill=0.75)
    save_pretrained(model, tmp_path / "tuned", sampler=tuned)
    assert load_sampler_defaults(tmp_path / "tuned") == tuned
    gen = json.loads((tmp_path / "tuned" / "generation_config.json").read_text())
    # gap_min_fill has no generation_config.json key (transformers refuses unknown ones): it lives beside it.
    assert "gap_min_fill" not in gen
    assert gen["bos_token_id"] == PRESETS["tiny"].bos_token_id  # the token ids stay beside the sampler fields


@pytest.mark.parametrize(
    ("content", "why"),
    [("{oops", "Expecting"), ("[1]", "not a JSON object"), ('{"max_denoising_steps": "many"}', "must be a number"),
     ('{"max_denoising_steps": 0}', "max_steps"), ('{"max_denoising_steps": 2.5}', "must be a number"),
     ('{"t_min": 0.9}', "t_min")],
)  # fmt: skip
def test_bad_generation_config_names_the_file(tmp_path: Path, content: str, why: str) -> None:
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=why) as info:
        load_sampler_defaults(tmp_path)
    assert "generation_config.json" in str(info.value)


@pytest.mark.parametrize("content", ['{"gap_min_fill": "most"}', '{"gap_min_fill": 2}', "[]"])
def test_bad_extra_sampler_file_names_the_file(tmp_path: Path, content: str) -> None:
    (tmp_path / EXTRA_FILE).write_text(content)
    with pytest.raises(ValueError, match=EXTRA_FILE):
        load_sampler_defaults(tmp_path)


def test_missing_generation_config_gives_the_reference_defaults(tmp_path: Path) -> None:
    assert load_sampler_defaults(tmp_path) == SamplerConfig()


def test_the_wire_fallback_defaults_are_the_sampler_defaults() -> None:
    """A welcome without `defaults` (an older server) means the reference defaults; both spellings must agree."""
    wire = ModelInfo(name="m", canvas_length=8, modes=["diffusion"]).defaults
    assert {k: getattr(SamplerConfig(), k) for k in GenDefaults.model_fields} == wire.model_dump()


def test_select_accepted_matches_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    entropy = torch.rand(3, 20, generator=g)
    free = torch.rand(3, 20, generator=g) < 0.7
    got = select_accepted(entropy, free, 0.4)
    for b in range(3):
        order = sorted((float(e), i) for i, e in enumerate(entropy[b]) if free[b, i])
        want, total = set(), 0.0
        for e, i in order:
            if total <= 0.4:  # cumulative entropy of the slots before this one
                want.add(i)
            total += e
        assert {i for i in range(20) if got[b, i]} == want


# ---- AR mode's truncation (llama.cpp's top_k / top_p / min_p) -----------------------------------------------------
def test_truncate_logits_keeps_what_each_cut_allows() -> None:
    from canvas.sampling.sampler import truncate_logits

    probs = torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]])
    logits = probs.log()
    kept = lambda out: (out > -torch.inf)[0].tolist()  # noqa: E731
    assert truncate_logits(logits) is logits  # all off: untouched
    assert kept(truncate_logits(logits, top_k=2)) == [True, True, False, False, False]
    assert kept(truncate_logits(logits, top_p=0.7)) == [True, True, False, False, False]  # 0.5 + 0.25 reach 0.7
    assert kept(truncate_logits(logits, top_p=0.75)) == [True, True, False, False, False]
    assert kept(truncate_logits(logits, top_p=0.76)) == [True, True, True, False, False]
    assert kept(truncate_logits(logits, min_p=0.3)) == [True, True, True, False, False]  # >= 0.3 * 0.5
    assert kept(truncate_logits(logits, top_p=0.01)) == [True, False, False, False, False]  # the best stays
    both = truncate_logits(logits.expand(2, -1), top_k=3, min_p=0.5)
    assert (both > -torch.inf).tolist() == [[True, True, False, False, False]] * 2


def test_top_p_within_top_k_equals_the_cut_over_the_whole_vocabulary() -> None:
    """With top-k on, top-p is cut among the k survivors (no sort of the vocabulary): the same tokens as cutting
    the top-k result over the vocabulary; tied logits take the general path and keep its result too."""
    from canvas.sampling.sampler import truncate_logits

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=g) * 3
    logits[5, :50] = 7.0  # ties across the k-th value
    for k, p in ((40, 0.9), (40, 0.5), (1, 0.9), (300, 0.99), (40, 0.0001)):
        whole = truncate_logits(truncate_logits(logits, top_k=k), top_p=p)
        assert torch.equal(truncate_logits(logits, top_k=k, top_p=p), whole), (k, p)


def test_sample_categorical_draws_by_probability_and_never_a_zero() -> None:
    from canvas.sampling.sampler import sample_categorical

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])  # any positive sum
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_categorical(probs, g) for _ in range(4000)])  # (N, 2)
    assert (draws[:, 1] == 5).all()
    freq = torch.bincount(draws[:, 0], minlength=6).float() / len(draws)
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq[[1, 3, 4]], torch.tensor([0.5, 0.3, 0.2]), atol=0.03)  # ~4 sigma at N=4000


def test_sample_categorical_at_the_ends_of_the_uniform_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draw of 0 takes the first token of positive probability, a draw that rounds up to the total the last:
    never a zero-probability neighbour."""
    from canvas.sampling import sampler

    probs = torch.tensor([[0.0, 0.25, 0.75, 0.0, 0.0]])
    for u, want in ((0.0, 1), (1.0, 2)):
        monkeypatch.setattr(sampler.torch, "rand", lambda n, **_: torch.full((n,), u))  # noqa: B023
        assert sampler.sample_categorical(probs).tolist() == [want]


def test_truncation_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="ar_top_k"):
        SamplerConfig(ar_top_k=-1)
    with pytest.raises(ValueError, match="ar_top_p"):
        SamplerConfig(ar_top_p=0.0)
    with pytest.raises(ValueError, match="ar_min_p"):
        SamplerConfig(ar_min_p=1.5)
