"""`dcanvas bench drafts` on the tiny preset: the batch step is timed through the engine's `ARBatch` with a lane of
the shape `ARWalk` gives it, the lanes' draw beside it, and every infill completes."""

from __future__ import annotations

import argparse

import torch

from canvas.bench.drafts import bench_drafts, register


def test_bench_drafts_times_the_batch_step_and_whole_infills() -> None:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args(["--preset", "tiny", "--drafts", "3", "--gaps", "6,8", "--prompt", "10", "--runs", "1"])
    out = bench_drafts(args)
    assert out["drafts"] == 3
    assert out["step_single_ms"] > 0 and out["step_batch_ms"] > 0
    assert out["step_ratio"] == out["step_batch_ms"] / out["step_single_ms"]
    assert out["draw_single_ms"] > 0 and out["draw_batch_ms"] > 0
    both = (out["step_batch_ms"] + out["draw_batch_ms"]) / (out["step_single_ms"] + out["draw_single_ms"])
    assert abs(out["step_draw_ratio"] - both) < 1e-9
    assert set(out["infill_s"]) == {"6", "8"}
    assert all(w > 0 for gap in out["infill_s"].values() for w in gap.values())
