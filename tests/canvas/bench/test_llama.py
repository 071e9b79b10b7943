"""llama.cpp's batched bench read: the batch ratio from its JSON lines, its arguments, typed errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from canvas.bench.llama import LlamaBenchError, llama_batched
from tests.canvas.bench.llama_fakes import fake_batched


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_the_batch_ratio_is_read_from_its_json_lines(tmp_path: Path, gguf: Path) -> None:
    exe = fake_batched(tmp_path, prompt=256, tokens=32, batch=8, steps_s=(0.023, 0.055))
    got = llama_batched(exe, gguf, prompt=256, tokens=32, batch=8, threads=2)
    assert got["b1_step_ms"] == pytest.approx(23.0) and got["batch_step_ms"] == pytest.approx(55.0)
    assert got["ratio"] == pytest.approx(55 / 23) and got["batch"] == 8
    argv = (tmp_path / "argv_b").read_text().split()
    assert argv[argv.index("-npl") + 1] == "1,8" and argv[argv.index("-npp") + 1] == "256"
    assert argv[argv.index("-ntg") + 1] == "32" and argv[argv.index("-t") + 1] == "2"
    assert int(argv[argv.index("-c") + 1]) >= 8 * (256 + 32)  # room for every sequence
    assert "-pps" not in argv  # distinct prompts, as bench ar's batch


def test_errors_are_typed(tmp_path: Path, gguf: Path) -> None:
    with pytest.raises(LlamaBenchError, match="no such executable"):
        llama_batched(tmp_path / "missing", gguf, prompt=8, tokens=2, batch=4, threads=1)
    exe = fake_batched(tmp_path, prompt=8, tokens=2, batch=4, steps_s=(0.01, 0.02))
    with pytest.raises(LlamaBenchError, match="unreadable"):  # asked for batch 5: no such line
        llama_batched(exe, gguf, prompt=8, tokens=2, batch=5, threads=1)
    with pytest.raises(LlamaBenchError, match="no such GGUF"):
        llama_batched(exe, tmp_path / "none.gguf", prompt=8, tokens=2, batch=4, threads=1)
