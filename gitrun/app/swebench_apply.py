"""The SWE-bench apply chain, on temporary indexes: what tree each write will build.

Stage 1 is gitrun's own strict applier (:mod:`gitrun.core.patch`); stage 2 is
``git apply --cached --recount`` on a temporary index (``GIT_INDEX_FILE`` in a temp dir),
which repairs wrong hunk counts and nothing else. There is no ``--reject`` and no
``patch --fuzz``: a patch neither stage takes is refused, never applied approximately.
Nothing here changes the repository's refs, index or worktree; only objects are written.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gitrun.adapter.gittypes import Repository, Tree, blob_data, peel_tree, tree_of
from gitrun.core.errors import BadInput, GitrunError
from gitrun.core.patch import apply_file_patch, parse_patch
from gitrun.core.runner_files import (
    SECTION_SUFFIXES,
    SHADOW_DIRS,
    command_paths,
    runner_reason,
    shadowing_module,
)

STRICT = "strict"
RECOUNT = "recount"


@dataclass(frozen=True)
class Applied:
    """The tree a prediction builds on the base and the stage that built it."""

    stage: str  # STRICT or RECOUNT
    tree: str
    diff: bytes  # the gitrun write: the raw patch (strict) or git's diff to its tree (recount)


def _git(repo: Path, args: list[str], index: Path, stdin: bytes | None = None) -> bytes:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env |= {"GIT_INDEX_FILE": str(index), "GIT_DIR": str(repo)}
    done = subprocess.run(
        ["git", *args],
        input=stdin,
        env=env,
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        raise BadInput(done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:][0]
                       if done.stderr.strip() else f"git {args[0]} failed")  # fmt: skip
    return done.stdout


def _apply_on(repo: Path, tree: str, patch: bytes, extra: list[str]) -> str:
    """``tree`` with ``patch`` applied by ``git apply --cached`` on a throwaway index."""
    with tempfile.TemporaryDirectory(prefix="gitrun-swe-index-") as tmp:
        index = Path(tmp) / "index"
        _git(repo, ["read-tree", tree], index)
        _git(repo, ["apply", "--cached", *extra, "-"], index, patch)
        return _git(repo, ["write-tree"], index).decode().strip()


def strict_accepts(repo: Repository, base: str, patch: bytes) -> bool:
    """Whether gitrun's strict applier takes ``patch`` on ``base`` as it stands."""
    tree = peel_tree(repo, base)
    try:
        for fp in parse_patch(patch):
            old_path = fp.old_path
            old = None
            if old_path is not None and old_path in tree:
                obj = tree[old_path]
                old = blob_data(repo, obj.id)
            apply_file_patch(old, fp)
    except GitrunError:
        return False
    return True


def apply_prediction(repo: Repository, base: str, patch: bytes) -> Applied:
    """The prediction's tree on ``base``: the strict stage, else the recount stage; refused
    (BadInput naming git's reason) when neither applies it exactly."""
    gitdir = Path(repo.path)
    base_tree = str(tree_of(repo, base))
    if strict_accepts(repo, base, patch):
        return Applied(STRICT, _apply_on(gitdir, base_tree, patch, []), patch)
    tree = _apply_on(gitdir, base_tree, patch, ["--recount"])
    return Applied(RECOUNT, tree, _diff(gitdir, base_tree, tree))


def _diff(gitdir: Path, old: str, new: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="gitrun-swe-index-") as tmp:
        return _git(gitdir, ["diff-tree", "-p", "--full-index", "--no-renames", old, new],
                    Path(tmp) / "index")  # fmt: skip


def test_files(repo: Repository, base: str, test_patch: bytes) -> tuple[str, tuple[str, ...]]:
    """The base tree with ``test_patch`` applied (by ``git apply``, as the write does) and
    every path that changes: the files the harness resets to the base before applying it."""
    gitdir = Path(repo.path)
    base_tree = str(tree_of(repo, base))
    if not test_patch.strip():
        return base_tree, ()
    tree = _apply_on(gitdir, base_tree, test_patch, [])
    return tree, tuple(path for path, _, _ in _changed(gitdir, base_tree, tree))


