"""The project's layout: no import cycle between its modules, no source file over 450 lines, and `rl_core`
free of the orchestration layers (Prefect, Ray, MLflow, `infra`, `flows`).

The import graph is read from the source (AST), not by importing it, and counts every import statement
wherever it stands: an import inside a function still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the project's packages; `benchmarks` and `tools` are folders of scripts (no __init__), their modules named as if
# they were packages
PACKAGES = ("rl_core", "infra", "flows", "tasks", "recipes", "cli", "examples", "benchmarks", "tools")
MAX_LINES = 450
# what the pure algorithm layer may not import
RL_CORE_FORBIDDEN = ("prefect", "ray", "mlflow", "infra", "flows", "tasks", "cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    """Module name -> file, for every .py file of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            modules[_module_name(path)] = path
    return modules


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                submodules = [f"{source}.{alias.name}" for alias in node.names]
                targets = [name for name in submodules if name in modules]
                if len(targets) < len(submodules):
                    targets.append(source)
            else:
                continue
            for name in targets:
                edges.add(name)
                # importing a.b.c first runs the __init__ of a and a.b: an edge to each package the importing
                # module is not itself inside of (within its own package, Python resolves the submodule anyway)
                parts = name.split(".")
                edges.update(package for i in range(1, len(parts))
                             if (package := ".".join(parts[:i])) in modules
                             and not (module + ".").startswith(package + "."))
        graph[module] = {name for name in edges if name in modules and name != module}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path = [root]
        stack = [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return None


def _all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A cycle through each strongly connected part of the graph that has one, found by cutting edges."""
    graph = {module: set(edges) for module, edges in graph.items()}
    cycles = []
    while (cycle := _find_cycle(graph)) is not None:
        cycles.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])
    return cycles


# Import edges that close a cycle and are left to the rewrite of their module, each with why. An edge listed here
# that is not imported fails the test, so every entry names a real edge.
OPEN_CYCLE_EDGES: dict[tuple[str, str], str] = {}


def test_no_import_cycle():
    graph = _graph(_sources())
    gone = [edge for edge in OPEN_CYCLE_EDGES if edge[1] not in graph.get(edge[0], set())]
    assert not gone, f"not imported, so not a cycle: drop from OPEN_CYCLE_EDGES: {gone}"
    for source, target in OPEN_CYCLE_EDGES:
        graph[source].discard(target)
    cycles = _all_cycles(graph)
    if cycles:
        pytest.fail("import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles))


def test_cycle_search_finds_a_lazy_import_cycle():
    """The search itself: a cycle closed by an import inside a function is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_source_file_over_450_lines():
    long = {
        str(path.relative_to(REPO)): n
        for path in _sources().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    if long:
        pytest.fail(f"source files over {MAX_LINES} lines: {long}")


def test_rl_core_imports_no_orchestration():
    offending = []
    for module, path in _sources().items():
        if module.split(".")[0] != "rl_core":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.split(".")[0] in RL_CORE_FORBIDDEN:
                    offending.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    if offending:
        pytest.fail("rl_core imports the orchestration layers:\n" + "\n".join(offending))
