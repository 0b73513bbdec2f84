"""The import graph of ``rrefpipe`` and ``workers`` has no cycle, and ``rrefpipe.stage_side`` never imports
``rrefpipe.driver_side``.

Every module is parsed with :mod:`ast`, and every import counts wherever it stands: at module top,
inside a function or class (a "lazy" import hides a cycle; it does not remove it), ``import a.b``,
``from . import x``, ``from .x import y``, relative and absolute. ``from pkg import name`` is an edge
to ``pkg.name`` when that is a module, and to ``pkg`` otherwise. Importing a submodule runs its
package's ``__init__`` first, but that edge is not counted: a package's ``__init__`` that re-exports
its submodules is the one allowed way down into them. (So ``workers`` importing ``rrefpipe._rpc``, which
runs ``rrefpipe/__init__.py`` and with it ``rrefpipe.driver_side.placement``, whose ``worker_module`` imports
``workers`` when called, is no cycle here; ARCHITECTURE.md's "Layers" says why that import stays lazy.)
``importlib.import_module("pkg.x")`` (or an f-string starting ``"pkg."``) counts as importing ``pkg.x``
(or the package ``pkg``).

Imports under ``if TYPE_CHECKING:`` (``typing.TYPE_CHECKING``) are left out: they never run, and
annotations are the one thing they are for.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rrefpipe", "workers")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.AST]:
    """Every import statement (and ``import_module`` call) of ``tree`` at any depth, except under
    ``if TYPE_CHECKING:``."""
    found: list[ast.AST] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)) or _imported_by_name(node) is not None:
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _imported_by_name(node: ast.AST) -> str | None:
    """The module named by ``importlib.import_module(...)``: its constant name, or the package an
    f-string's constant start names (``f"workers.{name}"``: ``workers``)."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.func, (ast.Attribute, ast.Name))):
        return None
    if (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) != "import_module":
        return None
    name = node.args[0]
    if isinstance(name, ast.Constant) and isinstance(name.value, str):
        return name.value
    if isinstance(name, ast.JoinedStr) and name.values and isinstance(name.values[0], ast.Constant):
        return str(name.values[0].value).rpartition(".")[0] or None
    return None


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is one of ours."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """Module name -> the names of our modules it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.Call):
                targets = [_imported_by_name(node) or ""]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else base)
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_a_cycle(graph, set(component)) for component in components]


def _a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a path back to it."""
    start = min(component)
    paths: dict[str, list[str]] = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle in {sorted(component)}")


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "rrefpipe.driver_side.remote" in graph["rrefpipe.pipe"]  # from .driver_side.remote import RemoteDriver
    assert "rrefpipe.timeline" in graph["rrefpipe.pipe"]  # inside a method
    assert "rrefpipe._rpc" in graph["workers.serve"]  # from rrefpipe import _rpc, inside a function
    assert "workers" in graph["rrefpipe.driver_side.placement"]  # importlib.import_module(f"workers.{name}")
    assert "workers.serve" in graph["workers.__main__"]  # from .serve import serve


def test_a_cycle_is_found_and_named() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]


def test_no_import_cycle() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    lines = []
    for cycle in cycles:
        knot = {m for m in graph if _reaches(graph, m, cycle[0]) and _reaches(graph, cycle[0], m)}
        edges = [f"{m} -> {', '.join(sorted(graph[m] & knot))}" for m in sorted(knot)]
        lines.append(" -> ".join(cycle) + f"\n    (its knot of {len(knot)} modules imports:\n      "
                     + "\n      ".join(edges) + ")")
    assert not cycles, "import cycles:\n  " + "\n  ".join(lines)


def _reaches(graph: dict[str, set[str]], a: str, b: str) -> bool:
    seen = {a}
    frontier = [a]
    while frontier:
        v = frontier.pop()
        if v == b:
            return True
        for w in graph[v] - seen:
            seen.add(w)
            frontier.append(w)
    return False


def test_the_pipe_optimizers_worker_side_stays_below_its_driver_side():
    """``stage_optim`` runs on stage workers (above ``server``, which the stream runtime shares with it);
    ``pipe_optimizer`` is the driver's (above ``remote``, ``local`` and ``stage_optim``; ``pipe`` and
    ``optim`` above it)."""
    graph = import_graph()
    assert "rrefpipe.stage_side.server" in graph["rrefpipe.stage_side.stage_optim"]
    for driver_side in ("rrefpipe.driver_side.remote", "rrefpipe.driver_side.local", "rrefpipe.pipe",
                        "rrefpipe.driver_side.pipe_optimizer", "rrefpipe.optim"):
        assert not _reaches(graph, "rrefpipe.stage_side.stage_optim", driver_side), driver_side
    assert {"rrefpipe.driver_side.remote", "rrefpipe.driver_side.local",
            "rrefpipe.stage_side.stage_optim"} <= graph["rrefpipe.driver_side.pipe_optimizer"]
    assert not _reaches(graph, "rrefpipe.driver_side.pipe_optimizer", "rrefpipe.pipe")
    assert "rrefpipe.driver_side.pipe_optimizer" in graph["rrefpipe.optim"]


STAGE_SIDE, DRIVER_SIDE = "rrefpipe.stage_side", "rrefpipe.driver_side"


def _within(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


def side_crossings(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each stage-side module's shortest import path to a driver-side module (direct, or through modules
    of neither side), if it has one."""
    found: list[list[str]] = []
    for start in sorted(m for m in graph if _within(STAGE_SIDE, m)):
        paths = {start: [start]}
        frontier = [start]
        while frontier:
            following = []
            for v in frontier:
                for w in sorted(graph[v] - paths.keys()):
                    paths[w] = paths[v] + [w]
                    following.append(w)
            frontier = following
        ends = sorted((len(path), path) for w, path in paths.items() if _within(DRIVER_SIDE, w))
        if ends:
            found.append(ends[0][1])
    return found


def test_a_crossing_from_the_stage_side_is_found_and_named():
    s, t, clean, x = (f"{STAGE_SIDE}.{name}" for name in ("s", "t", "clean", "x"))
    d = f"{DRIVER_SIDE}.d"
    graph = {s: {"rrefpipe.top"}, t: {d}, clean: {x}, x: set(), "rrefpipe.top": {"rrefpipe.deeper"},
             "rrefpipe.deeper": {d}, d: {s, x}}
    assert side_crossings(graph) == [[s, "rrefpipe.top", "rrefpipe.deeper", d], [t, d]]


def test_the_stage_side_never_imports_the_driver_side():
    """A stage-side module runs where a stage is: on a stage worker, which must not need the driver's
    code, or in the driver of a one-process pipe. So none imports a driver-side module, at any depth
    (lazily inside a function too) and through no module of the top level either. It reaches the
    driver only through functions the driver hands it (``server.connect``'s ``deliver`` and
    ``keep_phony``, a stream's ``StreamPlan.deliver``). The driver side imports the stage side freely,
    to name its functions in RPCs."""
    graph = import_graph()
    stage_side = [m for m in graph if _within(STAGE_SIDE, m)]
    assert "rrefpipe.stage_side.server" in stage_side and "rrefpipe.driver_side.remote" in graph
    assert "rrefpipe.stage_side.server" in graph["rrefpipe.driver_side.remote"]  # the driver side may
    crossings = side_crossings(graph)
    assert not crossings, ("stage-side modules that import the driver side (pass a function instead, or "
                           "move what both need to the top level):\n  "
                           + "\n  ".join(" -> ".join(path) for path in crossings))
