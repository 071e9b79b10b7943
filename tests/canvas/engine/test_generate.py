"""Token-for-token parity of our static generation with `DiffusionGemmaForBlockDiffusion.generate`."""

from __future__ import annotations

import pytest
import torch

from canvas.engine.generate import generate_static
from canvas.model import DiffusionModel
from canvas.sampling.sampler import ReferenceNoise, SamplerConfig
from tests.canvas.model.reference import RefSpec, build_reference

SPEC = RefSpec("gen", vocab_size=61, canvas_length=12)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # Moderate weights: the random model is not chaotic, so float rounding cannot snowball across steps.
    ref = build_reference(SPEC, seed=3, std=0.05)
    path = tmp_path_factory.mktemp("gen")
    ref.save_pretrained(path)
    return ref, DiffusionModel.from_pretrained(str(path))


def run_reference(ref, prompt, mask, cfg: SamplerConfig, max_new_tokens: int, seed: int):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    torch.manual_seed(seed)
    kwargs = {} if mask is None else {"attention_mask": mask}
    out = ref.generate(
        prompt,
        max_new_tokens=max_new_tokens,
        max_denoising_steps=cfg.max_steps,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=cfg.entropy_bound),
        t_min=cfg.t_min,
        t_max=cfg.t_max,
        stability_threshold=cfg.stability_threshold,
        confidence_threshold=cfg.confidence_threshold,
        eos_token_id=1,
        pad_token_id=0,
        **kwargs,
    )
    return out.sequences, out.tokens_per_forward


@pytest.mark.parametrize(
    "cfg",
    [
        SamplerConfig(max_steps=6),  # never converges on random weights: runs all steps
        # confident part-way down the temperature schedule: rows stop at different steps
        SamplerConfig(max_steps=12, t_max=0.8, t_min=0.05, stability_threshold=0, confidence_threshold=3.7),
        SamplerConfig(max_steps=8, stability_threshold=0, confidence_threshold=50.0, entropy_bound=2.0),
    ],
    ids=["full-steps", "early-stop", "stop-at-once"],
)
@pytest.mark.parametrize("batch", [1, 2])
def test_matches_reference_generate(pair, cfg: SamplerConfig, batch: int) -> None:
    ref, ours = pair
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, SPEC.vocab_size, (batch, 10), generator=g)
    mask = None
    if batch == 2:
        mask = torch.ones(batch, 10, dtype=torch.long)
        mask[1, :3] = 0
        prompt[1, :3] = 0
    max_new = 2 * SPEC.canvas_length
    with torch.no_grad():
        ref_seq, ref_tpf = run_reference(ref, prompt, mask, cfg, max_new, seed=5)
    torch.manual_seed(5)
    ours_out = generate_static(ours, prompt, cfg, attention_mask=mask, max_new_tokens=max_new, noise=ReferenceNoise())
    assert ours_out.sequences.shape == ref_seq.shape
    assert torch.equal(ours_out.sequences, ref_seq)
    torch.testing.assert_close(ours_out.tokens_per_forward, ref_tpf.float())
    if cfg.confidence_threshold == 3.7:  # the case must really stop early, or it tests nothing new
        assert min(ours_out.steps) < cfg.max_steps
