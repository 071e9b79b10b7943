"""Textual editor for diffusion-canvas: edit, pin, mask and watch the canvas converge live."""
