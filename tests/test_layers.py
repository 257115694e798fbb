"""kubestar's layers, as import contracts checked on the source.

Every package of the `kubestar` namespace lives in the folder of its layer (pyproject's
package-dir), and imports only packages of its own layer's rank or below (`LAYERS`, bottom to
top). Packages of one rank import each other only where `SIDEWAYS` says why; a layer skips
the packages `SKIPPED` names although they lie below it. Nothing imports the CLI but the
tests. Between packages, and between the modules of one package, the imports form no cycle.

Every import counts: at module level, inside functions, and under `if TYPE_CHECKING:` (a
cycle of annotations is still one reader going round in circles). docs/architecture.md draws
the same table. Only the source is read: no module is imported.
"""

from __future__ import annotations

import ast
import itertools
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Bottom to top: (folder, the packages of this rank). A package imports its own modules and
# the packages of lower ranks; packages of one rank do not import each other.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The wire contracts (generated gRPC stubs) and the Kubernetes API (the custom resources,
    # conditions, the trainer's contract, KubestarError).
    ("protos", ("kubestar.v1", "kubestar.api")),
    # Shared runtime utilities: auth, logs, the Kubernetes client, listening, statistics.
    ("services", ("kubestar.common",)),
    # The long-running services (and their clients).
    ("services", ("kubestar.sandbox", "kubestar.engine", "kubestar.scheduler", "kubestar.scoring")),
    # The trainer: agent loop, rewards, GRPO-RoC, SFT, checkpoints, progress.
    ("training", ("kubestar.training",)),
    # Test-time search, the PPM's training and self-evolution: built on the trainer's parts.
    ("training", ("kubestar.search",)),
    # The kopf operator: builds the services' and the trainer's pods, runs none of them.
    ("operator", ("kubestar.operator",)),
    # The command line: flags into the library's settings.
    ("cli", ("kubestar.cli",)),
)

# (importer, imported) of one rank, and why the importer needs it.
SIDEWAYS: Mapping[tuple[str, str], str] = {
    ("kubestar.scheduler", "kubestar.engine"): (
        "the scheduler drives the engines: their HTTP client (engine.client) and the "
        "weights' broadcast sessions (engine.weight_sync)"
    ),
    ("kubestar.scoring", "kubestar.engine"): (
        "the PPM's backbone is a model folder, found, fingerprinted (tokenizer_sha256) and "
        "copied as the engines' are (engine.models)"
    ),
}

# (importer, imported) although imported lies below importer, and why not.
SKIPPED: Mapping[tuple[str, str], str] = {
    ("kubestar.operator", "kubestar.training"): (
        "the operator builds the trainer's pods from the API's contract (kubestar.api); it "
        "runs no trainer code and does not depend on torch"
    ),
    ("kubestar.operator", "kubestar.search"): "as for kubestar.training",
}

# Outside the layers: they may import any package, but only the tests import the CLI.
OUTSIDE = ("bench", "e2e")
CLI = "kubestar.cli"

# Imports the rules refuse that are still in the tree: {(importing file, imported module):
# why}. Each entry is a debt, to be paid by moving code; the test fails when one is paid and
# the entry stays.
KNOWN_EXCEPTIONS: Mapping[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # the module imported (or the package, when the name is not a module)


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    imports: tuple[Import, ...]

    @property
    def package(self) -> str:
        return package_of(self.name)

    def line_of(self, imported: str) -> int:
        return next(i.line for i in self.imports if i.module == imported)

    def where(self, line: int) -> str:
        return f"{self.path.relative_to(REPO)}:{line}"


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


@cache
def package_dirs() -> dict[str, str]:
    """pyproject's package-dir: package -> folder (relative to the repository)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    dirs: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    return dirs


def rank_of(package: str) -> int:
    for rank, (_, packages) in enumerate(LAYERS):
        if package in packages:
            return rank
    raise KeyError(package)


def statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement of a body and of the bodies within (functions, classes, if, try,
    with, loops, match): an import is a statement, so expressions need no visit."""
    for node in body:
        yield node
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, name, ()):
                if isinstance(child, ast.stmt):
                    yield from statements([child])
                else:  # an except handler or a match case
                    yield from statements(child.body)


