"""llama.cpp as the AR pathway's yardstick: run its benchmark binaries on the GGUF of the same weights and read them.

Owns `llama_bench` (`llama-bench`: prefill and batch-1 decode tok/s), `llama_batched` (`llama-batched-bench`: the
decode step of B distinct sequences against one, the figure beside `dcanvas bench ar`'s batch ratio), `default_gguf`
(the GGUF `dcanvas model build` joined into its cache) and `LlamaBenchError`, the one error either raises (a missing
binary or file, a failed run, output it cannot read). llama.cpp is never a dependency: these only run a binary the
user built and pointed at.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

BATCHED = "llama-batched-bench"  # looked for beside the llama-bench binary


class LlamaBenchError(RuntimeError):
    """A llama.cpp benchmark could not be run or its output not read (the message says which)."""


def default_gguf() -> Path | None:
    """The Gemma 3 GGUF `dcanvas model build` joined into its cache, when there is one."""
    from canvas.convert.build import cache_root

    found = sorted((cache_root() / "gemma3").glob("*.gguf"))
    return found[0] if found else None


def _run(binary: Path, gguf: Path, args: list[str]) -> tuple[list[str], str]:
    exe = shutil.which(str(binary))
    if exe is None:
        raise LlamaBenchError(f"{binary}: no such executable (build llama.cpp's {binary.name} target)")
    if not gguf.is_file():
        raise LlamaBenchError(f"{gguf}: no such GGUF file")
    cmd = [exe, "-m", str(gguf), *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    except subprocess.TimeoutExpired:
        raise LlamaBenchError(f"{' '.join(cmd)} ran over 30 minutes") from None
    if done.returncode != 0:
        raise LlamaBenchError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return cmd, done.stdout


def llama_bench(binary: Path, gguf: Path, *, prompt: int, tokens: int, threads: int, runs: int) -> dict[str, Any]:
    """Run `llama-bench` (prefill of `prompt` tokens, `tokens` decode steps at batch 1) and read its JSON:
    {"prefill_tok_s", "decode_tok_s", "build", "model_type", "cpu_info", "threads", "command"}."""
    cmd, stdout = _run(binary, gguf, ["-p", str(prompt), "-n", str(tokens), "-t", str(threads), "-r", str(runs),
                                      "-o", "json"])
    try:
        rows = json.loads(stdout)
        prefill = next(r for r in rows if r["n_prompt"] == prompt and r["n_gen"] == 0)
        decode = next(r for r in rows if r["n_gen"] == tokens and r["n_prompt"] == 0)
    except (ValueError, KeyError, TypeError, StopIteration):
        raise LlamaBenchError(f"unreadable llama-bench output: {stdout[:300]!r}") from None
    return {"prefill_tok_s": float(prefill["avg_ts"]), "decode_tok_s": float(decode["avg_ts"]),
            "build": prefill.get("build_commit"), "model_type": prefill.get("model_type"),
            "cpu_info": prefill.get("cpu_info"), "threads": threads, "command": cmd}


def llama_batched(binary: Path, gguf: Path, *, prompt: int, tokens: int, batch: int, threads: int) -> dict[str, Any]:
    """Run `llama-batched-bench` on 1 and on `batch` distinct sequences (each a `prompt`-token prefill, then `tokens`
    decode steps of every sequence at once) and read its JSON lines: {"b1_step_ms", "batch_step_ms", "ratio"
    (batch step over batch-1 step), "batch", "threads", "command"}."""
    cmd, stdout = _run(binary, gguf, ["-c", str(batch * (prompt + tokens) + 16), "-b", str(max(2048, batch * prompt)),
                                      "-ub", "512", "-npp", str(prompt), "-ntg", str(tokens), "-npl", f"1,{batch}",
                                      "-t", str(threads), "--output-format", "jsonl"])
    try:
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        step = {int(r["pl"]): float(r["t_tg"]) / int(r["tg"]) * 1e3 for r in rows
                if int(r["pp"]) == prompt and int(r["tg"]) == tokens}
        one, many = step[1], step[batch]
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        raise LlamaBenchError(f"unreadable {BATCHED} output: {stdout[:300]!r}") from None
    return {"b1_step_ms": one, "batch_step_ms": many, "ratio": many / one, "batch": batch, "threads": threads,
            "command": cmd}


__all__ = ["BATCHED", "LlamaBenchError", "default_gguf", "llama_bench", "llama_batched"]
