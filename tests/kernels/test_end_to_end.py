"""The tiny model with every kernel forced to Triton (under the interpreter) gives the reference's logits and
tokens. The Triton run happens in a child process: TRITON_INTERPRET must be set before triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.e2e_worker import outputs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not __import__("kernels._triton", fromlist=["HAS_TRITON"]).HAS_TRITON, reason="triton missing")
def test_triton_model_matches_reference(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "DCANVAS_KERNELS": "triton", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "triton.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.e2e_worker", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    triton = torch.load(out)
    ref = outputs()
    torch.testing.assert_close(triton["encoder"], ref["encoder"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(triton["decoder"], ref["decoder"], rtol=1e-4, atol=1e-4)
    assert torch.equal(triton["tokens"], ref["tokens"])
