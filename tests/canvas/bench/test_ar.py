"""`dcanvas bench ar`: every figure present and positive on the tiny preset; llama-bench's JSON read and compared."""

from __future__ import annotations

import argparse
import json
import stat
from pathlib import Path

import pytest
import torch

from canvas.bench.ar import SPLIT, ArShape, bench_ar, decode_bytes, register
from canvas.bench.llama import LlamaBenchError, llama_bench
from canvas.model import DiffusionModel, ModelConfig
from canvas.model.int8 import quantize_decode
from tests.canvas.bench.llama_fakes import fake_batched


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser)
    return parser.parse_args(["--preset", "tiny", "--prompt", "12", "--tokens", "3", "--runs", "1", "--batch", "3",
                              "--dtype", "fp32", *extra])


def _fake_llama_bench(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    """An executable that prints `rows` as llama-bench's `-o json` does, and records its arguments."""
    exe = tmp_path / "llama-bench"
    exe.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv'}\ncat <<'JSON'\n{json.dumps(rows)}\nJSON\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_bench_ar_reports_decode_prefill_and_the_split() -> None:
    torch.set_num_threads(1)
    out = bench_ar(_args())
    assert out["dtype"] == "fp32" and out["vocab"] == 512
    for key in ("decode_b1_tok_s", "decode_b3_tok_s", "prefill_tok_s", "batch_step_vs_b1"):
        assert out[key] > 0, key
    assert out["decode_b3_tok_s"] == pytest.approx(3 * 1e3 / out["decode_b3_step_ms"])
    assert set(out["split_ms"]) == set(SPLIT) and all(v >= 0 for v in out["split_ms"].values())
    assert out["split_ms"]["head"] > 0 and out["split_ms"]["attention"] > 0
    assert {"cpu_kind", "torch", "git"} <= set(out["machine"]) and "llama" not in out
    assert out["step_weight_mb"] > 0 and out["step_kv_mb"] > 0 and out["read_bandwidth_gb_s"] > 0
    assert isinstance(out["machine"]["simd"], list)


def test_decode_bytes_count_one_expert_in_k_and_int8_weights_at_one_byte() -> None:
    torch.manual_seed(0)
    model = DiffusionModel(ModelConfig.from_name("tiny")).eval()
    cfg = model.config
    _, cache = model.encode(torch.randint(3, cfg.vocab_size, (1, 5)), logits="none")
    weights, kv = decode_bytes(model, cache)
    every = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.self_conditioning.parameters())
    experts = sum(b.experts_gate_up.numel() + b.experts_down.numel() for b in model.blocks)
    assert weights == 4 * (every - experts + experts * cfg.top_k_experts // cfg.num_experts)
    assert kv == 4 * sum(2 * 5 * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) for i in range(cfg.num_hidden_layers))
    quantize_decode(model, "weight")
    quantized = model.embed.numel() + sum(b.attn.qkv.numel() + b.attn.o_proj.numel() + b.mlp_gate_up.numel()
                                          + b.mlp_down.numel() for b in model.blocks)
    assert decode_bytes(model, cache) == (weights - 3 * quantized, kv)


