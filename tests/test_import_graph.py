"""The import graph (issue 44 section 7): the configuration does not import what it configures.
Counted statically from the sources (``import`` / ``from ... import`` anywhere in a module, the
imports inside functions too): no module-level circle at all, and ``conveyor.config`` is in no
circle even counting the imports inside functions (it was in one of 14 modules, through the
environment registry it imported to validate ``env.name``)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    mods = {}
    for p in SRC.rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in (tree.body if top_level_only else ast.walk(tree)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    target = full if full in mods else node.module if node.module in mods else None
                    if target:
                        graph[m].add(target)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_module_level_import_circle():
    assert _circles(_graph(top_level_only=True)) == []


def test_the_configuration_imports_nothing_that_imports_it_back():
    circles = [c for c in _circles(_graph(top_level_only=False)) if "conveyor.config" in c]
    assert circles == [], circles


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
