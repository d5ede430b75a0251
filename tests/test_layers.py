"""Imports only point down (DESIGN.md §2 and the kernels' sub-layers below), and no module imports itself round a
circle.

Every module of ``ntk_service`` is parsed with ``ast`` (nothing is imported); each ``import`` / ``from ... import``
naming an ``ntk_service`` module is an edge, wherever it stands (module level or inside a function: a lazy import is
a dependency too). Two kinds of import are not edges, because they never run as part of an import:

- those under ``if TYPE_CHECKING:`` (annotations only; STYLE.md's way to name a type from a layer above);
- those inside a module-level ``def __getattr__`` (PEP 562: a lazy re-export or a deprecated alias, run on first
  use of that one name).

``from package import name`` is an edge to ``package.name`` when that is a module, else to the package itself.

NOTE [layer table]: ``PACKAGE_LAYERS`` is DESIGN.md §2 as data: a layer may import the layers it lists and, through
them, everything they may import. ``KERNEL_LAYERS`` orders ``kernels/`` bottom-up; a kernels module may import its
own sub-layer and those below. Engine primitives sit below the implementations, the implementations below the
dispatch and ``api.py``, and the consumers of the engine (the kernel family, operators, sketches) above ``api.py``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PACKAGE = "ntk_service"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

PACKAGE_LAYERS: dict[str, tuple[str, ...]] = {
    "errors": (),
    "_tensors": (),  # is_torch_tensor without importing torch
    "_openmp": (),  # the OpenMP wait policy, set before anything imports torch
    "_indexing": (),  # a result's keys and row groups, shared by the client and the server's views (no torch)
    "root": ("errors", "_openmp"),  # ntk_service/__init__.py: __version__; Client is a lazy re-export (__getattr__)
    "vocabulary": ("errors",),  # torch-free words shared by every layer: modes, implementations
    "wire": ("errors",),
    "config": ("errors",),
    "layers": ("errors",),
    "plot": ("errors", "_tensors"),
    "kernels": ("vocabulary",),  # pure math: no HTTP, no SQL, no settings
    "analysis": ("kernels", "wire", "_tensors"),
    "attribution": ("kernels",),  # data attribution from eNTK features: no HTTP, no SQL
    "registry": ("kernels", "layers", "config", "wire"),
    "jobs": ("registry", "analysis", "attribution", "config", "wire", "_indexing"),  # attribution jobs run the library
    "results": ("jobs",),
    "server": ("jobs", "root", "config", "wire"),
    "client": ("root", "vocabulary", "wire", "_tensors", "_indexing"),  # imports without torch or fastapi
    "cli": ("client", "server", "plot"),
    "main": ("cli",),
}
"""Layer -> the layers it may import directly (DESIGN.md §2); see NOTE [layer table]."""

KERNEL_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("words", ("modes", "types", "_moved")),
    ("problem", ("problem",)),
    ("spec", ("spec",)),  # KernelSpec: what to compute, normalised once
    ("primitives", ("algorithm", "groups", "derived", "planning")),
    ("runtime", ("runtime",)),
    ("implementations", ("jacobian_contraction", "ntk_vector_products", "structured")),
    ("dispatch", ("choice", "blocks", "options")),
    ("core", ("core",)),  # the one private core every public function calls
    ("api", ("api",)),
    ("consumers", ("family", "operators", "sketch", "functional", "paths")),
)
"""kernels/ bottom-up: (sub-layer, the first name under ``kernels.`` of its modules and packages)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module (or one of its functions) runs; see the module docstring."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            if node is tree and isinstance(child, ast.FunctionDef) and child.name == "__getattr__":
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child
            stack.append(child)


def _resolve(importer: str, node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, int]]:
    """(imported ntk_service module, line) for each name the statement imports."""
    known = modules()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == PACKAGE:
                yield alias.name, node.lineno
        return
    base = node.module or ""
    if node.level:  # relative: from the module's package (a package is its own), up level - 1 more
        package = importer if importer in _packages() else importer.rsplit(".", 1)[0]
        package = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{package}.{base}" if base else package
    if base.split(".")[0] != PACKAGE:
        return
    for alias in node.names:
        child = f"{base}.{alias.name}"
        yield (child if child in known else base), node.lineno


@cache
def _packages() -> frozenset[str]:
    return frozenset(name for name, path in modules().items() if path.name == "__init__.py")


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} -> {self.imported}"


@cache
def edges() -> tuple[Edge, ...]:
    """Every pair of modules of the package where the first imports the second (at its first such line)."""
    out: dict[tuple[str, str], Edge] = {}
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in sorted(_imports(tree), key=lambda n: n.lineno):
            for imported, line in _resolve(name, node):
                if imported != name:
                    out.setdefault((name, imported), Edge(name, imported, line))
    return tuple(out.values())


