"""What every `dcanvas bench` subcommand measures with: the machine record, paired medians, peak extra memory, a
random model beside its transformers twin, and the table printed to stderr.

Figures are medians of several runs with the compared variants alternating (`paired`), so a shared, noisy machine
slows both alike; the machine record (`machine`) goes into each report's JSON. Imports the model only (and
transformers, lazily, for `random_pair`); every module of `canvas.bench` imports this one, never the CLI.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from canvas.model import DiffusionModel, ModelConfig


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    from canvas.model.cpu import bf16_probe, configure_allocator, cpu_features, cpu_kind, usable_cores

    # Whether this process's allocator keeps large blocks (`_run` sets it, as load_backend does); reading never sets it.
    kept = bool(configure_allocator.cache_info().currsize) and configure_allocator()
    kind = cpu_kind()
    probe = bf16_probe() if kind in ("amx", "avx512_bf16", "arm_bf16") else None  # seconds where bf16 is emulated
    return {"cpu": cpu, "cpu_kind": kind, "cpu_flags": sorted(cpu_features()), "cores": os.cpu_count(),
            "usable_cores": usable_cores(), "threads": torch.get_num_threads(), "allocator_keeps_blocks": kept,
            "bf16_probe_ms": {"fp32": probe.fp32_s * 1e3, "bf16": probe.bf16_s * 1e3} if probe else None,
            "load_average_1min": os.getloadavg()[0],  # other processes' load: figures taken on a busy machine read high
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "git": sha}


def median_time(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median seconds of each function, run alternately so that machine noise hits all alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated (and not yet freed) while `fn` runs, from the profiler's CPU memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = []
    for e in prof.events():
        d = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if d:
            deltas.append((e.time_range.start, d))
    cur = peak = 0
    for _, d in sorted(deltas):
        cur += d
        peak = max(peak, cur)
    return peak


def random_pair(cfg: ModelConfig, workdir: Path, seed: int = 0) -> tuple[DiffusionModel, Any]:
    """Our model and the transformers reference holding the same random weights."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    ours = DiffusionModel(cfg).eval()
    ours.save_pretrained(str(workdir))
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(str(workdir)).eval()
    return DiffusionModel.from_pretrained(str(workdir)), ref


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in rows:
        table.add_row(k, v)
    Console(stderr=True).print(table)
