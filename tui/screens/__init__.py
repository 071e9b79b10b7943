"""The editor's screens: `main` (built on `base` < `files` < `generation`) and the modal `help`, `settings` and
`prompt`. They import the widgets, `tui.docsync`, `tui.messages` and the protocol client; `tui.app` imports them."""
