"""Generation: the continuous-batching engine that refines canvases, and what loads a model into it.

Map: `core` (`Engine`: requests join between steps, rows stop one by one, frames stream out), `rows` (`Row`: one
running generation's canvas and counters, its diffusion step's draw, the frames and `Done` it reports), `ar` (the
engine's AR mode: batched drafts, each cut at clause ends and scored by the text after the gap), `types`
(`GenRequest`, `Frame`, `Done`, `GenHandle`: what goes in and comes out), `scheduling` (the fair queue, the measured
load, the row cap), `prefix_cache` (`PrefixCache`: encoder caches reused by the longest common prefix of token ids, so
that an editor that resends its context on every keystroke pays only for what changed), `block_pool` (`PagePool`: the
prefix cache's one arena of fixed pages, so evicted blocks' memory is reused, never handed back to a fragmenting
heap), `heap` (`Trimmer`: glibc's `malloc_trim`, at most once every few seconds), `generate` (static-batch generation
that reproduces transformers' `generate` token for token), `backend` (a model directory loaded into an `Engine` with
its tokenizer, special ids and defaults; the tiny random checkpoint the tests serve), `decoder_weights` (a gap
denoiser's decoder-only adapters as served, and the shifted head that reads slot i from hidden state i - 1),
`generate_cli` (`dcanvas generate`).

It imports the model, the sampler, the document (a prompt's tokens), `canvas.convert` (which model to load, the FIM
prompt), `kernels` (the AR draw on the CPU) and `canvas.env` (`DCANVAS_DECODER_ADAPTERS`), never the server or the UI.
The server and its HTTP dialects, the cluster's replicas, the eval, training's eval points, the benchmarks and the CLI
(`dcanvas generate`) import it.
Imports: `canvas`, `canvas.convert`, `canvas.document`, `canvas.model`, `canvas.sampling` and `kernels`.
Imported by: `canvas.bench`, `canvas.cli`, `canvas.cluster`, `canvas.eval`, `canvas.server`, `canvas.server.http` and
`canvas.training`.
"""
