"""Triton kernels for diffusion-canvas, each next to the vectorised torch reference it must match.

Every op exposes `op(..., impl="auto"|"triton"|"ref")`: `auto` picks Triton on CUDA and the reference elsewhere;
the environment variable `DCANVAS_KERNELS` (`triton` or `ref`) forces a choice for the whole process.

No `__version__` here on purpose: transformers probes any importable `kernels` package (the HF hub kernels
library) by version, and this package must never look like it.
"""
