"""`dcanvas bench ...`: every performance claim in BENCHMARKS.md, measured side by side in one run.

Map: `cli` (the subcommands, and `bench engine`), `common` (the machine record, paired medians, peak memory, the
table), `model` (`bench model`: each component against the transformers modules; `gpu` its `--gpu` path), `ar`
(`bench ar`: the AR decode against llama.cpp's), `llama` (llama.cpp's `llama-bench` and `llama-batched-bench` run
on the GGUF of the same weights: the yardstick beside `bench ar`), `drafts` (`bench drafts`: K batched AR drafts
against one), `load` (`bench load`: many clients against a real server), `typing` (`bench typing`: a typing session
replayed against a running server's `/infill`, as llama.vim sends it), `http` (`bench http`: plain continuation
through our HTTP API against llama.cpp's `llama-server`, alternating); `bench kernels` is `kernels.bench` and
`bench soak` is `canvas.soak`.

The top layer with the eval and the UI. It measures the engine, the model and its CPU kernels with the sampler's
settings, finds the GGUF beside a build (`canvas.convert.build`), drives servers through the protocol client and
runs the soak; its clients take their token from `canvas.env`. The CLI registers it, and the eval takes
`common`'s machine record for its reports.
Imports: `canvas`, `canvas.convert`, `canvas.engine`, `canvas.model`, `canvas.protocol`, `canvas.sampling`,
`canvas.soak` and `kernels`.
Imported by: `canvas.cli` and `canvas.eval`.
"""
