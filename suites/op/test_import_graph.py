"""The kernels package's layering, read from the source (AST, function-local imports included).

* the reference (the oracle) imports nothing from ``kernels.ops`` (what it judges);
* the contracts import only the settings and each other: every layer may import them;
* ``kernels`` imports nothing from ``pytest_rlk`` or ``suites``;
* no import cycle between the modules of ``kernels``, nor between those of ``pytest_rlk``.

``python suites/op/test_import_graph.py`` prints the graph between kernels' subpackages.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import statement in ``path``, at any depth; ``from a import b``
    gives ``a.b`` (b may be a module) and ``a``."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def import_graph(root: Path = KERNELS) -> dict[str, set[str]]:
    """module of the package at ``root`` -> the modules of that package it imports."""
    files = {module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        graph[name] = {target for _, target in imported_modules(path) if target in files and target != name}
    return graph


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted(KERNELS.rglob("*.py")):
        if not _within(module_name(path), package):
            continue
        for line, target in imported_modules(path):
            if any(_within(target, f) for f in forbidden):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return found


def test_reference_imports_nothing_from_ops():
    assert _violations("kernels.reference", ("kernels.ops",)) == []


def test_contracts_import_only_settings_and_each_other():
    layers = ("kernels.ops", "kernels.reference", "kernels.backends", "kernels.dispatch", "kernels.api",
              "kernels.integrations", "kernels.launch", "kernels.tolerances")
    assert _violations("kernels.contracts", layers) == []


def test_kernels_import_neither_the_plugin_nor_the_suites():
    assert _violations("kernels", ("pytest_rlk", "suites")) == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_graph(root: Path) -> dict[str, set[str]]:
    """``import_graph`` less the edges from a package's __init__ to its own submodules (those
    make no cycle of layers)."""
    return {m: {t for t in targets if not (m.count(".") < t.count(".") and _within(t, m))}
            for m, targets in import_graph(root).items()}


@pytest.mark.parametrize("package", ["kernels", "pytest_rlk"])
def test_no_import_cycle_between_a_packages_modules(package):
    assert _cycles(layer_graph(ROOT / package)) == []


def test_the_check_finds_a_reference_to_ops_import(tmp_path, monkeypatch):
    """The gate can fail: a reference module that imports an op is reported with its line."""
    fake = tmp_path / "kernels"
    (fake / "reference").mkdir(parents=True)
    (fake / "reference" / "bad.py").write_text("def f():\n    from kernels.ops.linear_logp import linear_logp\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", fake)
    assert _violations("kernels.reference", ("kernels.ops",)) == [
        "kernels/reference/bad.py:2 imports kernels.ops.linear_logp",
        "kernels/reference/bad.py:2 imports kernels.ops.linear_logp.linear_logp",
    ]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_check_finds_a_cycle_through_a_package_init(tmp_path, monkeypatch):
    """A module importing a package whose __init__ imports a module that imports the first: one
    cycle of three, though the __init__'s edges to its own submodules are left out."""
    pkg = tmp_path / "pkg"
    (pkg / "engines").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "spec.py").write_text("from pkg.engines import registry\n")
    (pkg / "engines" / "__init__.py").write_text("from pkg.engine import Engine\n")
    (pkg / "engine.py").write_text("from pkg.spec import Spec\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _cycles(layer_graph(pkg)) == [["pkg.engine", "pkg.engines", "pkg.spec"]]


@pytest.mark.parametrize("package", ["kernels.reference", "kernels.contracts", "pytest_rlk.drift",
                                     "pytest_rlk.e2e.engines"])
def test_package_is_in_the_graph(package):
    assert any(_within(m, package) for m in import_graph(ROOT / package.split(".")[0])), package


def subpackage_edges() -> dict[str, set[str]]:
    """kernels.<sub> -> the kernels.<sub> it imports (module-level edges folded per subpackage)."""
    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        edges.setdefault(top(module), set()).update(top(t) for t in targets if top(t) != top(module))
    return edges


if __name__ == "__main__":
    for source, targets in sorted(subpackage_edges().items()):
        print(f"{source:28s} -> {', '.join(sorted(targets)) or '-'}")
