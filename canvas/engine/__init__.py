"""Generation: the continuous-batching engine that refines canvases, and what loads a model into it.

Map: `core` (`Engine`: requests join between steps, rows stop one by one, frames stream out), `ar` (the engine's AR
mode: batched drafts, each cut at clause ends and scored by the text after the gap), `types` (`GenRequest`, `Frame`,
`Done`, `GenHandle`: what goes in and comes out), `scheduling` (the fair queue, the measured load, the row cap),
`generate` (static-batch generation that reproduces transformers' `generate` token for token), `backend` (a model
directory loaded into an `Engine` with its tokenizer, special ids and defaults; the tiny random checkpoint the tests
serve), `generate_cli` (`dcanvas generate`). May import `canvas.model`, `canvas.sampling`, `canvas.document` and
`canvas.convert` (which model to load), never the server or the UI; imported by the server, the cluster, the eval
and the benchmarks.
"""
