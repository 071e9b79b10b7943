"""Code infill tasks for `dcanvas eval --task code`: held-out Python functions with doctests, one or a few of their
lines taken out, and the function's doctests as the test of whatever is written in their place.

Owns `CodeTask` (one gap: `prefix` + `middle` + `suffix` is the function's program, `middle` the human lines without
their final newline, `suffix` starting with the newline that ended them), `build_tasks` (the deterministic generator)
and `read_tasks`. The shape is the one an editor sends at an emptied line: the cursor at the start of a blank line, so
the model writes the indentation too. The program is the module's absolute imports (context for the model; the test
runs in the module's own namespace anyway) and the function's source, decorators included.

A task is kept only when its test can fail on it: the human program passes the function's doctests in the sandbox
(`canvas.eval.sandbox`), and the same program with the gap left empty fails them (or does not compile). Gaps are
simple statements (single-line: one line; multi-line: a statement or a run of statements spanning 2-4 lines, all in
one block), chosen per function with a seeded generator, so a rebuild from the same source gives the same file.

Source of the committed set (`canvas/eval/data/code_gaps.jsonl`, README there): networkx (BSD-3-Clause), a
dependency of torch and so installed wherever this project is; its doctests run with `import networkx as nx`, as its
own test configuration adds it. Rebuild:
`python -m canvas.eval.code_tasks --modules networkx.algorithms.dag,... --out canvas/eval/data/code_gaps.jsonl`.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import inspect
import json
import random
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from canvas.eval.samples import EvalError

Kind = Literal["line", "lines"]
KINDS: tuple[Kind, ...] = ("line", "lines")
DEFAULT_TASKS = Path(__file__).parent / "data" / "code_gaps.jsonl"
MAX_LINE_CHARS = 120  # a gap line longer than this is data, not code one would type
MIN_LINE_CHARS = 8  # "x = 0" is too easy to tell anything
# networkx's doctests assume `nx`; its `@nx._dispatchable` refuses to register a name twice, and the program defines
# the function again, so the registry forgets the module's copy first.
NETWORKX_GLOBS = "import networkx as nx\nnx.utils.backends._registered_algorithms.pop({function}, None)"


@dataclass(frozen=True, slots=True)
class CodeTask:
    id: str  # <module>:<function>:<kind>:<first gap line, 1-based in the program>
    kind: Kind
    module: str  # the test runs the program in this module's namespace
    function: str  # whose doctests are the test
    prefix: str
    middle: str  # the human lines, without the newline that ends the last one
    suffix: str  # starts with that newline
    globs: str = ""  # Python run in the namespace before the doctests (imports the doctests assume)
    source: str = ""  # where the code comes from (distribution, version, licence)

    @property
    def program(self) -> str:
        return self.prefix + self.middle + self.suffix

    def filled(self, fill: str) -> str:
        """The program with `fill` in place of the human lines."""
        return self.prefix + fill + self.suffix

    @property
    def lines(self) -> int:
        return self.middle.count("\n") + 1


def read_tasks(path: Path) -> list[CodeTask]:
    if not path.is_file():
        raise EvalError(f"no code tasks at {path}: build them with `python -m canvas.eval.code_tasks`")
    tasks = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            task = CodeTask(**rec)
        except (json.JSONDecodeError, TypeError) as exc:
            raise EvalError(f"{path}:{n}: not a code task ({exc})") from None
        if task.kind not in KINDS or not task.suffix.startswith("\n") or not task.middle.strip():
            raise EvalError(f"{path}:{n}: a code task needs kind in {KINDS}, a middle and a suffix starting a line")
        tasks.append(task)
    if not tasks:
        raise EvalError(f"{path} holds no code tasks")
    return tasks


# ---- the generator ------------------------------------------------------------------------------------------------
def _simple(stmt: ast.stmt) -> bool:
    return not isinstance(stmt, ast.If | ast.For | ast.While | ast.With | ast.Try | ast.FunctionDef | ast.ClassDef
                          | ast.AsyncFunctionDef | ast.AsyncFor | ast.AsyncWith | ast.Match)  # fmt: skip


def _blocks(body: Sequence[ast.stmt]) -> Iterator[list[ast.stmt]]:
    """Every statement list (block) under `body`, `body` first."""
    yield list(body)
    for stmt in body:
        for name in ("body", "orelse", "finalbody"):
            sub = getattr(stmt, name, None)
            if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                yield from _blocks(sub)
        for handler in getattr(stmt, "handlers", []):
            yield from _blocks(handler.body)


def gap_spans(fn: ast.FunctionDef, lines: Sequence[str]) -> dict[Kind, list[tuple[int, int]]]:
    """Candidate gaps of `fn` as (first, last) 1-based lines of `lines` (the program's): single lines that hold one
    simple statement, and 2-4 line spans that are one statement or a run of statements of one block. The docstring
    is never a gap (the model reads the doctests from it)."""
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    out: dict[Kind, list[tuple[int, int]]] = {"line": [], "lines": []}

    def typed(a: int, b: int) -> bool:  # lines a human types: not too short, none too long, none blank
        text = [lines[k - 1].strip() for k in range(a, b + 1)]
        return all(text) and MIN_LINE_CHARS <= max(len(t) for t in text) and all(len(t) <= MAX_LINE_CHARS for t in text)

    for block in _blocks(body):
        for i, stmt in enumerate(block):
            a, b = stmt.lineno, stmt.end_lineno or stmt.lineno
            if a == b and _simple(stmt) and typed(a, a) and not lines[a - 1].rstrip().endswith("\\"):
                out["line"].append((a, a))
            for j in range(i, len(block)):
                end = block[j].end_lineno or block[j].lineno
                if end - a + 1 > 4:
                    break
                if end > a and typed(a, end):
                    out["lines"].append((a, end))
    return out


def _header(tree: ast.Module, source: str) -> str:
    """The module's absolute top-level imports, as written."""
    parts = [ast.get_source_segment(source, node) for node in tree.body
             if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0)]  # fmt: skip
    return "".join(p + "\n" for p in parts if p)


