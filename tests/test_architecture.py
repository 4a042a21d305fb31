"""The package's shape, enforced: no import cycles (function-level imports included), rooms import only the
floors below them, no function longer than ~80 lines, and no module-level mutable state."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llmjp_ds"
MAX_FUNCTION_LINES = 80

# what each room may import from the package (besides itself); docs/architecture.md draws the same floors
ALLOWED = {
    "errors": set(),
    "io_utils": {"errors"},
    "model": {"errors", "io_utils"},
    "data": {"errors", "io_utils", "metrics"},
    "batching": set(),
    "metrics": {"errors"},
    "config": {"errors", "model"},
    "precision": {"errors", "model"},
    "optim": set(),
    "parallel": {"errors", "io_utils", "config", "model", "optim"},
    "validate": {"errors", "config", "model", "parallel", "precision", "metrics"},
    "checkpoint": {"errors", "io_utils", "config", "model", "parallel"},
    "drills": {"errors"},
    "trainer": {"errors", "config", "validate", "model", "precision", "parallel", "data", "batching",
                "checkpoint", "metrics", "optim", "drills"},
    "train": {"errors", "config", "trainer", "parallel"},
    "bench": {"errors", "config", "validate", "trainer", "model", "metrics", "optim", "parallel", "io_utils"},
    "preflight": {"errors", "config", "validate", "model", "parallel"},
    "demo": {"checkpoint", "config", "metrics", "train"},
    "plot": {"errors", "metrics"},
    "cli": {"errors"},
}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its body (``from x import y`` counts ``x.y`` if it is
    a module, else ``x``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, tree, set(modules)) for name, tree in modules.items()}


def _room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def test_no_import_cycles():
    graph = _graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_each_room_imports_only_the_floors_below_it():
    wrong = []
    for module, deps in _graph().items():
        room = _room(module)
        if room == "__init__":
            continue
        allowed = ALLOWED[room] | {room}
        wrong += [f"{module} -> {d}" for d in deps if _room(d) not in allowed | {"__init__"}]
    assert not wrong, "imports across floors: " + ", ".join(sorted(wrong))


def test_every_room_is_listed():
    rooms = {_room(m) for m in _modules()} - {"__init__"}
    assert rooms == set(ALLOWED), rooms ^ set(ALLOWED)


def test_no_function_is_longer_than_80_lines():
    long = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {length} lines")
    assert not long, long


def _is_constant_name(name: str) -> bool:
    return name.isupper() or name.startswith("__")


def test_no_module_level_mutable_state():
    """No ``global`` statement anywhere, and module-level names bound to a list, dict or set (or an instance)
    are UPPER_CASE tables that nothing assigns to after import."""
    problems = []
    for name, tree in _modules().items():
        problems += [f"{name}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) and node.value is not None else []
            value = getattr(node, "value", None)
            mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp))
            for t in targets:
                if isinstance(t, ast.Name) and mutable and not _is_constant_name(t.id):
                    problems.append(f"{name}: module-level mutable {t.id}")
    assert not problems, problems
