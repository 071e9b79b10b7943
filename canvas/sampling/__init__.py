"""The sampler and the settings a model directory carries for it.

Map: `sampler` (`SamplerConfig`, the pin-aware entropy-bound step: temperature schedule, acceptance, renoising,
stopping; the noise sources; reading and writing a model's sampler defaults, `dcanvas_sampler.json`), `modes` (which
mode a request runs in when it names none: the model's default per kind, infill or continuation).

Pure functions over logits: imports only `kernels` (the fused sampler step, the CPU draw). Below the model because
`canvas.model` saves a `SamplerConfig` beside its weights; the settings are read wherever a request's are built or
shown: the model, the conversion, the engine, the server and its HTTP dialects, the eval, training's export, the
benchmarks and the TUI with its screens.
Imports: `kernels`.
Imported by: `canvas.bench`, `canvas.convert`, `canvas.engine`, `canvas.eval`, `canvas.model`, `canvas.server`,
`canvas.server.http`, `canvas.training`, `tui` and `tui.screens`.
"""
