"""Helpers shared by the kernel tests (pytest imports test files as `tests.kernels.<name>`)."""

from __future__ import annotations

import pytest
import torch

# (rtol, atol) per dtype for kernel-vs-reference comparisons. fp32 differs only by summation order; bf16/fp16
# carry one rounding of the output (plus, for MoE, of the intermediate activation) on top.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
