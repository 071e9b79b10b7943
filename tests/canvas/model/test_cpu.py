"""Run-time dtype and threads: CPU flags read, the "auto" rule and its overrides, bf16 agreeing with fp32, and
`load_backend` loading in the chosen dtype."""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import pytest
import torch

from canvas.env import DTYPE
from canvas.model import DiffusionModel, ModelConfig, cpu
from canvas.model.cpu import Probe, configure_threads, cpu_features, cpu_kind, resolve_dtype, usable_cores

X86 = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma avx512f {extra} popcnt\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(("text", "kind"), [
    (X86.format(extra="amx_bf16 amx_tile avx512_bf16"), "amx"),
    (X86.format(extra="avx512_bf16 avx512_vnni"), "avx512_bf16"),
    (X86.format(extra=""), "avx2"),
    (ARM, "arm_bf16"),
    ("processor\t: 0\n", "other"),
])
def test_cpu_kind_from_flags(text: str, kind: str) -> None:
    assert cpu_kind(cpu_features(text)) == kind


def test_features_keep_only_the_flags_that_matter() -> None:
    assert cpu_features(X86.format(extra="avx512_bf16")) == {"avx2", "fma", "avx512f", "avx512_bf16"}


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """Pretend to be a CPU of a given kind whose probe says bf16 is or is not faster."""
    monkeypatch.delenv(DTYPE.name, raising=False)
    probed: list[bool] = []

    def set_machine(kind: str, bf16_faster: bool = True) -> list[bool]:
        monkeypatch.setattr(cpu, "cpu_kind", lambda features=None: kind)

        def probe() -> Probe:
            probed.append(True)
            return Probe(fp32_s=1.0, bf16_s=0.25 if bf16_faster else 1.5)

        monkeypatch.setattr(cpu, "bf16_probe", probe)
        return probed

    return set_machine


BIG = cpu.AUTO_BF16_MIN_PARAMS


def test_auto_picks_bf16_only_where_native_and_measured_faster(machine) -> None:
    machine("amx")
    assert resolve_dtype("auto", params=BIG) == torch.bfloat16
    machine("avx512_bf16", bf16_faster=False)  # native bf16 that measures slower: fp32
    assert resolve_dtype("auto", params=BIG) == torch.float32
    probed = machine("avx2")
    probed.clear()
    assert resolve_dtype("auto", params=BIG) == torch.float32
    assert not probed  # no probe where bf16 is emulated: it would take seconds


def test_small_models_stay_fp32_under_auto(machine) -> None:
    machine("amx")
    assert resolve_dtype("auto", params=BIG - 1) == torch.float32
    assert resolve_dtype("bf16", params=10) == torch.bfloat16  # an explicit choice is obeyed


