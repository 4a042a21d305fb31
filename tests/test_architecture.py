"""The package's shape, enforced: no import cycles (function-level imports included), rooms import only the
floors below them (nothing below the trainer imports it), DeepSpeed only where the parallel wiring lives (never in
``model/``, ``data/``, ``precision/`` or ``trainer/``, and the private names of DeepSpeed's objects only in
``parallel/deepspeed_internals.py``), no function longer than ~80 lines, no class longer than 250 and no module
longer than 500, every room's ``__init__`` docstring naming each of its modules, imports at the top of their module
unless an optional dependency, start-up time or a cycle needs them in a function, and no module-level mutable state
(no ``global``, and no module-level name rebound or mutated after import). Each rule is also run on a planted
violation, so a rule that stops seeing is noticed."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmjp_ds"
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250
MAX_MODULE_LINES = 500
DEEPSPEED_INTERNALS = "llmjp_ds.parallel.deepspeed_internals"

# what each room may import from the package (besides itself); docs/architecture.md draws the same floors
ALLOWED = {
    "errors": set(),
    "io_utils": {"errors"},
    "model": {"errors", "io_utils"},
    "metrics": {"errors", "io_utils"},
    "data": {"errors", "io_utils", "metrics"},
    "config": {"errors", "model", "data"},
    "optim": {"errors", "config", "data"},
    "precision": {"errors", "model"},
    "launch": {"errors", "io_utils"},
    "parallel": {"errors", "io_utils", "config", "model", "optim", "launch"},
    "validate": {"errors", "config", "model", "parallel", "precision", "metrics", "data", "optim"},
    "checkpoint": {"errors", "io_utils", "config", "model", "parallel", "launch", "data", "validate", "optim"},
    "interchange": {"errors", "io_utils", "config", "model", "parallel", "data", "checkpoint"},
    "health": {"errors", "checkpoint", "metrics"},
    "trainer": {"errors", "config", "validate", "model", "precision", "parallel", "data", "optim", "checkpoint",
                "metrics", "health", "launch"},
    "bench": {"errors", "config", "validate", "trainer", "model", "metrics", "optim", "health", "parallel",
              "precision", "io_utils"},
    "train": {"errors", "config", "trainer", "parallel", "validate", "launch"},
    "preflight": {"errors", "config", "validate", "model", "parallel", "checkpoint", "launch", "optim"},
    "demo": {"checkpoint", "config", "metrics", "train", "interchange"},
    "samples": {"errors", "config", "io_utils", "trainer", "validate", "data", "checkpoint"},
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


def imports_across_floors(graph: dict[str, set[str]]) -> list[str]:
    """Every ``module -> dependency`` of ``graph`` that its room's row of :data:`ALLOWED` does not allow."""
    wrong = []
    for module, deps in graph.items():
        room = _room(module)
        if room == "__init__":
            continue
        allowed = ALLOWED[room] | {room}
        wrong += [f"{module} -> {d}" for d in deps if _room(d) not in allowed | {"__init__"}]
    return sorted(wrong)


def test_each_room_imports_only_the_floors_below_it():
    wrong = imports_across_floors(_graph())
    assert not wrong, "imports across floors: " + ", ".join(wrong)


def test_every_room_is_listed():
    rooms = {_room(m) for m in _modules()} - {"__init__"}
    assert rooms == set(ALLOWED), rooms ^ set(ALLOWED)


def too_long(tree: ast.Module) -> list[str]:
    """Functions longer than :data:`MAX_FUNCTION_LINES` and classes longer than :data:`MAX_CLASS_LINES`."""
    long = []
    for node in ast.walk(tree):
        limit = MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else (
            MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else None)
        if limit is not None and node.end_lineno - node.lineno + 1 > limit:
            long.append(f"{node.name}: {node.end_lineno - node.lineno + 1} lines")
    return long


def test_no_function_is_longer_than_80_lines_and_no_class_longer_than_250():
    long = [f"{name}.{where}" for name, tree in _modules().items() for where in too_long(tree)]
    assert not long, long


