"""`dcanvas bench ...`: every performance claim in BENCHMARKS.md, measured side by side in one run.

Map: `cli` (the subcommands, and `bench engine`), `common` (the machine record, paired medians, peak memory, the
table), `model` (`bench model`: each component against the transformers modules; `gpu` its `--gpu` path), `ar`
(`bench ar`: the AR decode against llama.cpp's), `drafts` (`bench drafts`: K batched AR drafts against one),
`load` (`bench load`: many clients against a real server); `bench kernels` is `kernels.bench` and `bench soak`
is `canvas.soak`. The top layer with the eval and the UI: may import the engine, the model, the conversion, the
protocol client and `canvas.soak`; nothing imports it but the CLI.
"""
