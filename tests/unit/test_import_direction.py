"""The package's import direction (../shared/ARCHITECTURE.md; docs/architecture.md, "Direction of
imports"), lazy imports included: tools, then config, then protocols, then components /
distributed / datasets, then models, then the entry points (train.py, launch.py).
A package may import its own layer and those before it, never one after it."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "torchtitan"

LAYER_OF_PACKAGE = {
    "tools": 0,
    "config": 1,
    "protocols": 2,
    "components": 3,
    "distributed": 3,
    "datasets": 3,
    "models": 4,
    "train": 5,
    "launch": 5,  # the launch scripts' torchrun
    "preflight": 5,  # the launch scripts' dry build of a layout
}

# The AC module knows no model by name: torch, the config dataclasses and the tools layer only.
AC_MODULE = "torchtitan.distributed.activation_checkpoint"
AC_MAY_IMPORT = ("torchtitan.config", "torchtitan.tools", "torchtitan.distributed.activation_offload")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path) -> set[str]:
    """Every torchtitan module `path` imports, at module level or inside a function; for
    `from package import name`, the package and, where `name` is a module of it, that module."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return {name for name in imported if name in _MODULES}


_MODULES = {_module_name(path) for path in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYER_OF_PACKAGE.get(parts[1]) if len(parts) > 1 else None


def _all_imports() -> list[tuple[str, str]]:
    return [
        (_module_name(path), target)
        for path in sorted(PACKAGE.rglob("*.py"))
        for target in sorted(_imported_modules(path))
    ]


def test_every_package_of_torchtitan_has_a_layer():
    packages = {path.name.removesuffix(".py") for path in PACKAGE.iterdir() if not path.name.startswith("_")}
    packages.discard("assets")
    assert packages == set(LAYER_OF_PACKAGE), "a new top-level package needs a place in the layer order"


def test_no_module_imports_a_later_layer():
    upward = [
        f"{source} -> {target}"
        for source, target in _all_imports()
        if _layer(target) is not None and _layer(source) is not None and _layer(target) > _layer(source)
    ]
    assert not upward, "imports against the layer order: " + "; ".join(upward)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module in `graph` (module -> the modules
    it imports), found with Tarjan's algorithm; each group sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports. A package's `__init__` naming its own submodules
    (`from torchtitan.models import llama3`) gives edges to them, not to itself."""
    graph: dict[str, set[str]] = {}
    for source, target in _all_imports():
        if target != source:
            graph.setdefault(source, set()).add(target)
    return graph


def test_the_package_has_no_import_cycle():
    assert import_cycles(_import_graph()) == []


def test_a_cycle_through_a_lazy_import_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_nothing_imports_the_trainer():
    assert [source for source, target in _all_imports() if target == "torchtitan.train"] == []


def test_activation_checkpoint_module_imports_only_config_tools_and_its_offload():
    path = PACKAGE / "distributed" / "activation_checkpoint.py"
    assert _imported_modules(path), "the AC module imports the config dataclasses at least"
    assert {m for m in _imported_modules(path) if not m.startswith(AC_MAY_IMPORT)} == set()


def test_activation_offload_imports_nothing_of_torchtitan():
    path = PACKAGE / "distributed" / "activation_offload.py"
    assert {m for m in _imported_modules(path) if m.startswith("torchtitan")} == set()


@pytest.mark.parametrize(
    "source, target, upward",
    [
        ("torchtitan.components.optimizer", "torchtitan.models.moe", True),
        ("torchtitan.models.moe", "torchtitan.components.optimizer", False),
        ("torchtitan.tools.logging", "torchtitan.config", True),
        ("torchtitan.datasets.text_datasets", "torchtitan.components.tokenizer", False),
    ],
)
def test_layer_order_ranks_packages_as_documented(source, target, upward):
    assert (_layer(target) > _layer(source)) is upward
