"""The package's modules import each other without a cycle: each import, read from the source with ast, is an
edge, whether it runs at import time, inside a function or only for the type checker (a cycle hidden in a
function is still two modules that cannot be understood, or changed, one without the other)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "volprobe"


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for a package directory and everything under it."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _within(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of the modules, or None (the standard library, a dependency)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports: those it names, and the packages whose __init__ that import
    runs on the way (not its own parents': those ran before it, unless it names one, `from . import x`)."""
    is_package = path.name == "__init__.py"
    named: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            # `from pkg import name`: the module pkg.name if there is one, else a name defined in pkg.
            named += [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin for alias in node.names]
    edges = set()
    for name in named:
        target = _within(name, known)
        if target is None:
            continue
        edges.add(target)
        parent = _within(target.rpartition(".")[0], known)
        while parent:
            if not module.startswith(parent + "."):
                edges.add(parent)
            parent = _within(parent.rpartition(".")[0], known)
    return edges - {module}


def import_graph(package: Path) -> dict[str, set[str]]:
    known = modules(package)
    return {module: imports_of(module, path, known) for module, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_package_has_no_import_cycle() -> None:
    found = cycles(import_graph(PACKAGE))
    assert not found, f"import cycles: {[sorted(c) for c in found]}"


def test_the_graph_has_the_imports_the_source_makes() -> None:
    graph = import_graph(PACKAGE)
    assert "volprobe.capabilities" in graph["volprobe.warmup"]  # from .capabilities import ...
    assert "volprobe.supervise" in graph["volprobe.runtime.provider"]  # from .. import nvme, supervise
    assert "volprobe.targets" in graph["volprobe.warmup"]  # under TYPE_CHECKING
    assert "volprobe.collectors.registry" in graph["volprobe.collectors.probe"]
    assert "volprobe.compare.html" in graph["volprobe.compare.command"]
    assert graph["volprobe.capabilities"] == {"volprobe.privileges"}  # under TYPE_CHECKING
    assert graph["volprobe.privileges"] == set()
    assert graph["volprobe.voldata"] == set()  # read by discovery and kubelet, which import it, not each other


def test_a_cycle_is_found_however_it_is_imported(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    (package / "d.py").write_text("from . import a\n")  # imports into the cycle, is not part of it
    assert cycles(import_graph(package)) == [{"pkg.a", "pkg.sub.b", "pkg.c"}]
    (package / "c.py").write_text("import os\n")
    assert cycles(import_graph(package)) == []
    # A package whose __init__ imports a module that imports from the package (a registry, say).
    (package / "sub" / "__init__.py").write_text("REGISTRY = {}\nfrom . import b\n")
    (package / "sub" / "b.py").write_text("from . import REGISTRY\n")
    assert cycles(import_graph(package)) == [{"pkg.sub", "pkg.sub.b"}]
