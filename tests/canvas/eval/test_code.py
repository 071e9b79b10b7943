"""`dcanvas eval --task code`: the sandboxed doctest run (passes, fails, syntax errors, timeouts, no network, a
temporary directory), the gap generator on a hand-made module, the committed task file, and the run against fake
`/infill` servers answering the human lines or wrong ones (the metrics must tell them apart)."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from canvas.eval.client_shapes import Sender
from canvas.eval.code import code_body, cut_lines, normalise, run_code
from canvas.eval.code_tasks import DEFAULT_TASKS, KINDS, CodeTask, build_tasks, read_tasks
from canvas.eval.report import code_markdown
from canvas.eval.samples import EvalError
from canvas.eval.sandbox import run_doctests

# A module of our own, run in the namespace of `builtins` (any importable module works; this one imports nothing).
SOURCE = '''import math


def hypot_sum(xs):
    """The sum of the hypotenuses of (x, x + 1) triangles.

    >>> round(hypot_sum([3, 4]), 3)
    11.403
    """
    total = 0.0
    for x in xs:
        side = x + 1
        total += math.sqrt(x * x + side * side)
    return total


def no_doctest(x):
    return x
'''


def task_of(program: str, function: str = "f", module: str = "builtins") -> CodeTask:
    return CodeTask("t", "line", module, function, program, "", "\n")


def test_sandbox_passes_fails_and_reports() -> None:
    ok = 'def f(x):\n    """\n    >>> f(2)\n    4\n    """\n    return x * 2\n'
    assert run_doctests(task_of(ok), ok).passed
    wrong = ok.replace("x * 2", "x + 3")
    r = run_doctests(task_of(wrong), wrong)
    assert not r.passed and (r.attempted, r.failed) == (1, 1)
    broken = ok.replace("return x * 2", "return (x")
    r = run_doctests(task_of(broken), broken)
    assert not r.passed and "SyntaxError" in r.error
    none = "def f(x):\n    return x\n"
    assert not run_doctests(task_of(none), none).passed  # nothing ran: not a pass


def test_sandbox_has_no_network_a_temp_dir_and_a_timeout() -> None:
    net = ('def f():\n    """\n    >>> f()\n    \'blocked\'\n    """\n    import socket\n    try:\n'
           '        socket.create_connection(("1.1.1.1", 53), timeout=2)\n    except OSError:\n'
           '        return "blocked"\n    return "open"\n')  # fmt: skip
    assert run_doctests(task_of(net), net).passed
    cwd = ('def f():\n    """\n    >>> f()\n    True\n    """\n    import os\n    open("x.txt", "w").write("x")\n'
           '    return os.getcwd().split("/")[-1].startswith("dcanvas-code-") and os.listdir() == ["x.txt"]\n')
    assert run_doctests(task_of(cwd), cwd).passed
    spin = 'def f():\n    """\n    >>> f()\n    """\n    while True:\n        pass\n'
    started = time.monotonic()
    r = run_doctests(task_of(spin), spin, timeout_s=2)
    assert not r.passed and "timed out" in r.error and time.monotonic() - started < 10


def test_build_tasks_keeps_gaps_the_doctests_notice() -> None:
    tasks = build_tasks(["builtins"], globs="", source_of=lambda m: SOURCE, per_function=3)
    assert tasks and {t.kind for t in tasks} == set(KINDS) and {t.function for t in tasks} == {"hypot_sum"}
    for t in tasks:
        assert t.program.startswith("import math\n\n\ndef hypot_sum(xs):") and t.suffix.startswith("\n")
        assert ">>>" in t.prefix and ">>>" not in t.middle  # the docstring is never the gap
        assert t.lines == 1 if t.kind == "line" else 2 <= t.lines <= 4
        assert run_doctests(t, t.program).passed and not run_doctests(t, t.filled("")).passed
    assert tasks == build_tasks(["builtins"], globs="", source_of=lambda m: SOURCE, per_function=3)  # seeded


def test_committed_tasks_are_valid() -> None:
    tasks = read_tasks(DEFAULT_TASKS)
    assert {t.kind for t in tasks} == set(KINDS) and len({t.id for t in tasks}) == len(tasks)
    assert all(t.source.startswith("networkx ") for t in tasks)
    first = tasks[0]
    assert run_doctests(first, first.program).passed and not run_doctests(first, first.filled("")).passed


