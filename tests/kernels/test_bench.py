"""The benchmark's CPU path: a clear message, reference timings at tiny shapes, exit 0, JSON as the last line."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cpu_path_reports_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "no CUDA device" in out[0]
    record = json.loads(out[-1])
    assert record["device"] == "cpu" and record["gpu"] is None
    assert record["torch"] == torch.__version__ and record["git_sha"]
    assert record["shapes"] == {
        "tokens": 16,
        "hidden": 64,
        "experts": 8,
        "top_k": 2,
        "moe_inter": 32,
        "vocab": 1024,
        "softcap": 30.0,
    }
    ops = {row["op"].split()[0] for row in record["rows"]}
    assert ops == {"fused_moe", "sampler_step", "soft_embedding", "rms_norm_add"}
    assert all(row["impl"] == "ref" and row["ms"] > 0 for row in record["rows"])
    assert any(line.startswith("fused_moe") for line in out)  # the table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_json_flag_prints_only_the_record(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--json", "--no-compile"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and json.loads(out[0])["device"] == "cpu"


def test_real_shapes_are_the_26b_a4b_text_config() -> None:
    s = bench.BenchShapes.real()
    assert (s.hidden, s.experts, s.top_k, s.moe_inter, s.vocab, s.tokens) == (2816, 128, 8, 704, 262144, 256)
    with pytest.raises(ValueError, match="top_k"):
        bench.BenchShapes(experts=4, top_k=8)


def test_triton_cases_and_checks_run(triton_device: str) -> None:
    # The GPU path's cases at tiny shapes: every Triton callable runs and every correctness check passes.
    cases = bench.build_cases(bench.BenchShapes.tiny(), triton_device, with_triton=True, compile_ref=False)
    for case in cases:
        assert case.check is not None and case.check() == "", case.op
        case.impls["triton"]()
        assert case.bytes > 0 and case.flops > 0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bench_checks_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--json", "--no-compile"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(record["checks"].values()) == {"ok"}
