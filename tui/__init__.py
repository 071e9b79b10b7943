"""Textual editor for diffusion-canvas: edit, pin, mask and watch the canvas converge live.

Map: `app` (the `dcanvas tui` app and command), `screens/` and `widgets/`, `docsync` (the editor's text against the
server's document), `live` and `render` (the canvas as it converges), `textfile`, `settings`, `messages`, `keys`,
`embedded` (the server it starts). The top layer: imports the protocol and its client, `canvas.convert.resolve`
and `canvas.server.embedded`; nothing in `canvas` imports it."""
