"""Building git trees: deterministic base commits, and a new tree from a parent tree
changing only the given paths (cost grows with path depth, not repository size)."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pygit2
from pygit2.enums import FileMode

from gitrun.core.errors import GateRejected, TaskError

BLOB = int(FileMode.BLOB)
EXEC = int(FileMode.BLOB_EXECUTABLE)
TREE = int(FileMode.TREE)
LINK = int(FileMode.LINK)

# A deterministic identity and date for sandbox base commits: same oid on every machine.
BASE_SIGNATURE = ("gitrun sandbox", "sandbox@gitrun.invalid", 1_700_000_000, 0)

Change = tuple[pygit2.Oid, int] | None  # new (blob, mode), or None to delete


def tree_at(repo: pygit2.Repository, tree_id: str) -> pygit2.Tree | None:
    """The tree ``tree_id`` of ``repo``, or None when it holds no such tree."""
    try:
        found = repo.get(tree_id)
    except ValueError:  # not an object id at all
        return None
    return found if isinstance(found, pygit2.Tree) else None


def entry(tree: pygit2.Tree, path: str) -> pygit2.Object | None:
    """The object at ``path`` in ``tree``, or None."""
    try:
        obj: pygit2.Object = tree[path]
    except KeyError:
        return None
    return obj


def entry_mode(tree: pygit2.Tree, path: str) -> int | None:
    parent, _, name = path.rpartition("/")
    sub: pygit2.Tree | None = tree
    if parent:
        obj = entry(tree, parent)
        sub = obj if isinstance(obj, pygit2.Tree) else None
    if sub is None or name not in sub:
        return None
    mode: int = sub[name].filemode
    return mode


def entry_state(tree: pygit2.Tree, path: str) -> tuple[int, bytes] | None:
    """(mode, bytes) of ``path`` in ``tree`` as :func:`gitrun.adapter.safefs.inspect` reports a
    file on disk: blobs and links with their content, directories as (TREE, b"")."""
    mode = entry_mode(tree, path)
    if mode is None:
        return None
    obj = entry(tree, path)
    data: bytes = obj.data if isinstance(obj, pygit2.Blob) else b""
    return mode, data


def blob_bytes(repo: pygit2.Repository, tree: pygit2.Tree, path: str) -> bytes | None:
    obj = entry(tree, path)
    if obj is None:
        return None
    if not isinstance(obj, pygit2.Blob):
        raise GateRejected("path-is-directory", f"{path} is a directory in the tree, not a file")
    data: bytes = obj.data
    return data


@dataclass
class _Dir:
    """One directory of :func:`tree_with_changes`: its own entries' changes, its changed
    subdirectories, the tree it starts from, and (once written) its new tree."""

    base: pygit2.Tree | None
    here: dict[str, Change] = field(default_factory=dict)
    below: dict[str, _Dir] = field(default_factory=dict)
    oid: pygit2.Oid | None = None


def tree_with_changes(
    repo: pygit2.Repository, base: pygit2.Tree | None, changes: Mapping[str, Change]
) -> pygit2.Oid:
    """Write the tree that is ``base`` with ``changes`` applied; only touched dirs rebuilt.
    Iterative (deepest directories first), so no path depth exhausts the stack."""
    root = _Dir(base)
    order = [root]  # every directory after its parent
    for path, change in changes.items():
        *dirs, name = path.split("/")
        node = root
        for part in dirs:
            child = node.below.get(part)
            if child is None:
                child = node.below[part] = _Dir(None)
                order.append(child)
            node = child
        node.here[name] = change
    for node in order:  # a directory's start: its parent's entry, unless that changes too
        for name, child in node.below.items():
            if name not in node.here and node.base is not None and name in node.base:
                sub = node.base[name]
                child.base = sub if isinstance(sub, pygit2.Tree) else None
    for node in reversed(order):
        node.oid = _write_dir(repo, node)
    if root.oid is None:
        raise TaskError("the tree was not written")
    return root.oid


def _write_dir(repo: pygit2.Repository, node: _Dir) -> pygit2.Oid:
    builder = repo.TreeBuilder(node.base) if node.base is not None else repo.TreeBuilder()
    for name, change in node.here.items():
        if change is None:
            if builder.get(name) is not None:
                builder.remove(name)
        else:
            builder.insert(name, change[0], change[1])
    for name, child in node.below.items():
        if child.oid is None:
            raise TaskError(f"{name}: a subdirectory was not written before its parent")
        sub_tree = repo[child.oid]
        if isinstance(sub_tree, pygit2.Tree) and len(sub_tree) == 0:
            if builder.get(name) is not None:
                builder.remove(name)
        else:
            builder.insert(name, child.oid, TREE)
    oid: pygit2.Oid = builder.write()
    return oid


def changed_paths(old: pygit2.Tree, new: pygit2.Tree) -> set[str]:
    """Every path a diff from ``old`` to ``new`` adds, removes or modifies (the set
    libgit2's tree diff names), found by descending only into subtrees whose ids differ:
    the cost is the width of the changed directories, not the repository's size
    (libgit2's diff expands every subtree, equal or not: 10 ms a step at 100,000 files).
    Iterative, so a hostile tree thousands of levels deep cannot exhaust the stack."""
    paths: set[str] = set()
    pairs: list[tuple[pygit2.Tree, pygit2.Tree, str]] = [(old, new, "")]
    while pairs:
        a, b, prefix = pairs.pop()
        if a.id != b.id:
            _diff_level(a, b, prefix, pairs, paths)
    return paths


def _diff_level(
    old: pygit2.Tree,
    new: pygit2.Tree,
    prefix: str,
    pairs: list[tuple[pygit2.Tree, pygit2.Tree, str]],
    out: set[str],
) -> None:
    """One directory of :func:`changed_paths`: differing subtree pairs go on ``pairs``."""
    for name, o, e in level_changes(old, new):
        path = f"{prefix}{name}"
        if isinstance(o, pygit2.Tree) and isinstance(e, pygit2.Tree):
            pairs.append((o, e, f"{path}/"))
            continue
        for side in (o, e):
            if side is not None:
                _leaves(side, path, out)


LevelChange = tuple[str, pygit2.Object | None, pygit2.Object | None]
_level_changes: dict[tuple[pygit2.Oid, pygit2.Oid], list[LevelChange]] = {}
_LEVELS_KEPT = 64


def level_changes(old: pygit2.Tree, new: pygit2.Tree) -> list[LevelChange]:
    """Every name whose entry differs between the two directories (its id, or a file's
    mode): (name, the old entry or None, the new entry or None), ``new``'s entries in
    order, then those only ``old`` has.

    A pure function of the two tree ids (objects are content-addressed, and libgit2
    hash-checks each one it reads), remembered for the last few pairs: a write compares
    the same directories for its receipt and for its journal record, and in a wide
    directory (1,000 entries) each comparison costs ~0.3 ms of Python."""
    key = (old.id, new.id)
    found = _level_changes.get(key)
    if found is not None:
        return found
    before = {e.name: e for e in old}
    found = []
    for e in new:
        o = before.pop(e.name, None) if e.name is not None else None
        # (filemode builds an enum per call: read it only where a mode alone can differ)
        if (
            o is not None
            and o.id == e.id
            and (isinstance(e, pygit2.Tree) or o.filemode == e.filemode)
        ):
            continue
        found.append((e.name or "", o, e))
    found += [(name or "", o, None) for name, o in before.items()]
    if len(_level_changes) >= _LEVELS_KEPT:
        _level_changes.clear()
    _level_changes[key] = found
    return found


def _leaves(obj: pygit2.Object, path: str, out: set[str]) -> None:
    """``path`` itself for a file (blob, link, submodule); every file under it for a tree."""
    todo = [(obj, path)]
    while todo:
        item, where = todo.pop()
        if isinstance(item, pygit2.Tree):
            todo += [(e, f"{where}/{e.name}") for e in item]
        else:
            out.add(where)


def rewind_changes(old: pygit2.Tree, new: pygit2.Tree) -> dict[str, Change]:
    """The path → (blob, mode) map (None: delete) that turns ``old`` into ``new``."""
    changes: dict[str, Change] = {}
    for path in sorted(changed_paths(old, new)):
        mode = entry_mode(new, path)
        obj = entry(new, path)
        if mode is None or mode == TREE or obj is None:
            changes[path] = None
        else:
            changes[path] = (obj.id, mode)
    return changes


def tree_from_dir(repo: pygit2.Repository, root: Path) -> pygit2.Oid:
    """A tree of every regular file under ``root`` (sorted, exec bit kept, no symlinks)."""
    changes: dict[str, Change] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in (".git", "__pycache__", ".pytest_cache")
        )
        for name in sorted(filenames):
            full = Path(dirpath) / name
            st = full.lstat()
            if not stat.S_ISREG(st.st_mode):
                raise TaskError(f"{full}: only regular files can be part of a base tree")
            rel = full.relative_to(root).as_posix()
            mode = EXEC if st.st_mode & stat.S_IXUSR else BLOB
            changes[rel] = (repo.create_blob(full.read_bytes()), mode)
    return tree_with_changes(repo, None, changes)


def deterministic_commit(
    repo: pygit2.Repository, tree: pygit2.Oid, message: str, parents: list[pygit2.Oid]
) -> pygit2.Oid:
    """A commit with a fixed author, committer and date: the same oid everywhere."""
    name, email, when, offset = BASE_SIGNATURE
    sig = pygit2.Signature(name, email, when, offset)
    text = message if message.endswith("\n") else message + "\n"
    oid: pygit2.Oid = repo.create_commit(None, sig, sig, text, tree, parents)
    return oid


def _git_hash(kind: bytes, body: bytes) -> bytes:
    return hashlib.sha1(kind + b" " + str(len(body)).encode() + b"\0" + body).digest()  # noqa: S324 - git's object id


def _hash_tree(root: Path) -> bytes:
    entries: list[tuple[bytes, bytes, bytes]] = []  # (sort key, mode, name) -> oid below
    oids: dict[bytes, bytes] = {}
    for child in root.iterdir():
        if child.name in (".git", "__pycache__", ".pytest_cache"):
            continue
        st = child.lstat()
        name = child.name.encode()
        if stat.S_ISDIR(st.st_mode):
            sub = _hash_tree(child)
            if sub:
                entries.append((name + b"/", b"40000", name))
                oids[name] = _git_hash(b"tree", sub)
        elif stat.S_ISREG(st.st_mode):
            mode = b"100755" if st.st_mode & stat.S_IXUSR else b"100644"
            entries.append((name, mode, name))
            oids[name] = _git_hash(b"blob", child.read_bytes())
        else:
            raise TaskError(f"{child}: only regular files can be part of a base tree")
    return b"".join(mode + b" " + name + b"\0" + oids[name] for _, mode, name in sorted(entries))


def hash_base(root: Path, message: str) -> tuple[str, str]:
    """(commit, tree) ids that :func:`deterministic_commit` of ``root`` would write,
    computed without writing any object (so a refused resume changes nothing)."""
    tree = _git_hash(b"tree", _hash_tree(root)).hex()
    name, email, when, _ = BASE_SIGNATURE
    ident = f"{name} <{email}> {when} +0000"
    text = message if message.endswith("\n") else message + "\n"
    body = f"tree {tree}\nauthor {ident}\ncommitter {ident}\n\n{text}".encode()
    return _git_hash(b"commit", body).hex(), tree
