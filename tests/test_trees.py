"""The changed paths of a write: gitrun's pruned tree walk names exactly what libgit2's
tree diff names, for any pair of trees (files, links, executables, nested directories,
a file replacing a directory and back, deletions that empty a directory)."""

from __future__ import annotations

from pathlib import Path

import pygit2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gitrun.store import trees

NAMES = st.sampled_from(["a", "b", "c d", "é", "src", "x.py"])
PATHS = st.lists(NAMES, min_size=1, max_size=4).map("/".join)
MODES = st.sampled_from([trees.BLOB, trees.EXEC, trees.LINK])
CONTENTS = st.sampled_from([b"one\n", b"two\n", b"three\n"])
CHANGE = st.one_of(st.none(), st.tuples(CONTENTS, MODES))
Planned = tuple[bytes, int] | None  # new (content, mode), or None to delete
SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=120,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def libgit2_paths(old: pygit2.Tree, new: pygit2.Tree) -> set[str]:
    """The reference: every old and new path of libgit2's tree-to-tree diff."""
    deltas = old.diff_to_tree(new).deltas
    return {d.new_file.path for d in deltas} | {d.old_file.path for d in deltas}


def build(
    repo: pygit2.Repository, base: pygit2.Tree | None, changes: dict[str, Planned]
) -> pygit2.Tree:
    planned: dict[str, trees.Change] = {}
    for path, change in changes.items():
        if change is None:
            planned[path] = None
        else:
            data, mode = change
            planned[path] = (repo.create_blob(data), mode)
    tree = repo[trees.tree_with_changes(repo, base, planned)]
    if not isinstance(tree, pygit2.Tree):
        raise TypeError("not a tree")
    return tree


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> pygit2.Repository:
    path: Path = tmp_path_factory.mktemp("trees")
    return pygit2.init_repository(str(path), bare=True)


@SETTINGS
@given(
    first=st.dictionaries(PATHS, st.tuples(CONTENTS, MODES), min_size=1, max_size=8),
    second=st.dictionaries(PATHS, CHANGE, max_size=6),
)
def test_the_pruned_walk_names_what_libgit2s_diff_names(
    repo: pygit2.Repository, first: dict[str, Planned], second: dict[str, Planned]
) -> None:
    old = build(repo, None, first)
    new = build(repo, old, second)
    assert trees.changed_paths(old, new) == libgit2_paths(old, new)
    assert trees.changed_paths(new, old) == libgit2_paths(new, old)


def test_a_file_that_replaces_a_directory_names_the_file_and_every_file_it_removed(
    repo: pygit2.Repository,
) -> None:
    old = build(repo, None, {"d/a": (b"1", trees.BLOB), "d/e/b": (b"2", trees.BLOB)})
    gone = build(repo, old, {"d/a": None, "d/e/b": None})
    new = build(repo, gone, {"d": (b"3", trees.BLOB)})
    assert trees.changed_paths(old, new) == {"d", "d/a", "d/e/b"}
    assert trees.changed_paths(old, new) == libgit2_paths(old, new)


def test_a_tree_thousands_of_levels_deep_is_walked_without_exhausting_the_stack(
    repo: pygit2.Repository,
) -> None:
    """An agent can commit any tree; one 3,000 directories deep (past Python's recursion
    limit) is walked, added and removed, like any other."""
    deep = "/".join(["d"] * 3000) + "/f"
    old = build(repo, None, {"top": (b"1", trees.BLOB)})
    new = build(repo, old, {deep: (b"2", trees.BLOB)})
    assert trees.changed_paths(old, new) == {deep}
    assert trees.changed_paths(new, old) == {deep}
    changed = build(repo, new, {deep: (b"3", trees.BLOB)})
    assert trees.changed_paths(new, changed) == {deep}
