"""The package's layout rules (docs/contributing.md), checked on its source.

Read with `ast`, nothing is imported: module size, import circles between modules and
between packages, the documented order of the layers (imports under `TYPE_CHECKING` and
inside functions count), what the core and the launcher may import, and that no `_kmk_*`
attribute is set on anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.subproc import REPO

PACKAGE = REPO / "keras_mirror_kit"
MAX_LINES = 700
# What sits above the core: nothing in the core may import these.
ABOVE_CORE = (
    "keras_mirror_kit.callbacks",
    "keras_mirror_kit.integrations",
    "keras_mirror_kit.cli",
    "keras_mirror_kit.multi_worker.launch",
)

# The layers, bottom first, as docs/contributing.md lists them: a unit (a sub-package, or a
# module at the package's root) imports only units of its own row or of rows before it.
# `multi_worker.launch` (the launcher, standard library only) is a unit of its own above the
# core; the rest of `multi_worker` (TF_CONFIG and Slurm parsing, the strategy) is below `data`.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("upstream",),  # the one seam to Keras' and TensorFlow's internals: imports no other unit
    ("validation", "atomic_files", "_version", "named_objects", "tensorflow_objects"),
    ("model_parts",),
    ("precision", "batch_norm"),
    ("workarounds",),
    ("own_steps",),
    ("scaling",),
    ("devices",),
    ("datasets",),
    ("multi_worker",),
    ("data",),
    ("backends",),
    ("distribution",),
    ("schedules",),
    ("throughput",),
    ("fit_inputs",),
    ("fit_arguments",),
    ("model_record", "fit_hooks"),
    ("learning_rate_callbacks",),
    ("fit_wrapper",),
    ("model_setup",),
    ("with_block",),
    ("distributed",),
    ("checkpoint",),
    ("models",),
    ("replica_check",),
    ("callbacks",),
    ("integrations", "multi_worker.launch"),
    ("keras_mirror_kit",),  # the package's own __init__: the public names, over all of it
    ("cli",),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules that `name` imports (a package import means its __init__)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in MODULES else base)
    return {t for t in targets if t in MODULES and t != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_no_module_is_longer_than_700_lines():
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, long


def test_no_two_modules_import_each_other_directly_or_around_a_circle():
    # A package's __init__ that re-exports its modules is not a circle with them.
    def edges(name: str) -> set[str]:
        return {
            t
            for t in GRAPH[name]
            if not (name.startswith(f"{t}.") and MODULES[t].name == "__init__.py")
        }

    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(edges(name)):
            if state.get(target) == 1:
                circles.append(
                    [*trail[trail.index(target) :], target] if target in trail else [name, target]
                )
            elif not state.get(target):
                visit(target, [*trail, target])
        state[name] = 2

    for name in sorted(GRAPH):
        if not state.get(name):
            visit(name, [name])
    assert not circles, circles


def _unit(module: str) -> str:
    """The layer unit a module belongs to (`keras_mirror_kit`: the package's own __init__)."""
    if module.startswith("keras_mirror_kit.multi_worker.launch"):
        return "multi_worker.launch"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


UNIT_GRAPH: dict[str, set[str]] = {}
for _name, _targets in GRAPH.items():
    _from = _unit(_name)
    UNIT_GRAPH.setdefault(_from, set()).update(u for t in _targets if (u := _unit(t)) != _from)


def test_every_package_and_root_module_has_its_place_in_the_layers():
    placed = [unit for row in LAYERS for unit in row]
    assert len(placed) == len(set(placed)), placed
    assert set(UNIT_GRAPH) == set(placed), set(UNIT_GRAPH) ^ set(placed)


def test_no_package_imports_a_layer_above_its_own():
    row = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    upward = {
        unit: sorted(t for t in targets if row[t] > row[unit])
        for unit, targets in UNIT_GRAPH.items()
    }
    assert not {k: v for k, v in upward.items() if v}, upward


def test_no_two_packages_import_each_other_directly_or_around_a_circle():
    # Units of one row may import each other only without a circle (Tarjan's SCCs).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        for target in sorted(UNIT_GRAPH[unit]):
            if target not in index:
                visit(target)
                low[unit] = min(low[unit], low[target])
            elif target in stack:
                low[unit] = min(low[unit], index[target])
        if low[unit] == index[unit]:
            component = [stack.pop()]
            while component[-1] != unit:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for unit in sorted(UNIT_GRAPH):
        if unit not in index:
            visit(unit)
    assert not circles, circles


def test_the_layer_check_sees_imports_inside_functions():
    # backends.tensorflow imports its StopAgreement inside a function: that edge is counted.
    assert (
        "keras_mirror_kit.backends.tensorflow_agreement"
        in GRAPH["keras_mirror_kit.backends.tensorflow"]
    )
    assert "multi_worker" in UNIT_GRAPH["data"]
    # `import keras_mirror_kit as kmk` inside a function of a lower layer is an upward import.
    assert "keras_mirror_kit" in UNIT_GRAPH["cli"]


def test_the_core_imports_nothing_above_it():
    upward = {
        name: sorted(t for t in targets if t.startswith(ABOVE_CORE))
        for name, targets in GRAPH.items()
        if not name.startswith(ABOVE_CORE) and name != "keras_mirror_kit"
    }
    assert not {k: v for k, v in upward.items() if v}


def test_the_launcher_and_the_shared_multi_worker_names_import_the_standard_library_only():
    for name, path in MODULES.items():
        if not (
            name.startswith("keras_mirror_kit.multi_worker.launch")
            or name in ("keras_mirror_kit.multi_worker", "keras_mirror_kit.multi_worker.gpus")
        ):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        third_party = {
            (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
            for alias in node.names
        } - {"keras_mirror_kit", "__future__"}
        assert not third_party & {"tensorflow", "keras", "numpy", "jax", "wandb"}, name


def test_wandb_is_imported_only_by_its_integration():
    importers = [
        name
        for name, path in MODULES.items()
        if "import wandb" in path.read_text(encoding="utf-8")
        and name != "keras_mirror_kit.integrations.wandb"
    ]
    assert not importers


def test_no_kmk_attribute_is_set_on_anything():
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_kmk_"):
                found.append(f"{name}: .{node.attr}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith("_kmk_"):
                    found.append(f"{name}: {node.value!r}")
    assert not found, found


_FRAME_NAMES = {"_getframe", "_current_frames", "currentframe", "f_back", "f_locals"}


def _frame_walks(source: str) -> list[str]:
    """The attributes of `source` that read the call stack (sys._getframe, f_back, ...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            is_stack = node.attr == "stack" and getattr(node.value, "id", None) == "inspect"
            if node.attr in _FRAME_NAMES or is_stack:
                found.append(node.attr)
    return found


def test_nothing_walks_the_call_stack():
    # The callback list and the end of a fit() come from fit_hooks.dispatch, not from
    # looking for Keras' CallbackList or fit() in the frames above a callback.
    found = {
        name: walks
        for name, path in MODULES.items()
        if (walks := _frame_walks(path.read_text(encoding="utf-8")))
    }
    assert not found, found


def test_the_stack_check_sees_a_frame_walk():
    source = "import sys, inspect\nf = sys._getframe(1)\nwhile f: f = f.f_back\ninspect.stack()\n"
    assert _frame_walks(source) == ["_getframe", "f_back", "stack"]
    assert _frame_walks("import traceback\nx.stack.pop()\n") == []
