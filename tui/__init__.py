"""Textual editor for diffusion-canvas: edit, pin, mask and watch the canvas converge live.

Map: `app` (the `dcanvas tui` app and command), `screens/` and `widgets/`, `docsync` (the editor's text against the
server's document), `live` and `render` (the canvas as it converges), `textfile`, `settings`, `messages`, `keys`
(the key table), `keydoc` (`python -m tui.keydoc`: the key table as the Markdown docs/tui.md embeds), `screenshot`
(`python -m tui.screenshot`: a real run captured as the README's SVG), `embedded` (the server it starts).

The top layer: imports the protocol and its client, `canvas.convert.resolve`, `canvas.sampling.modes`,
`canvas.server.embedded`, `canvas.env` (the token) and its own screens and widgets (which import its modules in
turn); nothing in `canvas` imports it but the CLI.
Imports: `canvas`, `canvas.convert`, `canvas.protocol`, `canvas.sampling`, `canvas.server`, `tui.screens` and
`tui.widgets`.
Imported by: `canvas.cli`, `tui.screens` and `tui.widgets`.
"""
