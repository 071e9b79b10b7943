"""The editor's screens: `main` (built on `base` < `files` < `generation`) and the modal `help`, `settings` and
`prompt`."""
