"""The editor's widgets, one per module."""
