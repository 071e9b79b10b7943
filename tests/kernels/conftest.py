"""Shared fixtures for kernel tests: where Triton kernels run, a seeded generator, per-dtype tolerances.

Triton picks interpreter or compiler when it is first imported, so `TRITON_INTERPRET=1` must be in the environment
before that. This file sets it at import time when triton is not loaded yet and there is no CUDA device (the case
for `pytest tests/kernels`). In a full run something earlier (e.g. importing the transformers model) may already
have imported triton in compiled mode; then every test that uses the `triton_device` fixture is run once more, all
together, in one subprocess started with `TRITON_INTERPRET=1`, and its outcome is reported here
(`pytest_pyfunc_call` below). With a CUDA device and no interpreter, the same tests run the compiled kernels on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels._triton import HAS_TRITON, interpreter_active  # noqa: E402  (after the variable is set)

_FIXTURE = "triton_device"
_DELEGATED_ENV = "DCANVAS_KERNEL_TESTS_DELEGATED"


def _where_kernels_run() -> str | None:
    """'cpu' (interpreter), 'cuda' (compiled), or None: only a fresh process with the interpreter can run them."""
    if not HAS_TRITON:
        return None
    if interpreter_active():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    return None


@pytest.fixture
def triton_device(monkeypatch: pytest.MonkeyPatch) -> str:
    """Device on which `impl="triton"` runs in this process; the test allocates its inputs there."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.delenv("DCANVAS_KERNELS", raising=False)
    device = _where_kernels_run()
    if device is not None:
        return device
    if os.environ.get(_DELEGATED_ENV):  # the subprocess exists to run these; the variable must have taken effect
        pytest.fail("TRITON_INTERPRET=1 did not take effect: triton was imported before it was set", pytrace=False)
    return "cpu"  # never used: pytest_pyfunc_call reports the subprocess outcome instead of calling the test


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def cpp_unbuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU C++ kernels as on a machine where they could not be built (no compiler), nothing warned yet."""
    from kernels import _cpp

    isa = _cpp.build_isa()
    monkeypatch.setitem(_cpp._MODULES, isa, None)
    monkeypatch.setitem(_cpp._ERRORS, isa, "RuntimeError: no compiler (simulated)")
    monkeypatch.setattr(_cpp, "_WARNED", set())


def _run_delegated(session: pytest.Session) -> dict[str, tuple[str, str]]:
    """Run every selected test that needs Triton in one interpreter subprocess; return nodeid -> (outcome, text)."""
    nodeids = [item.nodeid for item in session.items if _FIXTURE in getattr(item, "fixturenames", ())]
    root = Path(session.config.rootpath)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        env = {**os.environ, "TRITON_INTERPRET": "1", _DELEGATED_ENV: "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *nodeids]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if not report.exists():
            raise RuntimeError(f"delegated kernel tests produced no report (rc={proc.returncode}):\n{proc.stdout}")
        outcomes: dict[str, tuple[str, str]] = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            nodeid = case.attrib["classname"].replace(".", "/") + ".py::" + case.attrib["name"]
            outcome, text = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, text = "failed", (child.text or child.attrib.get("message", ""))
                elif child.tag == "skipped":
                    outcome, text = "skipped", child.attrib.get("message", "")
            outcomes[nodeid] = outcome, text
    return outcomes


_delegated: dict[str, tuple[str, str]] | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Replace the in-process call by the subprocess outcome when this process cannot run Triton kernels."""
    global _delegated
    if _FIXTURE not in pyfuncitem.fixturenames or not HAS_TRITON or _where_kernels_run() is not None:
        return None
    if os.environ.get(_DELEGATED_ENV):
        return None  # inside the subprocess: let the fixture report the failure
    if _delegated is None:
        _delegated = _run_delegated(pyfuncitem.session)
    outcome, text = _delegated.get(pyfuncitem.nodeid, ("failed", "missing from the delegated run's report"))
    if outcome == "failed":
        pytest.fail(f"failed under TRITON_INTERPRET=1 in a subprocess:\n{text}", pytrace=False)
    if outcome == "skipped":
        pytest.skip(text)
    return True
