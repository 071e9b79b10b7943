"""diffusion-canvas: an interactive editor backend for block-diffusion MoE language models.

The package owns the canvas state, our own DiffusionGemma implementation (`canvas.model`), the sampler and
engine that refine a canvas, the dcanvas/1 protocol and its server, the store and training. Kernels live in the
sibling package `kernels`, the Textual app in `tui`, the browser client in `web/`.

Map, bottom up (a package imports its own layer and the ones below; tests/test_layers.py holds the rule):
`protocol` (with the Python client), `document`, `store` | `sampling` | `model` | `convert` (building models, and
which one a command serves) | `engine` | `server` (with its HTTP dialects, `server.http`), `cluster` | `eval`,
`training`, `bench`, `soak`, and `tui` beside them | `cli`, the entry point. Only this face and `cli` are modules
of their own here; this face imports nothing and everything may import its `__version__`.
"""

from __future__ import annotations

__version__ = "0.1.0"