def package_layer(module: str) -> str:
    """The DESIGN.md layer of a module: its first name under ``ntk_service``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    return {"__main__": "main"}.get(parts[1], parts[1])


def kernel_layer(module: str) -> int | None:
    """The rank of a kernels module in ``KERNEL_LAYERS`` (None outside kernels; -1 for the package itself)."""
    parts = module.split(".")
    if parts[:2] != [PACKAGE, "kernels"]:
        return None
    if len(parts) == 2:
        return len(KERNEL_LAYERS)  # kernels/__init__.py re-exports the public names: the top
    for rank, (_, heads) in enumerate(KERNEL_LAYERS):
        if parts[2] in heads:
            return rank
    raise AssertionError(f"{module} is in no sub-layer of KERNEL_LAYERS; add it to the table")


@cache
def allowed(layer: str) -> frozenset[str]:
    """The layers ``layer`` may import: itself, the ones it lists and theirs (transitively)."""
    out = {layer}
    for below in PACKAGE_LAYERS[layer]:
        out |= allowed(below)
    return frozenset(out)


def upward_imports() -> list[Edge]:
    """The edges that point up: across DESIGN.md's layers, or up the kernels' sub-layers."""
    bad = []
    for edge in edges():
        a, b = package_layer(edge.importer), package_layer(edge.imported)
        if a not in PACKAGE_LAYERS or b not in PACKAGE_LAYERS:
            raise AssertionError(f"{edge}: a layer missing from PACKAGE_LAYERS ({a!r} or {b!r})")
        if b not in allowed(a):
            bad.append(edge)
            continue
        ra, rb = kernel_layer(edge.importer), kernel_layer(edge.imported)
        if ra is not None and rb is not None and rb > ra:
            bad.append(edge)
    return bad


def layer_of(module: str) -> str:
    """The layer a module sits in: its DESIGN.md layer, and for kernels its sub-layer."""
    rank = kernel_layer(module)
    if rank is None:
        return package_layer(module)
    return "kernels" if rank == len(KERNEL_LAYERS) else f"kernels.{KERNEL_LAYERS[rank][0]}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one node (Tarjan's algorithm): each is a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycles() -> list[list[str]]:
    """Circles of modules, each importing the next."""
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for edge in edges():
        graph[edge.importer].add(edge.imported)
    return _strongly_connected(graph)


def layer_cycles() -> list[list[str]]:
    """Circles of layers (kernels: sub-layers), each with a module importing a module of the next."""
    graph: dict[str, set[str]] = {layer_of(name): set() for name in modules()}
    for edge in edges():
        a, b = layer_of(edge.importer), layer_of(edge.imported)
        if a != b:
            graph[a].add(b)
    return _strongly_connected(graph)


def test_the_scan_sees_the_package() -> None:
    """The scan reads real modules and finds known edges (so an empty answer below is not a broken scan)."""
    assert "ntk_service.kernels.api" in modules() and "ntk_service.client" in modules()
    found = {(e.importer, e.imported) for e in edges()}
    assert ("ntk_service.wire", "ntk_service.errors") in found
    assert ("ntk_service.kernels.core", "ntk_service.kernels.blocks") in found
    assert all(kernel_layer(m) is not None for m in modules() if m.startswith("ntk_service.kernels"))


def test_a_planted_upward_import_is_caught() -> None:
    """The checks flag an edge up the layers and a circle (the checker itself is tested, not trusted)."""
    assert package_layer("ntk_service.client._client") == "client"
    assert "kernels" not in allowed("client") and "errors" in allowed("server")
    low, high = kernel_layer("ntk_service.kernels.planning"), kernel_layer("ntk_service.kernels.runtime.device")
    assert low is not None and high is not None and low < high
    assert kernel_layer("ntk_service.kernels.family.nngp") == kernel_layer("ntk_service.kernels.operators")
    api = kernel_layer("ntk_service.kernels.api")
    assert api is not None and kernel_layer("ntk_service.kernels.groups") < api < kernel_layer(  # type: ignore[operator]
        "ntk_service.kernels.family.monte_carlo"
    )


def test_imports_only_point_down() -> None:
    bad = upward_imports()
    assert not bad, f"{len(bad)} upward imports (NOTE [layer table] in tests/test_layers.py):\n" + "\n".join(
        map(str, bad)
    )


def test_no_import_cycles() -> None:
    found = cycles() + layer_cycles()
    assert not found, f"{len(found)} import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


if __name__ == "__main__":  # the counts, for a commit message: python -m tests.test_layers
    ups = upward_imports()
    kernel_ups = [e for e in ups if e.importer.startswith(f"{PACKAGE}.kernels")]
    print(f"modules {len(modules())}, import edges {len(edges())}")
    print(f"upward imports: {len(ups)} in the package, {len(kernel_ups)} in kernels/")
    for edge in ups:
        print("  ", edge, f"({layer_of(edge.importer)} -> {layer_of(edge.imported)})")
    for kind, circles in (("modules", cycles()), ("layers", layer_cycles())):
        inside = [c for c in circles if all(m.startswith(f"{PACKAGE}.kernels") or m.startswith("kernels") for m in c)]
        print(f"circles of {kind}: {len(circles)} in the package, {len(inside)} in kernels/")
        for c in circles:
            print("  ", " <-> ".join(c))