def test_models_that_decode_by_default_stay_fp32_where_the_q8_kernel_builds(machine,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On AMX the AR step runs 3x faster in fp32 with q8 weights than in bf16 (the module docstring): an AR-default
    model gets fp32; without the kernel the bf16 rule stands, and an explicit choice is still obeyed."""
    machine("amx")
    monkeypatch.setattr(cpu.q8_gemm, "available", lambda: True)
    assert resolve_dtype("auto", params=BIG, decodes=True) == torch.float32
    assert resolve_dtype("auto", params=BIG, decodes=False) == torch.bfloat16
    assert resolve_dtype("bf16", params=BIG, decodes=True) == torch.bfloat16
    monkeypatch.setattr(cpu.q8_gemm, "available", lambda: False)
    assert resolve_dtype("auto", params=BIG, decodes=True) == torch.bfloat16


def test_env_overrides_auto_and_an_explicit_choice_wins(machine, monkeypatch: pytest.MonkeyPatch) -> None:
    machine("avx2")
    monkeypatch.setenv(DTYPE.name, "bf16")
    assert resolve_dtype("auto", params=BIG) == torch.bfloat16
    assert resolve_dtype("fp32", params=BIG) == torch.float32
    machine("amx")
    monkeypatch.setenv(DTYPE.name, "fp32")
    assert resolve_dtype("auto", params=BIG) == torch.float32
    monkeypatch.setenv(DTYPE.name, "auto")
    assert resolve_dtype("auto", params=BIG) == torch.bfloat16
    monkeypatch.setenv(DTYPE.name, "fp16")
    with pytest.raises(ValueError, match=DTYPE.name):
        resolve_dtype("auto")
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("float16")


def test_threads_follow_the_usable_cores() -> None:
    n = usable_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        assert configure_threads() == n == torch.get_num_threads()
        assert configure_threads(1) == 1 == torch.get_num_threads()
        with pytest.raises(ValueError, match="threads"):
            configure_threads(0)
    finally:
        torch.set_num_threads(before)


def test_bf16_agrees_with_fp32_on_a_tiny_random_model() -> None:
    """bf16 logits within 10% RMS of fp32's (a random tiny model's logits are nearly flat, std ~0.2, so rounding
    weighs more here than on a trained model), top-1 kept on >= 85% of slots and on every slot whose fp32 top-1
    leads by more than twice the largest difference. All experts active: a top-k routing flip is a discrete jump,
    not a rounding error."""
    cfg = ModelConfig.from_name("tiny")
    cfg = dataclasses.replace(cfg, top_k_experts=cfg.num_experts)
    torch.manual_seed(0)
    fp32 = DiffusionModel(cfg).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    g = torch.Generator().manual_seed(10)
    V, L = cfg.vocab_size, cfg.canvas_length
    prompt, canvas = torch.randint(3, V, (2, 9), generator=g), torch.randint(0, V, (2, L), generator=g)
    sc = torch.randn(2, L, V, generator=g) * 3
    enc32, cache32 = fp32.encode(prompt)
    enc16, cache16 = bf16.encode(prompt)
    assert cache16.layers[0].k.dtype == torch.bfloat16
    for ours, ref in ((enc16, enc32), (bf16.denoise(canvas, cache16, sc), fp32.denoise(canvas, cache32, sc))):
        assert ours.dtype == torch.float32  # logits come out fp32 whatever the compute dtype
        diff = ours - ref
        assert diff.pow(2).mean().sqrt() <= 0.10 * ref.pow(2).mean().sqrt()
        same = ours.argmax(-1) == ref.argmax(-1)
        assert same.float().mean() >= 0.85
        top2 = ref.topk(2, dim=-1).values
        clear = top2[..., 0] - top2[..., 1] > 2 * diff.abs().max()
        assert same[clear].all()


def test_load_backend_loads_in_the_chosen_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from canvas.engine.backend import load_backend, write_tiny_checkpoint
    from canvas.engine.core import GenRequest
    from canvas.sampling.sampler import SamplerConfig

    path = write_tiny_checkpoint(tmp_path / "m")
    monkeypatch.delenv(DTYPE.name, raising=False)
    before = torch.get_num_threads()
    try:
        assert load_backend(path).engine.model.dtype == torch.float32  # a tiny model: fp32 under "auto"
        backend = load_backend(path, dtype="bf16", threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    engine = backend.engine
    assert engine.model.dtype == torch.bfloat16
    handle = engine.submit(GenRequest(backend.context((5, 6, 7)), config=SamplerConfig(max_steps=3, seed=0)))
    engine.run_until_idle()
    assert handle.wait(0).status == "completed"


def _libgomp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line.rsplit("/", 1)[-1] for line in maps)
    except OSError:
        return False


@pytest.mark.skipif(not _libgomp_loaded(), reason="torch runs no libgomp here")
def test_release_openmp_pool_frees_the_callers_workers_and_torch_still_computes() -> None:
    import threading
    import time

    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(512, 512)
        expected = x @ x  # a parallel region: this thread's pool now holds a worker
        tasks = len(os.listdir("/proc/self/task"))
        assert cpu.release_openmp_pool()
        for _ in range(100):  # the workers leave asynchronously
            if len(os.listdir("/proc/self/task")) < tasks:
                break
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/task")) < tasks
        got: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: got.append(x @ x))  # the engine's thread: a team of its own
        worker.start()
        worker.join()
        torch.testing.assert_close(got[0], expected)
        torch.testing.assert_close(x @ x, expected)  # and the caller gets a new pool when it runs torch again
    finally:
        torch.set_num_threads(before_threads)
