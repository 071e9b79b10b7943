"""Ahead-of-time compile of the kernels for sm_90 (H100/H200) with Triton's bundled ptxas: no GPU needed.

The interpreter does not check what the compiler checks (types of loop-carried values, `tl.dot` shapes and
operand dtypes, shared-memory use), so each kernel is compiled here at the tile configuration its launcher uses
for the real DiffusionGemma 26B-A4B shapes, and the cubin's shared-memory use is checked against the H100/H200
limit (227 KiB per block).

Run as `python -m tests.kernels.sm90_compile CHECK...` from the repository root, without `TRITON_INTERPRET` (the
compiler cannot trace kernels whose `tl.sum`/`tl.rand` were built for the interpreter); it prints one JSON line,
{check: shared_bytes}. `test_compile_sm90.py` runs it in a subprocess.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

_SMEM_LIMIT = 227 * 1024


def _compile(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], **options: Any) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError("kernels were jitted for the interpreter: unset TRITON_INTERPRET")
    for name in constexprs:
        signature[name] = "constexpr"
    src = ASTSource(kernel, signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": True, **options})
    if "cubin" not in compiled.asm:
        raise RuntimeError("no cubin produced")
    if compiled.metadata.shared > _SMEM_LIMIT:
        raise RuntimeError(f"shared memory {compiled.metadata.shared} B exceeds {_SMEM_LIMIT} B")
    return int(compiled.metadata.shared)


def _ptrs(names: str, dtype: str) -> dict[str, str]:
    return {n: f"*{dtype}" for n in names.split()}


def _ints(names: str, kind: str = "i32") -> dict[str, str]:
    return {n: kind for n in names.split()}


def moe_kernels(dtype: str) -> int:
    from kernels.moe import _moe_down_kernel, _moe_gate_up_kernel, default_tiles
    from kernels.moe_align import _moe_align_kernel

    tiles = default_tiles(256 * 8, 128)
    meta = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "DOT_FP32": dtype == "fp32"}
    opts = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    sig = {
        **_ptrs("ids_ptr sorted_ptr expert_ids_ptr num_post_ptr", "i64"),
        "cursor_ptr": "*i32",
        **_ints("num_pairs num_experts num_tiles num_slots"),
    }
    align_meta = {"BLOCK_M": tiles.block_m, "NUM_BINS": 128, "BLOCK_P": 1024, "BLOCK_T": 64}
    _compile(_moe_align_kernel, sig, align_meta, num_warps=4)
    sig = {
        **_ptrs("x_ptr w_ptr a_ptr", dtype),
        **_ptrs("sorted_ids_ptr expert_ids_ptr num_post_padded_ptr", "i64"),
        **_ints("num_pairs top_k hidden inter stride_xt stride_we stride_wn stride_ap"),
    }
    shared = _compile(_moe_gate_up_kernel, sig, dict(meta), **opts)
    sig = {
        **_ptrs("a_ptr w_ptr", dtype),
        **_ptrs("y_ptr topk_w_ptr", "fp32"),
        **_ptrs("sorted_ids_ptr expert_ids_ptr num_post_padded_ptr", "i64"),
        **_ints("num_pairs hidden inter stride_ap stride_we stride_wn stride_yp"),
    }
    return max(shared, _compile(_moe_down_kernel, sig, dict(meta), **opts))


def sampler_step_kernel(has_uniform: bool) -> int:
    from kernels.sampler_step import _sampler_step_kernel

    sig = {
        **_ptrs("logits_ptr", "bf16"),
        **_ptrs("temp_ptr uniform_ptr entropy_ptr", "fp32"),
        **_ptrs("sample_ptr argmax_ptr", "i64"),
        **_ints("vocab stride_l stride_u"),
        "seed": "i64",
        "softcap": "fp32",
    }
    return _compile(
        _sampler_step_kernel,
        sig,
        {"HAS_UNIFORM": has_uniform, "HAS_SOFTCAP": True, "BLOCK_V": 4096},
        num_warps=8,
    )


def soft_embed_kernel(dtype: str) -> int:
    from kernels.soft_embed import DEFAULT_TILES, _soft_embed_kernel

    sig = {
        **_ptrs("logits_ptr", "bf16"),
        **_ptrs("emb_ptr out_ptr", dtype),
        **_ptrs("part_acc_ptr part_ml_ptr", "fp32"),
        **_ints("n_rows vocab dim v_chunk stride_l stride_e stride_o"),
        "scale": "fp32",
    }
    block_n, block_d, block_v = DEFAULT_TILES
    shared = 0
    for split in (True, False):
        meta = {"BLOCK_N": block_n, "BLOCK_D": block_d, "BLOCK_V": block_v, "SPLIT": split, "DOT_FP32": dtype == "fp32"}
        shared = max(shared, _compile(_soft_embed_kernel, dict(sig), meta, num_warps=8, num_stages=3))
    return shared


def rmsnorm_kernel() -> int:
    from kernels.rmsnorm import _rms_norm_kernel

    sig = {
        **_ptrs("x_ptr w_ptr res_ptr out_ptr", "bf16"),
        **_ints("n_cols x_row_stride res_row_stride out_row_stride"),
        "eps": "fp32",
    }
    return _compile(_rms_norm_kernel, sig, {"HAS_WEIGHT": True, "HAS_RESIDUAL": True, "BLOCK_D": 4096}, num_warps=8)


CHECKS: dict[str, Callable[[], int]] = {
    "moe_bf16": lambda: moe_kernels("bf16"),
    "moe_fp32": lambda: moe_kernels("fp32"),
    "sampler_seeded": lambda: sampler_step_kernel(False),
    "sampler_uniform": lambda: sampler_step_kernel(True),
    "soft_embed_bf16": lambda: soft_embed_kernel("bf16"),
    "soft_embed_fp32": lambda: soft_embed_kernel("fp32"),
    "rmsnorm": rmsnorm_kernel,
}


def main(argv: list[str]) -> int:
    unknown = [name for name in argv if name not in CHECKS]
    if unknown:
        print(f"unknown checks {unknown}; choose from {sorted(CHECKS)}", file=sys.stderr)
        return 2
    print(json.dumps({name: CHECKS[name]() for name in argv or sorted(CHECKS)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
