"""SVG snapshots (pytest-textual-snapshot) of the editor at 80x24: idle, mid-generation (diffusion, and an AR infill
with slots still unwritten), proposal, help.

A snapshot must not depend on timing, so these run without a server on the scenes of `tests.tui.scenes`. Update
them after a deliberate change with `pytest tests/tui/test_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.tui.scenes import app_for, ar_midway, generating, opened, proposal_shown

pytest.importorskip("pytest_textual_snapshot", reason="needs pytest-textual-snapshot (the test extra)")


def test_idle(snap_compare: Any, tmp_path: Path) -> None:
    assert snap_compare(app_for(tmp_path), run_before=opened)


def test_generating_with_entropy_colours(snap_compare: Any, tmp_path: Path) -> None:
    assert snap_compare(app_for(tmp_path), run_before=generating)


def test_ar_infill_midway_shows_unwritten_slots_as_blanks(snap_compare: Any, tmp_path: Path) -> None:
    assert snap_compare(app_for(tmp_path), run_before=ar_midway)


def test_proposal_diff(snap_compare: Any, tmp_path: Path) -> None:
    assert snap_compare(app_for(tmp_path), run_before=proposal_shown, press=["tab"])


def test_help(snap_compare: Any, tmp_path: Path) -> None:
    assert snap_compare(app_for(tmp_path), run_before=opened, press=["f1"])
