"""Package-level checks: the console script, the version, and that transformers ignores our `kernels`."""

from __future__ import annotations

import subprocess
import sys

import canvas


def test_version_below_018() -> None:
    major, minor, *_ = (int(p) for p in canvas.__version__.split("."))
    assert (major, minor) < (0, 18)


def test_cli_help_and_version() -> None:
    out = subprocess.run([sys.executable, "-m", "canvas.cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"dcanvas {canvas.__version__}"
    out = subprocess.run([sys.executable, "-m", "canvas.cli", "--help"], capture_output=True, text=True, check=True)
    assert "dcanvas" in out.stdout


def test_transformers_does_not_detect_our_kernels_package() -> None:
    from transformers.utils.import_utils import is_kernels_available

    import kernels  # noqa: F401  (importable, and must not look like the HF hub `kernels` library)

    assert not is_kernels_available()
