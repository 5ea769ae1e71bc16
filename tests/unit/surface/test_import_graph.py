# SPDX-License-Identifier: Apache-2.0
"""No import circles among the package's modules.

The graph is read from the source, not from a running interpreter: an edge runs from a module to every module its
top-level statements import (``if`` and ``try`` bodies included; imports inside functions are deferred by design and
left out), and to the packages above the imported module, whose ``__init__`` runs first. A circle in that graph
means that importing some module first finds another half-initialised, so it must stay empty.
"""

import ast
import os

import deepspeed

PACKAGE_ROOT = os.path.dirname(deepspeed.__file__)


def _modules():
    base = os.path.dirname(PACKAGE_ROOT)
    found = {}
    for folder, dirs, files in os.walk(PACKAGE_ROOT):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _top_level_imports(body):
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level_imports(block)


def import_graph():
    modules = _modules()

    def known(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        targets = []
        for node in _top_level_imports(ast.parse(open(path).read()).body):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                continue
            source = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(parts + ([source] if source else []))
            targets += [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                        for alias in node.names]
        for target in filter(None, map(known, targets)):
            while target:
                if target != name and not name.startswith(target + "."):
                    graph[name].add(target)
                target = target.rpartition(".")[0] if "." in target else ""
                target = target if target in modules else ""
    return graph


def circles(graph):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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


def test_the_graph_sees_the_packages_imports():
    graph = import_graph()
    assert "deepspeed.runtime.zero.stage3" in graph["deepspeed.runtime.engine"] or any(
        target.startswith("deepspeed.runtime.zero") for target in graph["deepspeed.runtime.engine"])
    # a package's __init__ runs before its module: importing runtime.zero.config reaches runtime.zero too
    assert "deepspeed.runtime.zero" in graph["deepspeed.runtime.config"]


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    found = circles(import_graph())
    listed = "\n".join(", ".join(component) for component in found)
    assert not found, f"import circles (each line one strongly connected set):\n{listed}"