def test_read_tasks_rejects_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(EvalError):
        read_tasks(bad)
    with pytest.raises(EvalError):
        read_tasks(tmp_path / "missing.jsonl")


def test_normalise_and_cut() -> None:
    assert normalise("  x = 1  \n") == "x = 1"
    assert normalise("    a = 1 \n    b = 2\n") == "a = 1\n    b = 2"  # inner indentation counts
    assert cut_lines("a\nb\nc", 2) == "a\nb" and cut_lines("a", 3) == "a"
    body = code_body(CodeTask("t", "lines", "m", "f", "P", "x\ny", "\nS"))
    assert body["input_prefix"] == "P" and body["input_suffix"] == "\nS" and body["n_predict"] == 128


# ---- the run against fake servers --------------------------------------------------------------------------------
def fake_infill(tasks: list[CodeTask], mode: str) -> Starlette:
    by_prefix = {t.prefix: t for t in tasks}

    async def infill(request: Request) -> Response:
        body = await request.json()
        task = by_prefix[body["input_prefix"]]
        text = {"human": task.middle + "\n        extra_line()", "wrong": "    pass", "empty": ""}[mode]
        return JSONResponse({"content": text})

    return Starlette(routes=[Route("/infill", infill, methods=["POST"])])


@pytest.fixture(scope="module")
def tasks() -> list[CodeTask]:
    return build_tasks(["builtins"], globs="", source_of=lambda m: SOURCE, per_function=2)


@pytest.fixture(scope="module")
def fake_urls(tasks: list[CodeTask]) -> Iterator[dict[str, str]]:
    urls, servers, threads = {}, [], []
    for mode in ("human", "wrong", "empty"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(fake_infill(tasks, mode), host="127.0.0.1", port=port,
                                               log_level="warning"))  # fmt: skip
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append(server)
        threads.append(thread)
        urls[mode] = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not all(s.started for s in servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield urls
    for s in servers:
        s.should_exit = True
    for t in threads:
        t.join(10)


def test_run_code_tells_right_from_wrong(tasks: list[CodeTask], fake_urls: dict[str, str]) -> None:
    result = run_code({"url": Sender(fake_urls["human"]), "peer": Sender(fake_urls["wrong"])}, tasks)
    json.dumps(result)
    rows = {(r["server"], r["kind"]): r for r in result["results"]}
    for kind in KINDS:
        human, wrong = rows[("url", kind)], rows[("peer", kind)]
        # the human lines come back with a line too many: cut to the gap's lines, they match and pass
        assert human["exact_match"] == 1.0 and human["tests_passed"] == 1.0 and human["errors"] == 0
        assert wrong["exact_match"] == 0.0 and wrong["tests_passed"] == 0.0
        assert human["seconds_median"] > 0
    assert "| peer | line |" in code_markdown(result)
    empty = run_code({"url": Sender(fake_urls["empty"])}, tasks, limit=1)
    assert all(r["empty_share"] == 1.0 and r["tests_passed"] == 0.0 for r in empty["results"])
    assert empty["tasks"] == 2  # the first task of each kind


def test_the_command(tasks: list[CodeTask], fake_urls: dict[str, str], tmp_path: Path,
                     capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from canvas.cli import main

    file = tmp_path / "gaps.jsonl"
    file.write_text("".join(json.dumps(dataclasses.asdict(t)) + "\n" for t in tasks))
    out = tmp_path / "code.json"
    args = ["eval", "--task", "code", "--url", fake_urls["human"], "--peer-url", fake_urls["wrong"], "--code-tasks",
            str(file), "--code-limit", "1", "--json", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == json.loads(out.read_text()) and result["tasks"] == 2
    assert {(r["server"], r["tests_passed"]) for r in result["results"]} == {("url", 1.0), ("peer", 0.0)}
    assert main(["eval", "--task", "code", "--code-tasks", str(file)]) == 2  # no --url
    assert main(["eval", "--task", "code", "--url", "localhost:1", "--code-tasks", str(file)]) == 2
    assert main(["eval", "--task", "code", "--url", fake_urls["human"], "--code-tasks", str(tmp_path / "no")]) == 2