def module_source(module: str) -> str:
    return inspect.getsource(importlib.import_module(module))


def _candidates(source: str) -> Iterator[tuple[str, str, ast.FunctionDef]]:
    """(program, function name, its parsed node in the program) of every top-level function with doctests in a
    module's `source`."""
    tree = ast.parse(source)
    header = _header(tree, source)
    lines = source.splitlines()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or ">>>" not in (ast.get_docstring(node) or ""):
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        fn_src = textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno]))
        program = (header + "\n\n" if header else "") + fn_src + "\n"
        parsed = next(n for n in ast.parse(program).body if isinstance(n, ast.FunctionDef) and n.name == node.name)
        yield program, node.name, parsed


def _distribution(module: str) -> str:
    top = module.split(".")[0]
    for dist in importlib.metadata.packages_distributions().get(top, []):
        meta = importlib.metadata.metadata(dist)
        licence = meta["License-Expression"] or meta["License"] or "see the distribution"  # None when absent
        return f"{dist} {meta['Version']} ({licence})"
    return top


def build_tasks(modules: Sequence[str], *, globs: str = NETWORKX_GLOBS, seed: int = 0, per_function: int = 1,
                timeout_s: float = 20.0,
                source_of: Callable[[str], str] = module_source) -> list[CodeTask]:  # fmt: skip
    """Up to `per_function` gaps of each kind per doctested top-level function of `modules`, each kept only if its
    doctests pass on the human program and fail with the gap left empty (see the module docstring). `globs` runs
    before each program; "{function}" in it becomes the function's name as a string literal. `source_of` gives a
    module's source (the installed module's by default; the test runs in that module's namespace either way)."""
    from canvas.eval.sandbox import run_doctests

    out: list[CodeTask] = []
    for module in modules:
        source = _distribution(module)
        for program, name, fn in _candidates(source_of(module)):
            lines = program.splitlines()
            fn_globs = globs.replace("{function}", repr(name))
            probe = CodeTask("", "line", module, name, program, "", "\n", fn_globs, source)
            if not run_doctests(probe, program, timeout_s=timeout_s).passed:
                continue  # the human program fails its own doctests here (a version or platform difference)
            rng = random.Random(f"{seed}:{module}:{name}")
            for kind, spans in gap_spans(fn, lines).items():
                rng.shuffle(spans)
                kept = 0
                for a, b in spans:
                    if kept == per_function:
                        break
                    prefix = "".join(line + "\n" for line in lines[: a - 1])
                    middle = "\n".join(lines[a - 1 : b])
                    suffix = "\n" + "".join(line + "\n" for line in lines[b:])
                    task = CodeTask(f"{module}:{name}:{kind}:{a}", kind, module, name, prefix, middle, suffix,
                                    fn_globs, source)  # fmt: skip
                    if run_doctests(task, task.filled(""), timeout_s=timeout_s).passed:
                        continue  # the doctests do not notice the gap: no test of what is written there
                    out.append(task)
                    kept += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m canvas.eval.code_tasks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", required=True, help="comma-separated modules whose doctested functions to use")
    parser.add_argument("--globs", default=NETWORKX_GLOBS,
                        help="Python run before the program and its doctests; {function} becomes the function's name "
                             "as a string literal")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-function", dest="per_function", type=int, default=1, help="gaps of each kind")
    parser.add_argument("--out", type=Path, default=DEFAULT_TASKS)
    args = parser.parse_args(argv)
    modules = [m.strip() for m in args.modules.split(",") if m.strip()]
    tasks = build_tasks(modules, globs=args.globs, seed=args.seed, per_function=args.per_function)
    if not tasks:
        print("no task passed the checks", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(asdict(t), ensure_ascii=False) + "\n" for t in tasks), encoding="utf-8")
    kinds = {k: sum(t.kind == k for t in tasks) for k in KINDS}
    print(f"{args.out}: {len(tasks)} tasks ({kinds}) from {len({(t.module, t.function) for t in tasks})} functions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
