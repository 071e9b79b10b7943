"""The editor's screens: `main` (editing, live view, proposals) and the modal `help`, `settings` and `prompt`."""
