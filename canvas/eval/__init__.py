"""`dcanvas eval`: the quality of any model, trained here or converted, side by side across modes and settings.

Map: `samples` (passages laid out as infill and continuation tasks), `judge` (the SmolLM2 judge: perplexity of the
filled text and its seams), `metrics` (fill ratio, seam ratio, repetition, null share; the records and their
pooling), `choice` (the per-kind default mode and sampler settings chosen from measured quality), `report` (the
table and the model card's marked block), `evaluate` (the runs and the command); against running servers
(`remote`: `--task clients|code`): `client_shapes` (the requests llama.vim, OpenAI FIM clients and the websocket
send, at half-typed lines), `clients` (noise, echo, first-line ratio, length, seconds), `code_tasks` (held-out
Python gaps with doctests; `data/code_gaps.jsonl`), `sandbox` (their doctests, run without network), `code` (exact
match, tests passed, seconds, beside a llama.cpp peer). May import the engine (through
`canvas.engine.backend`), `canvas.convert` (which model), `canvas.sampling`, `canvas.document` and `canvas.protocol`
(its websocket client); imported by the
CLI and by `canvas.training` (the exported card keeps the eval's block).
"""
