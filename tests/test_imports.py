"""The package's layering: no import cycles in src/shoal, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "src" / "shoal"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts).removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, known) -> set[str]:
    """The modules of shoal that ``name`` imports, anywhere in its code (a package counts as its
    ``__init__``; importing one's own package is not an edge)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def _cycle_from(graph: dict, start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_the_walk_sees_imports_inside_functions():
    mods = _modules()
    assert "shoal.seam" in mods and "shoal.graph.trace" in mods
    # graph/api.py imports the runtime inside a method: the walk must count it
    assert "shoal.runtime" in _imports("shoal.graph.api", mods["shoal.graph.api"], mods)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_import_cycle(name):
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    cycle = _cycle_from(graph, name)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_seam_and_errors_import_nothing_of_shoal():
    mods = _modules()
    for name in ("shoal.seam", "shoal.errors", "shoal.sbp"):
        assert _imports(name, mods[name], mods) == set(), name
