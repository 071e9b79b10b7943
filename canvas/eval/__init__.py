"""`dcanvas eval`: the quality of any model, trained here or converted, side by side across modes and settings.

Map: `samples` (passages laid out as infill and continuation tasks), `judge` (the SmolLM2 judge: perplexity of the
filled text and its seams), `metrics` (fill ratio, seam ratio, repetition, null share; the records and their
pooling), `choice` (the per-kind default mode and sampler settings chosen from measured quality), `report` (the
table and the model card's marked block), `evaluate` (the runs and the command). May import the engine (through
`canvas.engine.backend`), `canvas.convert` (which model), `canvas.sampling` and `canvas.document`; imported by the
CLI and by `canvas.training` (the exported card keeps the eval's block).
"""
