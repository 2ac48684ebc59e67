"""tbexp's modules import one way: no import circle, counting the imports made inside functions too.

A circle that only lazy imports hold together still ties two modules into one (neither can be read, tested or moved
without the other), which is why function-level imports count here. Read from the source with `ast`; nothing is
imported, so this takes a fraction of a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tbexp"


def import_graph(package: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, a package standing for its `__init__`."""
    modules = {
        ".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }

    def module_of(name: str) -> str:
        while name and name not in modules:  # `from a.b import c`: c is a module, or a name in a.b
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        names = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names += [f"{node.module}.{alias.name}" for alias in node.names]
        graph[module] = {target for name in names if (target := module_of(name)) and target != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_of_tbexp_imports_one_that_imports_it_back():
    found = circles(import_graph(PACKAGE))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_a_circle_held_by_a_lazy_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import thing\n")
    (package / "b.py").write_text("thing = 1\n\ndef later():\n    from pkg import a\n")
    (package / "c.py").write_text("import pkg.a\n")
    assert circles(import_graph(package)) == [["pkg.a", "pkg.b"]]
    (package / "b.py").write_text("thing = 1\n")
    assert circles(import_graph(package)) == []
