"""The package's layers: each folder imports only from the folders below it, no module
imports itself back through others (function-local imports included), and none takes
another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "embshard"
# Bottom to top; a module may import its own layer or those below. The public facade
# (embshard/__init__.py) sits on everything, beside the application.
LAYERS = ["errors", "plan", "runtime", "storage", "modules", "checkpoint", "serving", "planner",
          "testing", "app"]  # fmt: skip
FACADE = "embshard"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    base = PACKAGE / relative
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """Every embshard module ``path`` imports, anywhere in it, with the names taken."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == FACADE]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != FACADE:
                continue
            names = [a.name for a in node.names]
            submodules = [f"{node.module}.{n}" for n in names if _is_module(f"{node.module}.{n}")]
            found += [(m, []) for m in submodules]
            if len(submodules) < len(names):
                found.append(
                    (node.module, [n for n in names if f"{node.module}.{n}" not in submodules])
                )
    return found


def _layer(module: str) -> int:
    if module == FACADE:
        return LAYERS.index("app")
    return LAYERS.index(module.split(".")[1])


def _graph() -> dict[str, set[str]]:
    return {
        _module(p): {m for m, _ in _imports(p) if m != _module(p)} for p in PACKAGE.rglob("*.py")
    }


def test_every_module_sits_in_a_layer():
    for path in PACKAGE.rglob("*.py"):
        module = _module(path)
        if module != FACADE:
            assert module.split(".")[1] in LAYERS, f"{module} is in no layer of {LAYERS}"


def test_imports_go_down_the_layers_only():
    upward = [
        f"{source} imports {target}"
        for source, targets in _graph().items()
        if source != FACADE
        for target in targets
        if _layer(target) > _layer(source)
    ]
    assert upward == []


def test_no_import_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_no_module_takes_another_modules_private_names():
    taken = [
        f"{_module(path)} takes {name} from {module}"
        for path in PACKAGE.rglob("*.py")
        for module, names in _imports(path)
        for name in names
        if name.startswith("_") and module != _module(path)
    ]
    assert taken == []
