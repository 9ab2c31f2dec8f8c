"""The layering, read from the source: gui → core → planner, no import cycles, no private names across modules.

Every module's imports are read with `ast` (those inside functions too: an import moved into a function to dodge a
cycle is still a dependency), so these checks import nothing of the project and take about a second.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"planner": "hivekeeper.planner", "core": "hivekeeper.core", "gui": "hivekeeper.gui"}
# what the planner must stay free of: it is pure Python (numpy allowed) and imports fast
HEAVY = ("torch", "PySide6", "hivemind")
# `hivekeeper app` opens the desktop app: the command line is the one entry point above every layer, so this is the
# one import of the app from core (the app itself never imports a command: checked below)
ENTRY_POINTS = {("hivekeeper.core.cli.app", "hivekeeper.gui.app")}


def module_name(path: Path) -> str:
    """'hivekeeper.core.offload.local_plan' for core/offload/local_plan.py ('…offload' for its __init__.py)."""
    relative = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[relative.parts[0]], *relative.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for folder in PACKAGES for path in sorted((ROOT / folder).rglob("*.py"))}


MODULES = project_modules()


def absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (resolving `from .x import y` against `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache
def project_trees() -> dict[str, ast.AST]:
    """Every project module's syntax tree, parsed when a check first needs it: parsed at import, it cost each
    pytest-xdist worker ~3 s of CPU while collecting the suite, and only one worker runs these checks."""
    return {module: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for module, path in MODULES.items()}


def imports_in(tree: ast.AST, module: str, is_package: bool, known) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import statement of a module, at any depth.

    `from package import name` counts as an import of package.name when that is one of the `known` modules."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = absolute(module, is_package, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule, None, node.lineno) if submodule in known
                             else (source, alias.name, node.lineno))
    return found


@functools.cache
def project_imports() -> dict[str, list[tuple[str, str | None, int]]]:
    """Every project module's imports (imports_in), read once."""
    trees = project_trees()
    return {module: imports_in(trees[module], module, MODULES[module].name == "__init__.py", MODULES)
            for module in MODULES}


def project_target(name: str, known: set[str] | dict = MODULES) -> str | None:
    """The project module an imported name resolves to (the longest known prefix), or None for other packages."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def violations(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{module}:{line} imports {target}" for module, found in project_imports().items()
            if module.startswith(prefix)
            for target, _, line in found if any(target == f or target.startswith(f + ".") for f in forbidden)
            and (module, target) not in ENTRY_POINTS]


@pytest.mark.parametrize("prefix,forbidden", [
    ("hivekeeper.planner", ("hivekeeper.core", "hivekeeper.gui", *HEAVY)),
    ("hivekeeper.core", ("hivekeeper.gui",)),
    ("hivekeeper.gui", ("hivekeeper.core.cli",)),
])
def test_imports_flow_gui_core_planner(prefix, forbidden):
    assert violations(prefix, forbidden) == []


def module_graph(imports: dict[str, list] | None = None) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package's __init__ counts only where it is named itself); the
    project's own by default."""
    imports = project_imports() if imports is None else imports
    graph = {}
    for module, found in imports.items():
        targets = {project_target(target, imports) for target, _, _ in found}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    assert cycles(module_graph()) == []


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    """The check above could fail: a cycle closed by an import inside a function (of a module, or of a name from
    a package) is found, and a module importing into the cycle is not part of it."""
    sources = {"p.a": "from p import b\n",
               "p.b": "import os\n\ndef later():\n    from p.c import thing\n",
               "p.c": "def later():\n    from . import a\n",
               "p.d": "import p.a\n"}
    imports = {module: imports_in(ast.parse(text), module, False, sources) for module, text in sources.items()}
    assert cycles(module_graph(imports)) == [["p.a", "p.b", "p.c"]]


def test_no_private_names_across_modules():
    private = [f"{module}:{line} imports {name} from {target}" for module, found in project_imports().items()
               for target, name, line in found
               if name is not None and name.startswith("_") and not name.startswith("__")
               and project_target(target) is not None and project_target(target) != module]
    assert private == []


def bound_private_names(tree: ast.AST) -> set[str]:
    """Private names a module binds itself: its functions, classes, attributes it assigns, keywords it passes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def private_reads(trees: dict[str, ast.AST]) -> list[str]:
    """Reads of a private attribute that only other modules bind, on something other than `self`/`cls`."""
    binders: dict[str, set[str]] = {}  # private name -> the modules that bind it
    for module, tree in trees.items():
        for name in bound_private_names(tree):
            binders.setdefault(name, set()).add(module)
    crossing = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) \
                    and module not in binders.get(node.attr, {module}) \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                crossing.append(f"{module}:{node.lineno} reads .{node.attr}")
    return crossing


def test_private_attributes_of_other_modules_objects_are_not_read():
    """`cache._off_device(...)`: a private attribute that another module defines, read on something other than
    `self`/`cls`, is a private name crossing modules too."""
    assert private_reads(project_trees()) == []


def test_the_private_read_finder_finds_one():
    cache = ast.parse("class Cache:\n    def _off_device(self, i):\n        return self._tiers[i]\n")
    model = ast.parse("def run(cache):\n    return cache._off_device(0)\n")
    assert private_reads({"cache": cache, "model": model}) == ["model:2 reads ._off_device"]
