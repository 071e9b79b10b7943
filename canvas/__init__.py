"""diffusion-canvas: an interactive editor backend for block-diffusion MoE language models.

The package owns the canvas state, our own DiffusionGemma implementation (`canvas.model`), the sampler and
engine that refine a canvas, the dcanvas/1 protocol and its server, the store and training. Kernels live in the
sibling package `kernels`, the Textual app in `tui`, the browser client in `web/`.

Map, bottom up (a package imports its own layer and the ones below; tests/test_layers.py holds the rule):
`env` (the environment variables), `protocol` (with the Python client), `document`, `store` | `sampling` |
`model` | `convert` (building models, and which one a command serves) | `engine` | `server` (with its HTTP
dialects, `server.http`), `cluster` | `eval`, `training`, `bench`, `soak`, and `tui` beside them | `cli`, the entry
point: it maps each `dcanvas` subcommand to its module by name (`SUBCOMMANDS`) and imports only the one that runs.
Only this face, `env` and `cli` are modules of their own here: `env` names, documents and reads every `DCANVAS_*`
environment variable, at layer 0 beside the face so that every layer, `kernels` included, may read it. Each
package's map ends with two lines, `Imports:` and `Imported by:`, that tests/test_layers.py holds to the code;
`canvas.cli` counts there as a package of its own.

This face and `env` import nothing, so that anything may read them: the CLI, the protocol client and the server
read `__version__`; the model, the conversion, the engine, the server, the eval, training, the benchmarks, the TUI
and `kernels` read the environment through `env`.
Imports: nothing.
Imported by: `canvas.bench`, `canvas.cli`, `canvas.convert`, `canvas.engine`, `canvas.eval`, `canvas.model`,
`canvas.protocol`, `canvas.server`, `canvas.soak`, `canvas.store`, `canvas.training`, `kernels` and `tui`.
"""

from __future__ import annotations

__version__ = "0.1.0"
