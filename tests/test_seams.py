"""The seams of the package (docs/design.md §11): no private name imported across modules,
no import circle, and pygit2 imported only where git is the concept (``store/``,
``adapter/``), types included.

Read from the source with :mod:`ast`. Imports under ``if TYPE_CHECKING:`` count for the
pygit2 rule (a type is a dependency on the library's model) and for private names, not
for circles (they never run). Imports inside functions (lazy ones, for start-up speed)
count for circles like any other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gitrun"
PYGIT2_LAYERS = ("store", "adapter")

# Circles through lazy (function-level) imports outside the store, each a factory or a
# fast path that picks its implementation at run time; the list may only shrink (an
# entry that no longer closes a circle fails below and must be struck off).
KNOWN_LAZY_CIRCLES: dict[frozenset[str], str] = {
    frozenset({"gitrun.adapter.environment", "gitrun.adapter.exec_step"}): (
        "Environment.execute hands an exec action to exec_step, which builds on Environment"
    ),
    frozenset(
        {
            "gitrun.engine.agents",
            "gitrun.engine.session_agent",
            "gitrun.engine.session",
            "gitrun.engine.mcp_server",
        }
    ): "the agent factory builds a session agent, whose session speaks to agents",
    frozenset({"gitrun.app.status", "gitrun.app.status_read"}): (
        "status() tries the pygit2-free reader first, which builds the same typed result"
    ),
    frozenset({"gitrun.cli", "gitrun.entry"}): (
        "the fast entry point hands every command but status to the Typer CLI"
    ),
}

# Modules above the adapter that still import pygit2: the shared SWE-bench queue, a store
# on a bare repository in all but its place (to move into gitrun/store/ whole). The list
# may only shrink: a module that no longer imports it fails below and must be struck
# off. The engine, the other use cases and the CLI hold git handles typed from
# gitrun.adapter.gittypes and read through the store and the adapter.
KNOWN_PYGIT2_ABOVE: frozenset[str] = frozenset(
    {
        "gitrun.app.swebench_queue",
    }
)


# The store's durability mechanism: above the store it is reached only through
# gitrun.store.gitstore (what a caller means: sync_all, covering, power_cut_branches),
# never by calling the journal, its recovery or the barrier directly (issue #29).
MECHANISMS = frozenset(
    {"gitrun.store.durable", "gitrun.store.journal", "gitrun.store.journal_recovery"}
)
MECHANISM_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("gitrun.app.status_read", "gitrun.store.journal"): (
        "the pygit2-free status asks whether a recovery is pending, without loading pygit2"
    ),
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module imported from (a submodule when a name is one)
    name: str  # the name imported ("" for ``import x``)
    lazy: bool  # inside a function
    types_only: bool  # under ``if TYPE_CHECKING:``


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str) -> Iterator[Import]:
    tree = ast.parse(MODULES[module].read_text())
    types_only: set[int] = set()
    lazy: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            types_only.update(id(child) for child in ast.walk(node))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lazy.update(id(child) for child in ast.walk(node))
    for node in ast.walk(tree):
        where = {"lazy": id(node) in lazy, "types_only": id(node) in types_only}
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                target = sub if sub in MODULES else node.module
                yield Import(module, target, alias.name, **where)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, "", **where)


IMPORTS = [imp for module in MODULES for imp in _imports(module)]


def _circles(*, eager_only: bool = False) -> list[frozenset[str]]:
    """The strongly connected parts (more than one module) of the import graph (of the
    module-level imports only, with ``eager_only``)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        if eager_only and imp.lazy:
            continue
        if imp.target in MODULES and not imp.types_only and imp.target != imp.module:
            edges[imp.module].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(frozenset(part))

    for v in MODULES:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_another_modules_private_name() -> None:
    crossing = [
        f"{imp.module} imports {imp.target}.{imp.name}"
        for imp in IMPORTS
        if imp.name.startswith("_") and not imp.name.startswith("__")
        and imp.target.startswith("gitrun") and imp.target != imp.module
    ]  # fmt: skip
    assert crossing == [], "make the name public, or move it where it is used"


def test_no_import_circle_between_modules_at_import_time() -> None:
    assert _circles(eager_only=True) == []


def test_no_import_circle_in_the_package_beyond_the_known_lazy_ones() -> None:
    circles = set(_circles())
    assert not {c for c in circles if c not in KNOWN_LAZY_CIRCLES}, "an import circle"
    gone = set(KNOWN_LAZY_CIRCLES) - circles
    assert not gone, f"strike these off KNOWN_LAZY_CIRCLES: {gone}"


def test_the_store_has_no_import_circle_even_through_lazy_imports() -> None:
    assert [c for c in _circles() if any(m.startswith("gitrun.store.") for m in c)] == []


def test_pygit2_is_imported_only_in_the_store_and_the_adapter() -> None:
    users = {imp.module for imp in IMPORTS if imp.target.split(".")[0] == "pygit2"}
    outside = {
        m for m in users if m.split(".")[1] not in PYGIT2_LAYERS if m not in KNOWN_PYGIT2_ABOVE
    }
    assert outside == set(), "reach git through the store's contracts instead"
    gone = KNOWN_PYGIT2_ABOVE - users
    assert gone == set(), f"strike these off KNOWN_PYGIT2_ABOVE: {gone}"


def test_the_core_imports_no_pygit2_even_for_types() -> None:
    core = {i.module for i in IMPORTS if i.module.startswith("gitrun.core.")}
    assert {i.module for i in IMPORTS if i.module in core and i.target == "pygit2"} == set()


def test_above_the_store_durability_is_asked_of_gitstore_not_of_its_mechanism() -> None:
    users = {
        (imp.module, imp.target)
        for imp in IMPORTS
        if imp.target in MECHANISMS and imp.module.split(".")[1] not in ("store", "core")
    }
    assert users - set(MECHANISM_EXCEPTIONS) == set()
    assert set(MECHANISM_EXCEPTIONS) <= users, "strike these off MECHANISM_EXCEPTIONS"
