"""Training the embedded default model: corpus (`data`, `sources`, `clean`), tokenizer, token arrays, training.

`dcanvas data build` writes `data/corpus` (prose from `sources`, code from `code_sources`, a held-out set),
`data/tokenizer` and `data/tokens` (git-ignored, rebuilt from registry packages); `dcanvas train` reads the token
arrays. Also the FIM fine-tune of the converted Gemma (`fim`, `fim_gaps`, `fim_train`, `fim_curve`), low-rank
adapters (`adapt`), the decoder's gap denoiser on the frozen encoder (`decoder_adapt`, `gap_data`, `gap_denoise`,
`gap_train`, `gap_curve`), the export (`export`) and the GPU job (`gpu_base`, `gpu_job`, `gpu_gap`). The
tokenizer itself is `canvas.model.tokenizer`; the evaluation is `canvas.eval`.

The top layer, an offline tool: imports the model, the conversion, `canvas.sampling`, `kernels` and the eval's
report (the card block an export keeps); nothing imports it but the CLI.
"""
