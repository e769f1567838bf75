"""The layering `ls gitrun/` shows holds in the code: each layer imports only the layers
below it, and the pure core imports no pygit2 and no other I/O library.

    core < store < adapter < engine < app < integrations < cli (cli*.py, entry.py, pipes.py)

(integrations are the optional bridges to other agents, e.g. mini-swe-agent; only the
CLI may import them.)

Imports under ``if TYPE_CHECKING:`` are types only and are not counted; imports inside
functions (lazy ones, for start-up speed) are.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gitrun"
LAYERS = ("core", "store", "adapter", "engine", "app", "integrations")
IO_LIBRARIES = ("pygit2", "cryptography", "filelock", "typer", "rich", "click")


def _layer(module: str) -> str | None:
    """The layer of a ``gitrun.*`` module name ("top" for the CLI), else None."""
    parts = module.split(".")
    if parts[0] != "gitrun":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "top"


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    types_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            types_only.update(id(child) for child in ast.walk(node))
    found: list[str] = []
    for node in ast.walk(tree):
        if id(node) in types_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def _violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mine = _layer(module)
        if mine == "top":
            continue
        for target in _imports(path):
            if mine == "core" and target.split(".")[0] in IO_LIBRARIES:
                out.append(f"{module} (core) imports {target}")
            theirs = _layer(target)
            if theirs == "top" and target != "gitrun":
                out.append(f"{module} ({mine}) imports the CLI module {target}")
            elif theirs in LAYERS and LAYERS.index(theirs) > LAYERS.index(str(mine)):
                out.append(f"{module} ({mine}) imports {target} from the higher layer {theirs}")
    return out


def test_every_layer_imports_only_the_layers_below_it() -> None:
    assert _violations() == []


def test_every_module_lives_in_a_layer_and_the_top_holds_only_the_cli() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == [
        "__init__.py", "__main__.py", "cli.py", "cli_claude.py", "cli_options.py",
        "cli_view.py", "entry.py", "pipes.py",
    ]  # fmt: skip
    assert sorted(
        p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"
    ) == sorted(LAYERS)


def test_importing_the_whole_core_loads_no_io_library() -> None:
    """The check above reads the source; this one imports every core module for real."""
    names = [f"gitrun.core.{p.stem}" for p in sorted((PACKAGE / "core").glob("*.py"))]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {IO_LIBRARIES!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
