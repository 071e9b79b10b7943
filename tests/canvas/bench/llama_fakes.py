"""Stand-ins for llama.cpp's benchmark binaries: shell scripts that print what the real ones print."""

from __future__ import annotations

import json
import stat
from pathlib import Path


def fake_batched(tmp_path: Path, *, prompt: int, tokens: int, batch: int, steps_s: tuple[float, float]) -> Path:
    """A `llama-batched-bench` in tmp_path printing its JSON lines (a log line first, as the real one) for 1 and
    `batch` sequences, whose decode steps take steps_s seconds; it records its arguments in tmp_path / "argv_b"."""
    lines = [json.dumps({"pp": prompt, "tg": tokens, "pl": pl, "is_pp_shared": 0, "t_tg": step * tokens,
                         "speed_tg": pl / step}) for pl, step in zip((1, batch), steps_s, strict=True)]
    body = "\n".join(["main: n_kv_max = 4096", *lines])
    exe = tmp_path / "llama-batched-bench"
    exe.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv_b'}\ncat <<'JSON'\n{body}\nJSON\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe
