"""The import graph of the three packages: no cycle, no side importing the other, imports pointing down.

Read with the standard library's ``ast`` only (nothing is imported), so a broken module still gets a
clear failure here. Function-local imports count as edges too: a local import that would close a
cycle is a cycle hidden, not removed. ``if TYPE_CHECKING:`` imports count as well, since a type-only
cycle is still two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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

# The agent's layers, top first, read the same way: the composition root, then the wings from the
# one that answers the controller down to what every wing leans on. The shared
# ``fleet_protocol`` (the contract and ``fleet_protocol.vision``) sits below them all.
AGENT_LAYERS: tuple[tuple[str, ...], ...] = (
    ("edge_agent.__main__", "edge_agent.cli", "edge_agent.agent", "edge_agent.supervisor"),
    # The local status page reads the parts the composition root wires (the twin, the pipeline, the
    # link, the outbox), so it sits right below it and above every wing it reads.
    ("edge_agent.local",),
    ("edge_agent.control",),
    ("edge_agent.vision", "edge_agent.update"),
    ("edge_agent.device",),
    ("edge_agent.inference",),
    ("edge_agent.uplink",),
    ("edge_agent.core",),
    ("edge_agent",),  # the package's own __init__: the version
)
# The fleet simulator is a client of the contract that ships beside the agent: it may import the
# contract and the agent's version, and nothing of the daemon imports it.
SIMULATOR = "edge_agent.sim"
# The supervisor is the base install's code: a new agent version never replaces it, so what it runs
# must stay small. Everything it reaches, transitively, is listed here.
SUPERVISOR = "edge_agent.update.supervisor"
SUPERVISOR_MAY_REACH = frozenset(
    {
        "edge_agent",
        "edge_agent.core",
        "edge_agent.core.files",
        "edge_agent.core.settings",
        "edge_agent.update",
        "edge_agent.update.slots",
    }
)
# Heavy optional modules: where in the first-party packages each may be imported.
OPTIONAL_IMPORTS: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("edge_agent.inference", "edge_agent.device", "controller.registry"),
    "tensorrt": ("edge_agent.inference", "edge_agent.device"),
    "cuda": ("edge_agent.inference",),
    "pynvml": ("edge_agent.device",),
    # The tracker and what it is built on (edge_agent/vision/tracking.py imports them when it makes one).
    "trackers": ("edge_agent.vision",),
    "supervision": ("edge_agent.vision",),
    "cv2": (
        "edge_agent.vision",
        "edge_agent.control.commands",
        "edge_agent.local.server",
        "fleet_protocol.vision",
        "controller.registry",
    ),
}
# Wings a device imports with none of the optional extras installed (no onnxruntime, OpenCV,
# TensorRT, CUDA or NVML): what answers the controller and what carries data to it.
WINGS_WITHOUT_EXTRAS = ("edge_agent.control", "edge_agent.uplink", "edge_agent.core", "edge_agent.update")


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


def _layer(mod: str, layers: tuple[tuple[str, ...], ...] = CONTROLLER_LAYERS) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer): the longest matching prefix wins
    for i, layer in enumerate(layers):
        for prefix in layer:
            if (mod == prefix or mod.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), i)
    assert best is not None, f"{mod} is in no declared layer: add it to the layer table"
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


def _agent_daemon(mod: str) -> bool:
    return mod.startswith("edge_agent") and not (mod == SIMULATOR or mod.startswith(SIMULATOR + "."))


def test_every_agent_module_is_in_a_layer() -> None:
    for mod in first_party_modules():
        if _agent_daemon(mod):
            _layer(mod, AGENT_LAYERS)


def test_agent_imports_point_down(graph: list[Import]) -> None:
    bad = [
        e
        for e in graph
        if _agent_daemon(e.source)
        and _agent_daemon(e.target)
        and not _is_package_init_edge(e)
        and _layer(e.target, AGENT_LAYERS) < _layer(e.source, AGENT_LAYERS)
    ]
    assert not bad, "imports against the agent's layer order:\n" + "\n".join(
        f"{e.source}:{e.line} (layer {_layer(e.source, AGENT_LAYERS)}) imports {e.target} "
        f"(layer {_layer(e.target, AGENT_LAYERS)})"
        for e in bad
    )


def test_the_agents_wings_import_no_wing_above_through_the_root(graph: list[Import]) -> None:
    """No wing reaches back to the composition root (the agent, its CLI)."""
    root = AGENT_LAYERS[0]
    bad = [
        e
        for e in graph
        if _agent_daemon(e.source)
        and _layer(e.source, AGENT_LAYERS) > 0
        and any(e.target == r or e.target.startswith(r + ".") for r in root)
    ]
    assert not bad, "\n".join(f"{e.source}:{e.line} imports {e.target}" for e in bad)


def test_the_simulator_is_a_client_of_the_contract_only(graph: list[Import]) -> None:
    sim = [e for e in graph if e.source == SIMULATOR or e.source.startswith(SIMULATOR + ".")]
    assert sim, "the simulator's imports were not read"
    bad = [
        e
        for e in sim
        if not (
            e.target.startswith("fleet_protocol")
            or e.target == "edge_agent"
            or e.target == SIMULATOR
            or e.target.startswith(SIMULATOR + ".")
        )
    ]
    assert not bad, "\n".join(f"{e.source}:{e.line} imports {e.target}" for e in bad)
    users = [e for e in graph if e.target.startswith(SIMULATOR) and not e.source.startswith(SIMULATOR)]
    bad_users = [e for e in users if not (e.source == AGENT_DISPATCH_FROM and e.local)]
    assert not bad_users, "\n".join(f"{e.source}:{e.line} imports {e.target}" for e in bad_users)


def test_the_contract_never_needs_its_vision_half(graph: list[Import]) -> None:
    """``fleet_protocol.vision`` needs numpy and OpenCV; the rest of the contract must not."""
    bad = [
        e
        for e in graph
        if e.source.startswith("fleet_protocol")
        and not e.source.startswith("fleet_protocol.vision")
        and e.target.startswith("fleet_protocol.vision")
    ]
    assert not bad, "\n".join(f"{e.source}:{e.line} imports {e.target}" for e in bad)


def test_the_supervisor_reaches_only_the_slot_state_and_the_settings(graph: list[Import]) -> None:
    adj: dict[str, set[str]] = {}
    for e in graph:
        adj.setdefault(e.source, set()).add(e.target)
    reached: set[str] = set()
    todo = [SUPERVISOR]
    while todo:
        mod = todo.pop()
        for target in adj.get(mod, ()):
            if target.startswith("edge_agent") and target not in reached:
                reached.add(target)
                todo.append(target)
    assert reached <= SUPERVISOR_MAY_REACH, f"the supervisor reaches {sorted(reached - SUPERVISOR_MAY_REACH)}"


def _third_party_imports(mod: str, path: Path) -> Iterator[tuple[str, int]]:
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module.split(".")[0], node.lineno


def test_optional_runtimes_are_imported_only_in_the_wings_that_use_them() -> None:
    bad = []
    for mod, path in first_party_modules().items():
        for top, line in _third_party_imports(mod, path):
            allowed = OPTIONAL_IMPORTS.get(top)
            if allowed is not None and not any(mod == a or mod.startswith(a + ".") for a in allowed):
                bad.append(f"{mod}:{line} imports {top}")
    assert not bad, "\n".join(bad)


def test_the_control_and_uplink_wings_import_without_the_optional_extras() -> None:
    """A fresh interpreter that cannot import any optional runtime still imports these wings."""
    modules = [m for m in first_party_modules() if m.startswith(WINGS_WITHOUT_EXTRAS)]
    code = (
        "import importlib, importlib.abc, sys\n"
        f"BLOCKED = {sorted(OPTIONAL_IMPORTS)!r}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'blocked: {name}')\n"
        "        return None\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print('ok', len(BLOCKED))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


# --------------------------------------------------------------------------- the test harness

HARNESS = "tests.support"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in ``path``, relative ones resolved; ``from P import N`` also
    yields ``P.N`` (N may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def test_no_module_imports_a_test_module_and_bench_imports_only_the_harness_of_tests() -> None:
    """Test modules share code through tests/support (or a conftest fixture, which pytest hands over
    by name), never through each other or by importing a conftest; bench/ reaches into tests/ only
    for the harness, ``tests.support``, and runs as ``python -m bench.NAME`` with no ``sys.path`` edit."""
    files = sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")])
    test_modules = {_module_name(f) for f in files if f.name.startswith("test_") or f.name == "conftest.py"}
    assert len(test_modules) > 100, "the scan found no test modules: is ROOT right?"
    bad: list[str] = []
    harness_imports = 0
    for f in files:
        where = f.relative_to(ROOT)
        if where.parts[0] == "bench" and "sys.path" in f.read_text():
            bad.append(f"{where} edits sys.path: run it as python -m bench.{f.stem} from the checkout")
        for line, module in _imported(f):
            if module in test_modules:
                bad.append(f"{where}:{line} imports the test module {module}")
            if where.parts[0] == "bench" and (module == "tests" or module.startswith("tests.")):
                if module == HARNESS or module.startswith(f"{HARNESS}."):
                    harness_imports += 1
                elif module != "tests":  # ``from tests import support`` also yields tests itself
                    bad.append(f"{where}:{line} imports {module}: bench/ may import only {HARNESS}")
    assert not bad, "\n".join(bad)
    assert harness_imports, f"bench/ no longer imports {HARNESS}: is the scan still reading it?"
