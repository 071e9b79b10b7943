"""Training the embedded default model: corpus (`data`, `sources`, `clean`), tokenizer, token arrays, training.

`dcanvas data build` writes `data/corpus`, `data/tokenizer` and `data/tokens` (git-ignored, rebuilt from registry
packages); `dcanvas train` reads the token arrays.
"""