def test_no_module_is_longer_than_500_lines():
    long = {path.relative_to(PACKAGE.parent).as_posix(): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def unlisted_modules(doc: str, modules: list[str]) -> list[str]:
    """The modules of a room that its ``__init__`` docstring ``doc`` does not name (``:mod:`.name```)."""
    return [m for m in modules if f":mod:`.{m}`" not in (doc or "")]


def test_every_room_names_its_modules():
    """A room's ``__init__`` docstring is its map: each module of it named (``:mod:`.name```) with its job."""
    missing = {}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        modules = sorted(p.stem for p in init.parent.glob("*.py") if p.stem != "__init__")
        missing.update({f"{init.parent.name}/{m}.py": "unnamed" for m in
                        unlisted_modules(ast.get_docstring(ast.parse(init.read_text())), modules)})
    assert not missing, f"modules their room's __init__ docstring does not name: {sorted(missing)}"


# third-party packages a module may import inside a function whatever else it loads: optional, absent where the
# extra or the GPU is not
OPTIONAL = {"transformer_engine", "triton", "megatron", "wandb", "zstandard", "pyarrow", "psutil", "matplotlib",
            "datasets"}


def _split_imports(tree: ast.Module) -> tuple[list, list]:
    """(module-level, function-level) import statements; ``if TYPE_CHECKING:`` blocks import nothing."""
    top, inner = [], []

    def walk(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (inner if in_function else top).append(child)
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(tree, False)
    return top, inner


def _targets(node, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level or node.module == "__future__":
        return []
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]


def needless_inner_imports(modules: dict[str, ast.Module]) -> list[str]:
    """Function-level imports that buy nothing at the top of their module: a standard-library module, a package
    module that neither closes a cycle nor brings a third-party module the importer does not load already, or a
    third-party module (not :data:`OPTIONAL`) that the importer's module-level imports load already."""
    known = set(modules)
    tops = {m: [t for n in _split_imports(tree)[0] for t in _targets(n, known)] for m, tree in modules.items()}

    def loaded(start: str) -> tuple[set, set]:  # (package modules, third-party modules) importing start runs
        package, third, todo = set(), set(), [start]
        while todo:
            parts = todo.pop().split(".")
            for name in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
                if parts[0] != "llmjp_ds":
                    third |= set() if parts[0] in sys.stdlib_module_names else {name}
                elif name in known and name not in package:
                    package.add(name)
                    todo += tops[name]
        return package, third

    needless = []
    for module, tree in sorted(modules.items()):
        own = loaded(module)[1]
        for node in _split_imports(tree)[1]:
            for target in _targets(node, known):
                root = target.split(".")[0]
                if root == "llmjp_ds":
                    package, third = loaded(target)
                    why = None if module in package or third - own else "adds nothing to load"
                elif root in sys.stdlib_module_names:
                    why = "standard library"
                else:
                    why = None if root in OPTIONAL or target not in own else "loaded already"
                if why:
                    needless.append(f"{module}:{node.lineno} {target} ({why})")
    return needless


def test_imports_sit_at_the_top_unless_an_optional_dependency_or_start_up_time_needs_otherwise():
    needless = needless_inner_imports(_modules())
    assert not needless, f"function-level imports to move to the top of their module: {needless}"


def _is_constant_name(name: str) -> bool:
    return name.isupper() or name.startswith("__")


# plain PyTorch and data, usable without DeepSpeed; precision's controller gets its losses as functions; the
# trainer drives DeepSpeed through parallel/ only
NO_DEEPSPEED = ("model", "data", "precision", "trainer")
MUTATING_METHODS = {"append", "extend", "insert", "update", "setdefault", "add", "discard", "remove", "pop",
                    "popitem", "clear", "sort", "reverse"}


def deepspeed_imports(tree: ast.Module) -> list[str]:
    """Every ``import deepspeed...`` / ``from deepspeed... import`` in ``tree``, function-level ones included."""
    found = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
            node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        found += [f"line {node.lineno}: {n}" for n in names if n == "deepspeed" or n.startswith("deepspeed.")]
    return found


def deepspeed_private_names(internals: ast.Module) -> set[str]:
    """The private names of DeepSpeed's objects that ``parallel/deepspeed_internals.py`` uses: ``x._name`` on
    anything but ``self``, and the ``"_name"`` strings it hands to ``hasattr`` / ``getattr``."""
    names = set()
    for node in ast.walk(internals):
        if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)
    return {n for n in names if n.startswith("_") and not n.startswith("__") and not n.endswith("_")}


def private_uses(tree: ast.Module, private: set[str]) -> list[str]:
    """Where ``tree`` names one of ``private`` on another object or in a string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private and not (
                isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in private:
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def _module_names(tree: ast.Module) -> dict[str, int]:
    """Names bound by assignment at module level -> how many top-level statements bind them."""
    counts: dict[str, int] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    counts[n.id] = counts.get(n.id, 0) + 1
    return counts


def _local_names(fn) -> set[str]:
    args = fn.args
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}
    return names | {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _root_name(node) -> str | None:
    """``X`` of ``X``, ``X[k]``, ``X.a``, ``X[k].a`` ..."""
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _mutations(scope, shared: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every write through a module-level name of ``shared`` in ``scope`` (a function body or
    the module's top level): item or attribute assignment, ``del X[k]``, augmented assignment, a mutating
    method call (``X.append(...)``, ``X.update(...)`` ...)."""
    found = []
    for node in ast.walk(scope):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, (ast.Subscript, ast.Attribute)) or isinstance(node, ast.AugAssign):
                name = _root_name(t)
                if name in shared:
                    found.append((node.lineno, name))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr in MUTATING_METHODS):
            name = _root_name(node.func.value)
            if name in shared:
                found.append((node.lineno, name))
    return found


def module_state_problems(tree: ast.Module) -> list[str]:
    """What makes module-level state mutable: a ``global`` statement, a lower-case module-level name bound to a
    list, dict or set, a module-level name bound twice at the top level, and any write through a module-level
    name after its binding (in a function that does not bind the name itself, or at the top level)."""
    problems = [f"line {n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp))
        problems += [f"line {node.lineno}: module-level mutable {t.id}" for t in targets
                     if isinstance(t, ast.Name) and mutable and not _is_constant_name(t.id)]
    names = _module_names(tree)
    problems += [f"module-level {name} bound {count} times" for name, count in names.items()
                 if count > 1 and name != "__all__"]
    shared = set(names)
    writes = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        writes += _mutations(node, shared)
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            writes += _mutations(fn, shared - _local_names(fn))
    problems += sorted({f"line {line}: {name} written after import" for line, name in writes})
    return problems


def test_no_deepspeed_in_model_data_or_precision():
    found = [f"{name} {where}" for name, tree in _modules().items() if _room(name) in NO_DEEPSPEED
             for where in deepspeed_imports(tree)]
    assert not found, found


def test_deepspeed_private_names_only_in_deepspeed_internals():
    modules = _modules()
    private = deepspeed_private_names(modules[DEEPSPEED_INTERNALS])
    assert {"_update_hp_grad", "_global_grad_norm", "_partition_layers"} <= private, private
    found = [f"{name} {where}" for name, tree in modules.items() if name != DEEPSPEED_INTERNALS
             for where in private_uses(tree, private)]
    assert not found, found


def test_no_module_level_mutable_state():
    """No ``global`` statement anywhere; module-level names bound to a list, dict or set (or an instance) are
    UPPER_CASE tables, and nothing rebinds or writes through any module-level name after import."""
    problems = [f"{name}: {p}" for name, tree in _modules().items() for p in module_state_problems(tree)]
    assert not problems, problems


PLANTED = {
    "deepspeed": ("def build():\n    from deepspeed.pipe import LayerSpec\n    return LayerSpec\n", deepspeed_imports),
    "global": ("_count = 0\ndef bump():\n    global _count\n    _count += 1\n", module_state_problems),
    "lower-case table": ("_STATE = None\n_cache = {}\n", module_state_problems),
    "item assignment": ("_STATE = {}\ndef init(x):\n    _STATE['x'] = x\n", module_state_problems),
    "method call": ("REGISTRY = []\ndef register(f):\n    REGISTRY.append(f)\n    return f\n",
                    module_state_problems),
    "update": ("TABLE = {}\nTABLE.update(a=1)\n", module_state_problems),
    "augmented": ("LIMIT = 1\nLIMIT += 1\n", module_state_problems),
    "rebound": ("MODE = 'a'\nMODE = 'b'\n", module_state_problems),
    "attribute": ("CONFIG = object()\ndef set_mode(m):\n    CONFIG.mode = m\n", module_state_problems),
}


def test_each_rule_sees_a_planted_violation():
    missed = [case for case, (source, rule) in PLANTED.items() if not rule(ast.parse(source))]
    assert not missed, f"rules that saw nothing: {missed}"
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    long_class = "class C:\n" + "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(MAX_CLASS_LINES))
    assert too_long(ast.parse(long_function)) == [f"f: {MAX_FUNCTION_LINES + 1} lines"]
    assert too_long(ast.parse(long_class)) == [f"C: {2 * MAX_CLASS_LINES + 1} lines"]
    assert unlisted_modules("* :mod:`.store`: tags;", ["store", "lock"]) == ["lock"]
    internals = ast.parse("def fuse(opt):\n    return opt._update_hp_grad, hasattr(opt, '_uses_muon')\n")
    private = deepspeed_private_names(internals)
    assert private == {"_update_hp_grad", "_uses_muon"}, private
    assert private_uses(ast.parse("def grad_norm(engine):\n    return engine.optimizer._update_hp_grad\n"), private)
    assert private_uses(ast.parse("def f(o):\n    return getattr(o, '_uses_muon')\n"), private)
    planted = {"llmjp_ds.a": ast.parse("import torch\nfrom llmjp_ds.b import f\n"
                                       "def g():\n    import json\n    import torch.nn\n    import torch\n"
                                       "    import wandb\n    from llmjp_ds.c import h\n"
                                       "    from llmjp_ds.d import k\n"),
               "llmjp_ds.b": ast.parse("import os\n"), "llmjp_ds.c": ast.parse("import os\n"),
               "llmjp_ds.d": ast.parse("import deepspeed\n")}
    assert needless_inner_imports(planted) == ["llmjp_ds.a:4 json (standard library)",
                                               "llmjp_ds.a:6 torch (loaded already)",
                                               "llmjp_ds.a:8 llmjp_ds.c (adds nothing to load)"]
    # a room below the trainer that imports it, and the trainer importing a verb above it
    assert imports_across_floors({"llmjp_ds.checkpoint.store": {"llmjp_ds.trainer.restore"},
                                  "llmjp_ds.trainer.trainer": {"llmjp_ds.train"}}) == [
        "llmjp_ds.checkpoint.store -> llmjp_ds.trainer.restore", "llmjp_ds.trainer.trainer -> llmjp_ds.train"]


def test_a_local_of_the_same_name_is_not_module_state():
    source = "TABLE = {'a': 1}\ndef f():\n    TABLE = {}\n    TABLE['b'] = 2\n    return TABLE\n"
    assert module_state_problems(ast.parse(source)) == []


# --- a built model is changed only by its own room --------------------------------------------------------------

_SPY_SCRIPT = '''
import json, sys
from torch import nn

SETS = []
original = nn.Module.__setattr__


def spy(self, name, value):
    """Every attribute set on a module of llmjp_ds.model from a file of the package outside llmjp_ds/model/."""
    if type(self).__module__.startswith("llmjp_ds.model"):
        frame = sys._getframe(1)
        path = frame.f_code.co_filename
        if "/llmjp_ds/" in path and "/llmjp_ds/model/" not in path:
            SETS.append(f"{path.rsplit('/llmjp_ds/', 1)[1]}:{frame.f_lineno} {type(self).__name__}.{name}")
    original(self, name, value)


nn.Module.__setattr__ = spy
from llmjp_ds.train import cli_main
from llmjp_ds.model.llama import DecoderLayer

cli_main([a for s in sys.argv[1:] for a in ("--set", s)])
planted = DecoderLayer.__new__(DecoderLayer)
nn.Module.__init__(planted)
exec(compile("layer.fused_residual_norm = True", "/x/llmjp_ds/trainer/planted.py", "exec"), {"layer": planted})
print("RESULT " + json.dumps(SETS))
'''


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_no_attribute_of_a_built_model_is_set_from_outside_its_room(train_env, tmp_path):
    """A one-process CPU training (ZeRO-1 in BF16 with the fused fp32 accumulation, recompute full, emulated FP8
    from step 2, FP8 weight cache on) builds, attaches and steps the model with a spy on ``nn.Module.__setattr__``:
    no file of the package outside ``llmjp_ds/model/`` sets an attribute of a model module. The planted set (a
    file named as the trainer's) is seen."""
    import json
    import subprocess
    import sys

    from tests.launch import REPO, free_port, subprocess_env

    sets = [f"run_dir={tmp_path / 'run'}", "logging.wandb=disabled", "model.shape=tiny", "data.seq_len=32",
            "model.overrides={hidden_size: 64, num_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
            "ffn_hidden_size: 128}", "train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2",
            "precision.dtype=bf16", "parallel.zero_stage=1", "model.recompute=full", "precision.emulate_fp8=true",
            "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 2, recipe: delayed}]",
            "checkpoint.interval=0", "train.eval_interval=0"]
    env = subprocess_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", _SPY_SCRIPT, *sets], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=380)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    sets_seen = json.loads(lines[-1][len("RESULT "):])
    assert sets_seen == ["trainer/planted.py:1 DecoderLayer.fused_residual_norm"], sets_seen


@pytest.mark.slow
def test_the_walk_names_every_file_a_step_opens_to_the_loss(tmp_path):
    """docs/architecture.md's walk of a token, rows 4 on, is what one training step enters on its way to the loss,
    in that order (tests/walk.py measures it on the CPUs: the torch twins stand where the TE layers do on a GPU),
    and the walk from the corpus to the loss stays within twenty files."""
    import re

    from tests.launch import run, subprocess_env

    done = run([sys.executable, "-m", "tests.walk", str(tmp_path / "run")], timeout=300,
               env=subprocess_env(LLMJP_DS_CACHE=str(tmp_path / "cache")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = next(line for line in done.stdout.splitlines() if line.startswith("WALK ")).split()[1:]
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `([^`]+)`", doc, re.M)
    assert [int(n) for n, _ in rows] == list(range(1, len(rows) + 1))
    walk = [path for n, path in rows if int(n) >= 4]
    assert walk == measured
    assert len(rows) <= 20
