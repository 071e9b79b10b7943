"""The editor's screens: `main` (built on `base` < `files` < `generation`) and the modal `help`, `settings` and
`prompt`. They import the widgets, `tui`'s modules (`docsync`, `messages`, `live`, `settings`, `keys`, `textfile`),
the protocol client and the sampler's modes; `tui.app` and `tui.keys` import them.
Imports: `canvas.protocol`, `canvas.sampling`, `tui` and `tui.widgets`.
Imported by: `tui`.
"""
