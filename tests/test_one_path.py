"""One way to do each of two things: write a durable file, and build a runtime.

Every rename or link of durable state in the whole package is in the one atomic file
path (``store/atomicfile.py``) or the one ref move (``store/refmove.py``); only the
worktree writers rename files synced from git (docs/design.md §3, §5)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
# The one atomic path for files (outside git's refs and objects), and the one ref move
# (objects published from the stage, a ref's lock renamed over it, its spare kept).
WRITE_PATHS = {"store/atomicfile.py", "store/refmove.py"}
# The agent's worktree (and the spare of each file it replaces) and the verifier's tree
# copy are synced from git, not durable state.
WORKTREE_WRITERS = {"adapter/safefs.py", "adapter/filespare.py", "adapter/materialise.py"}
# Scratch files no reader trusts after a crash, each named with its function: the
# verifier's copy of its pytest plugin (made read-only in the run's private scratch,
# removed with it) and the requirements file of an environment being built (a build
# that does not finish is never marked ready, and is built again).
SCRATCH_WRITES = {
    ("engine/verifier.py", "__enter__"),
    ("app/swebench_env.py", "_packages"),
    # a published batch's inputs copied into a TemporaryDirectory to plan from, then gone
    ("app/worker.py", "publish"),
    ("app/worker.py", "_published"),
}
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
    package = ROOT / "gitrun"
    stray = [
        f"{path.relative_to(package)}:{line} {name}() in {where}"
        for path in sorted(package.rglob("*.py"))
        if path.relative_to(package).as_posix() not in WRITE_PATHS | WORKTREE_WRITERS
        for name, where, line in _calls(path)
        if name in WRITES and (path.relative_to(package).as_posix(), where) not in SCRATCH_WRITES
    ]
    assert not stray, "write through gitrun.store.atomicfile instead:\n" + "\n".join(stray)


def test_the_one_path_check_walks_every_layer_of_the_package() -> None:
    """A rename in a module of any layer is found (the check once read only the top)."""
    found = {
        path.parent.name
        for path in (ROOT / "gitrun").rglob("*.py")
        if any(name in WRITES for name, _, _ in _calls(path))
    }
    assert {"store", "adapter"} <= found


def test_every_runtime_is_built_by_its_one_factory() -> None:
    """``runtime.begin`` (a new run) and ``runtime.at_checkpoint`` (a stored checkpoint,
    which ``service.build_runtime`` calls): the product, the benchmarks and the tests
    build the same runtime."""
    factories = {("runtime.py", "begin"), ("runtime.py", "at_checkpoint")}
    sources = [*(ROOT / "gitrun").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    sources += (ROOT / "tests").rglob("*.py")
    builds = {
        (path.name, where)
        for path in sources
        for name, where, _line in _calls(path)
        if name in {"Runtime", ".Runtime"}
    }
    assert builds <= factories, f"Runtime(...) built outside its factory: {builds - factories}"


def test_the_exec_start_mark_never_writes_through_a_link_planted_at_a_temp_name(
    tmp_path: Path,
) -> None:
    """The mark an exec step leaves in the worktree's git dir (within the agent's reach)
    once went through a fixed temp name opened with ``O_TRUNC``: a link planted there
    had the user's file it named truncated and overwritten. Now it takes the one path."""
    from gitrun.adapter import exec_step

    victim = tmp_path / "victim"
    victim.write_text("the user's file")
    gitdir = tmp_path / "worktree-gitdir"
    gitdir.mkdir()
    (gitdir / f"{exec_step.STARTED_FILE}.tmp").symlink_to(victim)
    env = SimpleNamespace(wt=SimpleNamespace(path=str(gitdir)))
    exec_step._mark_started(env, "k-1")  # type: ignore[arg-type]
    assert victim.read_text() == "the user's file"
    assert exec_step.may_have_started(env, "k-1")  # type: ignore[arg-type]
