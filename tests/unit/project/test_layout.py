"""The house rules of the source tree, checked on every module of the two installed packages:
no module imports the benchmarks, no import circle (deferred and TYPE_CHECKING imports count), and no
comment or docstring cites a benchmark finding, a date or a run on some CPU (they state the reason
and link a stable doc section instead)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("pipeline_rl", "inference_shim")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imported(name: str, path: Path) -> set[str]:
    """Every module `name` imports, anywhere in it (module level, functions, TYPE_CHECKING blocks)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found


def test_no_product_module_imports_the_benchmarks() -> None:
    offenders = {
        name: sorted(m for m in _imported(name, path) if m == "benchmarks" or m.startswith("benchmarks."))
        for name, path in MODULES.items()
    }
    assert not {k: v for k, v in offenders.items() if v}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    graph = {
        name: {m for m in _imported(name, path) if m in MODULES and m != name}
        for name, path in MODULES.items()
    }
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# A finding number (F5, "docs/benchmarks.md F18"), a calendar date, or a CPU kind a run was made on.
HISTORY = re.compile(r"\bF\d{1,2}\b|\b20\d\d-\d\d-\d\d\b|\b(Xeon|EPYC|Ryzen|Sapphire Rapids)\b")


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc))
    return found


# The tests' own comments too (this file's example above excepted); benchmarks/ is left out: its reports
# name the machine a run was made on.
COMMENTED = [*MODULES.values(), *(p for p in (REPO / "tests").rglob("*.py") if p != Path(__file__).resolve())]


def test_no_comment_or_docstring_cites_a_finding_a_date_or_a_cpu_run() -> None:
    cited = [
        f"{path.relative_to(REPO)}:{line}: {match.group(0)!r}"
        for path in COMMENTED
        for line, text in _comments_and_docstrings(path)
        for match in HISTORY.finditer(text)
    ]
    assert cited == []
