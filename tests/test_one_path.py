"""One way to do each of two things: write a durable file, and build a runtime."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The agent's worktree and the verifier's tree copy are synced from git, not durable state.
WORKTREE_WRITERS = {"atomicfile.py", "safefs.py", "materialise.py"}
# Path.replace/rename are not told from str.replace here; os.* and the Path writers are.
WRITES = {"os.replace", "os.rename", "os.link", "shutil.move", ".write_text", ".write_bytes"}


def _calls(path: Path) -> list[tuple[str, str, int]]:
    """(called name, enclosing function, line) of every call in ``path``: ``f``,
    ``os.f`` / ``shutil.f``, or ``.f`` for a method."""
    out: list[tuple[str, str, int]] = []

    def walk(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = child.name if isinstance(child, ast.FunctionDef) else where
            if isinstance(child, ast.Call):
                fn = child.func
                name = getattr(fn, "id", "")
                if isinstance(fn, ast.Attribute):
                    owner = fn.value.id if isinstance(fn.value, ast.Name) else ""
                    name = f"{owner if owner in {'os', 'shutil'} else ''}.{fn.attr}"
                out.append((name, here, child.lineno))
            walk(child, here)

    walk(ast.parse(path.read_text()), "<module>")
    return out


def test_every_durable_file_gitrun_writes_goes_through_the_one_atomic_path() -> None:
    stray = [
        f"{path.name}:{line} {name}() in {where}"
        for path in sorted((ROOT / "gitrun").glob("*.py"))
        if path.name not in WORKTREE_WRITERS
        for name, where, line in _calls(path)
        if name in WRITES
    ]
    assert not stray, "write through gitrun.store.atomicfile instead:\n" + "\n".join(stray)


def test_every_runtime_is_built_by_its_one_factory() -> None:
    """``runtime.begin`` (a new run) and ``service.build_runtime`` (a stored checkpoint):
    the product, the benchmarks and the tests build the same runtime."""
    factories = {("runtime.py", "begin"), ("service.py", "build_runtime")}
    sources = [*(ROOT / "gitrun").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    sources += (ROOT / "tests").rglob("*.py")
    builds = {
        (path.name, where)
        for path in sources
        for name, where, _line in _calls(path)
        if name in {"Runtime", ".Runtime"}
    }
    assert builds <= factories, f"Runtime(...) built outside its factory: {builds - factories}"
