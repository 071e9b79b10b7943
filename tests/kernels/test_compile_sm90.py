"""Every kernel compiles for sm_90 (H100/H200) at its real-shape tiles, checked on CPU via `sm90_compile`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

_ROOT = Path(__file__).resolve().parents[2]


def _run(checks: list[str]) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile", *checks],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, int] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_bf16_kernels_compile_for_sm90() -> None:
    shared = _run(["moe_bf16", "sampler_seeded", "soft_embed_bf16", "rmsnorm"])
    assert set(shared) == {"moe_bf16", "sampler_seeded", "soft_embed_bf16", "rmsnorm"}
    assert all(0 <= b <= 227 * 1024 for b in shared.values())


@pytest.mark.slow
def test_other_variants_compile_for_sm90() -> None:
    _run(["moe_fp32", "sampler_uniform", "soft_embed_fp32"])