def test_against_llama_reads_its_json_and_prints_the_ratio(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    exe = _fake_llama_bench(tmp_path, [
        {"n_prompt": 12, "n_gen": 0, "avg_ts": 400.0, "build_commit": "abc", "model_type": "gemma3 Q4_K_M",
         "cpu_info": "x"},
        {"n_prompt": 0, "n_gen": 3, "avg_ts": 40.0, "build_commit": "abc", "model_type": "gemma3 Q4_K_M",
         "cpu_info": "x"},
    ])
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = bench_ar(_args("--against-llama", str(exe), "--gguf", str(gguf)))
    llama = out["llama"]
    assert llama["decode_tok_s"] == 40.0 and llama["prefill_tok_s"] == 400.0
    assert llama["decode_ratio"] == pytest.approx(out["decode_b1_tok_s"] / 40.0)
    assert llama["prefill_ratio"] == pytest.approx(out["prefill_tok_s"] / 400.0)
    argv = (tmp_path / "argv").read_text().split()
    assert argv[argv.index("-p") + 1] == "12" and argv[argv.index("-n") + 1] == "3"
    assert argv[argv.index("-t") + 1] == "1" and argv[argv.index("-m") + 1] == str(gguf)
    assert llama["batched"] is None  # no llama-batched-bench beside it: its batch ratio is not run


def test_against_llama_runs_the_batched_bench_beside_it(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    exe = _fake_llama_bench(tmp_path, [{"n_prompt": 12, "n_gen": 0, "avg_ts": 400.0},
                                       {"n_prompt": 0, "n_gen": 3, "avg_ts": 40.0}])
    fake_batched(tmp_path, prompt=12, tokens=3, batch=3, steps_s=(0.03, 0.06))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = bench_ar(_args("--against-llama", str(exe), "--gguf", str(gguf)))
    batched = out["llama"]["batched"]
    assert batched["batch"] == 3 and batched["ratio"] == pytest.approx(2.0)
    assert batched["b1_step_ms"] == pytest.approx(30.0) and batched["batch_step_ms"] == pytest.approx(60.0)


def test_llama_bench_errors_are_typed(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(LlamaBenchError, match="no such executable"):
        llama_bench(tmp_path / "missing", gguf, prompt=8, tokens=2, threads=1, runs=1)
    exe = _fake_llama_bench(tmp_path, [{"n_prompt": 8, "n_gen": 0, "avg_ts": 1.0}])  # no decode row
    with pytest.raises(LlamaBenchError, match="unreadable"):
        llama_bench(exe, gguf, prompt=8, tokens=2, threads=1, runs=1)
    with pytest.raises(LlamaBenchError, match="no such GGUF"):
        llama_bench(exe, tmp_path / "none.gguf", prompt=8, tokens=2, threads=1, runs=1)


def test_shape_rejects_empty_runs() -> None:
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        ArShape(prompt=4, tokens=0, batch=1, runs=1)


def test_bench_ar_times_the_general_step_beside_the_few_op_one() -> None:
    torch.set_num_threads(1)
    out = bench_ar(_args("--vs-general", "--compile", "off"))
    assert out["step"] == "eager" and out["compile_s"] is None
    assert set(out["variants"]) == {"general", "eager"}
    assert out["variants"]["eager"]["decode_b1_step_ms"] == pytest.approx(out["decode_b1_step_ms"])
    assert all(v > 0 for variant in out["variants"].values() for v in variant.values())


def test_bench_ar_times_another_int8_scheme_beside_the_primary_one() -> None:
    """`--vs-int8`: the other scheme's copies swapped in for its runs, the primary's back for its own."""
    torch.set_num_threads(1)
    out = bench_ar(_args("--int8", "q8", "--vs-int8", "weight", "--compile", "off"))
    assert out["decode_int8"] == "q8" and set(out["variants"]) == {"int8 weight", "eager"}
    assert out["variants"]["eager"]["decode_b1_step_ms"] == pytest.approx(out["decode_b1_step_ms"])
    assert all(v > 0 for variant in out["variants"].values() for v in variant.values())
    assert 0.0 <= out["int8_fidelity"]["top1_agree"] <= 1.0


def test_the_split_counts_the_cpp_kernels_as_operators() -> None:
    """The profiler sees aten ops only; the C++ kernels' calls are timed by wrapping their entry points, which are
    put back after."""
    from canvas.bench.ar import _timed_kernels
    from canvas.model import decode
    from kernels import attend_cpu

    if attend_cpu.kernel() is None:
        pytest.skip("the CPU C++ kernels do not build here")
    torch.manual_seed(0)
    model = DiffusionModel(ModelConfig.from_name("tiny")).eval()
    _, cache = model.encode(torch.tensor([[5, 6, 7]]), cache=model.new_cache(1, 8), logits="none")
    before = decode._attend_cpu_kernel
    with _timed_kernels() as spent:
        model.encode(torch.tensor([[8]]), cache=cache, logits="last")
    assert spent[0] > 0  # the fp32 step's attention and norms ran in C++
    assert decode._attend_cpu_kernel is before
