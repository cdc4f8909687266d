"""File-level import cycles, which import-linter's layer contracts cannot see: two modules
that import each other (at the top, in a function or under TYPE_CHECKING alike) cannot be
understood apart. Prints every cycle and exits 1 when there is one; scripts/test runs it after
lint-imports.

A package's `__init__` that re-exports its modules is not a cycle with them unless one of those
modules imports the package's `__init__` back.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    imported = graph.find_modules_directly_imported_by(child) & modules
                    work.append((child, iter(sorted(imported))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main() -> int:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["importlinter"]["root_packages"]
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*packages, cache_dir=None)
    modules = {m for m in graph.modules if m.split(".")[0] in packages}
    found = cycles(graph, modules)
    for component in found:
        print(f"import cycle between files: {', '.join(component)} import each other")
    if found:
        return 1
    print(f"no import cycle between files ({len(modules)} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
