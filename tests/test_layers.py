"""The package's layering: imports go downward only, the kernels layer imports nothing above it, and no
two packages import each other (read from the source, function-level imports included)."""
import ast
from pathlib import Path

import specserve

ROOT = Path(specserve.__file__).parent


def _imports() -> dict[str, set[str]]:
    """For each unit (a subpackage, or a top-level module), the other units its code imports."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        unit = path.relative_to(ROOT).parts[0].removesuffix(".py")
        targets = graph.setdefault(unit, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "specserve" and len(parts) > 1 and (ROOT / parts[1]).exists() or (
                        parts[0] == "specserve" and len(parts) > 1 and (ROOT / f"{parts[1]}.py").exists()):
                    if parts[1] != unit:
                        targets.add(parts[1])
    return graph


def test_kernels_layer_imports_nothing_above_it():
    assert _imports()["ops"] <= {"ops"}, _imports()["ops"]


def test_models_sampling_and_drafters_never_import_the_worker():
    graph = _imports()
    for unit in ("models", "sample", "spec_decode", "ops"):
        assert "worker" not in graph[unit] and "engine" not in graph[unit], (unit, graph[unit])


def test_no_import_cycles_between_units():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for nxt in sorted(graph.get(unit, ())):
            assert state.get(nxt) != 1, " -> ".join(path + [unit, nxt])
            if nxt not in state:
                visit(nxt, path + [unit])
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [])