def imported_names(tree: ast.Module, module: str, is_package: bool) -> Iterator[Import]:
    """Every module this source imports, anywhere in it, as names: `from a.b import c` gives
    `a.b.c` (`resolve` finds the module, as c may be a function)."""
    for node in statements(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package, level - 1 above it
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            for alias in node.names:
                yield Import(node.lineno, f"{base}.{alias.name}")


def resolve(name: str, modules: Mapping[str, object]) -> str:
    """The longest module (or package) a dotted name starts with."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


@cache
def tree_modules() -> dict[str, Module]:
    """Every module of the layered folders, by dotted name."""
    found: dict[str, tuple[Path, ast.Module]] = {}
    for package, folder in package_dirs().items():
        root = REPO / folder
        for path in sorted(root.rglob("*.py")):
            parts = [*package.split("."), *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = (path, ast.parse(path.read_bytes(), str(path)))
    modules: dict[str, Module] = {}
    for name, (path, tree) in found.items():
        imports = {
            Import(i.line, resolve(i.module, found))
            for i in imported_names(tree, name, path.name == "__init__.py")
            if i.module.split(".")[0] == "kubestar"
        }
        modules[name] = Module(name, path, tuple(sorted(imports, key=lambda i: i.line)))
    return modules


def outside_imports() -> Iterator[tuple[str, Import]]:
    """(file, import) of every kubestar import of the folders outside the layers (but the
    tests, which may import anything)."""
    modules = tree_modules()
    for folder in OUTSIDE:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_bytes(), str(path))
            for i in imported_names(tree, "outside", False):
                if i.module.split(".")[0] == "kubestar":
                    yield (
                        path.relative_to(REPO).as_posix(),
                        Import(i.line, resolve(i.module, modules)),
                    )


def refusal(importer: str, imported: str) -> str | None:
    """Why a module of package `importer` may not import package `imported` (None: it may)."""
    if importer == imported:
        return None
    if imported not in package_dirs():
        return f"{imported} is no package of kubestar"
    if importer not in package_dirs():  # tests, bench, e2e
        return "only the tests import the CLI" if imported == CLI else None
    edge = (importer, imported)
    low, high = rank_of(imported), rank_of(importer)
    if edge in SKIPPED:
        return f"{importer} does not import {imported}: {SKIPPED[edge]}"
    if low < high or edge in SIDEWAYS:
        return None
    if low == high:
        return f"{importer} and {imported} are of one layer: neither imports the other"
    return (
        f"{imported} (layer {low}, {LAYERS[low][0]}/) lies above {importer} "
        f"(layer {high}, {LAYERS[high][0]}/) in LAYERS"
    )


@cache
def refused() -> tuple[tuple[str, str, int, str], ...]:
    """Every import the rules refuse: (file, imported module, line, why)."""
    found = []
    for module in tree_modules().values():
        file = module.path.relative_to(REPO).as_posix()
        for i in module.imports:
            why = refusal(module.package, package_of(i.module))
            if why:
                found.append((file, i.module, i.line, f"{module.name} imports {i.module}: {why}"))
    for file, i in outside_imports():
        why = refusal(file.split("/")[0], package_of(i.module))
        if why:
            found.append((file, i.module, i.line, f"imports {i.module}: {why}"))
    return tuple(found)


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph, as the path [a, b, ..., a]; None without one."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


# -- the tests ------------------------------------------------------------------------------


def test_every_package_lives_in_the_folder_of_its_layer() -> None:
    dirs = package_dirs()
    tabled = {package: folder for folder, packages in LAYERS for package in packages}
    assert sorted(dirs) == sorted(tabled), (
        "pyproject's package-dir and the LAYERS table of tests/test_layers.py name different "
        f"packages: only in pyproject {sorted(set(dirs) - set(tabled))}, only in the table "
        f"{sorted(set(tabled) - set(dirs))}"
    )
    misplaced = [
        f"{package} is in {dirs[package]}, not under {folder}/"
        for package, folder in tabled.items()
        if dirs[package] != f"{folder}/{package.replace('.', '/')}"
    ]
    assert not misplaced, "\n".join(misplaced)


def test_the_tables_name_only_edges_the_layers_would_decide_otherwise() -> None:
    for importer, imported in SIDEWAYS:
        assert rank_of(importer) == rank_of(imported), (importer, imported)
    for importer, imported in SKIPPED:
        assert rank_of(importer) > rank_of(imported), (importer, imported)


def test_each_package_imports_only_its_own_layer_or_below() -> None:
    violations = [
        f"{file}:{line}: {why}"
        for file, module, line, why in refused()
        if (file, module) not in KNOWN_EXCEPTIONS
    ]
    assert not violations, "imports against the layers (tests/test_layers.py):\n" + "\n".join(
        violations
    )


def test_every_known_exception_is_still_there() -> None:
    stale = sorted(set(KNOWN_EXCEPTIONS) - {(file, module) for file, module, _, _ in refused()})
    assert not stale, f"KNOWN_EXCEPTIONS names imports no longer refused: drop {stale}"


def test_no_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for module in tree_modules().values():
        targets = graph.setdefault(module.package, set())
        targets.update(package_of(i.module) for i in module.imports)
        targets.discard(module.package)
    cycle = find_cycle(graph)
    assert cycle is None, "the packages import each other in a cycle: " + " -> ".join(cycle)


def test_no_cycle_between_the_modules_of_a_package() -> None:
    modules = tree_modules()
    cycles = []
    for package in package_dirs():
        graph = {
            module.name: {i.module for i in module.imports if package_of(i.module) == package}
            - {module.name}
            for module in modules.values()
            if module.package == package
        }
        cycle = find_cycle(graph)
        if cycle:
            edges = [
                f"{a} -> {b} ({modules[a].where(modules[a].line_of(b))})"
                for a, b in itertools.pairwise(cycle)
            ]
            cycles.append(f"{package}: " + " -> ".join(cycle) + "\n  " + "\n  ".join(edges))
    assert not cycles, "modules of one package import each other in a cycle:\n" + "\n".join(cycles)


def test_the_checks_find_what_they_look_for() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kubestar.x import y\n"
        "def f():\n    import kubestar.z.w\nfrom . import sibling\nfrom ..up import thing\n"
    )
    names = {i.module for i in imported_names(ast.parse(source), "kubestar.p.m", False)}
    assert names == {
        "typing.TYPE_CHECKING",
        "kubestar.x.y",
        "kubestar.z.w",
        "kubestar.p.sibling",
        "kubestar.up.thing",
    }
    assert refusal("kubestar.scoring", "kubestar.search")
    assert refusal("kubestar.sandbox", "kubestar.scheduler")
    assert refusal("kubestar.operator", "kubestar.training")
    assert refusal("kubestar.training", "kubestar.search")
    assert refusal("kubestar.common", "kubestar.sandbox")
    assert refusal("kubestar.search", "kubestar.training") is None
    assert refusal("kubestar.operator", "kubestar.scheduler") is None
    assert refusal("kubestar.scheduler", "kubestar.engine") is None
    assert refusal("bench", "kubestar.cli")
    assert refusal("bench", "kubestar.search") is None