def _changed(gitdir: Path, old: str, new: str) -> list[tuple[str, str | None, str | None]]:
    """Every blob path that differs between two trees, with its old and new blob ids
    (None: absent), from ``git diff-tree -r -z`` (no quoting, no renames)."""
    with tempfile.TemporaryDirectory(prefix="gitrun-swe-index-") as tmp:
        out = _git(gitdir, ["diff-tree", "-r", "-z", "--no-renames", "--full-index", old, new],
                   Path(tmp) / "index")  # fmt: skip
    fields = out.split(b"\0")
    changes = []
    for head, raw in zip(fields[0::2], fields[1::2], strict=False):
        if not head.startswith(b":"):
            continue
        _, _, old_id, new_id, _ = head.decode().split(" ", 4)
        path = raw.decode("utf-8", "surrogateescape")
        changes.append((path, None if set(old_id) == {"0"} else old_id,
                        None if set(new_id) == {"0"} else new_id))  # fmt: skip
    return changes


def runner_changes(
    repo: Repository, reference: str, tree: str, test_cmd: str
) -> tuple[tuple[str, str], ...]:
    """Each path (with the reason) where ``tree`` changes how the tests run compared with
    ``reference`` (the base with the test patch): :func:`gitrun.core.runner_files.runner_reason`
    over the trees themselves, never over patch text."""
    named = command_paths(test_cmd)
    present = _modules_at(repo, reference)
    found = []
    for path, old_id, new_id in _changed(Path(repo.path), reference, tree):

        def blob(oid: str | None, path: str = path) -> bytes | None:
            if oid is None or not path.endswith(SECTION_SUFFIXES):
                return None  # only a config file's bytes are compared
            return blob_data(repo, oid)

        why = runner_reason(path, blob(old_id), blob(new_id), named)
        shadowed = shadowing_module(path, present) if old_id is None and why is None else None
        if shadowed is not None:
            why = f"a new module {shadowed!r} ahead of the standard library and the runner"
        if why is not None:
            found.append((path, why))
    return tuple(found)


def _modules_at(repo: Repository, reference: str) -> set[tuple[str, str]]:
    """(directory, module name) of every entry of ``reference`` at the root and in ``src/``."""
    root = peel_tree(repo, reference)
    found: set[tuple[str, str]] = set()
    for where in SHADOW_DIRS:
        tree: Tree | None = root
        if where:
            name = where.rstrip("/")
            tree = next((peel_tree(repo, e.id) for e in root
                         if e.name == name and e.type_str == "tree"), None)  # fmt: skip
        if tree is not None:
            found |= {(where, (e.name or "").partition(".")[0]) for e in tree}
    return found


def with_test_patch(
    repo: Repository, base: str, tree: str, test_patch: bytes, paths: tuple[str, ...]
) -> tuple[str, bytes]:
    """``tree`` with ``paths`` (the files ``test_patch`` names, and any test-runner file
    the prediction changed) reset to ``base`` and ``test_patch`` applied, as the harness
    does; and git's diff from ``tree`` to it (the second write)."""
    gitdir = Path(repo.path)
    base_tree = peel_tree(repo, base)
    with tempfile.TemporaryDirectory(prefix="gitrun-swe-index-") as tmp:
        index = Path(tmp) / "index"
        _git(gitdir, ["read-tree", tree], index)
        kept = [p for p in paths if p in base_tree and base_tree[p].type_str == "blob"]
        gone = [p for p in paths if p not in kept]
        if gone:  # first: a path that was a directory in the base may be a file now
            _git(gitdir, ["update-index", "--force-remove", "-z", "--stdin"], index,
                 b"".join(p.encode("utf-8", "surrogateescape") + b"\0" for p in gone))  # fmt: skip
        if kept:
            info = b"".join(
                f"{base_tree[p].filemode:o} {base_tree[p].id}\t".encode()
                + p.encode("utf-8", "surrogateescape")
                + b"\0"
                for p in kept
            )
            _git(gitdir, ["update-index", "--add", "-z", "--index-info"], index, info)
        if test_patch.strip():
            _git(gitdir, ["apply", "--cached", "-"], index, test_patch)
        new = _git(gitdir, ["write-tree"], index).decode().strip()
    return new, _diff(gitdir, tree, new)
