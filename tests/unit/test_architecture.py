"""The import graph of the three packages: no cycle, no side importing the other, imports pointing down.

Read with the standard library's ``ast`` only (nothing is imported), so a broken module still gets a
clear failure here. Function-local imports count as edges too: a local import that would close a
cycle is a cycle hidden, not removed. ``if TYPE_CHECKING:`` imports count as well, since a type-only
cycle is still two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fleet_protocol", "controller", "edge_agent")

# The controller's layers, top first. A module may import its own layer (no cycle allowed there
# either) or any layer below it, never one above. Each entry is a module or a sub-package prefix.
CONTROLLER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("controller.__main__", "controller.cli", "controller.demo"),
    ("controller.app",),
    ("controller.api",),
    ("controller.runtime",),
    ("controller.fleet", "controller.observe"),
    ("controller.link", "controller.registry", "controller.security"),
    ("controller.db",),
    ("controller.settings", "controller.types", "controller.errors"),
    ("controller",),  # the package's own __init__
)
# The one place the controller side may reach the agent: the `edgefleet agent` command, dispatched
# lazily so that the controller installs without the agent's extras.
AGENT_DISPATCH_FROM = "controller.cli.serve"


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported first-party module
    line: int
    local: bool  # inside a function


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def first_party_modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "migrations" in path.parts:
                continue  # Alembic scripts, loaded by Alembic, never imported
            out[module_name(path)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The first-party module ``name`` refers to (a module, or the package owning an attribute)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _package_of(mod: str, modules: dict[str, Path]) -> str:
    path = modules[mod]
    return mod if path.name == "__init__.py" else mod.rpartition(".")[0]


def imports_of(mod: str, modules: dict[str, Path]) -> Iterator[Import]:
    tree = ast.parse(modules[mod].read_text(), filename=str(modules[mod]))
    local_lines: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    local_lines.add(node.lineno)
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package_of(mod, modules).split(".")
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            # `from pkg import sub` imports the sub-module when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != mod:
                yield Import(
                    mod, target, node.lineno, node.lineno in local_lines or isinstance(node, ast.Call)
                )


@pytest.fixture(scope="module")
def graph() -> list[Import]:
    modules = first_party_modules()
    return [imp for mod in modules for imp in imports_of(mod, modules)]


def _cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    adj: dict[str, set[str]] = {}
    for e in edges:
        adj.setdefault(e.source, set()).add(e.target)
        adj.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(adj[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return out


def _is_package_init_edge(e: Import) -> bool:
    # A package's __init__ importing its own sub-modules (re-exports) is not a layering edge.
    return e.target.startswith(e.source + ".")


def test_no_import_cycle_anywhere(graph: list[Import]) -> None:
    edges = [e for e in graph if not _is_package_init_edge(e)]
    cycles = _cycles(edges)
    detail = []
    for comp in cycles:
        members = set(comp)
        detail.append(
            " <-> ".join(comp)
            + ": "
            + "; ".join(
                f"{e.source}:{e.line} imports {e.target}{' (function-local)' if e.local else ''}"
                for e in edges
                if e.source in members and e.target in members
            )
        )
    assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_the_two_sides_never_import_each_other(graph: list[Import]) -> None:
    bad = [
        e
        for e in graph
        if (e.source.startswith("edge_agent") and e.target.startswith("controller"))
        or (
            e.source.startswith("controller")
            and e.target.startswith("edge_agent")
            and not (e.source == AGENT_DISPATCH_FROM and e.local)
        )
    ]
    assert not bad, "\n".join(f"{e.source}:{e.line} imports {e.target}" for e in bad)


def test_the_wire_contract_imports_neither_side(graph: list[Import]) -> None:
    bad = [
        e
        for e in graph
        if e.source.startswith("fleet_protocol") and not e.target.startswith("fleet_protocol")
    ]
    assert not bad, "\n".join(f"{e.source}:{e.line} imports {e.target}" for e in bad)


def _layer(mod: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer): the longest matching prefix wins
    for i, layer in enumerate(CONTROLLER_LAYERS):
        for prefix in layer:
            if (mod == prefix or mod.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), i)
    assert best is not None, f"{mod} is in no declared layer: add it to CONTROLLER_LAYERS"
    return best[1]


def test_every_controller_module_is_in_a_layer() -> None:
    for mod in first_party_modules():
        if mod.startswith("controller"):
            _layer(mod)


def test_controller_imports_point_down(graph: list[Import]) -> None:
    bad = [
        e
        for e in graph
        if e.source.startswith("controller")
        and e.target.startswith("controller")
        and not _is_package_init_edge(e)
        and _layer(e.target) < _layer(e.source)
    ]
    assert not bad, "imports against the layer order:\n" + "\n".join(
        f"{e.source}:{e.line} (layer {_layer(e.source)}) imports {e.target} (layer {_layer(e.target)})"
        for e in bad
    )


def test_the_checker_sees_a_cycle_and_an_upward_import() -> None:
    """The rules above must be able to fail: a made-up graph with both faults is caught."""
    edges = [
        Import("controller.db.crud", "controller.api.routes", 1, True),
        Import("controller.api.routes", "controller.db.crud", 1, False),
    ]
    assert _cycles(edges) == [["controller.api.routes", "controller.db.crud"]]
    assert _layer("controller.api.routes") < _layer("controller.db.crud")
