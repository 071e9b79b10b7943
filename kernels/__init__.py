"""Triton kernels for diffusion-canvas, each next to the vectorised torch reference it must match.

Every op exposes `op(..., impl="auto"|"triton"|"ref")`: `auto` picks Triton on CUDA and the reference elsewhere;
the environment variable `DCANVAS_KERNELS` (`triton` or `ref`) forces a choice for the whole process. The rule is
`kernels._triton`'s (`resolve_impl`, beside the guarded Triton import that lets the package load without it).

Ops (one module each; `<op>_ref` is the torch reference, `<op>_triton` the validating launcher):
- `kernels.moe.fused_moe`: routed expert FFN (GELU-tanh gate) of the DiffusionGemma MoE block, on
  `kernels.moe_align.moe_align_block_size` (tokens grouped by expert, padded to the M tile);
- `kernels.sampler_step.sampler_step`: softcap, temperature, Gumbel-max sample, argmax and entropy in one pass;
- `kernels.soft_embed.soft_embedding`: softmax(logits) @ embedding for self-conditioning, no (N, V) softmax;
- `kernels.rmsnorm.rms_norm` / `rms_norm_add`: DiffusionGemmaRMSNorm, alone or fused with the residual add.
CPU kernels in C++ (`impl="auto"|"cpp"|"ref"`, built once per machine by `kernels._cpp`; "auto" falls back to the
reference with one warning where they cannot be built):
- `kernels.q8_gemm.q8_linear`: int8 weights and activations, a scale per block of 32 along K (AVX-512 VNNI);
- `kernels.rmsnorm_cpu.rms_norm_fused`: RMSNorm with its residual add and layer scale in one call;
- `kernels.attend_cpu.attend_one`: the decode step's attention, one query a row over its cached keys (fp32, GQA);
- `kernels.act_cpu.gelu_mul` / `softcap_`: the MLP's gated GELU and the logit soft-cap of the decode step;
- `kernels.sample_cpu.draw_tokens`: the AR drafts' draw (bans, min-p, temperature, one inverse-CDF draw a row)
  with the drawn token's log-probability.
`kernels._cpp` builds them into a directory keyed by their sources' contents, flags and torch version, under
`kernels._build_lock` (a flock that dies with its holder, a stage per builder, a timeout that names the holder).
`kernels.bench` (`python -m kernels.bench`, `dcanvas bench kernels`) times them on CUDA, `kernels.cpu_bench` the CPU
ones. The kernels are forward-only: "auto" uses the references whenever an input requires grad.

The bottom layer: imports nothing of the project but `canvas.env`, which names and reads its environment
variables (layer 0 as well); the model, the sampler, the engine (the AR draw), training's objective and the
benchmarks import it.
Imports: `canvas`.
Imported by: `canvas.bench`, `canvas.engine`, `canvas.model`, `canvas.sampling` and `canvas.training`.

No `__version__` here on purpose: transformers probes any importable `kernels` package (the HF hub kernels
library) by version, and this package must never look like it.
"""
