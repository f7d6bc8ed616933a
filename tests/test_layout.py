"""The project's layout: no import cycle between its modules, no source file over 400 lines, and `rl_core`
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
MAX_LINES = 400
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


def _targets(module: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    """The modules an import statement names (the project's submodules resolved, others as written), with each
    project package whose __init__ importing them first runs; [] for any other statement."""
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
        return []
    packages = []
    for name in targets:
        # importing a.b.c first runs the __init__ of a and a.b: an edge to each package the importing module is not
        # itself inside of (within its own package, Python resolves the submodule anyway)
        parts = name.split(".")
        packages += [package for i in range(1, len(parts))
                     if (package := ".".join(parts[:i])) in modules and not (module + ".").startswith(package + ".")]
    return targets + packages


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = {name for node in ast.walk(tree) for name in _targets(module, path, node, modules)}
        graph[module] = {name for name in edges if name in modules and name != module}
    return graph


def _loaded_on_import(roots: tuple[str, ...], modules: dict[str, Path]) -> dict[str, str]:
    """Every module that importing `roots` loads through the project's module-level imports (those inside a
    function or under `if TYPE_CHECKING:` run later or never): name -> the project module that imports it."""
    def top_level(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                yield from top_level([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                                      *(s for h in getattr(node, "handlers", []) for s in h.body)])
            else:
                yield node

    loaded: dict[str, str] = {root: root for root in roots}
    todo = list(roots)
    while todo:
        module = todo.pop()
        path = modules[module]
        for node in top_level(ast.parse(path.read_text(), filename=str(path)).body):
            for name in _targets(module, path, node, modules):
                if name not in loaded:
                    loaded[name] = module
                    if name in modules:
                        todo.append(name)
    return loaded


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


def test_no_source_file_over_400_lines():
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


# The Ray actors' modules (trainer rank, engine, teacher, reward worker): each actor process imports one before it
# can start, so a library loaded there is paid once per actor and run; pandas alone cost 0.8 CPU-s an actor.
ACTOR_MODULES = ("infra.workers.policy", "infra.workers.engines", "infra.workers.teacher", "infra.workers.rewards")
NOT_IN_ACTORS = ("pandas", "pandera", "pyarrow", "prefect", "mlflow", "matplotlib", "boto3", "vllm")


def test_the_actor_modules_load_no_table_tracking_or_orchestration_library():
    loaded = _loaded_on_import(ACTOR_MODULES, _sources())
    heavy = {name: by for name, by in loaded.items() if name.split(".")[0] in NOT_IN_ACTORS}
    assert not heavy, f"imported at module level on an actor's import path (import it where it is used): {heavy}"


def test_the_import_reader_follows_module_level_imports_only():
    """The reader itself: the DPO objective reaches the pair module, whose pandas import is inside a function, and
    the layout code reaches torch."""
    loaded = _loaded_on_import(("rl_core.algorithms.dpo",), _sources())
    assert loaded["rl_core.data.preferences"] == "rl_core.algorithms.dpo" and "torch" in loaded
    assert "pandas" not in loaded
    assert "pandas" in _loaded_on_import(("rl_core.batch.gate",), _sources())


# ---------------------------------------------------------------------------------------------------- rooms
#
# `infra/` is in rooms by role; its top holds only what every room shares and the shims kept for one release (module
# paths that registered deployments and `python -m` commands name).
INFRA_ROOMS = ("checkpoints", "tracking", "services", "workers", "cluster")  # a room imports only rooms before it
INFRA_SHARED = {"__init__.py", "processes.py", "artifacts.py"}
INFRA_SHIMS = {"deploy_steps.py": "infra.services.deploy_steps", "work_pools.py": "infra.services.work_pools"}
# Imports between rl_core's rooms that close a cycle of rooms, each with why it stays: all are imports inside a
# function of a builder that sits in a lower room than what it drives. Every entry must name an existing import.
OPEN_ROOM_EDGES: dict[tuple[str, str], str] = {
    ("rl_core.data", "rl_core.tasks"): "the DPO pair reader and builder encode prompts through a task",
    ("rl_core.data", "rl_core.config"): "the arithmetic pair builder loads the model it asks by a ModelConfig",
    ("rl_core.rewards", "rl_core.tasks"): "the configured rewards fall back to the task's own reward functions",
}


def _room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in ("infra", "rl_core") and len(parts) > 1 else parts[0]


def _room_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(_room(a), _room(b)) for a, targets in graph.items() for b in targets if _room(a) != _room(b)}


def test_infra_top_holds_only_the_shared_modules_and_the_shims():
    top = {p.name for p in (REPO / "infra").glob("*.py")}
    assert top == INFRA_SHARED | set(INFRA_SHIMS), (
        f"flat modules in infra/: {sorted(top - INFRA_SHARED - set(INFRA_SHIMS))}; a module goes into the room of "
        f"its role ({', '.join(INFRA_ROOMS)}), a new role gets a room of its own")
    rooms = {p.name for p in (REPO / "infra").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(INFRA_ROOMS)
    for shim, target in INFRA_SHIMS.items():  # a shim re-exports its module and nothing else
        tree = ast.parse((REPO / "infra" / shim).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert imported == {target}, f"infra/{shim} imports {imported}, not only {target}"


def test_no_infra_room_imports_a_later_room():
    order = {f"infra.{room}": i for i, room in enumerate(INFRA_ROOMS)}
    upward = sorted((a, b) for a, b in _room_edges(_graph(_sources())) if a in order and b in order and order[b] > order[a])
    assert not upward, f"infra rooms import rooms after them in {INFRA_ROOMS}: {upward}"


def test_rl_core_rooms_form_no_cycle():
    edges = {(a, b) for a, b in _room_edges(_graph(_sources())) if a.startswith("rl_core") and b.startswith("rl_core")}
    gone = set(OPEN_ROOM_EDGES) - edges
    assert not gone, f"not imported, so not in a cycle: drop from OPEN_ROOM_EDGES: {sorted(gone)}"
    rooms: dict[str, set[str]] = {room: set() for edge in edges for room in edge}
    for a, b in edges - set(OPEN_ROOM_EDGES):
        rooms[a].add(b)
    cycles = _all_cycles(rooms)
    assert not cycles, "rl_core rooms in a cycle:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)
