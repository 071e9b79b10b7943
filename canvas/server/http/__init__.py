"""The server's HTTP dialects for text generation: OpenAI-compatible completions and llama.cpp's `/infill`, over one
shared HTTP core.

Map: `core` (`HttpApi`: who may call, body limits, how a request's generation is tied to its connection; `Refusal`,
server-sent events), `textgen` (text in, engine request out, text back), `textrun` (the `n` generations of one
request as a stream of text events), `openai` and `llama_infill` (the two dialects' routes), `llama_fields` and
`llama_instruct` (llama.cpp's request fields and llama.vim's instruction shape), `llama_rewrite` (llama.vim's
instructions answered from screened candidates), `endings` (where a suggestion ends: `/infill`'s line-level
endings as llama.cpp's server has them, echoes and copies cut), `draft_ends` (which of an AR row's side-by-side
drafts ends it: early, when all have reached their end, or at the deadline, the best-scored whole one).
`routes` below assembles both dialects for `canvas.server.app`.

It imports the engine (`canvas.engine`), the sampler settings, the document's tokenizer contract, the trimmed
vocabulary (`canvas.convert.vocab`) and `canvas.server.admission` / `config` / `security`; the dialects import
`core`, never the other way round. Only `canvas.server.app` imports it (and the tests).
Imports: `canvas.convert`, `canvas.document`, `canvas.engine`, `canvas.sampling` and `canvas.server`.
Imported by: `canvas.server`.
"""

from __future__ import annotations

from starlette.routing import BaseRoute

from canvas.server.http.core import HttpApi
from canvas.server.http.llama_infill import infill_routes
from canvas.server.http.openai import openai_routes


def routes(api: HttpApi) -> list[BaseRoute]:
    """Every HTTP generation route: the OpenAI-compatible ones, then llama.cpp's `/infill`."""
    return [*openai_routes(api), *infill_routes(api)]
