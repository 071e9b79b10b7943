"""The editor's widgets, one per module: `editor` (the text area), `canvas_view` (the canvas as it converges),
`mode_line`, `status_bar`, `banner`. They import `tui.live`, `tui.render`, `tui.textfile` and `tui.docsync`,
never a screen or the app; the screens and `tui.keys` import them.
Imports: `tui`.
Imported by: `tui` and `tui.screens`.
"""
