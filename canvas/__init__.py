"""diffusion-canvas: an interactive editor backend for block-diffusion MoE language models.

The package owns the canvas state, our own DiffusionGemma implementation (`canvas.model`), the sampler and
engine that refine a canvas, the dcanvas/1 protocol and its server, the store and training. Kernels live in the
sibling package `kernels`, the Textual app in `tui`, the browser client in `web/`.
"""

from __future__ import annotations

__version__ = "0.1.0"
