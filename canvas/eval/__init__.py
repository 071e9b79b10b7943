"""`dcanvas eval`: the quality of any model, trained here or converted, side by side across modes and settings.

Map: `samples` (passages laid out as infill and continuation tasks), `judge` (the SmolLM2 judge: perplexity of the
filled text and its seams), `metrics` (fill ratio, seam ratio, repetition, null share; the records and their
pooling), `choice` (the per-kind default mode and sampler settings chosen from measured quality), `gap_modes`
(diffusion infill beside AR + FIM per gap size, and the per-size mode the server may read), `report` (the
table and the model card's marked block), `evaluate` (the runs and the command); against running servers
(`remote`: `--task clients|code`): `client_shapes` (the requests llama.vim, OpenAI FIM clients and the websocket
send, at half-typed lines), `clients` (noise, echo, first-line ratio, length, seconds), `code_tasks` (held-out
Python gaps with doctests; `data/code_gaps.jsonl`), `sandbox` (their doctests, run without network), `code` (exact
match, tests passed, seconds, beside a llama.cpp peer).

It imports the engine (through `canvas.engine.backend`), `canvas.convert` (which model, the FIM format),
`canvas.model` (the CPU threads), `canvas.sampling`, `canvas.document`, `canvas.protocol` (its websocket client) and
`canvas.bench.common` (the machine record of a report), and `canvas.env` (a server's token); the CLI and
`canvas.training` (the exported card keeps the eval's block, a FIM run's eval points) import it.
Imports: `canvas`, `canvas.bench`, `canvas.convert`, `canvas.document`, `canvas.engine`, `canvas.model`,
`canvas.protocol` and `canvas.sampling`.
Imported by: `canvas.cli` and `canvas.training`.
"""
