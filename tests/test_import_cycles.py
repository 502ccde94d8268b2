"""Import structure: no module of the three packages depends on itself, directly or not.

The graph is built from the source with ``ast``, importing nothing. An edge A -> B means that
A imports B anywhere in its file: at module level (also under ``if``/``try``/``with`` and in
class bodies) and inside functions. A function-level import is counted because it is still a
dependency: deferring it (to keep torch or GX out of a DAG parse) hides a cycle from Python,
not from a reader, and hoisting it would bring the cycle back. Left out: imports under
``if TYPE_CHECKING:``, which only the type checker follows.

``from pkg import name`` is an edge to ``pkg.name`` when that is a module of ours, and to
``pkg`` otherwise. Only edges between modules of these packages count. The parent packages a
dotted import runs on the way (``burstcv/__init__.py`` for ``burstcv.data.suite``) are not
edges: a package ``__init__`` here imports none of its modules, so it can close no cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = (
    REPO / "src" / "burstcv",
    REPO / "serving" / "burstcv_serving",
    REPO / "spec" / "burstcv_spec",
)


def module_name(path: Path, root: Path) -> str:
    """Return the dotted module name of a source file under a package root."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    """Return whether an ``if`` test is ``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def import_nodes(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Yield every import statement under these statements, except TYPE_CHECKING-only ones."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from import_nodes(node.orelse)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt | ast.excepthandler):
                    yield from import_nodes([child] if isinstance(child, ast.stmt) else child.body)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """Return the absolute module a (possibly relative) ``from ... import`` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph() -> dict[str, set[str]]:
    """Return, for each module of the three packages, the modules of ours it imports."""
    sources = {
        module_name(path, root): path for root in ROOTS for path in sorted(root.rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for module, path in sources.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in import_nodes(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            else:
                base = _absolute(node, module, is_package)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in sources else base)
        graph[module] = {t for t in targets if t in sources and t != module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the cycles among the modules: the shortest through each module that is in one.

    Tarjan's algorithm finds the tangles (strongly connected components); a breadth-first
    search in each then gives, for each of its modules, a shortest cycle through it.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles: list[list[str]] = []
    for component in components:
        # The shortest cycle through each member, each named once (from its smallest module):
        # enough to show every module that takes part, without listing every path.
        for member in sorted(component):
            cycle = _shortest_cycle(graph, component, member)
            turn = cycle.index(min(cycle))
            cycle = [*cycle[turn:-1], *cycle[:turn], cycle[turn]]
            if cycle not in cycles:
                cycles.append(cycle)
    return cycles


def _shortest_cycle(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """Return a shortest path start -> ... -> start inside one strongly connected component."""
    # Breadth-first from start back to start, staying inside the component: a shortest cycle.
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if succ not in previous:
                    previous[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_the_packages_have_no_import_cycle() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_names_a_cycle_and_skips_type_checking_imports() -> None:
    """The checker itself: a planted cycle is found and named; every kind of import is seen."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    hub = {"base": {"ec2", "local"}, "ec2": {"base"}, "local": {"base"}, "other": set()}
    assert find_cycles(hub) == [["base", "ec2", "base"], ["base", "local", "base"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []

    tree = ast.parse(
        "import x\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import hidden\nelse:\n    import shown\n"
        "try:\n    import y\nexcept ImportError:\n    import z\n"
        "def f():\n    if True:\n        import lazy\n"
        "class C:\n    import in_class\n"
        "    async def g(self):\n        from pkg import in_method\n"
    )
    names = {
        alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
        for node in import_nodes(tree.body)
        for alias in node.names
    }
    assert names == {
        "x",
        "typing.TYPE_CHECKING",
        "shown",
        "y",
        "z",
        "lazy",
        "in_class",
        "pkg.in_method",
    }


def test_the_graph_sees_a_known_import() -> None:
    """A graph that found nothing would pass the cycle test vacuously."""
    graph = import_graph()
    assert "burstcv.cost.pricing" in graph["burstcv.gate.gate"]
    assert "burstcv_spec.preprocess" in graph["burstcv.gate.accuracy"]
    assert len(graph) > 80


# The layers of burstcv, top down: a module imports only from its own layer or those below.
# What a lower layer needs from a higher one is handed to it as data.
LAYERS = (
    ("burstcv.cli", "burstcv.supervisor"),
    ("burstcv.airflow",),
    ("burstcv.stages",),
    ("burstcv.report",),
    ("burstcv.compute", "burstcv.gate"),
    ("burstcv.cost", "burstcv.cli_options"),
    ("burstcv.params", "burstcv.export"),
    ("burstcv.training", "burstcv.registry"),
    (
        "burstcv.data",
        "burstcv.settings",
        "burstcv.lineage",
        "burstcv.links",
        "burstcv.stack",
        "burstcv.localports",
        "burstcv_serving",
    ),
    ("burstcv_spec",),
)


def layer_of(module: str) -> int:
    """Return the layer of a module (0 at the top), by the longest prefix that names one."""
    for depth, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return depth
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def test_every_import_runs_down_the_layers() -> None:
    roots = {root.name for root in ROOTS}  # the packages' faces: they import nothing
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if module not in roots
        for target in targets - roots
        if layer_of(target) < layer_of(module)
    )
    assert not upward, "imports that run back up the layers:\n" + "\n".join(upward)
