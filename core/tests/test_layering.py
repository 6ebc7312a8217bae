"""The core's import graph: arrows inside ``sakura`` point one way, and the core imports
neither torch (at module level) nor any plugin package.

Every module under ``core/src/sakura`` is parsed with :mod:`ast`. An arrow ``a -> b`` is
any ``import`` of ``b`` in ``a``: at module level or inside a function (a lazy import is
still a dependency, only a later one); ``if TYPE_CHECKING:`` blocks are left out (they
never run). ``from sakura import x`` is an arrow to the module ``sakura.x`` when there is
one, else to the package ``sakura`` itself; importing a submodule is not counted as an
arrow to its parent package (Python imports the parent first, but the parent's own imports
are its arrows, not the child's).

The cycle finder is checked on made-up graphs first, so a passing test means "no cycle",
not "a finder that finds nothing"::

    >>> find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    ['a', 'b', 'c', 'a']
    >>> find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    True

(``test_the_cycle_finder_finds_cycles`` runs these, and one on a made-up package on disk
whose cycle goes through a lazy import.)
"""

from __future__ import annotations

import ast
import itertools
import textwrap
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


@dataclass(frozen=True)
class Import:
    target: str  # the module imported, dotted
    line: int
    module_level: bool  # False: inside a function (a lazy import)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(nodes: list[ast.stmt], in_function: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every import statement under ``nodes`` with whether it is inside a function,
    skipping the bodies of ``if TYPE_CHECKING:`` (their ``else:`` runs, so it counts)."""
    for node in nodes:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.orelse, in_function)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
            continue
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                stmts = [c for c in children if isinstance(c, ast.stmt)]
                # except handlers and match cases hold statements one level down
                for c in children:
                    if isinstance(c, (ast.ExceptHandler, ast.match_case)):
                        stmts.extend(c.body)
                yield from _walk(stmts, inner)


def imports_of(source: str, module: str, is_package: bool, modules: set[str]) -> list[Import]:
    """The imports in ``source`` (the text of ``module``), resolved to dotted names; a
    ``from p import name`` becomes ``p.name`` when that is one of ``modules``."""
    found: list[Import] = []
    package = module if is_package else module.rpartition(".")[0]
    for node, in_function in _walk(ast.parse(source).body, False):
        if isinstance(node, ast.Import):
            found += [Import(a.name, node.lineno, not in_function) for a in node.names]
            continue
        assert isinstance(node, ast.ImportFrom)
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            anchor = ".".join(parts[: len(parts) - node.level + 1])
            base = f"{anchor}.{base}" if base else anchor
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.append(Import(sub if sub in modules else base, node.lineno, not in_function))
    return found


def core_modules(src: Path, top: str = "sakura") -> dict[str, Path]:
    """``{"sakura.runtime": path, "sakura": path/__init__.py, ...}``."""
    out = {}
    for path in sorted((src / top).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(src: Path, top: str = "sakura") -> dict[str, dict[str, Import]]:
    """``{module: {imported core module: the first such import}}`` over the core."""
    modules = core_modules(src, top)
    names = set(modules)
    graph: dict[str, dict[str, Import]] = {}
    for module, path in modules.items():
        edges: dict[str, Import] = {}
        for imp in imports_of(path.read_text(), module, path.name == "__init__.py", names):
            if imp.target in names and imp.target != module:
                edges.setdefault(imp.target, imp)
        graph[module] = edges
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of ``graph`` (``{node: iterable of successors}``) as ``[a, b, ..., a]``,
    or None. Depth-first, nodes and successors in sorted order, so the answer is stable."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def describe(cycle: list[str], graph: Mapping[str, Mapping[str, Import]]) -> str:
    steps = []
    for a, b in itertools.pairwise(cycle):
        imp = graph[a][b]
        how = "" if imp.module_level else ", inside a function"
        steps.append(f"  {a} imports {b} (line {imp.line}{how})")
    return "import cycle in the core:\n" + "\n".join(steps)


def test_the_cycle_finder_finds_cycles(tmp_path: Path) -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]

    # A made-up package: `one` imports `two` at module level, `two` imports `one` lazily
    # (a cycle), and `three` imports `one` only for type checking (not an arrow).
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "one.py").write_text("from toy.two import f\n")
    (pkg / "two.py").write_text(
        textwrap.dedent(
            """
            def f():
                from toy import one
                return one
            """
        )
    )
    (pkg / "three.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy.one import f\n"
    )
    graph = import_graph(tmp_path, "toy")
    assert graph["toy.three"] == {}
    assert graph["toy.two"]["toy.one"] == Import("toy.one", 3, module_level=False)
    cycle = find_cycle(graph)
    assert cycle == ["toy.one", "toy.two", "toy.one"]
    assert describe(cycle, graph) == (
        "import cycle in the core:\n"
        "  toy.one imports toy.two (line 1)\n"
        "  toy.two imports toy.one (line 3, inside a function)"
    )


def test_the_core_import_graph_has_no_cycle() -> None:
    graph = import_graph(SRC)
    assert len(graph) > 20  # the walk found the core
    cycle = find_cycle(graph)
    assert cycle is None, describe(cycle, graph)


def test_the_core_imports_no_plugin_package_and_no_torch_at_import() -> None:
    modules = core_modules(SRC)
    names = set(modules)
    problems = []
    for module, path in modules.items():
        for imp in imports_of(path.read_text(), module, path.name == "__init__.py", names):
            top = imp.target.split(".")[0]
            if top.startswith("sakura_"):
                problems.append(f"{module} imports {imp.target} (line {imp.line})")
            elif top == "torch" and imp.module_level:
                problems.append(f"{module} imports {imp.target} at import (line {imp.line})")
    assert problems == []
